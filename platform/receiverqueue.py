"""One webhook receiver's queue: a bounded FIFO of deliveries with worker tasks of its own.

The webhook sender keeps one per receiver (scheme, host and port), so a receiver that
answers slowly, or not at all, occupies only its own workers: another receiver's
deliveries never wait behind it. Workers are started when deliveries arrive and end when
the queue is empty, so an idle receiver costs nothing. When the queue is full the oldest
delivery that may go is dropped (the caller counts it): the oldest one ``evictable``
accepts, else the oldest of all.
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

    def put(self, item: T) -> T | None:
        """Queue ``item``; the delivery dropped to make room, if the queue was full."""
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

    def _evict(self) -> T:
        for i, item in enumerate(self._pending):
            if self._evictable(item):
                del self._pending[i]
                return item
        return self._pending.popleft()

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
