from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from retouch.functions.demo.images import SHAPES, mask_of_ratio, template_image
from retouch.functions.errors import BadRequest
from retouch.functions.imaging import (
    decode_image,
    decode_mask,
    decode_openai_mask,
    encode_image,
    encode_mask,
)


@settings(deadline=None, max_examples=30)
@given(ratio=st.floats(0.02, 0.98), shape=st.sampled_from(SHAPES), seed=st.integers(0, 1000))
def test_masks_hit_their_ratio(ratio: float, shape: str, seed: int) -> None:
    mask = mask_of_ratio((128, 96), ratio, shape, seed)
    assert mask.shape == (96, 128) and mask.dtype == bool
    assert abs(mask.mean() - ratio) < 0.03


def test_mask_encoding_round_trip() -> None:
    mask = mask_of_ratio((64, 64), 0.3, "blob", 1)
    assert np.array_equal(decode_mask(encode_mask(mask)), mask)


def test_formats() -> None:
    img = template_image((32, 48), 5)
    assert decode_image(encode_image(img, "png"), "x").size == (32, 48)
    assert np.array_equal(
        np.asarray(decode_image(encode_image(img, "webp"), "x").convert("RGB")), np.asarray(img)
    )
    assert len(encode_image(img, "raw")) == 32 * 48 * 3
    with pytest.raises(BadRequest) as err:
        decode_image(b"\x89PNG\r\n\x1a\n\0\0", "mask")
    assert (err.value.code, err.value.field) == ("undecodable_image", "mask")


SEL = np.zeros((16, 24), bool)
SEL[3:9, 5:15] = True  # the selection every mask below encodes, one way or another


def _encode(img: Image.Image, fmt: str = "PNG", **params: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **params)
    return buf.getvalue()


def _grey() -> Image.Image:
    return Image.fromarray(SEL.astype(np.uint8) * 255)


def _rgba(colour: np.ndarray, alpha: np.ndarray) -> bytes:
    arr = np.zeros((*SEL.shape, 4), np.uint8)
    arr[..., :3] = colour[..., None] if colour.ndim == 2 else colour
    arr[..., 3] = alpha
    return _encode(Image.fromarray(arr, "RGBA"))


def _lab_tiff() -> bytes:
    grey = _grey()
    neutral = Image.new("L", grey.size, 128)  # a/b are offset by 128 in PIL's LAB
    return _encode(Image.merge("LAB", [grey, neutral, neutral]), "TIFF")


MASKS_OF_EVERY_MODE = {
    "L": lambda: _encode(_grey()),
    "1-bit": lambda: _encode(_grey().convert("1")),
    "RGB": lambda: _encode(_grey().convert("RGB")),
    "dim RGB": lambda: _encode(
        Image.fromarray(np.stack([SEL * 0, SEL * 0, SEL * 1], -1).astype(np.uint8))
    ),
    "LAB TIFF": _lab_tiff,
    "CMYK TIFF": lambda: _encode(_grey().convert("RGB").convert("CMYK"), "TIFF"),
    "16-bit PNG": lambda: _encode(Image.fromarray(SEL.astype(np.uint16) * 3)),
    "32-bit int TIFF": lambda: _encode(Image.fromarray(SEL.astype(np.int32) * 70000), "TIFF"),
    "float TIFF": lambda: _encode(Image.fromarray(SEL.astype(np.float32) * 0.25), "TIFF"),
    "palette": lambda: _encode(_grey().convert("P")),
    "GIF": lambda: _encode(_grey(), "GIF"),
    "BMP": lambda: _encode(_grey(), "BMP"),
    "lossless WebP": lambda: _encode(_grey().convert("RGB"), "WEBP", lossless=True),
    "PGM": lambda: _encode(_grey(), "PPM"),
    "opaque RGBA": lambda: _rgba(SEL.astype(np.uint8) * 255, np.full(SEL.shape, 255)),
    "RGBA, alpha only trims": lambda: _rgba(
        SEL.astype(np.uint8) * 255, np.where(np.arange(24) < 20, 255, 0)[None, :].repeat(16, 0)
    ),
    "LA": lambda: _encode(Image.merge("LA", [_grey(), Image.new("L", _grey().size, 255)])),
}


@pytest.mark.parametrize("make", MASKS_OF_EVERY_MODE.values(), ids=MASKS_OF_EVERY_MODE.keys())
def test_masks_of_every_mode_select_the_same_pixels(make: Callable[[], bytes]) -> None:
    """Unusual modes used to fail in conversion outside the guard (a 500); now each one is
    read by the documented rule: not black and not fully transparent."""
    assert np.array_equal(decode_mask(make()), SEL)


@pytest.mark.parametrize(
    "data",
    [
        _rgba(np.zeros(SEL.shape, np.uint8), np.where(SEL, 255, 0)),  # black, alpha selects
        _rgba(np.full(SEL.shape, 255, np.uint8), np.where(SEL, 255, 0)),  # white on clear
        _rgba(np.full(SEL.shape, 90, np.uint8), np.where(SEL, 0, 255)),  # OpenAI: a hole
    ],
    ids=["black-alpha-selects", "white-on-transparent", "transparent-hole"],
)
def test_selection_only_in_alpha_is_refused(data: bytes) -> None:
    """Such a mask used to edit nothing (or the inverse) and answer 200."""
    with pytest.raises(BadRequest) as err:
        decode_mask(data)
    assert (err.value.code, err.value.field, err.value.status) == ("mask_in_alpha", "mask", 400)
    assert "white" in err.value.message and "black" in err.value.message


