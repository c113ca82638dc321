"""Autoscaling the executor pool at run time (``retouch serve --autoscale``).

The policy is :mod:`retouch.platform.control.autoscaler` (pure, time passed in; the
simulator runs the same one). :class:`PoolScaler` is the thin service around it: every
``tick_s`` it reads the pool's predicted work (running invocations' remaining time from the
cluster view, plus the queued invocations' predicted service), asks the policy for a count,
and acts: it starts executors through the pool, or drains the victims the pool picks
(no new placements, running invocations finish, then the process stops). Invocations that
arrive while the pool is at zero wait in the gateway queue while an executor starts.

One pool serves every function, so the pool's settings merge the functions' ``scaling``
tables: the largest ``min_executors`` and ``max_executors`` (capped by the devices the
provider has), the smallest ``target_s`` and ``upscale_delay_s`` (the most eager function
decides how fast to grow) and the largest stable window and downscale delays (the most
patient one decides how fast to shrink). Per-model pools are not built.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from retouch.functions.spec import ScalingSpec
from retouch.platform.control.autoscaler import Autoscaler, AutoscalingConfig, Decision

if TYPE_CHECKING:
    from retouch.platform.pool import ExecutorPool

log = logging.getLogger(__name__)

TICK_S = 1.0
EVENTS_KEPT = 256


def pool_config(scalings: list[ScalingSpec], capacity: int) -> AutoscalingConfig:
    """The pool's settings from its functions' tables (none deployed: scale to zero)."""
    if not scalings or capacity < 1:
        return AutoscalingConfig(0, max(1, capacity))
    top = min(capacity, max(s.max_executors for s in scalings))
    return AutoscalingConfig(
        min_executors=min(top, max(s.min_executors for s in scalings)),
        max_executors=top,
        target_s=min(s.target_s for s in scalings),
        panic_window_s=min(s.upscale_delay_s for s in scalings),
        stable_window_s=max(s.stable_window_s for s in scalings),
        downscale_delay_s=max(s.downscale_delay_s for s in scalings),
        downscale_to_zero_delay_s=max(s.downscale_to_zero_delay_s for s in scalings),
        panic_hold_s=min(s.upscale_delay_s for s in scalings) * 10,
    )


@dataclass(frozen=True)
class ScaleEvent:
    """One decision that changed the pool's size (or would have, in a dry run)."""

    at: float  # seconds since the scaler started
    change: int
    desired: int
    reason: str
    applied: bool

    def describe(self) -> dict[str, Any]:
        return {
            "at_s": round(self.at, 3),
            "change": self.change,
            "desired": self.desired,
            "reason": self.reason,
            "applied": self.applied,
        }


class PoolScaler:
    """Ticks the autoscaling policy and applies its decisions to ``pool``.

    Owned by the pool (started in its ``start``, closed in its ``close``); one task, no
    lock: everything runs on the event loop, and the slow parts (an executor's start, a
    drain) run in the pool's own tasks, never inside a tick."""

    def __init__(
        self,
        pool: ExecutorPool,
        *,
        tick_s: float = TICK_S,
        dry_run: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.tick_s = tick_s
        self.dry_run = dry_run
        self._clock = clock
        self._born = clock()
        self._policy = Autoscaler(pool_config([], 1))
        self.last: Decision | None = None
        self.events: deque[ScaleEvent] = deque(maxlen=EVENTS_KEPT)  # the latest
        self.ups = self.downs = 0  # decisions since start
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                # The provider's device list may be a network call (Ray's cluster state):
                # read off the event loop, once per tick, and handed to what needs it.
                devices = await asyncio.to_thread(self.pool.provider.devices)
                self.tick(devices)
            except Exception:  # a failed tick must not end autoscaling
                log.exception("autoscaler tick failed")
            await asyncio.sleep(self.tick_s)

    def tick(self, devices: list[str]) -> Decision:
        """One period: read the pool, decide, act (or log, in a dry run). ``devices``: the
        provider's, one per executor it can run."""
        config = pool_config([f.spec.scaling for f in self.pool.functions.values()], len(devices))
        if config != self._policy.config:
            self._policy.reconfigure(config)
        now = self._clock() - self._born
        target = self.pool.target_executors()
        decision = self._policy.tick(now, self.pool.work_s(), len(self.pool.queue), target)
        self.last = decision
        change = decision.desired - target
        if change:
            event = ScaleEvent(now, change, decision.desired, decision.reason, not self.dry_run)
            self.events.append(event)
            if change > 0:
                self.ups += 1
            else:
                self.downs += 1
            log.info(
                "autoscaler%s: %d -> %d executors (%s)",
                " (dry run)" if self.dry_run else "",
                target,
                decision.desired,
                decision.reason,
            )
            if not self.dry_run:
                self._apply(change, devices)
        return decision

    def _apply(self, change: int, devices: list[str]) -> None:
        if change > 0:
            for _ in range(change):
                self.pool.spawn(devices)
            return
        for victim in self.pool.scale_down_victims(-change):
            self.pool.retire(victim)

    def describe(self) -> dict[str, Any]:
        config = self._policy.config
        return {
            "dry_run": self.dry_run,
            "desired": self.last.desired if self.last else None,
            "panicking": self.last.panicking if self.last else False,
            "reason": self.last.reason if self.last else "",
            "config": {
                "min_executors": config.min_executors,
                "max_executors": config.max_executors,
                "target_s": config.target_s,
                "upscale_delay_s": config.panic_window_s,
                "stable_window_s": config.stable_window_s,
                "downscale_delay_s": config.downscale_delay_s,
                "downscale_to_zero_delay_s": config.downscale_to_zero_delay_s,
            },
            "reversals": self._policy.reversals,
            "events": [e.describe() for e in list(self.events)[-20:]],
        }
