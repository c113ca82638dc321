"""The shared-memory transport: round trips of every kind, dtype and shape, and no leaks."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from retouch.functions.wire.codec import pack, unpack
from retouch.runtime import shm

SHM = Path("/dev/shm")
TORCH_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]
NUMPY_DTYPES = ["<f4", "<f2", "<i8", ">i4", "|u1", "|b1", "<c8"]
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


def _name() -> str:
    return f"rt-test-{os.getpid()}-{secrets.token_hex(4)}"


def _exists(name: str) -> bool:
    return (SHM / name).exists()


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=generator).to(dtype)


def _array(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.asarray((rng.standard_normal(shape) * 50).astype(np.dtype(dtype)))


def _same(a: shm.Item, b: shm.Item) -> bool:
    if isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


@settings(max_examples=60, deadline=None)
@given(
    torch_items=st.lists(
        st.tuples(st.sampled_from(TORCH_DTYPES), shapes, st.integers(0, 2**16)), max_size=4
    ),
    numpy_items=st.lists(
        st.tuples(st.sampled_from(NUMPY_DTYPES), shapes, st.integers(0, 2**16)), max_size=3
    ),
    blob=st.binary(max_size=300),
)
def test_round_trip_through_a_block_and_a_msgpack_header(torch_items, numpy_items, blob) -> None:
    items: dict[str, shm.Item] = {"blob": blob}
    for i, (dtype, shape, seed) in enumerate(torch_items):
        items[f"t{i}"] = _tensor(dtype, shape, seed)
    for i, (dtype, shape, seed) in enumerate(numpy_items):
        items[f"n{i}"] = _array(dtype, shape, seed)
    name = _name()
    header = unpack(pack(shm.put_tensors(items, name)))
    out = shm.take_tensors(header)
    assert out.keys() == items.keys()
    assert all(_same(out[key], value) for key, value in items.items())
    assert not _exists(name)


def test_offsets_are_aligned_and_views_are_copied() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    items = {"odd": torch.ones(3, dtype=torch.int8), "strided": base[:, ::2], "t": base.T}
    header = shm.put_tensors(items, _name())
    assert all(spec["offset"] % shm.ALIGN == 0 for spec in header["items"])
    out = shm.take_tensors(header)
    assert torch.equal(out["strided"], base[:, ::2]) and torch.equal(out["t"], base.T)
    out["t"][0, 0] = -1  # the copy owns its memory
    assert base[0, 0] == 0


def test_nothing_to_share_creates_no_block() -> None:
    name = _name()
    header = shm.put_tensors({"empty": torch.zeros(0, 4), "none": b""}, name)
    assert header["block"] is None and not _exists(name)
    out = shm.take_tensors(header)
    assert out["empty"].shape == (0, 4) and out["none"] == b""
    assert shm.take_tensors(shm.put_tensors({})) == {}


def test_numpy_scalars_arrive_as_zero_d_arrays() -> None:
    out = shm.take_tensors(shm.put_tensors({"s": np.float16(1.5)}, _name()))
    assert out["s"].shape == () and out["s"].dtype == np.float16 and out["s"] == 1.5


def test_discard_unlinks_a_message_nobody_will_take() -> None:
    name = _name()
    shm.put_tensors({"x": torch.ones(10)}, name)
    assert _exists(name)
    assert shm.discard(name) and not _exists(name)
    assert not shm.discard(name)


def test_a_corrupt_header_is_refused_and_the_block_still_unlinked() -> None:
    name = _name()
    header = shm.put_tensors({"x": torch.ones(4)}, name)
    header["items"][0]["shape"] = [5]
    with pytest.raises(ValueError, match="do not fit"):
        shm.take_tensors(header)
    assert not _exists(name)


def test_unsupported_values_are_refused_before_any_block() -> None:
    name = _name()
    with pytest.raises(TypeError):
        shm.put_tensors({"x": torch.ones(2), "bad": [1, 2]}, name)
    with pytest.raises(TypeError):
        shm.put_tensors({"obj": np.array([object()])}, name)
    assert not _exists(name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_tensors_arrive_on_the_host() -> None:
    tensor = torch.randn(3, 5, device="cuda", dtype=torch.float16)
    out = shm.take_tensors(shm.put_tensors({"x": tensor}, _name()))
    assert out["x"].device.type == "cpu" and torch.equal(out["x"], tensor.cpu())
