"""Image and mask encoding at the edges of the system.

Decoding user bytes is where most bad input shows up, so every failure here becomes a
structured error naming the field. Masks are any image format; nonzero pixels are edited.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image

from retouch.functions.errors import BadRequest

MAX_PIXELS = 4096 * 4096  # well above any model resolution; stops decompression bombs early


def decode_image(data: bytes, field: str) -> Image.Image:
    """Decode an encoded image (PNG, JPEG, WebP, ...) fully, or raise ``undecodable_image``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > MAX_PIXELS:
                raise BadRequest("image too large", field=field, code="image_too_large")
            img.load()
    except BadRequest:
        raise
    except Exception as exc:  # PIL raises many types for corrupt input
        raise BadRequest(
            f"cannot decode image: {exc}", field=field, code="undecodable_image"
        ) from exc
    return img


def decode_mask(data: bytes, size: tuple[int, int], field: str = "mask") -> np.ndarray:
    """A boolean ``[H, W]`` array (True = edit) from an encoded mask of exactly ``size``."""
    img = decode_image(data, field)
    if img.size != size:
        raise BadRequest(
            f"mask is {img.width}x{img.height}, template is {size[0]}x{size[1]}",
            field=field,
            code="mask_size_mismatch",
        )
    return np.asarray(img.convert("L")) > 0


def mask_ratio(mask: np.ndarray) -> float:
    return float(mask.mean()) if mask.size else 0.0


def encode_image(img: Image.Image, fmt: str) -> bytes:
    """PNG/WebP (lossless) bytes, or raw RGB8 rows for ``raw``."""
    rgb = img.convert("RGB")
    if fmt == "raw":
        return np.asarray(rgb, dtype=np.uint8).tobytes()
    buf = io.BytesIO()
    if fmt == "webp":
        rgb.save(buf, format="WEBP", lossless=True)
    else:
        rgb.save(buf, format="PNG")
    return buf.getvalue()


def encode_mask(mask: np.ndarray) -> bytes:
    return encode_image(Image.fromarray(mask.astype(np.uint8) * 255), "png")
