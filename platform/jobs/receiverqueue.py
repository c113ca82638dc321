"""One tenant's queue for one webhook receiver: a bounded FIFO of deliveries with worker
tasks of its own.

The webhook sender keeps one per tenant and receiver (scheme, host and port), so a
receiver that answers slowly, or not at all, occupies only its own workers, and a tenant
flooding a receiver that another tenant also uses fills only its own queue: other
deliveries never wait behind it. Workers are started when deliveries arrive and end when
the queue is empty, so an idle receiver costs nothing.

When the queue is over capacity the oldest delivery ``evictable`` accepts is dropped (the
caller counts it). One it refuses (a job's final ``completed``) is never dropped: it
stays even beyond the capacity, which such deliveries can exceed only by as many jobs as
their tenant may keep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class ReceiverQueue(Generic[T]):
    """Deliveries to one receiver, sent by at most ``concurrency`` tasks at a time."""

    def __init__(
        self,
        send: Callable[[T], Awaitable[None]],
        concurrency: int,
        capacity: int,
        evictable: Callable[[T], bool],
        on_idle: Callable[[], None],
    ) -> None:
        self._send = send  # makes one attempt and settles its outcome; never raises
        self._concurrency = concurrency
        self._capacity = capacity
        self._evictable = evictable
        self._on_idle = on_idle
        self._pending: deque[T] = deque()
        self._workers: set[asyncio.Task] = set()

    @property
    def idle(self) -> bool:
        return not self._pending and not self._workers

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def put(self, item: T) -> T | None:
        """Queue ``item``; the delivery dropped to make room (perhaps ``item`` itself), if
        the queue was full and held one that may be dropped."""
        self._pending.append(item)
        evicted = self._evict() if len(self._pending) > self._capacity else None
        self._staff()
        return evicted

    def _staff(self) -> None:
        """Enough workers for what is pending (up to the receiver's concurrency)."""
        while len(self._workers) < min(self._concurrency, len(self._pending)):
            task = asyncio.create_task(self._work())
            self._workers.add(task)
            task.add_done_callback(self._worker_done)

    def _evict(self) -> T | None:
        for i, item in enumerate(self._pending):
            if self._evictable(item):
                del self._pending[i]
                return item
        return None

    async def _work(self) -> None:
        while self._pending:
            item = self._pending.popleft()
            try:
                await self._send(item)
            except Exception:  # a bug in send must not end the receiver's worker
                log.exception("webhook delivery raised")

    def _worker_done(self, task: asyncio.Task) -> None:
        self._workers.discard(task)
        if task.cancelled():
            return  # closing
        self._staff()  # a delivery put while this worker was ending still gets one
        if self.idle:
            self._on_idle()

    async def close(self) -> None:
        workers = list(self._workers)
        for task in workers:
            task.cancel()
        for task in workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
