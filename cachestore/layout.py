"""Key layout of the LMDB environment.

Four named databases:

* ``meta``      — store-wide records: ``format`` (cache format version), ``next_gen``,
  ``map_size`` (chosen at creation; every process maps the file with it).
* ``manifests`` — template key (UTF-8) -> msgpack manifest (see ``manifest.py``).
* ``staging``   — generation (u64 BE) -> msgpack record of a bake in progress (writer pid and
  process start time), so a writer killed mid-bake leaves recognisable garbage.
* ``values``    — ``gen u64 BE | step+2**31 u32 BE | block UTF-8 | 0x00 | name UTF-8`` ->
  encoded tensor (``codec.py``).

Values are keyed by a *generation* number, not by the template key: every bake or spill gets
a fresh generation, so its values are invisible until the manifest that names the
generation is committed, and a re-bake never overwrites values a reader may be using.
"""

from __future__ import annotations

import struct
from pathlib import Path

STORE_DIRNAME = "cache"  # under a data directory

META_DB = b"meta"
MANIFEST_DB = b"manifests"
STAGING_DB = b"staging"
VALUES_DB = b"values"

FORMAT_KEY = b"format"
NEXT_GEN_KEY = b"next_gen"
MAP_SIZE_KEY = b"map_size"

MAX_KEY_BYTES = 511  # LMDB's default maximum key size
STEP_BIAS = 1 << 31

_GEN = struct.Struct(">Q")
_GEN_STEP = struct.Struct(">QI")

Slot = tuple[int, str, str]  # (step, block, name)


def store_path(data_dir: Path) -> Path:
    """Where the executors of one host keep their shared activation store (a path only:
    the CLI finds it without importing the store, which needs torch)."""
    return data_dir / STORE_DIRNAME


def template_key(key: str) -> bytes:
    """UTF-8 key of a template's manifest; refuses keys LMDB cannot hold."""
    raw = key.encode("utf-8")
    if not raw or len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"template key must be 1..{MAX_KEY_BYTES} UTF-8 bytes, got {len(raw)}")
    return raw


def gen_key(gen: int) -> bytes:
    """Big-endian generation: sorts numerically and is the prefix of its values."""
    return _GEN.pack(gen)


def parse_gen(raw: bytes | memoryview) -> int:
    """Generation from a ``gen_key`` or from the first 8 bytes of a value key."""
    return _GEN.unpack_from(raw, 0)[0]


def check_slot(step: int, block: str, name: str) -> None:
    """Refuse slot names the key layout cannot represent unambiguously."""
    if not -STEP_BIAS <= step < STEP_BIAS:
        raise ValueError(f"step {step} out of range")
    for label, text in (("block", block), ("name", name)):
        if not isinstance(text, str) or "\0" in text:
            raise ValueError(f"{label} must be a str without NUL characters, got {text!r}")


def value_key(gen: int, step: int, block: str, name: str) -> bytes:
    """Key of one stored tensor; values of one generation are contiguous in key order."""
    raw = _GEN_STEP.pack(gen, step + STEP_BIAS) + block.encode() + b"\0" + name.encode()
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"block/name too long for an LMDB key: {block!r}, {name!r}")
    return raw


def parse_value_key(raw: bytes | memoryview) -> tuple[int, Slot]:
    """Inverse of :func:`value_key`."""
    gen, biased = _GEN_STEP.unpack_from(raw, 0)
    block, _, name = bytes(raw[_GEN_STEP.size :]).partition(b"\0")
    return gen, (biased - STEP_BIAS, block.decode(), name.decode())
