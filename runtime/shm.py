"""Tensors between processes without pickle: one shared-memory block per message.

The sender copies every tensor, array or byte string of a message into one
``multiprocessing.shared_memory`` block (64-byte aligned) and sends only a small
msgpack-able header over a pipe: the block's name and each item's kind, dtype, shape and
offset. The receiver copies the items out and unlinks the block, so a block lives exactly
as long as one message is in flight. The caller names the block, which lets the owner of a
message unlink it (:func:`discard`) when the other side died before taking it; blocks of a
process that died without anyone noticing are unlinked by multiprocessing's resource
tracker when the processes sharing it exit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

ALIGN = 64  # offsets of items in a block (a cache line; every dtype's alignment)

Item = torch.Tensor | np.ndarray | bytes
Header = dict[str, Any]


def put_tensors(items: Mapping[str, Item], name: str | None = None) -> Header:
    """Copy ``items`` into a new shared-memory block; returns the header that describes it.

    Tensors may live on any device (they are copied to the host first); numpy scalars
    arrive as 0-d arrays. ``name`` fixes the
    block's name (it must not exist); without items holding bytes no block is created.
    """
    items = {k: np.asarray(v) if isinstance(v, np.generic) else v for k, v in items.items()}
    sources = {key: _as_bytes(value) for key, value in items.items()}
    specs, size = _layout(items, sources)
    if size == 0:
        return {"block": None, "items": specs}
    block = SharedMemory(name=name, create=True, size=size)
    try:
        _copy_in(block, sources, specs)
    except BaseException:
        _release(block)
        raise
    _close(block)
    return {"block": block.name, "items": specs}


def take_tensors(header: Header) -> dict[str, Item]:
    """The items a :func:`put_tensors` header describes, copied out; the block is unlinked
    whatever happens."""
    specs = header["items"]
    name = header.get("block")
    if name is None:
        return {spec["key"]: _empty(spec) for spec in specs}
    block = SharedMemory(name=name)
    try:
        return _copy_out(block, specs)
    finally:
        _release(block)


def discard(name: str) -> bool:
    """Unlink the block ``name`` if it still exists (its message will never be taken)."""
    try:
        block = SharedMemory(name=name)
    except FileNotFoundError:
        return False
    _release(block)
    return True


def header_bytes(header: Header) -> int:
    """Payload bytes a header describes (for accounting)."""
    return sum(spec["nbytes"] for spec in header["items"])


# -- layout ---------------------------------------------------------------------------------


def _as_bytes(value: Item) -> np.ndarray:
    """A flat uint8 view (or copy, for device or non-contiguous tensors) of ``value``."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        return flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError("object arrays cannot be shared")
        return np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    if isinstance(value, bytes | bytearray | memoryview):
        return np.frombuffer(value, dtype=np.uint8)
    raise TypeError(f"cannot share a {type(value).__name__}")


def _spec(key: str, value: Item, nbytes: int) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {
            "key": key,
            "kind": "torch",
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
        }
    if isinstance(value, np.ndarray):
        return {"key": key, "kind": "numpy", "dtype": value.dtype.str, "shape": list(value.shape)}
    return {"key": key, "kind": "bytes", "dtype": "|u1", "shape": [nbytes]}


def _layout(
    items: Mapping[str, Item], sources: Mapping[str, np.ndarray]
) -> tuple[list[dict[str, Any]], int]:
    specs, offset = [], 0
    for key, value in items.items():
        nbytes = int(sources[key].nbytes)
        specs.append({**_spec(key, value, nbytes), "offset": offset, "nbytes": nbytes})
        offset += -(-nbytes // ALIGN) * ALIGN
    return specs, offset


# -- copies ---------------------------------------------------------------------------------


def _copy_in(block: SharedMemory, sources: Mapping[str, np.ndarray], specs: list[dict]) -> None:
    for spec in specs:
        if spec["nbytes"]:
            target = np.frombuffer(
                block.buf, dtype=np.uint8, count=spec["nbytes"], offset=spec["offset"]
            )
            np.copyto(target, sources[spec["key"]])
            del target  # the block can only close once no view is exported


def _copy_out(block: SharedMemory, specs: list[dict]) -> dict[str, Item]:
    out: dict[str, Item] = {}
    for spec in specs:
        start, nbytes = int(spec["offset"]), int(spec["nbytes"])
        if start + nbytes > block.size:
            raise ValueError(f"item {spec['key']!r} lies outside its block")
        if spec["kind"] == "bytes":
            out[spec["key"]] = bytes(block.buf[start : start + nbytes])
            continue
        value = _empty(spec)
        if nbytes:
            source = np.frombuffer(block.buf, dtype=np.uint8, count=nbytes, offset=start)
            np.copyto(_bytes_of(value), source)
            del source
        out[spec["key"]] = value
    return out


def _empty(spec: dict[str, Any]) -> Item:
    """An uninitialised item of ``spec``'s kind, dtype and shape (owning its memory)."""
    shape = tuple(int(s) for s in spec["shape"])
    if spec["kind"] == "torch":
        dtype = getattr(torch, spec["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {spec['dtype']!r}")
        value = torch.empty(shape, dtype=dtype)
    elif spec["kind"] == "numpy":
        value = np.empty(shape, dtype=np.dtype(spec["dtype"]))
    elif spec["kind"] == "bytes":
        return b""
    else:
        raise ValueError(f"unknown item kind {spec['kind']!r}")
    if _bytes_of(value).nbytes != spec["nbytes"]:
        raise ValueError(f"item {spec['key']!r}: {spec['nbytes']} bytes do not fit its shape")
    return value


def _bytes_of(value: torch.Tensor | np.ndarray) -> np.ndarray:
    """A writable flat uint8 view of a contiguous host tensor or array."""
    if isinstance(value, torch.Tensor):
        flat = value.reshape(-1)
        return flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    return value.reshape(-1).view(np.uint8)


# -- block lifetime -------------------------------------------------------------------------


def _close(block: SharedMemory) -> None:
    """Unmap; a view still exported (an exception's traceback may hold one) is left to GC."""
    try:
        block.close()
    except BufferError:
        log.debug("shared-memory block %s still has views; unmapped later", block.name)


def _release(block: SharedMemory) -> None:
    """Unmap and unlink (the name goes now, the memory when the last mapping does)."""
    _close(block)
    try:
        block.unlink()
    except FileNotFoundError:
        log.debug("shared-memory block %s was already unlinked", block.name)
