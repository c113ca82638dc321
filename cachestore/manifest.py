"""A template's manifest: what was baked, under which generation, and whether it is valid.

The manifest is the commit record of a template. It is written last, in the same LMDB
transaction that makes the template's values reachable, so a reader sees either the whole
template or nothing.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import torch

from retouch.cachestore.codec import code_dtype, dtype_code
from retouch.cachestore.errors import CorruptValue
from retouch.cachestore.layout import Slot

FORMAT_VERSION = 1
VALID = b"V"
INVALID = b"I"
HOST_ALIGN = 64  # byte alignment of each tensor inside a host buffer


@dataclass(frozen=True)
class EntrySpec:
    """One stored tensor of a template."""

    step: int
    block: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def slot(self) -> Slot:
        return (self.step, self.block, self.name)

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize

    @classmethod
    def of(cls, slot: Slot, tensor: torch.Tensor) -> EntrySpec:
        step, block, name = slot
        return cls(step, block, name, tensor.dtype, tuple(tensor.shape))


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the host buffer's alignment of each tensor."""
    return -(-nbytes // HOST_ALIGN) * HOST_ALIGN


_SUMMARY = struct.Struct("<cQQd")  # status, gen, nbytes, created


@dataclass(frozen=True)
class ManifestSummary:
    """The fixed-size head of a manifest record: enough for budgets, eviction and gc
    without decoding the entry list (a scan of thousands of templates stays cheap)."""

    key: str
    gen: int
    nbytes: int
    created: float
    valid: bool

    @classmethod
    def unpack(cls, key: str, raw: bytes | memoryview) -> ManifestSummary:
        if len(raw) < _SUMMARY.size:
            raise CorruptValue(f"manifest record of {len(raw)} bytes is too short")
        status, gen, nbytes, created = _SUMMARY.unpack_from(raw, 0)
        if status not in (VALID, INVALID):
            raise CorruptValue(f"bad manifest status byte {status!r}")
        return cls(key=key, gen=gen, nbytes=nbytes, created=created, valid=status == VALID)


@dataclass(frozen=True)
class Manifest:
    """Commit record of one template (``valid`` turns False when corruption is found).

    Stored as a fixed head (:class:`ManifestSummary`) followed by a msgpack document with
    the metadata and the entry list.
    """

    key: str
    gen: int
    meta: dict[str, Any]
    entries: tuple[EntrySpec, ...]
    created: float = field(default_factory=time.time)
    valid: bool = True
    reason: str = ""

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)

    def invalidated(self, reason: str) -> Manifest:
        return replace(self, valid=False, reason=reason)

    def host_layout(self) -> tuple[list[int], int]:
        """Aligned byte offsets of every entry in one host buffer, and the buffer size."""
        offsets, cursor = [], 0
        for entry in self.entries:
            offsets.append(cursor)
            cursor += aligned(entry.nbytes)
        return offsets, cursor

    def pack(self) -> bytes:
        head = _SUMMARY.pack(VALID if self.valid else INVALID, self.gen, self.nbytes, self.created)
        doc = {
            "format": FORMAT_VERSION,
            "key": self.key,
            "meta": self.meta,
            "reason": self.reason,
            "entries": [
                [e.step, e.block, e.name, dtype_code(e.dtype), list(e.shape)] for e in self.entries
            ],
        }
        return head + msgpack.packb(doc, use_bin_type=True)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> Manifest:
        raw = bytes(raw)
        try:
            doc = msgpack.unpackb(raw[_SUMMARY.size :], raw=False, strict_map_key=False)
            summary = ManifestSummary.unpack(str(doc["key"]), raw)
            if doc["format"] != FORMAT_VERSION:
                raise CorruptValue(f"manifest format {doc['format']} != {FORMAT_VERSION}")
            entries = tuple(
                EntrySpec(int(s), str(b), str(n), code_dtype(int(c)), tuple(int(d) for d in shp))
                for s, b, n, c, shp in doc["entries"]
            )
            manifest = cls(
                key=summary.key,
                gen=summary.gen,
                meta=dict(doc["meta"]),
                entries=entries,
                created=summary.created,
                valid=summary.valid,
                reason=str(doc["reason"]),
            )
        except CorruptValue:
            raise
        except (msgpack.UnpackException, ValueError, KeyError, TypeError) as exc:
            raise CorruptValue(f"undecodable manifest: {exc}") from exc
        if manifest.nbytes != summary.nbytes:
            raise CorruptValue("manifest head disagrees with its entries")
        return manifest


def is_valid(raw: bytes | memoryview) -> bool:
    """Validity of a packed manifest from its status byte alone (no decoding)."""
    return bytes(raw[:1]) == VALID


def check_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """Refuse metadata msgpack cannot store, before any byte of a bake is written."""
    try:
        msgpack.packb(meta, use_bin_type=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"template meta must be msgpack-serialisable: {exc}") from exc
    return dict(meta)
