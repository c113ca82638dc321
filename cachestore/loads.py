"""Disk -> host loads of whole templates: at most one in flight per key.

A prefetch and an acquire of the same key share one future: the first thread to *claim*
it (the prefetch worker, or an acquire that finds it still queued) runs the load; every
other caller waits on the future. ``_loads`` holds the futures in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from retouch.cachestore.disktier import DiskTier
from retouch.cachestore.errors import CorruptEntry, StoreError
from retouch.cachestore.hosttier import HostTier, ResidentTemplate
from retouch.cachestore.stats import StoreCounters

log = logging.getLogger(__name__)


class TemplateLoads:
    """The in-flight loads of one store, shared by its prefetches and acquires."""

    def __init__(
        self,
        disk: DiskTier,
        host: HostTier,
        counters: StoreCounters,
        workers: ThreadPoolExecutor,
        corrupt: Callable[[CorruptEntry], None],
    ) -> None:
        self._disk, self._host, self._counters = disk, host, counters
        self._workers = workers
        self._corrupt = corrupt
        self._lock = threading.Lock()
        self._loads: dict[str, Future[int]] = {}

    def in_flight(self) -> int:
        return len(self._loads)

    def prefetch(self, key: str, streamed: bool) -> Future[int]:
        """Start loading ``key`` in the background unless resident (or ``streamed``: read
        step by step when acquired, never loaded whole); see ``ActivationStore.prefetch``."""
        with self._lock:
            if streamed or self._host.contains(key):
                self._counters.add(prefetch_resident=0 if streamed else 1)
                done: Future[int] = Future()
                done.set_result(0)
                return done
            fut = self._loads.get(key)
            if fut is not None and not fut.cancelled():
                self._counters.add(prefetch_merged=1)
                return fut
            fut = self._loads[key] = Future()
        self._counters.add(prefetches=1)
        self._workers.submit(self._prefetch_job, key, fut)
        return fut

    def acquire(self, key: str) -> ResidentTemplate:
        """``key`` host-resident and pinned for the caller: loaded here, or waited for
        while another thread loads it. KeyError when absent, CorruptEntry when corrupt."""
        waited = False
        while True:
            res = self._host.pin_resident(key)
            if res is not None:
                self._counters.add(**({"prefetch_waits": 1} if waited else {"host_hits": 1}))
                self._disk.touch(key, res.meta)
                return res
            with self._lock:
                fut = self._loads.get(key)
                if fut is None or fut.cancelled():
                    fut = self._loads[key] = Future()
                elif not fut.running() and not fut.done():
                    self._counters.add(prefetch_taken_over=1)  # queued, not started: load now
                owner = self._claim(fut)
            if owner:
                res = self._load_owned(key, fut, pin=True)
                assert res is not None  # pin=True always returns the held template
                return res
            start = time.perf_counter()
            try:
                fut.result()
            except KeyError:
                self._counters.add(misses=1)
                raise
            finally:
                self._counters.add(prefetch_wait_seconds=time.perf_counter() - start)
            waited = True

    @staticmethod
    def _claim(fut: Future[int]) -> bool:
        """Become the one thread that runs the load behind ``fut`` (lock held)."""
        if fut.running() or fut.done():
            return False
        return fut.set_running_or_notify_cancel()

    def _prefetch_job(self, key: str, fut: Future[int]) -> None:
        with self._lock:
            claimed = self._claim(fut)
            if not claimed and fut.cancelled() and self._loads.get(key) is fut:
                del self._loads[key]
        if not claimed:
            return  # an acquire took the load over, or the caller cancelled it
        try:
            self._load_owned(key, fut, pin=False)
        except KeyError:
            log.debug("prefetch of %r: not in the store", key)
        except StoreError as exc:
            log.error("prefetch of %r failed: %s", key, exc)
        except Exception:
            log.exception("prefetch of %r failed", key)

    def _load_owned(self, key: str, fut: Future[int], pin: bool) -> ResidentTemplate | None:
        """Load ``key`` as the owner of ``fut`` (the one in-flight load of that key); with
        ``pin`` the result is held for the caller. None: resident already (prefetch)."""
        try:
            res = self._resident_or_load(key, pin)
        except BaseException as exc:
            fut.set_exception(exc)
            raise
        else:
            fut.set_result(0 if res is None else res.footprint)
            return res
        finally:
            with self._lock:
                if self._loads.get(key) is fut:
                    del self._loads[key]

    def _resident_or_load(self, key: str, pin: bool) -> ResidentTemplate | None:
        # another load may have finished between the caller's check and taking ownership
        if pin:
            res = self._host.pin_resident(key)
            if res is not None:
                self._counters.add(host_hits=1)
                return res
        elif self._host.contains(key):
            return None
        res = self._load(key, pin)
        if pin:
            self._counters.add(disk_hits=1)
        return res

    def _load(self, key: str, pin: bool) -> ResidentTemplate:
        try:
            loaded = self._disk.load(key, self._host.reserve, self._host.unreserve)
        except KeyError:
            if pin:
                self._counters.add(misses=1)
            raise
        except CorruptEntry as exc:
            self._corrupt(exc)
            raise
        res = ResidentTemplate(
            key=key,
            meta=loaded.manifest.meta,
            tensors=loaded.tensors,
            footprint=loaded.buffer.nbytes,
            buffer=loaded.buffer,
        )
        self._host.insert(res, pinned=pin, reserved=True)
        return res
