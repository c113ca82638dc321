"""The disk tier's byte budget: which templates to evict, and when.

Two situations evict: a commit that would take the committed templates over the budget
(victims chosen inside the commit's own transaction, :meth:`DiskBudget.victims`), and a map
or disk that fills up mid-write (:meth:`DiskBudget.evict_for_space`, in a transaction of
its own before the write is retried). Both take broken and invalid templates first, then
valid ones in the eviction policy's order, ephemeral ones before all others.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import lmdb

from retouch.cachestore.diskenv import DiskEnv, Scan, is_full
from retouch.cachestore.errors import StoreFull
from retouch.cachestore.policy import EvictionPolicy, ephemeral_first, saved_compute
from retouch.cachestore.stats import StoreCounters

log = logging.getLogger(__name__)


class DiskBudget:
    """The eviction policy of one disk tier (shared by its threads) and its byte budget."""

    def __init__(
        self, env: DiskEnv, budget_bytes: int, policy: EvictionPolicy, counters: StoreCounters
    ) -> None:
        self._env = env
        self._policy = policy
        self._lock = threading.Lock()
        self._counters = counters
        self.budget_bytes = min(budget_bytes, env.map_size)
        if self.budget_bytes < budget_bytes:
            log.warning("disk budget clamped to the map size (%d bytes)", env.map_size)

    # ---- the policy's view of accesses ---------------------------------------------------

    def touch(self, key: str, meta: dict[str, Any]) -> None:
        """Record an access for the eviction policy."""
        with self._lock:
            self._policy.on_access(key, saved_compute(meta))

    def committed(self, key: str, meta: dict[str, Any], victims: list[str]) -> None:
        """A commit of ``key`` evicted ``victims`` to fit the budget."""
        with self._lock:
            for victim in victims:
                self._policy.on_evict(victim)
            self._policy.on_access(key, saved_compute(meta))
        if victims:
            self._counters.add(disk_evictions=len(victims))
            log.info("disk budget: evicted %s to fit %r", victims, key)

    def forget(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._policy.forget(key)

    # ---- choosing victims ----------------------------------------------------------------

    def order(self, scan: Scan) -> list[str]:
        """Broken and invalid templates first, then valid ones least valuable first
        (ephemeral ones before all others)."""
        valid = sorted((m for m in scan.manifests.values() if m.valid), key=lambda m: m.created)
        with self._lock:
            ranked = ephemeral_first(self._policy, (m.key for m in valid))
        invalid = [k for k, m in scan.manifests.items() if not m.valid]
        return [*scan.broken, *invalid, *ranked]

    def victims(self, scan: Scan, key: str, incoming: int) -> list[str]:
        """The templates to evict so that ``key`` (``incoming`` bytes) fits the budget;
        StoreFull when even evicting every other one would not do."""
        sizes = {k: m.nbytes for k, m in scan.manifests.items() if k != key}
        excess = sum(sizes.values()) + incoming - self.budget_bytes
        victims = []
        for victim in self.order(scan):
            if excess <= 0:
                break
            if victim != key:
                victims.append(victim)
                excess -= sizes.get(victim, 0)
        if excess > 0:
            raise StoreFull(f"template {key!r} ({incoming} bytes) does not fit the disk budget")
        return victims

    # ---- freeing space when the map or the disk is full ----------------------------------

    def try_evict_for_space(self, need: int, protect: set[str]) -> int:
        """:meth:`evict_for_space`, reporting 0 when even the deletions do not fit."""
        try:
            return self.evict_for_space(need, protect)
        except lmdb.Error as exc:
            if not is_full(exc):
                raise
            return 0

    def evict_for_space(self, need: int, protect: set[str]) -> int:
        """Free at least ``need`` value bytes (invalid templates first, then the least
        valuable) in a transaction of its own; returns the bytes freed."""
        with self._env.begin(write=True) as txn:
            scan = self._env.scan(txn)
            freed, evicted = 0, []
            for key in self.order(scan):
                if freed >= need:
                    break
                if key not in protect:
                    freed += self._env.delete_template(txn, key, scan.manifests.get(key))
                    evicted.append(key)
        self._env.advance()
        with self._lock:
            for key in evicted:
                self._policy.on_evict(key)
        self._counters.add(disk_evictions=len(evicted))
        return freed