def test_palette_transparency_follows_the_alpha_rule() -> None:
    """A transparent palette entry is alpha 0: that pixel is kept even though it is white."""
    grey = np.where(SEL, 255, 0).astype(np.uint8)
    grey[0, 0] = 200  # white-ish but transparent: not edited
    img = Image.fromarray(grey).convert("P")
    mask = decode_mask(_encode(img, transparency=img.getpixel((0, 0))))
    assert np.array_equal(mask, SEL)


def test_declared_size_is_checked_before_decoding() -> None:
    """A huge mask is refused from its header: its pixel data is garbage here and never
    read."""
    header = _encode(Image.new("L", (8000, 8000)))[:100]  # IHDR only, no pixel data
    with pytest.raises(BadRequest) as err:
        decode_mask(header)
    assert err.value.code == "image_too_large"


def test_pil_decompression_bomb_is_image_too_large() -> None:
    header = _encode(Image.new("1", (20000, 20000)))[:100]  # above PIL's own bomb limit
    for decode in (lambda: decode_mask(header), lambda: decode_image(header, "t")):
        with pytest.raises(BadRequest) as err:
            decode()
        assert err.value.code == "image_too_large"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not an image",
        _encode(_grey())[:-30],  # truncated
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 24 16\n",  # not a supported format
        b"II*\x00" + b"\x00" * 20,  # a TIFF header and nothing else
    ],
    ids=["empty", "text", "truncated-png", "eps", "bare-tiff"],
)
def test_undecodable_masks(data: bytes) -> None:
    with pytest.raises(BadRequest) as err:
        decode_mask(data)
    assert (err.value.code, err.value.field) == ("undecodable_image", "mask")


def test_templates_of_unusual_modes_become_rgb() -> None:
    lab = decode_image(_lab_tiff(), "templates.t.image")
    assert lab.mode == "RGB" and min(lab.getpixel((6, 4))) >= 250  # white stays white
    sixteen = decode_image(_encode(Image.fromarray(np.full((4, 4), 0x8040, np.uint16))), "t")
    assert sixteen.getpixel((0, 0)) == (0x80, 0x80, 0x80)  # the high byte, not clipped to 255
    cmyk = decode_image(_encode(Image.new("CMYK", (4, 4), (0, 255, 255, 0)), "TIFF"), "t")
    assert cmyk.getpixel((0, 0)) == (255, 0, 0)
    assert len(encode_image(Image.new("LAB", (4, 4)), "raw")) == 4 * 4 * 3


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_openai_masks_transparent_hole_white_and_explicit_modes() -> None:
    """OpenAI's transparent hole and the white-on-black mask select the same pixels; auto
    picks the alpha convention only when some pixel is fully transparent."""
    region = np.zeros((32, 48), bool)
    region[8:20, 10:30] = True
    hole = np.full((32, 48, 4), 255, np.uint8)
    hole[region, 3] = 0
    white = _png(Image.fromarray(region.astype(np.uint8) * 255))
    for mode in ("auto", "alpha"):
        assert np.array_equal(decode_openai_mask(_png(Image.fromarray(hole, "RGBA")), mode), region)
    for mode in ("auto", "white"):
        assert np.array_equal(decode_openai_mask(white, mode), region)
    # white painted on a transparent layer: the alpha convention under auto, white if asked
    layer = np.zeros((32, 48, 4), np.uint8)
    layer[region] = 255
    painted = _png(Image.fromarray(layer, "RGBA"))
    assert np.array_equal(decode_openai_mask(painted, "auto"), ~region)
    assert np.array_equal(decode_openai_mask(painted, "white"), region)
    # an opaque RGBA mask is read by its colour
    opaque = np.dstack([np.repeat(region[..., None] * 255, 3, -1), np.full((32, 48), 255)])
    assert np.array_equal(
        decode_openai_mask(_png(Image.fromarray(opaque.astype(np.uint8), "RGBA"))), region
    )
    with pytest.raises(BadRequest) as err:
        decode_openai_mask(white, "alpha")
    assert (err.value.code, err.value.field) == ("invalid_field", "mask")
    with pytest.raises(BadRequest) as err:
        decode_openai_mask(white, "black")
    assert err.value.field == "mask_mode"


def test_composite_pastes_the_masked_region_with_a_soft_edge_outside_it() -> None:
    from retouch.functions.imaging import composite

    template = Image.fromarray(np.full((64, 64, 3), 200, np.uint8))
    generated = Image.fromarray(np.full((64, 64, 3), 10, np.uint8))
    mask = np.zeros((64, 64), bool)
    mask[20:40, 20:40] = True
    out = np.asarray(composite(generated, template, mask, feather_px=4)).astype(int)
    assert (out[mask] == 10).all()  # every masked pixel is the model's
    assert (out[:14] == 200).all() and (out[:, 46:] == 200).all()  # beyond the feather
    ramp = out[30, 40:45, 0]  # just right of the mask: from the edit towards the template
    assert list(ramp) == sorted(ramp) and 10 < ramp[0] < ramp[-1] <= 200
    hard = np.asarray(composite(generated, template, mask, feather_px=0)).astype(int)
    assert (hard[mask] == 10).all() and (hard[~mask] == 200).all()


def test_composite_with_an_empty_mask_is_the_template() -> None:
    from retouch.functions.imaging import composite

    rng = np.random.default_rng(0)
    template = Image.fromarray(rng.integers(0, 255, (32, 48, 3), dtype=np.uint8))
    generated = Image.fromarray(rng.integers(0, 255, (32, 48, 3), dtype=np.uint8))
    out = composite(generated, template, np.zeros((32, 48), bool), feather_px=3)
    assert np.array_equal(np.asarray(out), np.asarray(template))
