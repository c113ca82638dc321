"""Uploaded images (``image`` instead of ``template``), as the gateway takes them.

The gateway checks an upload's declared size (its header: no pixel decoded) against the
function and the pixel limit, decodes it off the event loop within the decode budget
(``platform/imagegate.py``), and names it by its content: ``upload:`` + a hash of the
decoded pixels and their size. So the same photo sent as PNG, as lossless WebP or re-encoded gets the same id, and the
executors (which add the model's fingerprint and the function's settings to the store key)
find its bake whoever sent it. The pixels travel to the executor as a raw RGB8 array.
"""

from __future__ import annotations

import hashlib

import numpy as np

from retouch.functions import wire
from retouch.functions.errors import BadRequest
from retouch.functions.imaging import declared_size, decode_image
from retouch.functions.spec import FunctionSpec

PREFIX = "upload:"
ID_HEX = 24  # 96 bits of SHA-256: collisions are not a concern at a few images per function


def upload_id(pixels: np.ndarray) -> str:
    """The content address of an RGB8 ``[H, W, 3]`` image."""
    digest = hashlib.sha256(f"{pixels.shape[1]}x{pixels.shape[0]}\0".encode())
    digest.update(np.ascontiguousarray(pixels, dtype=np.uint8).tobytes())
    return PREFIX + digest.hexdigest()[:ID_HEX]


def check_upload(spec: FunctionSpec, size: tuple[int, int], field: str = "image") -> None:
    """Refuse (400 naming ``field``) an upload to a function that takes none
    (``uploads_disabled``) or of another size than the function's resolution
    (``image_size_mismatch``); ``size`` is the one its header declares, so nothing is
    decoded for a refusal."""
    if spec.uploads.max_images == 0:
        raise BadRequest(
            f"function {spec.name!r} does not accept uploaded images (uploads.max_images = 0)",
            field=field,
            code="uploads_disabled",
        )
    if size != (spec.width, spec.height):
        raise BadRequest(
            f"image is {size[0]}x{size[1]}, function {spec.name!r} edits "
            f"{spec.width}x{spec.height} images",
            field=field,
            code="image_size_mismatch",
        )


def decode_upload(
    spec: FunctionSpec, data: bytes, field: str = "image"
) -> tuple[str, wire.RawArray]:
    """(id, RGB8 pixels) of an uploaded image, or a 400 naming ``field``: not an image
    (``undecodable_image``), a bomb (``image_too_large``), or refused by
    :func:`check_upload` (from its header, before any pixel is decoded)."""
    check_upload(spec, declared_size(data, field), field)
    img = decode_image(data, field)
    pixels = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return upload_id(pixels), wire.RawArray.of(pixels)
