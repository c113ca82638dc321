"""Host-RAM tier: a byte-budgeted set of host-resident templates.

Budget: resident templates + loads in flight + the buffer pool must fit in ``budget`` bytes
(templates being spilled hold their memory a little longer, outside the budget). To make room the tier first frees pooled buffers, then
evicts unpinned templates in the policy's order. A template held by a handle (``refs > 0``)
is never evicted; when pinned templates alone exceed the budget a load still goes ahead
(counted as an overcommit) and the tier shrinks back as handles are released.

An evicted template that the disk tier does not hold is *spilled*: the store writes it to
disk in the background while the tier keeps its memory (counted against the budget) until
the write is done; an ``acquire`` in the meantime takes it back without any I/O.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from retouch.cachestore.buffers import BufferPool, HostBuffer, allocate
from retouch.cachestore.layout import Slot
from retouch.cachestore.policy import EvictionPolicy, ephemeral_first, saved_compute
from retouch.cachestore.stats import StoreCounters

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ResidentTemplate:
    """A template's tensors in host memory (views into ``buffer`` when loaded from disk)."""

    key: str
    meta: dict[str, Any]
    tensors: dict[Slot, torch.Tensor]
    footprint: int  # host bytes held: the buffer size, or the tensors' bytes
    buffer: HostBuffer | None = None
    refs: int = 0
    spills_in_flight: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @classmethod
    def from_tensors(
        cls, key: str, meta: dict[str, Any], tensors: dict[Slot, torch.Tensor]
    ) -> ResidentTemplate:
        footprint = sum(t.nbytes for t in tensors.values())
        return cls(key=key, meta=meta, tensors=tensors, footprint=footprint)


SpillFn = Callable[[ResidentTemplate], bool]  # schedules a spill; False when none is needed


