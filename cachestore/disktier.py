"""Disk tier: one memory-mapped LMDB environment per host.

Transaction discipline (py-lmdb / LMDB rules):

* Every write transaction of this process runs on one writer thread (``diskwriter.py``);
  LMDB's lock file serialises writers across processes. Write transactions are short: a
  bake is written as batches of values under a fresh *generation* (invisible, see
  ``layout.py``), and a final transaction deletes the template's previous generation,
  evicts what the disk budget requires (``diskbudget.py``), writes the manifest and removes
  the staging record. A writer killed at any point leaves either the old template or the
  new one, never a mixture; its staged values are found through the staging record and
  removed on the next open (or by ``gc``, ``diskcheck.py``).
* Readers use short read-only transactions (one per template load or lookup) from any
  thread or process; ``reader_check()`` on open clears reader slots of dead processes.
* ``map_size`` is set once, large; LMDB only grows the file as pages are used. When the map
  or the disk is full, the failed transaction is aborted (LMDB never half-commits), the
  least valuable templates are evicted in a separate transaction and the write is retried;
  if nothing can be evicted the write is refused with ``StoreFull``.

The environment itself and the record-level operations live in ``diskenv.py``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import lmdb
import msgpack
import torch

from retouch.cachestore import diskcheck, liveness
from retouch.cachestore.buffers import HostBuffer
from retouch.cachestore.codec import encode_value
from retouch.cachestore.diskbudget import DiskBudget
from retouch.cachestore.diskenv import (
    DATA_FILE,
    DiskConfig,
    DiskEnv,
    Scan,
    decode,
    decode_or_none,
    summary_or_none,
)
from retouch.cachestore.diskwriter import DiskWriter
from retouch.cachestore.errors import CorruptValue, StoreFull
from retouch.cachestore.layout import (
    NEXT_GEN_KEY,
    Slot,
    gen_key,
    parse_gen,
    template_key,
    value_key,
)
from retouch.cachestore.manifest import EntrySpec, Manifest, is_valid
from retouch.cachestore.policy import EvictionPolicy
from retouch.cachestore.stats import StoreCounters

__all__ = ["DATA_FILE", "DiskConfig", "DiskTier", "LoadedTemplate"]

log = logging.getLogger(__name__)


@dataclass
class LoadedTemplate:
    """A template copied out of the map into one host buffer (views in ``tensors``)."""

    manifest: Manifest
    buffer: HostBuffer
    tensors: dict[Slot, torch.Tensor]


class DiskTier:
    """Every read and write of templates in the disk tier (the environment, the budget and
    the writer thread are its parts)."""

    def __init__(self, config: DiskConfig, policy: EvictionPolicy, counters: StoreCounters) -> None:
        self.config = config
        self._counters = counters
        self._local_invalid: set[str] = set()  # read-only stores cannot write the flag
        self._staged: dict[int, tuple[str, int]] = {}  # writer thread only: gen -> (key, bytes)
        self._closed = False
        self._env = DiskEnv(config)
        self.map_size = self._env.map_size
        self._budget = DiskBudget(self._env, config.budget_bytes, policy, counters)
        self.budget_bytes = self._budget.budget_bytes
        self._writer = DiskWriter(self._env, self._budget.try_evict_for_space)
        if not config.readonly:
            removed = self._writer.run(self._in_txn, diskcheck.remove_dead_bakes)
            if removed:
                log.warning("removed %d partial bakes left by dead writers", removed)

    # ---- reads (any thread) --------------------------------------------------------------

    def contains(self, key: str) -> bool:
        """True when a valid manifest for ``key`` is committed."""
        with self._env.begin() as txn:
            raw = self._env.raw_manifest(txn, key)
            return raw is not None and is_valid(raw) and key not in self._local_invalid

    def manifest(self, key: str, txn: lmdb.Transaction | None = None) -> Manifest | None:
        """The committed manifest of ``key`` (valid or not; seen by ``txn`` when given);
        CorruptEntry if undecodable."""
        if txn is not None:
            raw = self._env.raw_manifest(txn, key)
            return None if raw is None else decode(key, raw)
        with self._env.begin() as own:
            raw = self._env.raw_manifest(own, key)
            return None if raw is None else decode(key, raw)

    def snapshot(self) -> lmdb.Transaction:
        """A read transaction held by the caller (abort it when done): every read through
        it sees one committed state, whatever writers commit meanwhile. It can be used from
        any thread, one at a time."""
        return self._env.begin()

    def scan(self) -> Scan:
        with self._env.begin() as txn:
            return self._env.scan(txn)

    def catalog(self) -> tuple[list[Manifest], list[str]]:
        """Every decodable manifest in full, and the keys of undecodable ones."""
        manifests, broken = [], []
        with self._env.begin() as txn:
            for raw_key, raw in txn.cursor(db=self._env.manifests):
                manifest = decode_or_none(raw)
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
        with contextlib.nullcontext(txn) if txn is not None else self._env.begin() as txn:
            raw = self._env.raw_manifest(txn, key)
            if raw is None or key in self._local_invalid:
                raise KeyError(key)
            manifest = decode(key, raw)
            if not manifest.valid:
                raise KeyError(key)
            if only is not None:
                manifest = replace(
                    manifest, entries=tuple(e for e in manifest.entries if only(e.slot))
                )
            offsets, total = manifest.host_layout()
            buf = alloc(total)
            try:
                tensors = self._env.copy_values(txn, manifest, offsets, buf)
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
        report = diskcheck.new_report()
        for key in self.keys():
            with self._env.begin() as txn:
                raw = self._env.raw_manifest(txn, key)
                if raw is None:
                    continue
                problem = diskcheck.verify_template(self._env, txn, key, raw, report)
            if problem is not None:
                report["corrupt"].append(problem)
        for problem in report["corrupt"]:
            self.mark_invalid(problem["key"], problem["reason"])
        report["orphans"] = diskcheck.orphan_report(self._env)
        return report

    def keys(self) -> list[str]:
        with self._env.env.begin(db=self._env.manifests) as txn:
            return [k.decode() for k in txn.cursor().iternext(keys=True, values=False)]

    def usage(self) -> dict[str, int]:
        scan = self.scan()
        valid = [m for m in scan.manifests.values() if m.valid]
        info, stat = self._env.env.info(), self._env.env.stat()
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
        self._budget.touch(key, meta)

    # ---- writes (public entry points; run on the writer thread) --------------------------

    def begin_stage(self, key: str) -> int:
        """Reserve a generation for a new bake of ``key`` and record it as in progress."""
        template_key(key)
        return self._writer.run(self._begin_stage, key)

    def stage_async(self, gen: int, items: list[tuple[Slot, torch.Tensor]]) -> Future[None]:
        """Write a batch of values of generation ``gen`` (invisible until commit)."""
        return self._writer.submit(self._stage, gen, items)

    def commit(self, manifest: Manifest) -> list[str]:
        """Publish a staged template; returns the keys evicted to fit the disk budget."""
        return self._writer.run(self._commit, manifest)

    def abort(self, gen: int) -> None:
        """Remove a staged, uncommitted generation."""
        self._writer.run(self._abort, gen)

    def write_async(
        self,
        key: str,
        meta: dict[str, Any],
        tensors: dict[Slot, torch.Tensor],
        should_write: Callable[[], bool],
    ) -> Future[bool]:
        """Write a whole template in the background (spill); ``should_write`` is asked on
        the writer thread just before, so a template deleted meanwhile is not resurrected."""
        return self._writer.submit(self._write_template, key, meta, tensors, should_write)

    def mark_invalid(self, key: str, reason: str) -> None:
        """Flag ``key`` invalid: it reads as absent until re-baked or collected by gc."""
        log.error("marking template %r invalid: %s", key, reason)
        if self.config.readonly:
            self._local_invalid.add(key)
            return
        self._writer.run(self._mark_invalid, key, reason)

    def delete(self, keys: Iterable[str]) -> list[str]:
        """Delete templates (valid or not); returns the keys that existed."""
        return self._writer.run(self._delete_keys, list(keys))

    def gc(self) -> int:
        """Remove invalid templates, partial bakes of dead writers and orphaned values."""
        freed = self._writer.run(self._in_txn, diskcheck.collect_garbage)
        self._local_invalid.clear()
        return freed

    def flush(self) -> None:
        """Wait until every write queued so far (spills included) is committed."""
        self._writer.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._writer.shutdown()  # queued writes finish; new ones are refused
        self._closed = True
        self._env.close()

    # ---- writer-thread jobs --------------------------------------------------------------

    def _in_txn(self, body: Callable[[DiskEnv, lmdb.Transaction], Any]) -> Any:
        """``body(env, txn)`` in a write transaction that evicts nothing."""
        return self._writer.txn(partial(body, self._env), need=0, protect=set())

    def _begin_stage(self, key: str) -> int:
        record = msgpack.packb(
            {"key": key, "proc": liveness.current().to_doc(), "t": time.time()}, use_bin_type=True
        )

        def body(txn: lmdb.Transaction) -> int:
            gen = parse_gen(txn.get(NEXT_GEN_KEY, db=self._env.meta))
            txn.put(NEXT_GEN_KEY, gen_key(gen + 1), db=self._env.meta)
            txn.put(gen_key(gen), record, db=self._env.staging)
            return gen

        gen = self._writer.txn(body, need=0, protect={key})
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
                txn.put(vkey, value, db=self._env.values)

        self._writer.txn(body, need=batch, protect={key})
        self._staged[gen] = (key, staged)

    def _commit(self, manifest: Manifest) -> list[str]:
        env = self._env

        def body(txn: lmdb.Transaction) -> list[str]:
            scan = env.scan(txn)
            victims = self._budget.victims(scan, manifest.key, manifest.nbytes)
            for victim in victims:
                env.delete_template(txn, victim, scan.manifests.get(victim))
            old = scan.manifests.get(manifest.key)
            if old is not None:
                env.delete_gen(txn, old.gen)
            env.put_manifest(txn, manifest)
            txn.delete(gen_key(manifest.gen), db=env.staging)
            return victims

        victims = self._writer.txn(body, need=4096, protect={manifest.key})
        self._staged.pop(manifest.gen, None)
        self._local_invalid.discard(manifest.key)
        self._budget.committed(manifest.key, manifest.meta, victims)
        return victims

    def _abort(self, gen: int) -> None:
        self._staged.pop(gen, None)
        self._writer.txn(lambda txn: self._env.drop_staging(txn, gen), need=0, protect=set())

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
        env = self._env

        def body(txn: lmdb.Transaction) -> None:
            raw = env.raw_manifest(txn, key)
            if raw is None:
                return
            try:
                manifest = Manifest.unpack(raw)
            except CorruptValue:
                # without a decodable manifest there is nothing to flag: drop the record
                # (the template reads as absent; gc collects its values as orphans)
                txn.delete(template_key(key), db=env.manifests)
                return
            env.put_manifest(txn, manifest.invalidated(reason))

        self._writer.txn(body, need=4096, protect=set())
        self._budget.forget([key])

    def _delete_keys(self, keys: list[str]) -> list[str]:
        env = self._env

        def body(txn: lmdb.Transaction) -> list[str]:
            found = []
            for key in keys:
                raw = env.raw_manifest(txn, key)
                if raw is not None:
                    env.delete_template(txn, key, summary_or_none(key, raw))
                    found.append(key)
            return found

        found = self._writer.txn(body, need=0, protect=set())
        self._budget.forget(keys)
        self._local_invalid.difference_update(keys)
        return found
