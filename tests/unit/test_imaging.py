from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retouch.functions.demo.images import SHAPES, mask_of_ratio, template_image
from retouch.functions.errors import BadRequest
from retouch.functions.imaging import decode_image, decode_mask, encode_image, encode_mask


@settings(deadline=None, max_examples=30)
@given(ratio=st.floats(0.02, 0.98), shape=st.sampled_from(SHAPES), seed=st.integers(0, 1000))
def test_masks_hit_their_ratio(ratio: float, shape: str, seed: int) -> None:
    mask = mask_of_ratio((128, 96), ratio, shape, seed)
    assert mask.shape == (96, 128) and mask.dtype == bool
    assert abs(mask.mean() - ratio) < 0.03


def test_mask_encoding_round_trip() -> None:
    mask = mask_of_ratio((64, 64), 0.3, "blob", 1)
    assert np.array_equal(decode_mask(encode_mask(mask), (64, 64)), mask)
    with pytest.raises(BadRequest) as err:
        decode_mask(encode_mask(mask), (32, 64))
    assert err.value.code == "mask_size_mismatch"


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
