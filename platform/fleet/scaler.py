"""Autoscaling the executor pool at run time (``retouch serve --autoscale``), per model.

The policy is :mod:`retouch.platform.control.autoscaler` (pure, time passed in; the
simulator runs the same one). :class:`PoolScaler` is the thin service around it.

**Model pools.** Functions that name the same model (``spec.model``) form one model pool:
they share its executors, and the model is loaded once per executor (LegoDiffusion's
per-model scaling). Each model pool has its own :class:`Autoscaler`, configured by
:func:`pool_config` over *its* functions' ``scaling`` tables only: the largest
``min_executors`` and ``max_executors`` (capped by the devices the provider has), the
smallest ``target_s``, ``target_utilisation`` and ``upscale_delay_s`` and the largest
``rise_cap`` (the most eager function decides how fast to grow) and the largest stable
window, downscale delays, ``upscale_hold_s`` and ``downscale_margin`` (the most patient one
decides how fast to shrink). Every ``tick_s`` the scaler splits the pool's load by model
(:func:`split_load`): a model pool's work is what its own executors hold plus the
predicted service of its functions' queued invocations, and its target count is its own
ready + starting executors; its *demand* is the executor-seconds of its functions'
invocations that arrived since the last tick (each at its share of a full batch, counted
when decoded, refused or not: :meth:`ScaledFleet.take_arrived`) per second, which shows a
step in the arrival rate before the work piles up. Then it acts per model pool:

* scale-up starts executors *assigned to the model* through the pool: such an executor is
  pushed only that model's functions (so it loads only that model) and placement considers
  it only for them;
* devices are shared: a scale-up takes a free device from the provider; when none is free
  it starts nothing (a busy executor of another model is never taken), logs it and counts
  it as ``no_device``; the pool asks again on the next tick. Model pools with fewer
  executors are served first in a tick, so a pool at zero with work is not starved by
  another one growing;
* scale-down picks victims among that model pool's executors only and drains them (no new
  placements, running invocations finish, then the process stops);
* a model pool whose functions were all deleted serves nothing: its executors are drained
  at once, whatever the delays said.

Invocations that arrive while their model pool is at zero wait in the gateway queue while
an executor starts. One executor serves one model (an executor serving several model pools
is not built); a static pool (no ``--autoscale``) is unchanged: every executor serves every
function.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from retouch.functions.spec import FunctionSpec, ScalingSpec
from retouch.platform.control.autoscaler import Autoscaler, AutoscalingConfig, Decision

log = logging.getLogger(__name__)

TICK_S = 1.0
EVENTS_KEPT = 256
NO_DEVICE = "no device"  # the reason recorded when a scale-up found no free device


def pool_config(scalings: list[ScalingSpec], capacity: int) -> AutoscalingConfig:
    """A pool's settings from its functions' tables (none deployed: scale to zero)."""
    if not scalings or capacity < 1:
        return AutoscalingConfig(0, max(1, capacity))
    top = min(capacity, max(s.max_executors for s in scalings))
    return AutoscalingConfig(
        min_executors=min(top, max(s.min_executors for s in scalings)),
        max_executors=top,
        target_s=min(s.target_s for s in scalings),
        target_utilisation=min(s.target_utilisation for s in scalings),
        headroom_sigmas=max(s.headroom_sigmas for s in scalings),
        panic_window_s=min(s.upscale_delay_s for s in scalings),
        stable_window_s=max(s.stable_window_s for s in scalings),
        downscale_delay_s=max(s.downscale_delay_s for s in scalings),
        downscale_to_zero_delay_s=max(s.downscale_to_zero_delay_s for s in scalings),
        panic_hold_s=min(s.upscale_delay_s for s in scalings) * 10,
        upscale_hold_s=max(s.upscale_hold_s for s in scalings),
        rise_cap=max(s.rise_cap for s in scalings),
        downscale_margin=max(s.downscale_margin for s in scalings),
    )


def model_configs(specs: Iterable[FunctionSpec], capacity: int) -> dict[str, AutoscalingConfig]:
    """Each model pool's settings: :func:`pool_config` over the tables of the functions
    that name that model, and only those."""
    by_model: dict[str, list[ScalingSpec]] = defaultdict(list)
    for spec in specs:
        by_model[spec.model].append(spec.scaling)
    return {model: pool_config(scalings, capacity) for model, scalings in by_model.items()}


@dataclass(frozen=True)
class Member:
    """One executor of the pool as the work split sees it."""

    model: str | None  # the model pool it was started for (None: serves every model)
    work_s: float  # predicted seconds of work it holds
    counted: bool  # ready, starting or restarting: capacity (a draining one is not)


@dataclass(frozen=True)
class ModelLoad:
    """One model pool at a tick: the policy's inputs."""

    work_s: float = 0.0  # its executors' predicted work plus its queued invocations'
    queued: int = 0  # invocations of its functions waiting in the gateway
    target: int = 0  # its ready + starting executors
    startup_s: float = 0.0  # measured: a scale-down victim's return, wake or cold (0: none)


