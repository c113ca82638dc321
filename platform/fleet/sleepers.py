"""The fleet's sleeping executors: which to wake, and which to stop.

A scaled-down executor of an autoscaled fleet sleeps (``runtime/executor/sleep.py``: its
device given back, its process, weights and store kept) when the fleet's
:class:`SleepPolicy` allows it, instead of stopping; a scale-up of its model wakes the most
recent sleeper before it starts a cold one, in seconds instead of a cold start's tens of
seconds. Sleepers are bounded twice: each sleeps at most ``keep_s`` (then it stops), and
together they hold at most ``host_bytes`` of host memory (each reports its resident set
when it falls asleep; over the bound, the oldest stop). A scale-up of another model that
finds no free device stops the oldest sleeper to take its device.

:class:`Sleepers` is the bookkeeping (which sleeper, pure); :class:`SleepingExecutors` the
fleet's part that makes the calls (``POST /sleep``, ``POST /wake``) and stops processes,
owned by the fleet (event-loop state, no lock).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import httpx

from retouch.functions.errors import RetouchError
from retouch.functions.wire.executor import ExecutorPhase, SleepInfo
from retouch.platform.fleet.executorlink import ExecutorHandle, ExecutorLink
from retouch.platform.fleet.providers import Provider
from retouch.platform.fleet.startups import StartupTimes

log = logging.getLogger(__name__)


class Sleeper(Protocol):
    """What the bookkeeping reads of an executor handle."""

    @property
    def name(self) -> str: ...

    def serves(self, model: str | None) -> bool: ...


H = TypeVar("H", bound=Sleeper)
# The longest a wake may take before the executor is stopped (and the pool starts another):
# a wake is seconds (weights back from host memory, graphs captured again), and one slower
# than this is slower than the cold start it stands in for. Without it a hung wake held
# its executor as capacity for the invocation client's 600 s.
WAKE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class SleepPolicy:
    """Whether scaled-down executors sleep, and for how long and how many bytes."""

    keep_s: float = 0.0  # 0: a scaled-down executor stops at once (no sleep)
    host_bytes: int = 0  # the sleepers' host memory, summed (0: no bound)

    @property
    def enabled(self) -> bool:
        return self.keep_s > 0


@dataclass
class _Asleep(Generic[H]):
    handle: H
    since: float  # monotonic seconds
    host_bytes: int


class Sleepers(Generic[H]):
    """The sleeping executors, oldest first."""

    def __init__(self, policy: SleepPolicy) -> None:
        self.policy = policy
        self._asleep: list[_Asleep[H]] = []

    def __len__(self) -> int:
        return len(self._asleep)

    def __contains__(self, handle: object) -> bool:
        return any(a.handle is handle for a in self._asleep)

    def host_bytes(self) -> int:
        return sum(a.host_bytes for a in self._asleep)

    def add(self, handle: H, now: float, host_bytes: int) -> list[H]:
        """``handle`` fell asleep; the sleepers to stop now that it did (over the host
        memory bound, oldest first: the newest is the likeliest to be woken)."""
        self._asleep.append(_Asleep(handle, now, max(0, host_bytes)))
        over: list[H] = []
        bound = self.policy.host_bytes
        while bound and self.host_bytes() > bound and self._asleep:
            over.append(self._asleep.pop(0).handle)
        return over

    def take(self, model: str | None) -> H | None:
        """The most recent sleeper that serves ``model``, no longer counted as asleep (the
        caller wakes it); None when there is none."""
        for i in range(len(self._asleep) - 1, -1, -1):
            if self._asleep[i].handle.serves(model):
                return self._asleep.pop(i).handle
        return None

    def take_oldest(self) -> H | None:
        """The oldest sleeper (its device is wanted for another model's cold start)."""
        return self._asleep.pop(0).handle if self._asleep else None

    def expired(self, now: float) -> list[H]:
        """Sleepers asleep for longer than ``keep_s``, no longer counted (to stop)."""
        keep = self.policy.keep_s
        gone = [a.handle for a in self._asleep if now - a.since >= keep]
        self._asleep = [a for a in self._asleep if now - a.since < keep]
        return gone

    def remove(self, handle: H) -> bool:
        """Forget ``handle`` (it died, or is stopped); whether it was asleep."""
        kept = [a for a in self._asleep if a.handle is not handle]
        removed = len(kept) != len(self._asleep)
        self._asleep = kept
        return removed


class SleepingExecutors:
    """The fleet's sleeping executors: drained ones put to sleep, woken for a scale-up,
    stopped when their time or the host memory is up, dropped when they die. Shares the
    fleet's list of executors (a sleeper stays in it, phase ``sleeping``)."""

    def __init__(
        self,
        policy: SleepPolicy,
        executors: list[ExecutorHandle],
        link: ExecutorLink,
        provider: Provider,
        startups: StartupTimes,
        *,
        ready: Callable[[ExecutorHandle], Awaitable[None]],
        on_capacity: Callable[[], None],
        in_background: Callable[[Any], None],
    ) -> None:
        self.asleep: Sleepers[ExecutorHandle] = Sleepers(policy)
        self.executors = executors
        self.link = link
        self.provider = provider
        self.ready = ready  # the fleet's: state read, functions pushed, opened to work
        self.on_capacity = on_capacity
        self.in_background = in_background
        self.startups = startups  # each wake recorded: its call to ready

    async def put_to_sleep(self, handle: ExecutorHandle) -> bool:
        """Ask a drained executor to sleep; whether it does (the caller stops one that
        does not: sleep off, process gone, executor busy or too old to know sleep)."""
        if not self.asleep.policy.enabled or not handle.process.alive:
            return False
        if handle not in self.executors:
            return False
        try:
            info = SleepInfo.from_wire(await self.link.call(handle, "POST", "/sleep"))
        except (RetouchError, httpx.HTTPError) as exc:
            log.warning("%s did not fall asleep (%s): it is stopped", handle.name, exc)
            return False
        handle.phase = ExecutorPhase.SLEEPING
        handle.probe_failures = 0  # a failed probe while it drained must not count at its wake
        log.info(
            "%s asleep in %.0f ms (%d MB of device memory given back, %d MB of host kept)",
            handle.name,
            info.last_sleep_ms,
            info.freed_bytes >> 20,
            info.host_bytes >> 20,
        )
        for over in self.asleep.add(handle, time.monotonic(), info.host_bytes):
            self.in_background(self.stop(over, "the sleepers' host memory is full"))
        return True

    def wake(self, model: str | None) -> bool:
        """Wake ``model``'s most recent sleeper in the background; False when it has none."""
        handle = self.asleep.take(model)
        if handle is None:
            return False
        handle.phase = ExecutorPhase.WAKING  # capacity from now: the next tick counts it
        self.in_background(self._wake(handle))
        return True

    def give_up_device(self, devices: list[str]) -> ExecutorHandle | None:
        """The oldest sleeper, no longer asleep, whose device (its name, ``exec-<i>``) a
        cold start may take once it is stopped; one on a device no longer in ``devices``
        is stopped, and None returned."""
        handle = self.asleep.take_oldest()
        if handle is not None and handle.name not in devices:
            self.in_background(self.stop(handle, "its device is gone"))
            return None
        return handle

    async def stop(self, handle: ExecutorHandle, why: str) -> None:
        self.asleep.remove(handle)
        if handle in self.executors:
            self.executors.remove(handle)
        await self.provider.stop(handle.process)
        log.info("sleeping %s stopped: %s", handle.name, why)

    def check(self) -> None:
        """Stop the sleepers that slept long enough; drop those that died (nothing ran
        there: nothing to re-place, and no restart: the pool wanted fewer executors)."""
        for handle in self.asleep.expired(time.monotonic()):
            self.in_background(self.stop(handle, "slept its keep time"))
        for handle in [e for e in self.executors if e.phase is ExecutorPhase.SLEEPING]:
            if not handle.process.alive:
                log.warning(
                    "sleeping %s died (exit code %s): dropped",
                    handle.name,
                    handle.process.exit_code,
                )
                self.in_background(self.stop(handle, "it died asleep"))

    async def _wake(self, handle: ExecutorHandle) -> None:
        """Wake a sleeper and make it ready (functions deployed meanwhile pushed). One that
        does not wake is stopped; one that died is the monitor's (it restarts it)."""
        started = time.monotonic()
        try:
            await self.link.call(handle, "POST", "/wake", timeout=WAKE_TIMEOUT_S)
            await self.ready(handle)
        except (RetouchError, httpx.HTTPError) as exc:
            if not handle.process.alive or handle.phase is ExecutorPhase.DEAD:
                log.warning("%s died while waking: the monitor restarts it", handle.name)
                return
            log.error("%s did not wake (%s): it is stopped", handle.name, exc)
            handle.phase = ExecutorPhase.DRAINING
            if handle in self.executors:
                self.executors.remove(handle)
            await self.provider.stop(handle.process, failed=True)
            self.on_capacity()
            return
        took = time.monotonic() - started
        self.startups.woke(handle.model, took)
        log.info("%s woken, ready in %.2f s", handle.name, took)
