"""Value encoding, key layout and manifests: round trips and corruption detection."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retouch.cachestore.codec import check_value, decode_value, encode_value, parse_header
from retouch.cachestore.errors import CorruptValue
from retouch.cachestore.layout import check_slot, parse_value_key, value_key
from retouch.cachestore.manifest import EntrySpec, Manifest

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 5, 7), (1, 2, 3, 4, 5, 6, 7, 8)])
def test_value_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = (torch.randn(shape) * 10).to(dtype)
    value = encode_value(tensor)
    assert len(value) % 64 == tensor.nbytes % 64  # payload sits at a 64-byte offset
    out = decode_value(value)
    assert out.dtype == dtype and tuple(out.shape) == shape
    if dtype == torch.float8_e4m3fn:  # no ``equal`` on CPU: compare the very bytes
        out, tensor = out.view(torch.uint8), tensor.view(torch.uint8)
    assert torch.equal(out, tensor)


def test_flipped_payload_byte_is_detected() -> None:
    value = bytearray(encode_value(torch.randn(4, 16).half()))
    value[-5] ^= 0x40
    with pytest.raises(CorruptValue, match="checksum"):
        check_value(value)
    with pytest.raises(CorruptValue, match="checksum"):
        decode_value(value)


def test_flipped_header_byte_is_detected() -> None:
    value = bytearray(encode_value(torch.randn(4, 16)))
    value[25] ^= 0x01  # inside the shape: either the length check or the CRC catches it
    with pytest.raises(CorruptValue):
        check_value(value)


def test_truncated_value_is_detected() -> None:
    value = encode_value(torch.randn(8, 8))
    with pytest.raises(CorruptValue):
        parse_header(value[:-1])
    with pytest.raises(CorruptValue):
        parse_header(value[:10])


def test_unsupported_dtype_is_refused() -> None:
    with pytest.raises(TypeError, match="cannot be stored"):
        encode_value(torch.zeros(2, dtype=torch.complex64))


@settings(max_examples=50, deadline=None)
@given(
    gen=st.integers(0, 2**64 - 1),
    step=st.integers(-(2**31), 2**31 - 1),
    block=st.text(max_size=40).filter(lambda s: "\0" not in s),
    name=st.text(max_size=20).filter(lambda s: "\0" not in s),
)
def test_value_key_round_trip(gen: int, step: int, block: str, name: str) -> None:
    check_slot(step, block, name)
    assert parse_value_key(value_key(gen, step, block, name)) == (gen, (step, block, name))


def test_value_keys_of_one_generation_are_contiguous() -> None:
    keys = sorted(value_key(g, s, "b", "k") for g in (1, 2, 256) for s in (-1, 0, 5, 70000))
    assert [parse_value_key(k)[0] for k in keys] == [1] * 4 + [2] * 4 + [256] * 4


def test_slot_with_nul_is_refused() -> None:
    with pytest.raises(ValueError):
        check_slot(0, "a\0b", "k")


def test_manifest_round_trip_and_layout() -> None:
    entries = (
        EntrySpec(0, "b0", "k", torch.float16, (2, 3, 5)),
        EntrySpec(-1, "", "noise", torch.float32, (7,)),
    )
    manifest = Manifest(key="t", gen=9, meta={"function": "f", "n": [1, 2]}, entries=entries)
    back = Manifest.unpack(manifest.pack())
    assert back == manifest
    assert Manifest.unpack(manifest.invalidated("bad").pack()).valid is False
    offsets, total = manifest.host_layout()
    assert offsets == [0, 64] and total == 128
    assert manifest.nbytes == 60 + 28


def test_garbage_manifest_is_corrupt() -> None:
    with pytest.raises(CorruptValue):
        Manifest.unpack(b"V\xc1\x00")
    with pytest.raises(CorruptValue):
        Manifest.unpack(b"")