@dataclass
class Arrived:
    """The invocations of one model that arrived since the autoscaler's last tick: their
    executor-seconds (the demand) and their number (the demand's Poisson noise)."""

    executor_s: float = 0.0
    count: int = 0


def split_load(
    members: Iterable[Member],
    queued: Iterable[tuple[str, float]],
    model_of: Mapping[str, str],
) -> dict[str, ModelLoad]:
    """The pool's load split by model pool. ``queued``: each waiting invocation's function
    and predicted service; ``model_of``: each deployed function's model. Executors of no
    model pool (a static pool's) and invocations of functions no longer deployed count
    nowhere."""
    work: dict[str, float] = defaultdict(float)
    waiting: dict[str, int] = defaultdict(int)
    target: dict[str, int] = defaultdict(int)
    for m in members:
        if m.model is None or not m.counted:
            continue
        work[m.model] += m.work_s
        target[m.model] += 1
    for function, service_s in queued:
        model = model_of.get(function)
        if model is None:
            continue
        work[model] += service_s
        waiting[model] += 1
    models = set(work) | set(waiting) | set(target)
    return {m: ModelLoad(work[m], waiting[m], target[m]) for m in models}


@dataclass(frozen=True)
class ScaleEvent:
    """One decision that changed a model pool's size (or would have: a dry run, or no
    free device)."""

    at: float  # seconds since the scaler started
    model: str
    change: int
    desired: int
    reason: str
    applied: bool

    def describe(self) -> dict[str, Any]:
        return {
            "at_s": round(self.at, 3),
            "model": self.model,
            "change": self.change,
            "desired": self.desired,
            "reason": self.reason,
            "applied": self.applied,
        }


class ModelPool:
    """One model's autoscaling state: its policy, last decision and scale events."""

    def __init__(self, model: str, config: AutoscalingConfig) -> None:
        self.model = model
        self.policy = Autoscaler(config)
        self.last: Decision | None = None
        self.events: deque[ScaleEvent] = deque(maxlen=EVENTS_KEPT)
        self.ups = self.downs = 0  # decisions that changed the pool, since start
        self.no_device = 0  # ticks whose scale-up found no free device
        self.blocked = False  # the last tick's scale-up found no free device
        self.startup_s = 0.0  # the least wait of a scale-down at the last tick (0: none)

    def describe(self) -> dict[str, Any]:
        config = self.policy.config
        reason = self.last.reason if self.last else ""
        return {
            "desired": self.last.desired if self.last else None,
            "panicking": self.last.panicking if self.last else False,
            "reason": f"{reason} ({NO_DEVICE})" if self.blocked else reason,
            "config": describe_config(config),
            "reversals": self.policy.reversals,
            "scale_ups": self.ups,
            "scale_downs": self.downs,
            "no_device": self.no_device,
            "startup_s": round(self.startup_s, 3),
            "events": [e.describe() for e in list(self.events)[-20:]],
        }


