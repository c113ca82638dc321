"""The disk tier's LMDB environment: opening it, its four databases and the record-level
operations every read or write transaction of the tier is built from.

``map_size`` is chosen once, at creation, and recorded in the store: every process maps the
file with that size (see :meth:`DiskEnv._adopt_recorded_map_size`). The operations taking a
``txn`` run inside a transaction the caller owns; none of them commits anything itself.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import torch

from retouch.cachestore import liveness
from retouch.cachestore.buffers import HostBuffer
from retouch.cachestore.codec import ValueHeader, copy_verified, parse_header
from retouch.cachestore.errors import CorruptEntry, CorruptValue, FormatMismatch, StoreError
from retouch.cachestore.layout import (
    FORMAT_KEY,
    MANIFEST_DB,
    MAP_SIZE_KEY,
    META_DB,
    NEXT_GEN_KEY,
    STAGING_DB,
    VALUES_DB,
    Slot,
    gen_key,
    parse_gen,
    template_key,
    value_key,
)
from retouch.cachestore.manifest import FORMAT_VERSION, EntrySpec, Manifest, ManifestSummary

log = logging.getLogger(__name__)

DATA_FILE = "data.mdb"
LAST_EVICTION_KEY = b"last_eviction"


@dataclass(frozen=True)
class DiskConfig:
    path: Path
    map_size: int
    budget_bytes: int
    readonly: bool = False
    max_readers: int = 126
    batch_bytes: int = 64 << 20  # values per staging transaction


@dataclass
class Scan:
    """Manifest heads of one transaction; ``broken`` are keys whose head is unreadable."""

    manifests: dict[str, ManifestSummary] = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)


def is_full(exc: lmdb.Error) -> bool:
    """Map full or disk full: the two conditions eviction can cure."""
    if isinstance(exc, lmdb.MapFullError):
        return True
    return getattr(exc, "code", None) == errno.ENOSPC or "No space left" in str(exc)


def decode(key: str, raw: bytes | memoryview) -> Manifest:
    """The manifest stored for ``key``; CorruptEntry if undecodable."""
    try:
        return Manifest.unpack(raw)
    except CorruptValue as exc:
        raise CorruptEntry(key, str(exc)) from exc


def decode_or_none(raw: bytes | memoryview) -> Manifest | None:
    try:
        return Manifest.unpack(raw)
    except CorruptValue:
        return None


def summary_or_none(key: str, raw: bytes | memoryview) -> ManifestSummary | None:
    try:
        return ManifestSummary.unpack(key, raw)
    except CorruptValue:
        return None


def entry_header(
    value: memoryview | None, entry: EntrySpec, read: Callable[[memoryview], ValueHeader]
) -> ValueHeader:
    """``value``'s header as ``read`` gives it, checked against the manifest's ``entry``;
    CorruptValue when the value is missing or disagrees."""
    if value is None:
        raise CorruptValue("value missing")
    header = read(value)
    if header.dtype != entry.dtype or header.shape != entry.shape:
        raise CorruptValue("value header disagrees with the manifest")
    return header


def writer_alive(rec: dict[str, Any]) -> bool:
    """Whether the process that wrote a staging record still runs."""
    try:
        return liveness.alive(liveness.ProcessId.from_doc(rec["proc"]))
    except (KeyError, TypeError, ValueError, IndexError):
        return False


class DiskEnv:
    """One opened LMDB environment of an activation store and its databases."""

    def __init__(self, config: DiskConfig) -> None:
        self.config = config
        if not config.readonly:
            config.path.mkdir(parents=True, exist_ok=True)
        self.map_size = config.map_size
        self.env = self._open_env()
        try:
            stale = self.env.reader_check()
            if stale:
                log.warning("cleared %d stale LMDB reader slots in %s", stale, config.path)
            self._open_dbs()
            self._check_format()
            self._adopt_recorded_map_size()
        except BaseException:
            self.env.close()
            raise

    # ---- opening -------------------------------------------------------------------------

    def _open_env(self) -> lmdb.Environment:
        return lmdb.open(
            str(self.config.path),
            map_size=self.map_size,
            subdir=True,
            readonly=self.config.readonly,
            max_dbs=8,
            max_readers=self.config.max_readers,
            lock=True,
            readahead=True,
            meminit=False,
        )

    def _adopt_recorded_map_size(self) -> None:
        """Open with the map size the store was created with.

        Every process must map the file with one size: a process that commits with a
        larger map makes the others fail with MDB_MAP_RESIZED, and remapping under live
        read transactions is not allowed. So the size is chosen once, at creation.
        """
        with self.env.begin(db=self.meta) as txn:
            recorded = txn.get(MAP_SIZE_KEY)
        if recorded is None or int(recorded) == self.map_size:
            return
        log.warning(
            "%s was created with map_size=%s; using it instead of %d",
            self.config.path,
            recorded.decode(),
            self.map_size,
        )
        self.env.close()
        self.map_size = int(recorded)
        self.env = self._open_env()
        self._open_dbs()

    def _open_dbs(self) -> None:
        create = not self.config.readonly
        try:
            self.meta = self.env.open_db(META_DB, create=create)
            self.manifests = self.env.open_db(MANIFEST_DB, create=create)
            self.staging = self.env.open_db(STAGING_DB, create=create)
            self.values = self.env.open_db(VALUES_DB, create=create)
        except lmdb.NotFoundError:
            raise StoreError(f"{self.config.path} is not an activation store") from None

    def _check_format(self) -> None:
        with self.env.begin(db=self.meta, write=not self.config.readonly) as txn:
            found = txn.get(FORMAT_KEY)
            if found is None and not self.config.readonly:
                txn.put(FORMAT_KEY, str(FORMAT_VERSION).encode())
                txn.put(NEXT_GEN_KEY, gen_key(1))
                txn.put(MAP_SIZE_KEY, str(self.map_size).encode())
                return
        if found is None:
            raise StoreError(f"{self.config.path} is not an initialised activation store")
        if int(found) != FORMAT_VERSION:
            raise FormatMismatch(
                f"{self.config.path} holds cache format {found!r}, this code reads "
                f"{FORMAT_VERSION}; delete the directory (templates are re-baked on use)"
            )

    def close(self) -> None:
        self.env.close()

    # ---- transactions --------------------------------------------------------------------

    def begin(self, write: bool = False) -> lmdb.Transaction:
        """A transaction over every database, values as buffers (zero-copy reads)."""
        return self.env.begin(write=write, buffers=True)

    def advance(self) -> None:
        """Commit one tiny transaction so pages freed by the previous one become reusable.

        LMDB keeps the last committed snapshot intact (crash safety), so pages freed in
        transaction N can only be allocated from transaction N + 2 on.
        """
        try:
            with self.env.begin(write=True, db=self.meta) as txn:
                txn.put(LAST_EVICTION_KEY, repr(time.time()).encode())
        except lmdb.Error as exc:
            if not is_full(exc):
                raise

    # ---- records inside a caller's transaction -------------------------------------------

    def scan(self, txn: lmdb.Transaction) -> Scan:
        scan = Scan()
        for raw_key, raw in txn.cursor(db=self.manifests):
            key = bytes(raw_key).decode()
            summary = summary_or_none(key, raw)
            if summary is None:
                scan.broken.append(key)
            else:
                scan.manifests[key] = summary
        return scan

    def raw_manifest(self, txn: lmdb.Transaction, key: str) -> memoryview | None:
        return txn.get(template_key(key), db=self.manifests)

    def put_manifest(self, txn: lmdb.Transaction, manifest: Manifest) -> None:
        txn.put(template_key(manifest.key), manifest.pack(), db=self.manifests)

    def delete_template(
        self, txn: lmdb.Transaction, key: str, manifest: ManifestSummary | None
    ) -> int:
        freed = self.delete_gen(txn, manifest.gen) if manifest is not None else 0
        txn.delete(template_key(key), db=self.manifests)
        return freed

    def delete_gen(self, txn: lmdb.Transaction, gen: int) -> int:
        """Delete every value of generation ``gen``; returns the bytes freed."""
        prefix = gen_key(gen)
        freed = 0
        cursor = txn.cursor(db=self.values)
        if not cursor.set_range(prefix):
            return 0
        while bytes(cursor.key()[: len(prefix)]) == prefix:
            freed += len(cursor.value())
            if not cursor.delete():
                break
        return freed

    def value_gens(self, txn: lmdb.Transaction) -> Iterator[int]:
        """Distinct generations present in the values database, skipping from one to the
        next without visiting every value."""
        cursor = txn.cursor(db=self.values)
        found = cursor.first()
        while found:
            gen = parse_gen(cursor.key())
            yield gen
            found = cursor.set_range(gen_key(gen + 1))

    def staging_records(self, txn: lmdb.Transaction) -> list[tuple[int, dict[str, Any]]]:
        records = []
        for raw_key, raw in txn.cursor(db=self.staging):
            try:
                rec = msgpack.unpackb(bytes(raw), raw=False)
            except (msgpack.UnpackException, ValueError):
                rec = {}
            records.append((parse_gen(raw_key), rec))
        return records

    def drop_staging(self, txn: lmdb.Transaction, gen: int) -> None:
        """Remove generation ``gen``'s values and its staging record."""
        self.delete_gen(txn, gen)
        txn.delete(gen_key(gen), db=self.staging)

    def copy_values(
        self, txn: lmdb.Transaction, manifest: Manifest, offsets: list[int], buf: HostBuffer
    ) -> dict[Slot, torch.Tensor]:
        """Copy ``manifest``'s values into ``buf`` at ``offsets``, verifying each checksum;
        returns typed views of ``buf`` by slot."""
        flat = buf.tensor.numpy()
        tensors: dict[Slot, torch.Tensor] = {}
        for entry, offset in zip(manifest.entries, offsets, strict=True):
            value = txn.get(value_key(manifest.gen, *entry.slot), db=self.values)
            try:
                header = entry_header(value, entry, parse_header)
                copy_verified(value, header, flat[offset : offset + entry.nbytes])
            except CorruptValue as exc:
                raise CorruptEntry(manifest.key, str(exc), *entry.slot) from exc
            view = buf.tensor[offset : offset + entry.nbytes]
            tensors[entry.slot] = view.view(entry.dtype).view(entry.shape)
        return tensors
