"""The executor's change feed: numbered events the gateway's cluster view follows.

A bake that finishes on the engine thread, or a template loaded into host memory, changes
where placement should send the next invocation. Nothing on the gateway's side would learn
it otherwise: an executor that gets no invocations sends no results, so a view that thinks
its templates are still baking would never send it one. The gateway therefore long-polls
``GET /changes?after=N`` and re-reads the executor's state when something changed.

Publishing happens on any thread (the engine thread bakes, executor threads load); waiting
happens on the event loop. The lock guards the counter, the bounded history and the
waiters; it is never held while waking one (``call_soon_threadsafe`` only schedules).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque

from retouch.functions.wire.executor import ChangeKind, ExecutorChange, ExecutorChanges

HISTORY = 256  # events kept for a reader that fell behind (beyond: it gets ``reset``)


class ChangeFeed:
    """Numbered events, a bounded history and long-poll waiters."""

    def __init__(self, history: int = HISTORY) -> None:
        self._lock = threading.Lock()
        self._version = 0
        self._events: deque[ExecutorChange] = deque(maxlen=history)
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._closed = False

    def publish(self, kind: ChangeKind, function: str = "", template: str = "") -> None:
        """Record one event and wake every waiter (safe from any thread)."""
        with self._lock:
            self._version += 1
            self._events.append(
                ExecutorChange(
                    version=self._version, kind=kind, function=function, template=template
                )
            )
            waiters = list(self._waiters)
        _wake(waiters)

    def close(self) -> None:
        """Answer every long poll now, and later ones at once: the server is stopping, and
        its graceful shutdown would otherwise wait for them."""
        with self._lock:
            self._closed = True
            waiters = list(self._waiters)
        _wake(waiters)

    def since(self, after: int) -> ExecutorChanges:
        """The events after ``after``; ``reset`` when some of them are no longer kept or
        ``after`` is from an earlier life of this executor (ahead of the counter)."""
        with self._lock:
            return self._since(after)

    def _since(self, after: int) -> ExecutorChanges:
        if after > self._version:
            return ExecutorChanges(version=self._version, changes=tuple(self._events), reset=True)
        changes = tuple(e for e in self._events if e.version > after)
        oldest = self._events[0].version if self._events else self._version + 1
        return ExecutorChanges(version=self._version, changes=changes, reset=after + 1 < oldest)

    async def wait(self, after: int, timeout_s: float) -> ExecutorChanges:
        """The events after ``after`` as soon as there are any, or none after ``timeout_s``."""
        event = asyncio.Event()
        waiter = (asyncio.get_running_loop(), event)
        with self._lock:
            if after != self._version or self._closed:
                return self._since(after)
            self._waiters.add(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await event.wait()
        finally:
            with self._lock:
                self._waiters.discard(waiter)
        return self.since(after)


def _wake(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    """Set each waiter's event on its own loop (never while holding the feed's lock)."""
    for loop, event in waiters:
        with contextlib.suppress(RuntimeError):  # that loop closed: nobody waits there
            loop.call_soon_threadsafe(event.set)