def describe_config(config: AutoscalingConfig) -> dict[str, Any]:
    return {
        "min_executors": config.min_executors,
        "max_executors": config.max_executors,
        "target_s": config.target_s,
        "target_utilisation": config.target_utilisation,
        "headroom_sigmas": config.headroom_sigmas,
        "upscale_delay_s": config.panic_window_s,
        "stable_window_s": config.stable_window_s,
        "downscale_delay_s": config.downscale_delay_s,
        "downscale_to_zero_delay_s": config.downscale_to_zero_delay_s,
        "upscale_hold_s": config.upscale_hold_s,
        "rise_cap": config.rise_cap,
        "downscale_margin": config.downscale_margin,
    }


class ScaledFleet(Protocol):
    """All the autoscaler sees of the executors (``platform/fleet/fleet.py`` is one)."""

    def devices(self) -> list[str]:
        """The provider's devices, one per executor it can run (may be a network call)."""
        ...

    def specs(self) -> list[FunctionSpec]:
        """The deployed functions (their models and scaling tables)."""
        ...

    def model_loads(self) -> dict[str, ModelLoad]: ...

    def take_arrived(self) -> dict[str, Arrived]:
        """The invocations that arrived since the last call, per model."""
        ...

    def spawn(self, devices: list[str], model: str | None = None) -> bool:
        """Start one executor for ``model`` on a free device; False when none is free."""
        ...

    def scale_down_victims(self, count: int, model: str | None = None) -> list[Any]: ...

    def retire(self, handle: Any) -> None:
        """Drain one of the victims, then stop it."""
        ...


