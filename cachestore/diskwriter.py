"""The disk tier's writer thread and its write transactions.

Every write transaction of this process runs on one thread; LMDB's lock file serialises
writers across processes. When the map or the disk is full, the failed transaction is
aborted (LMDB never half-commits), space is freed in a transaction of its own and the write
is retried, a bounded number of times, before it is refused with ``StoreFull``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import lmdb

from retouch.cachestore.diskenv import DiskEnv, is_full
from retouch.cachestore.errors import ReadOnlyStore, StoreClosed, StoreFull

log = logging.getLogger(__name__)

T = TypeVar("T")
FULL_RETRIES = 4  # evict-and-retry rounds before a full map or disk refuses a write

FreeSpace = Callable[[int, set[str]], int]  # (bytes needed, keys to keep) -> bytes freed


class DiskWriter:
    """Runs write jobs one at a time on the tier's writer thread (none when read-only)."""

    def __init__(self, env: DiskEnv, free_space: FreeSpace) -> None:
        self._env = env
        self._free_space = free_space
        self._closed = False
        self._closing = False
        self._pool = (
            None
            if env.config.readonly
            else ThreadPoolExecutor(max_workers=1, thread_name_prefix="cachestore-writer")
        )

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)`` on the writer thread."""
        if self._closed or self._closing:
            raise StoreClosed("activation store is closed")
        if self._pool is None:
            raise ReadOnlyStore(f"store {self._env.config.path} was opened read-only")
        return self._pool.submit(fn, *args)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the writer thread and wait for its result."""
        return self.submit(fn, *args).result()

    def txn(self, body: Callable[[lmdb.Transaction], T], need: int, protect: set[str]) -> T:
        """Run ``body`` in a write transaction; on map/disk full free space and retry.

        ``need``: the bytes the write adds; ``protect``: keys no eviction may take.
        """
        for attempt in range(FULL_RETRIES + 1):
            try:
                with self._env.begin(write=True) as txn:
                    return body(txn)
            except lmdb.Error as exc:
                if not is_full(exc):
                    raise
                freed = 0 if attempt == FULL_RETRIES else self._free_space(need, protect)
                if not freed:
                    raise StoreFull(
                        f"LMDB map or disk full at {self._env.config.path} (map_size="
                        f"{self._env.map_size}) and nothing left to evict: {exc}"
                    ) from exc
                log.warning("store full (%s); evicted %d bytes and retrying", exc, freed)
        raise AssertionError("unreachable")

    def flush(self) -> None:
        """Wait until every job queued so far has run."""
        if self._pool is not None and not self._closed:
            self.run(lambda: None)

    def shutdown(self) -> None:
        """Let queued jobs finish, refusing new ones."""
        self._closing = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._closed = True
