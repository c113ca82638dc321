"""Per-process counters of the activation store (``ActivationStore.stats()``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class StoreCounters:
    """Monotonic counters since the store was opened; updated from any thread."""

    host_hits: int = 0  # acquire() found the template host-resident
    disk_hits: int = 0  # acquire() had to load it from the disk tier
    misses: int = 0  # acquire() found it nowhere (KeyError)
    host_reads: int = 0  # read_rows() calls
    host_bytes_read: int = 0  # bytes gathered out of the host tier
    disk_bytes_read: int = 0  # bytes loaded from the disk tier into the host tier
    loads: int = 0  # disk -> host template loads (acquire or prefetch)
    load_seconds: float = 0.0
    host_evictions: int = 0
    disk_evictions: int = 0
    spills: int = 0  # host evictions written to the disk tier
    spill_bytes: int = 0
    spill_failures: int = 0
    rescues: int = 0  # acquire() took back a template that was still being spilled
    host_overcommits: int = 0  # loads kept although pinned templates filled the budget
    corrupt: int = 0  # corrupt templates detected (then marked invalid)
    bakes: int = 0
    bake_bytes: int = 0
    bake_aborts: int = 0
    prefetches: int = 0  # prefetches that started a load
    prefetch_merged: int = 0  # prefetch() joined a load already in flight
    prefetch_resident: int = 0  # prefetch() found the template host-resident
    prefetch_taken_over: int = 0  # acquire() ran a queued prefetch's load itself
    prefetch_waits: int = 0  # acquire() waited on a load started by someone else
    prefetch_wait_seconds: float = 0.0
    streamed: int = 0  # acquire() of a template bigger than the host tier: streamed by step
    streamed_steps: int = 0  # steps such templates loaded from disk
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {
                f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")
            }