class PoolScaler:
    """Ticks one autoscaling policy per model pool and applies the decisions to ``fleet``.

    Owned by the pool (started in its ``start``, closed in its ``close``); one task, no
    lock: everything runs on the event loop, and the slow parts (an executor's start, a
    drain) run in the fleet's own tasks, never inside a tick."""

    def __init__(
        self,
        fleet: ScaledFleet,
        *,
        tick_s: float = TICK_S,
        dry_run: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.tick_s = tick_s
        self.dry_run = dry_run
        self._clock = clock
        self._born = clock()
        self.models: dict[str, ModelPool] = {}  # kept after their functions go (counters)
        self.capacity = 0  # the provider's devices at the last tick
        self._task: asyncio.Task | None = None
        self._last_tick = 0.0  # seconds since start: the demand's denominator

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
                devices = await asyncio.to_thread(self.fleet.devices)
                self.tick(devices)
            except Exception:  # a failed tick must not end autoscaling
                log.exception("autoscaler tick failed")
            await asyncio.sleep(self.tick_s)

    @property
    def ups(self) -> int:
        return sum(p.ups for p in self.models.values())

    @property
    def downs(self) -> int:
        return sum(p.downs for p in self.models.values())

    def desired(self) -> int | None:
        """The model pools' desired counts summed (None before any decision)."""
        decided = [p.last.desired for p in self.models.values() if p.last is not None]
        return sum(decided) if decided else None

    def tick(self, devices: list[str]) -> dict[str, Decision]:
        """One period: read the pool, decide per model pool, act (or log, in a dry run).
        ``devices``: the provider's, one per executor it can run."""
        self.capacity = len(devices)
        configs = model_configs(self.fleet.specs(), len(devices))
        loads = self.fleet.model_loads()
        now = self._clock() - self._born
        arrived = self.fleet.take_arrived()
        elapsed, self._last_tick = now - self._last_tick, now
        demand = {m: a.executor_s / elapsed for m, a in arrived.items()} if elapsed > 0 else {}
        for model in set(loads) - set(configs):
            self._orphaned(model, loads[model], now)
        decisions = {}
        # Fewest executors first: a pool at zero with work gets a free device before
        # another pool grows.
        for model in sorted(configs, key=lambda m: (loads.get(m, ModelLoad()).target, m)):
            pool = self.models.setdefault(model, ModelPool(model, configs[model]))
            load = loads.get(model, ModelLoad())
            decisions[model] = self._tick_model(
                pool,
                configs[model],
                load,
                now,
                devices,
                demand.get(model, 0.0),
                arrived.get(model, Arrived()).count,
            )
        return decisions

    def _tick_model(
        self,
        pool: ModelPool,
        config: AutoscalingConfig,
        load: ModelLoad,
        now: float,
        devices: list[str],
        demand: float = 0.0,
        arrivals: int = 0,
    ) -> Decision:
        if config != pool.policy.config:
            pool.policy.reconfigure(config)
        decision = pool.policy.tick(
            now, load.work_s, load.queued, load.target, demand, arrivals, load.startup_s
        )
        pool.last = decision
        pool.startup_s = load.startup_s
        change = decision.desired - load.target
        if change > 0:
            started = change if self.dry_run else self._spawn(pool.model, change, devices)
            if started:
                self._record(pool, now, started, decision, load.target)
                pool.ups += 1
            blocked = started < change
            if blocked:
                pool.no_device += 1
                if not pool.blocked:  # once per run of blocked ticks, not every second
                    log.warning(
                        "autoscaler: model pool %s wants %d more executors; no free device "
                        "(%d in all, none stolen from another model)",
                        pool.model,
                        change - started,
                        len(devices),
                    )
                    pool.events.append(
                        ScaleEvent(
                            now,
                            pool.model,
                            change - started,
                            decision.desired,
                            f"{decision.reason} ({NO_DEVICE})",
                            False,
                        )
                    )
            pool.blocked = blocked
            return decision
        pool.blocked = False
        if change < 0:
            self._record(pool, now, change, decision, load.target)
            pool.downs += 1
            if not self.dry_run:
                for victim in self.fleet.scale_down_victims(-change, pool.model):
                    self.fleet.retire(victim)
        return decision

    def _spawn(self, model: str, count: int, devices: list[str]) -> int:
        """Start up to ``count`` executors for ``model``; how many found a free device."""
        started = 0
        while started < count and self.fleet.spawn(devices, model):
            started += 1
        return started

    def _record(
        self, pool: ModelPool, now: float, change: int, decision: Decision, target: int
    ) -> None:
        pool.events.append(
            ScaleEvent(now, pool.model, change, decision.desired, decision.reason, not self.dry_run)
        )
        log.info(
            "autoscaler%s: model pool %s %d -> %d executors (%s)",
            " (dry run)" if self.dry_run else "",
            pool.model,
            target,
            target + change,
            decision.reason,
        )

    def _orphaned(self, model: str, load: ModelLoad, now: float) -> None:
        """A model pool none of whose functions is deployed any more: its executors serve
        nothing, so they are drained now rather than after the idle delays."""
        victims = self.fleet.scale_down_victims(load.target, model)
        if not victims:
            return
        pool = self.models.get(model)
        reason = "no function uses the model"
        if pool is not None and not (self.dry_run and pool.last and pool.last.reason == reason):
            decision = Decision(load.target - len(victims), False, reason)
            pool.last = decision
            self._record(pool, now, -len(victims), decision, load.target)
            pool.downs += 1
        if not self.dry_run:
            for victim in victims:
                self.fleet.retire(victim)

    def describe(self) -> dict[str, Any]:
        """The model pools (``models``) and, for one glance, their sums: ``desired``,
        ``reversals``, every pool's recent ``events``; ``config`` is the merge of every
        function's table (the bound a single pool would have), each pool's own is under
        ``models``."""
        pools = {m: p.describe() for m, p in sorted(self.models.items())}
        events = sorted((e for p in self.models.values() for e in p.events), key=lambda e: e.at)
        specs = [spec.scaling for spec in self.fleet.specs()]
        return {
            "dry_run": self.dry_run,
            "desired": self.desired(),
            "panicking": any(p["panicking"] for p in pools.values()),
            "reason": "; ".join(f"{m}: {p['reason']}" for m, p in pools.items() if p["reason"]),
            "config": describe_config(pool_config(specs, self.capacity)),
            "reversals": sum(p.policy.reversals for p in self.models.values()),
            "events": [e.describe() for e in events[-20:]],
            "models": pools,
        }
