"""The gateway's invocation queue: late binding, bounded, fair to re-placed work.

An accepted invocation waits here until an executor that serves its function has a free
slot (its running batch plus a pre-processing buffer), then it is bound to that executor.
Waiting here rather than on an executor is what lets an invocation outlive the executor
it would have gone to (a restart, a deploy in progress): it simply waits for the next one.

Bounded memory: at most ``max_queued`` invocations wait in all (and ``max_per_function``
for one function); beyond that :meth:`admit` refuses with 429 ``overloaded`` and a
``Retry-After`` estimated from the recent service time. Invocations re-placed after their
executor was lost go to the head of the queue: they were accepted first.

The placement-and-admission issue replaces :meth:`admit` with predicted-completion
admission and :meth:`_dispatch` with cost-model placement; both plug in here.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from retouch.functions.errors import Canceled, GatewayTimeout, Overloaded
from retouch.platform.placement import Placement, PlacementRequest

Clock = Callable[[], float]
POLL_S = 1.0  # how often a waiter re-checks that some executor serves its function


class Slotted(Protocol):
    """What the queue needs of an executor: a name, its load and its capacity."""

    name: str
    inflight: int
    slots: int


@dataclass(frozen=True)
class QueueLimits:
    max_queued: int = 256  # waiting invocations, all functions
    max_per_function: int = 0  # waiting invocations of one function (0: no own limit)
    wait_timeout_s: float = 120.0  # longest wait with no executor serving the function


@dataclass(eq=False)
class Waiter:
    """One invocation waiting for a slot."""

    request: PlacementRequest
    enqueued: float
    tag: str | None = None  # the invocation's id: its queue position and cancel refer to it
    future: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass
class QueueStats:
    admitted: int = 0
    rejected: int = 0
    timed_out: int = 0
    replaced: int = 0  # invocations re-queued after their executor was lost
    canceled: int = 0  # left the queue by cancel
    service_s: float = 1.0  # EWMA of slot holding time (for Retry-After)


class InvocationQueue:
    """FIFO of waiting invocations bound to executors as slots free up (event loop only)."""

    def __init__(
        self,
        limits: QueueLimits,
        placement: Placement,
        candidates: Callable[[str], Sequence[Slotted]],
        clock: Clock = time.monotonic,
    ) -> None:
        self.limits = limits
        self.placement = placement
        self._candidates = candidates  # executors that serve a function now
        self._clock = clock
        self._waiting: deque[Waiter] = deque()
        self.stats = QueueStats()

    def __len__(self) -> int:
        return len(self._waiting)

    def waiting(self, function: str) -> int:
        return sum(w.request.function == function for w in self._waiting)

    def positions(self) -> dict[str, int]:
        """Tagged waiters and how many invocations wait ahead of each (0: next)."""
        return {w.tag: i for i, w in enumerate(self._waiting) if w.tag is not None}

    def cancel(self, tag: str) -> bool:
        """Take the waiter tagged ``tag`` out of the queue; it fails with ``canceled``."""
        for waiter in self._waiting:
            if waiter.tag == tag and not waiter.future.done():
                self._drop(waiter)
                self.stats.canceled += 1
                waiter.future.set_exception(Canceled(f"invocation {tag} was canceled"))
                return True
        return False

    def admit(self, function: str) -> None:
        """Refuse at once (429 with a retry hint) when the queue is full."""
        full = len(self._waiting) >= self.limits.max_queued
        per = self.limits.max_per_function
        if not full and per > 0 and self.waiting(function) >= per:
            full = True
        if full:
            self.stats.rejected += 1
            retry = self.retry_after_s()
            raise Overloaded(
                f"{len(self._waiting)} invocations are queued; retry in {retry} s",
                code="overloaded",
                retry_after_s=retry,
            )

    def retry_after_s(self) -> int:
        """Seconds until the queue has drained by about the limit: queued × service time
        over the slots that serve them (at least 1)."""
        slots = sum(
            max(1, c.slots)
            for fn in {w.request.function for w in self._waiting}
            for c in self._candidates(fn)
        )
        return max(1, math.ceil(len(self._waiting) * self.stats.service_s / max(1, slots)))

    async def acquire(
        self,
        request: PlacementRequest,
        deadline: float,
        front: bool = False,
        tag: str | None = None,
    ) -> Slotted:
        """Wait until an executor serving ``request.function`` has a free slot (bound to
        it, ``inflight`` counted). Raises :class:`GatewayTimeout` at the invocation's
        deadline, or once *no* executor has been able to serve the function for
        ``wait_timeout_s`` (an executor restarting, a deploy in progress): waiting behind
        other work is bounded by the deadline and the queue limit, not by this timeout."""
        waiter = Waiter(request, self._clock(), tag)
        if front:
            self.stats.replaced += 1
            self._waiting.appendleft(waiter)
        else:
            self.stats.admitted += 1
            self._waiting.append(waiter)
        self.dispatch()
        unserved_since: float | None = None
        try:
            while True:
                now = self._clock()
                if not self._candidates(request.function):
                    unserved_since = now if unserved_since is None else unserved_since
                else:
                    unserved_since = None
                if (
                    unserved_since is not None
                    and now - unserved_since >= self.limits.wait_timeout_s
                ):
                    raise self._timed_out(
                        waiter,
                        f"no executor could serve {request.function!r} for "
                        f"{self.limits.wait_timeout_s:.0f} s",
                    )
                if now >= deadline:
                    raise self._timed_out(waiter, "the invocation's deadline passed in the queue")
                try:
                    chunk = min(deadline - now, POLL_S)
                    return await asyncio.wait_for(asyncio.shield(waiter.future), chunk)
                except TimeoutError:
                    if waiter.future.done() and not waiter.future.cancelled():
                        return waiter.future.result()  # bound in the same tick
        except asyncio.CancelledError:  # the client went away: give back a bound slot
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())
            self._drop(waiter)
            raise

    def _timed_out(self, waiter: Waiter, why: str) -> GatewayTimeout:
        self._drop(waiter)
        self.stats.timed_out += 1
        return GatewayTimeout(why, code="timeout")

    def release(self, executor: Slotted, held_s: float | None = None) -> None:
        """An invocation left ``executor``: free its slot and bind the next waiters."""
        executor.inflight = max(0, executor.inflight - 1)
        if held_s is not None and held_s > 0:
            self.stats.service_s = 0.9 * self.stats.service_s + 0.1 * held_s
        self.dispatch()

    def dispatch(self) -> None:
        """Bind waiters, oldest first, to executors with room; a waiter whose function has
        no executor with room stays without blocking the others."""
        if not self._waiting:
            return
        for waiter in list(self._waiting):
            if waiter.future.done():
                self._drop(waiter)
                continue
            room = [c for c in self._candidates(waiter.request.function) if c.inflight < c.slots]
            if not room:
                continue
            chosen = self.placement.choose(room, waiter.request)
            chosen.inflight += 1
            self._drop(waiter)
            waiter.future.set_result(chosen)

    def fail(self, function: str, error: Exception) -> None:
        """Fail every invocation of ``function`` still waiting (e.g. it was deleted)."""
        for waiter in [w for w in self._waiting if w.request.function == function]:
            self._drop(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(error)

    def _drop(self, waiter: Waiter) -> None:
        with contextlib.suppress(ValueError):  # already bound or dropped
            self._waiting.remove(waiter)
