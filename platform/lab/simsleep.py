"""Executors put to sleep instead of stopped, in the simulation (#52's serverless pool).

A scaled-down executor that sleeps gives its device back (on a GPU its weights go to pinned
host memory, its graph pools and device tier are freed) and keeps its process, store and
profiles: it wakes to ready in ``wake_s`` where a cold start takes ``startup_s``. Sleepers
cost no GPU-seconds; up to ``limit`` of them are kept (the host memory their weights take;
0: no limit), each stopped after ``keep_s`` asleep. Scale-up wakes the most recent sleepers
(the warmest caches) before it starts cold executors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from retouch.platform.lab.simexecutor import SimExecutor


@dataclass
class Sleepers:
    wake_s: float  # 0: executors stop instead of sleeping
    limit: int = 0  # sleepers kept at most (0: no limit)
    keep_s: float = 1800.0  # a sleeper is stopped after this long asleep
    asleep: list[SimExecutor] = field(default_factory=list)  # oldest first
    waking: int = 0
    sleeps: int = 0
    wakes: int = 0

    @property
    def enabled(self) -> bool:
        return self.wake_s > 0

    def return_s(self, startup_s: float) -> float:
        """What bringing back a scale-down's victim takes: a wake where victims sleep,
        else a cold start of ``startup_s``."""
        return self.wake_s if self.enabled else startup_s

    def retire(self, ex: SimExecutor, now: float, later: Callable[[float, Callable], None]) -> None:
        """``ex`` drained for a scale-down: asleep (stopped after ``keep_s``), or stopped
        when sleep is off or the limit is reached."""
        ex.draining = False
        if not self.enabled or (self.limit and len(self.asleep) >= self.limit):
            ex.stopped_at = now
            return
        ex.asleep_since = now
        self.asleep.append(ex)
        self.sleeps += 1
        later(now + self.keep_s, lambda: self._expire(ex, now, now + self.keep_s))

    def wake(self, count: int) -> list[SimExecutor]:
        """Up to ``count`` sleepers, the most recent first; each is ready ``wake_s`` later
        (the caller calls :meth:`woke` then)."""
        woken = self.asleep[-count:][::-1] if count > 0 else []
        del self.asleep[len(self.asleep) - len(woken) :]
        self.waking += len(woken)
        self.wakes += len(woken)
        return woken

    def woke(self, ex: SimExecutor, now: float) -> None:
        assert ex.asleep_since is not None
        ex.slept_s += now - ex.asleep_since - self.wake_s  # its wake holds the GPU
        ex.asleep_since = None
        self.waking -= 1

    def _expire(self, ex: SimExecutor, since: float, now: float) -> None:
        if ex.asleep_since != since:
            return  # woken meanwhile (and maybe asleep again since)
        self.asleep.remove(ex)
        ex.slept_s += now - since
        ex.asleep_since = None
        ex.stopped_at = now


def gpu_seconds(
    executors: list[SimExecutor], span: float, cold_starts: int, startup_s: float
) -> float:
    """Device time held: each executor from its start until it stopped (or the end), less
    its sleep, plus the cold starts' start-up (a waking executor holds its device)."""
    held = 0.0
    for e in executors:
        end = span if e.stopped_at is None else e.stopped_at
        asleep = e.slept_s + (span - e.asleep_since if e.asleep_since is not None else 0.0)
        held += end - e.started_at - asleep
    return held + cold_starts * startup_s
