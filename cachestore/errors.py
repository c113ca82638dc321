"""Exceptions of the activation store.

Callers act on these: ``CorruptEntry`` means "re-bake this template", ``StoreFull`` means
"nothing could be evicted to make room, the write was refused and nothing changed".
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the activation store raises on purpose."""


class CorruptValue(StoreError):
    """A stored value or manifest failed its checksum or structural checks."""


class CorruptEntry(StoreError):
    """A template's stored data is corrupt; the template has been marked invalid."""

    def __init__(
        self,
        key: str,
        reason: str,
        step: int | None = None,
        block: str | None = None,
        name: str | None = None,
    ) -> None:
        where = "" if step is None else f" at (step={step}, block={block!r}, name={name!r})"
        super().__init__(f"template {key!r} is corrupt{where}: {reason}")
        self.key = key
        self.reason = reason
        self.step = step
        self.block = block
        self.name = name


class StoreFull(StoreError):
    """The LMDB map, the disk or the disk budget is full and eviction could not make room."""


class FormatMismatch(StoreError):
    """The store on disk was written with another cache format version."""


class ReadOnlyStore(StoreError):
    """A write was attempted on a store opened read-only."""


class StoreClosed(StoreError):
    """The store was used after ``close()``."""
