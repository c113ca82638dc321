"""Measured executor start-ups, per model pool: cold starts and wakes, each to ready.

The gateway reports them (``/metrics``: ``startup_s_*``, ``wake_s_*``), and the autoscaler
waits at least a pool's start-up before it scales the pool down
(:mod:`retouch.platform.control.autoscaler`): what bringing a victim back would take, a
wake where victims sleep, else a cold start; each estimated by the median of the pool's own
recent ones, else of every pool's (another model's start-up on the same machines is a
better guess than none), else 0, which the policy reads as "not measured".
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field

KEPT = 256  # recent start-ups kept per kind (and per kind and model)


def _recent() -> deque[float]:
    """The last :data:`KEPT` start-ups: an estimate follows the machines as they are."""
    return deque(maxlen=KEPT)


@dataclass
class StartupTimes:
    """Cold starts (process start to ready, executors the autoscaler started) and wakes
    (the wake call to ready), in seconds, oldest first."""

    cold: deque[float] = field(default_factory=_recent)
    wakes: deque[float] = field(default_factory=_recent)
    _cold_of: defaultdict[str | None, deque[float]] = field(
        default_factory=lambda: defaultdict(_recent)
    )
    _wakes_of: defaultdict[str | None, deque[float]] = field(
        default_factory=lambda: defaultdict(_recent)
    )

    def started(self, model: str | None, seconds: float) -> None:
        """A cold start of ``model``'s pool became ready in ``seconds``."""
        self.cold.append(seconds)
        self._cold_of[model].append(seconds)

    def woke(self, model: str | None, seconds: float) -> None:
        """A sleeper of ``model``'s pool was ready ``seconds`` after its wake call."""
        self.wakes.append(seconds)
        self._wakes_of[model].append(seconds)

    def estimate_s(self, model: str | None, woken: bool) -> float:
        """Seconds until an executor of ``model``'s pool serves: ``woken`` from sleep, or
        started cold (0: none measured)."""
        own, every = (self._wakes_of, self.wakes) if woken else (self._cold_of, self.cold)
        times = own.get(model) or every
        return statistics.median(times) if times else 0.0