@dataclass
class HostTier:
    """Resident templates, their eviction order and the buffer pool; thread-safe."""

    budget: int
    policy: EvictionPolicy
    pin: bool
    counters: StoreCounters
    spill: SpillFn
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _resident: dict[str, ResidentTemplate] = field(default_factory=dict)
    _spilling: dict[str, ResidentTemplate] = field(default_factory=dict)
    _pool: BufferPool = field(default_factory=BufferPool)
    _resident_bytes: int = 0
    _reserved_bytes: int = 0
    _spilling_bytes: int = 0

    # ---- queries -------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Bytes this tier holds or has promised (compared against the budget)."""
        return (
            self._resident_bytes + self._reserved_bytes + self._spilling_bytes + self._pool.nbytes
        )

    @property
    def _pressure(self) -> int:
        """Bytes that eviction can act on. Spills in flight are left out: their memory is
        about to be freed, and counting it would evict template after template while a
        spill is being written."""
        return self._resident_bytes + self._reserved_bytes + self._pool.nbytes

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {
                "host_bytes": self._resident_bytes,
                "host_reserved_bytes": self._reserved_bytes,
                "host_spilling_bytes": self._spilling_bytes,
                "host_pool_bytes": self._pool.nbytes,
                "host_budget_bytes": self.budget,
                "host_templates": len(self._resident),
            }

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._resident or key in self._spilling

    def tracks(self, res: ResidentTemplate) -> bool:
        """Whether ``res`` is still the tier's copy of its key (resident or spilling)."""
        with self._lock:
            return self._resident.get(res.key) is res or self._spilling.get(res.key) is res

    def residents(self) -> list[ResidentTemplate]:
        with self._lock:
            return [*self._resident.values(), *self._spilling.values()]

    # ---- handles -------------------------------------------------------------------------

    def pin_resident(self, key: str) -> ResidentTemplate | None:
        """Take a reference on a resident (or still spilling) template, or return None."""
        with self._lock:
            res = self._resident.get(key)
            if res is None and key in self._spilling:
                res = self._spilling.pop(key)
                self._spilling_bytes -= res.footprint
                self._add(res)
                self.counters.add(rescues=1)
            if res is None:
                return None
            res.refs += 1
            self.policy.on_access(key, saved_compute(res.meta))
            return res

    def release(self, res: ResidentTemplate) -> None:
        """Drop a reference; the template becomes evictable at zero."""
        with self._lock:
            if res.refs <= 0:
                raise RuntimeError(f"template {res.key!r} released more often than acquired")
            res.refs -= 1
            self._maybe_recycle(res)
            self._fit()

    # ---- loading -------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> HostBuffer:
        """A buffer for a template about to be loaded, after making room for it."""
        with self._lock:
            while True:
                buf = self._pool.take(nbytes)
                if buf is not None:
                    self._reserved_bytes += nbytes
                    return buf
                if self._pressure + nbytes <= self.budget:
                    break
                if self._pool.release_one():
                    continue
                victim = self._victim()
                if victim is None:
                    self.counters.add(host_overcommits=1)
                    break
                self._evict(victim)
            self._reserved_bytes += nbytes
        try:
            return allocate(nbytes, self.pin)
        except BaseException:
            with self._lock:
                self._reserved_bytes -= nbytes
            raise

    def unreserve(self, buf: HostBuffer) -> None:
        """Give back a reserved buffer whose load failed."""
        with self._lock:
            self._reserved_bytes -= buf.nbytes
            self._pool.put(buf)
            self._fit()

    def insert(self, res: ResidentTemplate, pinned: bool, reserved: bool) -> None:
        """Make ``res`` resident (replacing an older copy); with ``pinned`` the caller holds
        a reference. ``reserved`` says its buffer came from :meth:`reserve`."""
        with self._lock:
            if reserved:
                self._reserved_bytes -= res.footprint
            self._discard(res.key)
            self._add(res)
            res.refs = 1 if pinned else 0
            self.policy.on_access(res.key, saved_compute(res.meta))
            self._fit()

    # ---- eviction and removal ------------------------------------------------------------

    def evict(self, key: str) -> bool:
        """Evict ``key`` now (spilling it if needed) unless a handle holds it."""
        with self._lock:
            res = self._resident.get(key)
            if res is None or res.refs > 0:
                return False
            self._evict(key)
            self._fit()
            return True

    def remove(self, key: str) -> bool:
        """Forget ``key`` (delete); memory held by live handles is freed on release."""
        with self._lock:
            found = self._discard(key)
            self.policy.forget(key)
            self._fit()
            return found

    def spill_done(self, res: ResidentTemplate) -> None:
        """A background spill of ``res`` finished (successfully or not)."""
        with self._lock:
            res.spills_in_flight -= 1
            if res.spills_in_flight == 0 and self._spilling.get(res.key) is res:
                del self._spilling[res.key]
                self._spilling_bytes -= res.footprint
            self._maybe_recycle(res)
            self._fit()

    def clear(self) -> None:
        """Drop everything (store close)."""
        with self._lock:
            for key in list(self._resident):
                self._discard(key)
            self._spilling.clear()
            self._spilling_bytes = 0
            self._pool.clear()

    # ---- internals (lock held) -----------------------------------------------------------

    def _add(self, res: ResidentTemplate) -> None:
        self._resident[res.key] = res
        self._resident_bytes += res.footprint

    def _discard(self, key: str) -> bool:
        found = False
        res = self._resident.pop(key, None)
        if res is not None:
            self._resident_bytes -= res.footprint
            self._maybe_recycle(res)
            found = True
        spilling = self._spilling.pop(key, None)
        if spilling is not None:
            self._spilling_bytes -= spilling.footprint
            self._maybe_recycle(spilling)
            found = True
        return found

    def _victim(self) -> str | None:
        candidates = [key for key, res in self._resident.items() if res.refs == 0]
        ranked = ephemeral_first(self.policy, candidates)
        return ranked[0] if ranked else None

    def _evict(self, key: str) -> None:
        res = self._resident.pop(key)
        self._resident_bytes -= res.footprint
        self.policy.on_evict(key)
        self.counters.add(host_evictions=1)
        if res.spills_in_flight == 0:
            # counted before scheduling: the spill may finish (and call spill_done) at once
            res.spills_in_flight += 1
            if not self.spill(res):
                res.spills_in_flight -= 1
        if res.spills_in_flight:
            self._spilling[key] = res
            self._spilling_bytes += res.footprint
        else:
            self._maybe_recycle(res)

    def _maybe_recycle(self, res: ResidentTemplate) -> None:
        """Return a template's buffer to the pool once nothing can read it any more."""
        if res.refs or res.spills_in_flight:
            return
        if self._resident.get(res.key) is res or self._spilling.get(res.key) is res:
            return
        if res.buffer is not None:
            self._pool.put(res.buffer)
            res.buffer = None
        res.tensors = {}

    def _fit(self) -> None:
        while self._pressure > self.budget:
            if self._pool.release_one():
                continue
            victim = self._victim()
            if victim is None:
                return
            self._evict(victim)
