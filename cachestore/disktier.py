"""Disk tier: one memory-mapped LMDB environment per host.

Transaction discipline (py-lmdb / LMDB rules):

* Every write transaction of this process runs on one writer thread (``_writer``); LMDB's
  lock file serialises writers across processes. Write transactions are short: a bake is
  written as batches of values under a fresh *generation* (invisible, see ``layout.py``),
  and a final transaction deletes the template's previous generation, evicts what the disk
  budget requires, writes the manifest and removes the staging record. A writer killed at
  any point leaves either the old template or the new one, never a mixture; its staged
  values are found through the staging record and removed on the next open (or by ``gc``).
* Readers use short read-only transactions (one per template load or lookup) from any
  thread or process; ``reader_check()`` on open clears reader slots of dead processes.
* ``map_size`` is set once, large; LMDB only grows the file as pages are used. When the map
  or the disk is full, the failed transaction is aborted (LMDB never half-commits), the
  least valuable templates are evicted in a separate transaction and the write is retried
  once; if nothing can be evicted the write is refused with ``StoreFull``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import msgpack
import torch

from retouch.cachestore import liveness
from retouch.cachestore.buffers import HostBuffer
from retouch.cachestore.codec import check_value, copy_verified, encode_value, parse_header
from retouch.cachestore.errors import (
    CorruptEntry,
    CorruptValue,
    FormatMismatch,
    ReadOnlyStore,
    StoreClosed,
    StoreError,
    StoreFull,
)
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
from retouch.cachestore.manifest import (
    FORMAT_VERSION,
    EntrySpec,
    Manifest,
    ManifestSummary,
    is_valid,
)
from retouch.cachestore.policy import EvictionPolicy, ephemeral_first, saved_compute
from retouch.cachestore.stats import StoreCounters

log = logging.getLogger(__name__)

T = TypeVar("T")
DATA_FILE = "data.mdb"
FULL_RETRIES = 4  # evict-and-retry rounds before a full map or disk refuses a write
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
class LoadedTemplate:
    """A template copied out of the map into one host buffer (views in ``tensors``)."""

    manifest: Manifest
    buffer: HostBuffer
    tensors: dict[Slot, torch.Tensor]


@dataclass
class _Scan:
    """Manifest heads of one transaction; ``broken`` are keys whose head is unreadable."""

    manifests: dict[str, ManifestSummary] = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)


def _is_full(exc: lmdb.Error) -> bool:
    """Map full or disk full: the two conditions eviction can cure."""
    if isinstance(exc, lmdb.MapFullError):
        return True
    return getattr(exc, "code", None) == errno.ENOSPC or "No space left" in str(exc)


class DiskTier:
    """The LMDB environment, its writer thread and every read and write of templates."""

    def __init__(self, config: DiskConfig, policy: EvictionPolicy, counters: StoreCounters) -> None:
        self.config = config
        self._policy = policy
        self._policy_lock = threading.Lock()
        self._counters = counters
        self._local_invalid: set[str] = set()  # read-only stores cannot write the flag
        self._staged: dict[int, tuple[str, int]] = {}  # writer thread only: gen -> (key, bytes)
        self._closed = False
        self._closing = False
        if not config.readonly:
            config.path.mkdir(parents=True, exist_ok=True)
        self.map_size = config.map_size
        self._env = self._open_env()
        try:
            stale = self._env.reader_check()
            if stale:
                log.warning("cleared %d stale LMDB reader slots in %s", stale, config.path)
            self._open_dbs()
            self._check_format()
            self._adopt_recorded_map_size()
        except BaseException:
            self._env.close()
            raise
        self.budget_bytes = min(config.budget_bytes, self.map_size)
        if self.budget_bytes < config.budget_bytes:
            log.warning("disk budget clamped to the map size (%d bytes)", self.map_size)
        self._writer = (
            None
            if config.readonly
            else ThreadPoolExecutor(max_workers=1, thread_name_prefix="cachestore-writer")
        )
        if self._writer is not None:
            removed = self._write(self._recover_staging)
            if removed:
                log.warning("removed %d partial bakes left by dead writers", removed)

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
        with self._env.begin(db=self._meta) as txn:
            recorded = txn.get(MAP_SIZE_KEY)
        if recorded is None or int(recorded) == self.map_size:
            return
        log.warning(
            "%s was created with map_size=%s; using it instead of %d",
            self.config.path,
            recorded.decode(),
            self.map_size,
        )
        self._env.close()
        self.map_size = int(recorded)
        self._env = self._open_env()
        self._open_dbs()

    def _open_dbs(self) -> None:
        create = not self.config.readonly
        try:
            self._meta = self._env.open_db(META_DB, create=create)
            self._manifests = self._env.open_db(MANIFEST_DB, create=create)
            self._staging = self._env.open_db(STAGING_DB, create=create)
            self._values = self._env.open_db(VALUES_DB, create=create)
        except lmdb.NotFoundError:
            raise StoreError(f"{self.config.path} is not an activation store") from None

    def _check_format(self) -> None:
        with self._env.begin(db=self._meta, write=not self.config.readonly) as txn:
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

    # ---- writer thread -------------------------------------------------------------------

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self._closed or self._closing:
            raise StoreClosed("activation store is closed")
        if self._writer is None:
            raise ReadOnlyStore(f"store {self.config.path} was opened read-only")
        return self._writer.submit(fn, *args)

    def _write(self, fn: Callable[..., T], *args: Any) -> T:
        return self._submit(fn, *args).result()

    def _write_txn(self, body: Callable[[lmdb.Transaction], T], need: int, protect: set[str]) -> T:
        """Run ``body`` in a write transaction; on map/disk full evict and retry."""
        for attempt in range(FULL_RETRIES + 1):
            try:
                with self._env.begin(write=True, buffers=True) as txn:
                    return body(txn)
            except lmdb.Error as exc:
                if not _is_full(exc):
                    raise
                freed = 0 if attempt == FULL_RETRIES else self._try_evict_for_space(need, protect)
                if not freed:
                    raise StoreFull(
                        f"LMDB map or disk full at {self.config.path} (map_size="
                        f"{self.map_size}) and nothing left to evict: {exc}"
                    ) from exc
                log.warning("store full (%s); evicted %d bytes and retrying", exc, freed)
        raise AssertionError("unreachable")

    # ---- reads (any thread) --------------------------------------------------------------

    def contains(self, key: str) -> bool:
        """True when a valid manifest for ``key`` is committed."""
        with self._env.begin(db=self._manifests, buffers=True) as txn:
            raw = txn.get(template_key(key))
            return raw is not None and is_valid(raw) and key not in self._local_invalid

    def manifest(self, key: str, txn: lmdb.Transaction | None = None) -> Manifest | None:
        """The committed manifest of ``key`` (valid or not; seen by ``txn`` when given);
        CorruptEntry if undecodable."""
        if txn is not None:
            raw = txn.get(template_key(key), db=self._manifests)
            return None if raw is None else self._decode(key, raw)
        with self._env.begin(db=self._manifests, buffers=True) as own:
            raw = own.get(template_key(key))
            return None if raw is None else self._decode(key, raw)

    def snapshot(self) -> lmdb.Transaction:
        """A read transaction held by the caller (abort it when done): every read through
        it sees one committed state, whatever writers commit meanwhile. It can be used from
        any thread, one at a time."""
        return self._env.begin(buffers=True)

    def scan(self) -> _Scan:
        with self._env.begin(db=self._manifests, buffers=True) as txn:
            return self._scan(txn)

    def catalog(self) -> tuple[list[Manifest], list[str]]:
        """Every decodable manifest in full, and the keys of undecodable ones."""
        manifests, broken = [], []
        with self._env.begin(db=self._manifests, buffers=True) as txn:
            for raw_key, raw in txn.cursor():
                manifest = self._decode_or_none(raw)
                if manifest is None:
                    broken.append(bytes(raw_key).decode())
                else:
                    manifests.append(manifest)
        return manifests, broken

    def load(
        self,
        key: str,
        alloc: Callable[[int], HostBuffer],
        free: Callable[[HostBuffer], None],
        only: Callable[[Slot], bool] | None = None,
        txn: lmdb.Transaction | None = None,
    ) -> LoadedTemplate:
        """Copy a template out of the map into a host buffer, verifying every checksum.

        The values are copied (not mapped) so the host tier never depends on the map: the
        read transaction ends with the load and LMDB can reuse the pages afterwards.
        ``only``: copy just the slots it accepts (one step of a template streamed by step;
        the returned manifest then lists those entries); ``txn``: read inside this
        :meth:`snapshot`. Raises KeyError when absent or invalid, CorruptEntry on a
        checksum failure.
        """
        start = time.perf_counter()
        with (
            contextlib.nullcontext(txn) if txn is not None else self._env.begin(buffers=True) as txn
        ):
            raw = txn.get(template_key(key), db=self._manifests)
            if raw is None or key in self._local_invalid:
                raise KeyError(key)
            manifest = self._decode(key, raw)
            if not manifest.valid:
                raise KeyError(key)
            if only is not None:
                manifest = replace(
                    manifest, entries=tuple(e for e in manifest.entries if only(e.slot))
                )
            offsets, total = manifest.host_layout()
            buf = alloc(total)
            try:
                tensors = self._copy_values(txn, manifest, offsets, buf)
            except BaseException:
                free(buf)
                raise
        self._counters.add(
            loads=1, disk_bytes_read=manifest.nbytes, load_seconds=time.perf_counter() - start
        )
        self.touch(key, manifest.meta)
        return LoadedTemplate(manifest=manifest, buffer=buf, tensors=tensors)

    def verify(self) -> dict[str, Any]:
        """Check every checksum of every valid template; mark corrupt ones invalid."""
        report: dict[str, Any] = {
            "templates": 0,
            "values": 0,
            "bytes": 0,
            "corrupt": [],
            "invalid": [],
        }
        for key in self.keys():
            with self._env.begin(buffers=True) as txn:
                raw = txn.get(template_key(key), db=self._manifests)
                if raw is None:
                    continue
                problem = self._verify_one(txn, key, raw, report)
            if problem is not None:
                report["corrupt"].append(problem)
        for problem in report["corrupt"]:
            self.mark_invalid(problem["key"], problem["reason"])
        report["orphans"] = self._orphan_report()
        return report

    def keys(self) -> list[str]:
        with self._env.begin(db=self._manifests) as txn:
            return [k.decode() for k in txn.cursor().iternext(keys=True, values=False)]

    def usage(self) -> dict[str, int]:
        scan = self.scan()
        valid = [m for m in scan.manifests.values() if m.valid]
        info, stat = self._env.info(), self._env.stat()
        data = self.config.path / DATA_FILE
        return {
            "disk_bytes": sum(m.nbytes for m in valid),
            "disk_invalid_bytes": sum(m.nbytes for m in scan.manifests.values() if not m.valid),
            "disk_templates": len(valid),
            "disk_invalid_templates": len(scan.manifests) - len(valid) + len(scan.broken),
            "disk_budget_bytes": self.budget_bytes,
            "map_size": info["map_size"],
            "map_used_bytes": (info["last_pgno"] + 1) * stat["psize"],
            "file_bytes": data.stat().st_size if data.exists() else 0,
            "readers": info["num_readers"],
        }

    def touch(self, key: str, meta: dict[str, Any]) -> None:
        """Record an access for the disk tier's eviction policy."""
        with self._policy_lock:
            self._policy.on_access(key, saved_compute(meta))

    # ---- writes (public entry points; run on the writer thread) --------------------------

    def begin_stage(self, key: str) -> int:
        """Reserve a generation for a new bake of ``key`` and record it as in progress."""
        template_key(key)
        return self._write(self._begin_stage, key)

    def stage_async(self, gen: int, items: list[tuple[Slot, torch.Tensor]]) -> Future[None]:
        """Write a batch of values of generation ``gen`` (invisible until commit)."""
        return self._submit(self._stage, gen, items)

    def commit(self, manifest: Manifest) -> list[str]:
        """Publish a staged template; returns the keys evicted to fit the disk budget."""
        return self._write(self._commit, manifest)

    def abort(self, gen: int) -> None:
        """Remove a staged, uncommitted generation."""
        self._write(self._abort, gen)

    def write_async(
        self,
        key: str,
        meta: dict[str, Any],
        tensors: dict[Slot, torch.Tensor],
        should_write: Callable[[], bool],
    ) -> Future[bool]:
        """Write a whole template in the background (spill); ``should_write`` is asked on
        the writer thread just before, so a template deleted meanwhile is not resurrected."""
        return self._submit(self._write_template, key, meta, tensors, should_write)

    def mark_invalid(self, key: str, reason: str) -> None:
        """Flag ``key`` invalid: it reads as absent until re-baked or collected by gc."""
        log.error("marking template %r invalid: %s", key, reason)
        if self.config.readonly:
            self._local_invalid.add(key)
            return
        self._write(self._mark_invalid, key, reason)

    def delete(self, keys: Iterable[str]) -> list[str]:
        """Delete templates (valid or not); returns the keys that existed."""
        return self._write(self._delete_keys, list(keys))

    def gc(self) -> int:
        """Remove invalid templates, partial bakes of dead writers and orphaned values."""
        return self._write(self._gc)

    def flush(self) -> None:
        """Wait until every write queued so far (spills included) is committed."""
        if self._writer is not None and not self._closed:
            self._write(lambda: None)

    def close(self) -> None:
        if self._closed:
            return
        self._closing = True  # queued writes finish; new ones are refused
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self._closed = True
        self._env.close()

    # ---- writer-thread jobs --------------------------------------------------------------

    def _begin_stage(self, key: str) -> int:
        record = msgpack.packb(
            {"key": key, "proc": liveness.current().to_doc(), "t": time.time()}, use_bin_type=True
        )

        def body(txn: lmdb.Transaction) -> int:
            gen = parse_gen(txn.get(NEXT_GEN_KEY, db=self._meta))
            txn.put(NEXT_GEN_KEY, gen_key(gen + 1), db=self._meta)
            txn.put(gen_key(gen), record, db=self._staging)
            return gen

        gen = self._write_txn(body, need=0, protect={key})
        self._staged[gen] = (key, 0)
        return gen

    def _stage(self, gen: int, items: list[tuple[Slot, torch.Tensor]]) -> None:
        key, staged = self._staged[gen]
        encoded = [(value_key(gen, *slot), encode_value(tensor)) for slot, tensor in items]
        batch = sum(len(value) for _, value in encoded)
        staged += batch
        if staged > self.budget_bytes:
            raise StoreFull(
                f"template {key!r} exceeds the disk budget of {self.budget_bytes} bytes"
            )

        def body(txn: lmdb.Transaction) -> None:
            for vkey, value in encoded:
                txn.put(vkey, value, db=self._values)

        self._write_txn(body, need=batch, protect={key})
        self._staged[gen] = (key, staged)

    def _commit(self, manifest: Manifest) -> list[str]:
        def body(txn: lmdb.Transaction) -> list[str]:
            scan = self._scan(txn)
            victims = self._budget_victims(scan, manifest.key, manifest.nbytes)
            for victim in victims:
                self._delete_template(txn, victim, scan.manifests.get(victim))
            old = scan.manifests.get(manifest.key)
            if old is not None:
                self._delete_gen(txn, old.gen)
            txn.put(template_key(manifest.key), manifest.pack(), db=self._manifests)
            txn.delete(gen_key(manifest.gen), db=self._staging)
            return victims

        victims = self._write_txn(body, need=4096, protect={manifest.key})
        self._staged.pop(manifest.gen, None)
        self._local_invalid.discard(manifest.key)
        with self._policy_lock:
            for victim in victims:
                self._policy.on_evict(victim)
            self._policy.on_access(manifest.key, saved_compute(manifest.meta))
        if victims:
            self._counters.add(disk_evictions=len(victims))
            log.info("disk budget: evicted %s to fit %r", victims, manifest.key)
        return victims

    def _abort(self, gen: int) -> None:
        def body(txn: lmdb.Transaction) -> None:
            self._delete_gen(txn, gen)
            txn.delete(gen_key(gen), db=self._staging)

        self._staged.pop(gen, None)
        self._write_txn(body, need=0, protect=set())

    def _write_template(
        self,
        key: str,
        meta: dict[str, Any],
        tensors: dict[Slot, torch.Tensor],
        should_write: Callable[[], bool],
    ) -> bool:
        if not should_write():
            return False
        gen = self._begin_stage(key)
        try:
            batch: list[tuple[Slot, torch.Tensor]] = []
            size = 0
            for slot, tensor in tensors.items():
                batch.append((slot, tensor))
                size += tensor.nbytes
                if size >= self.config.batch_bytes:
                    self._stage(gen, batch)
                    batch, size = [], 0
            if batch:
                self._stage(gen, batch)
            entries = tuple(EntrySpec.of(slot, t) for slot, t in tensors.items())
            self._commit(Manifest(key=key, gen=gen, meta=meta, entries=entries))
        except BaseException:
            self._abort(gen)
            raise
        return True

    def _mark_invalid(self, key: str, reason: str) -> None:
        def body(txn: lmdb.Transaction) -> None:
            raw = txn.get(template_key(key), db=self._manifests)
            if raw is None:
                return
            try:
                manifest = Manifest.unpack(raw)
            except CorruptValue:
                # without a decodable manifest there is nothing to flag: drop the record
                # (the template reads as absent; gc collects its values as orphans)
                txn.delete(template_key(key), db=self._manifests)
                return
            txn.put(template_key(key), manifest.invalidated(reason).pack(), db=self._manifests)

        self._write_txn(body, need=4096, protect=set())
        with self._policy_lock:
            self._policy.forget(key)

    def _delete_keys(self, keys: list[str]) -> list[str]:
        def body(txn: lmdb.Transaction) -> list[str]:
            found = []
            for key in keys:
                raw = txn.get(template_key(key), db=self._manifests)
                if raw is not None:
                    self._delete_template(txn, key, self._summary_or_none(key, raw))
                    found.append(key)
            return found

        found = self._write_txn(body, need=0, protect=set())
        with self._policy_lock:
            for key in keys:
                self._policy.forget(key)
                self._local_invalid.discard(key)
        return found

    def _recover_staging(self) -> int:
        """Remove generations staged by writers that died before committing."""

        def body(txn: lmdb.Transaction) -> int:
            dead = [gen for gen, rec in self._staging_records(txn) if not self._writer_alive(rec)]
            for gen in dead:
                self._delete_gen(txn, gen)
                txn.delete(gen_key(gen), db=self._staging)
            return len(dead)

        return self._write_txn(body, need=0, protect=set())

    def _gc(self) -> int:
        def body(txn: lmdb.Transaction) -> int:
            scan = self._scan(txn)
            freed = 0
            for key, manifest in list(scan.manifests.items()):
                if not manifest.valid:
                    freed += self._delete_template(txn, key, manifest)
            for key in scan.broken:
                freed += self._delete_template(txn, key, None)
            live = {m.gen for m in scan.manifests.values() if m.valid}
            for gen, rec in self._staging_records(txn):
                if self._writer_alive(rec):
                    live.add(gen)
                else:
                    txn.delete(gen_key(gen), db=self._staging)
            for gen in list(self._value_gens(txn)):
                if gen not in live:
                    freed += self._delete_gen(txn, gen)
            return freed

        freed = self._write_txn(body, need=0, protect=set())
        self._local_invalid.clear()
        return freed

    def _try_evict_for_space(self, need: int, protect: set[str]) -> int:
        """:meth:`_evict_for_space`, reporting 0 when even the deletions do not fit."""
        try:
            return self._evict_for_space(need, protect)
        except lmdb.Error as exc:
            if not _is_full(exc):
                raise
            return 0

    def _evict_for_space(self, need: int, protect: set[str]) -> int:
        """Free at least ``need`` value bytes (invalid templates first, then the least
        valuable) in a transaction of its own; returns the bytes freed."""

        def body(txn: lmdb.Transaction) -> tuple[int, list[str]]:
            scan = self._scan(txn)
            freed, evicted = 0, []
            for key in self._eviction_order(scan):
                if freed >= need:
                    break
                if key not in protect:
                    freed += self._delete_template(txn, key, scan.manifests.get(key))
                    evicted.append(key)
            return freed, evicted

        with self._env.begin(write=True, buffers=True) as txn:
            freed, evicted = body(txn)
        self._advance()
        with self._policy_lock:
            for key in evicted:
                self._policy.on_evict(key)
        self._counters.add(disk_evictions=len(evicted))
        return freed

    def _advance(self) -> None:
        """Commit one tiny transaction so pages freed by the previous one become reusable.

        LMDB keeps the last committed snapshot intact (crash safety), so pages freed in
        transaction N can only be allocated from transaction N + 2 on.
        """
        try:
            with self._env.begin(write=True, db=self._meta) as txn:
                txn.put(LAST_EVICTION_KEY, repr(time.time()).encode())
        except lmdb.Error as exc:
            if not _is_full(exc):
                raise

    # ---- transaction helpers -------------------------------------------------------------

    def _decode(self, key: str, raw: bytes | memoryview) -> Manifest:
        try:
            return Manifest.unpack(raw)
        except CorruptValue as exc:
            raise CorruptEntry(key, str(exc)) from exc

    @staticmethod
    def _decode_or_none(raw: bytes | memoryview) -> Manifest | None:
        try:
            return Manifest.unpack(raw)
        except CorruptValue:
            return None

    @staticmethod
    def _summary_or_none(key: str, raw: bytes | memoryview) -> ManifestSummary | None:
        try:
            return ManifestSummary.unpack(key, raw)
        except CorruptValue:
            return None

    def _scan(self, txn: lmdb.Transaction) -> _Scan:
        scan = _Scan()
        for raw_key, raw in txn.cursor(db=self._manifests):
            key = bytes(raw_key).decode()
            summary = self._summary_or_none(key, raw)
            if summary is None:
                scan.broken.append(key)
            else:
                scan.manifests[key] = summary
        return scan

    def _eviction_order(self, scan: _Scan) -> list[str]:
        """Broken and invalid templates first, then valid ones least valuable first
        (ephemeral ones before all others)."""
        valid = sorted((m for m in scan.manifests.values() if m.valid), key=lambda m: m.created)
        with self._policy_lock:
            ranked = ephemeral_first(self._policy, (m.key for m in valid))
        invalid = [k for k, m in scan.manifests.items() if not m.valid]
        return [*scan.broken, *invalid, *ranked]

    def _budget_victims(self, scan: _Scan, key: str, incoming: int) -> list[str]:
        sizes = {k: m.nbytes for k, m in scan.manifests.items() if k != key}
        excess = sum(sizes.values()) + incoming - self.budget_bytes
        victims = []
        for victim in self._eviction_order(scan):
            if excess <= 0:
                break
            if victim != key:
                victims.append(victim)
                excess -= sizes.get(victim, 0)
        if excess > 0:
            raise StoreFull(f"template {key!r} ({incoming} bytes) does not fit the disk budget")
        return victims

    def _delete_template(
        self, txn: lmdb.Transaction, key: str, manifest: ManifestSummary | None
    ) -> int:
        freed = self._delete_gen(txn, manifest.gen) if manifest is not None else 0
        txn.delete(template_key(key), db=self._manifests)
        return freed

    def _delete_gen(self, txn: lmdb.Transaction, gen: int) -> int:
        """Delete every value of generation ``gen``; returns the bytes freed."""
        prefix = gen_key(gen)
        freed = 0
        cursor = txn.cursor(db=self._values)
        if not cursor.set_range(prefix):
            return 0
        while bytes(cursor.key()[: len(prefix)]) == prefix:
            freed += len(cursor.value())
            if not cursor.delete():
                break
        return freed

    def _value_gens(self, txn: lmdb.Transaction) -> Iterator[int]:
        """Distinct generations present in the values database, skipping from one to the
        next without visiting every value."""
        cursor = txn.cursor(db=self._values)
        found = cursor.first()
        while found:
            gen = parse_gen(cursor.key())
            yield gen
            found = cursor.set_range(gen_key(gen + 1))

    def _staging_records(self, txn: lmdb.Transaction) -> list[tuple[int, dict[str, Any]]]:
        records = []
        for raw_key, raw in txn.cursor(db=self._staging):
            try:
                rec = msgpack.unpackb(bytes(raw), raw=False)
            except (msgpack.UnpackException, ValueError):
                rec = {}
            records.append((parse_gen(raw_key), rec))
        return records

    @staticmethod
    def _writer_alive(rec: dict[str, Any]) -> bool:
        try:
            return liveness.alive(liveness.ProcessId.from_doc(rec["proc"]))
        except (KeyError, TypeError, ValueError, IndexError):
            return False

    def _copy_values(
        self, txn: lmdb.Transaction, manifest: Manifest, offsets: list[int], buf: HostBuffer
    ) -> dict[Slot, torch.Tensor]:
        flat = buf.tensor.numpy()
        tensors: dict[Slot, torch.Tensor] = {}
        for entry, offset in zip(manifest.entries, offsets, strict=True):
            value = txn.get(value_key(manifest.gen, *entry.slot), db=self._values)
            try:
                if value is None:
                    raise CorruptValue("value missing")
                header = parse_header(value)
                if header.dtype != entry.dtype or header.shape != entry.shape:
                    raise CorruptValue("value header disagrees with the manifest")
                copy_verified(value, header, flat[offset : offset + entry.nbytes])
            except CorruptValue as exc:
                raise CorruptEntry(manifest.key, str(exc), *entry.slot) from exc
            view = buf.tensor[offset : offset + entry.nbytes]
            tensors[entry.slot] = view.view(entry.dtype).view(entry.shape)
        return tensors

    def _verify_one(
        self, txn: lmdb.Transaction, key: str, raw: memoryview, report: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Check one template inside ``txn``; returns a problem record or None."""
        manifest = self._decode_or_none(raw)
        if manifest is None:
            return {"key": key, "reason": "undecodable manifest"}
        if not manifest.valid:
            report["invalid"].append(key)
            return None
        report["templates"] += 1
        for entry in manifest.entries:
            value = txn.get(value_key(manifest.gen, *entry.slot), db=self._values)
            try:
                if value is None:
                    raise CorruptValue("value missing")
                header = check_value(value)
                if header.dtype != entry.dtype or header.shape != entry.shape:
                    raise CorruptValue("value header disagrees with the manifest")
            except CorruptValue as exc:
                step, block, name = entry.slot
                return {"key": key, "reason": str(exc), "step": step, "block": block, "name": name}
            report["values"] += 1
            report["bytes"] += header.nbytes
        return None

    def _orphan_report(self) -> dict[str, int]:
        """Generations holding values that no manifest or live bake refers to."""
        with self._env.begin(buffers=True) as txn:
            scan = self._scan(txn)
            live = {m.gen for m in scan.manifests.values()}
            staging = self._staging_records(txn)
            live |= {gen for gen, rec in staging if self._writer_alive(rec)}
            orphans = [gen for gen in self._value_gens(txn) if gen not in live]
            dead = sum(1 for gen, rec in staging if not self._writer_alive(rec))
        return {
            "orphan_generations": len(orphans),
            "dead_staging_records": dead,
            "bakes_in_progress": len(staging) - dead,
        }
