"""The fleet: the executors the gateway runs, and their lives.

It starts executors through a provider (all at once for a static pool, one by one when the
autoscaler asks), pushes every deployed function to them, drains and stops the ones the
autoscaler retires, and keeps the fleet whole: a health monitor probes every executor with
its own short timeout and restarts one whose process died, whose engine died or that
stopped answering, each restart in its own task so a slow one never stalls the monitor.
"Restart" is the provider's: a new process (local, Ray), or for executors started outside
the gateway (attach) waiting until the URL answers again and taking it back.

An executor that refuses an invocation as full (its room is shared with other gateways)
gets nothing bound to it for a moment, its state is re-read, and the queue is woken after
the pause (:meth:`Fleet.refused`).
Each executor's change feed is followed (``platform/fleet/changefeed.py``), so the control
plane's view of it (templates, calibration) stays current even when it gets no invocations.

The autoscaler sees the fleet through :class:`~retouch.platform.fleet.scaler.ScaledFleet` only;
the dispatcher reads :meth:`Fleet.candidates` and is told through ``on_capacity`` whenever
an executor may take work it could not before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx

from retouch.functions.errors import RetouchError
from retouch.functions.spec import FunctionSpec
from retouch.functions.wire.executor import ExecutorPhase, ExecutorState
from retouch.platform.control.cluster import ClusterView, PlacementRequest, Residency
from retouch.platform.fleet.changefeed import ChangeFeeds
from retouch.platform.fleet.deployments import Deployments
from retouch.platform.fleet.executorlink import ExecutorHandle, ExecutorLink
from retouch.platform.fleet.providers import Executor, Provider
from retouch.platform.fleet.scaler import Arrived, Member, ModelLoad, split_load
from retouch.platform.fleet.sleepers import SleepingExecutors, SleepPolicy
from retouch.platform.fleet.startups import StartupTimes
from retouch.runtime.executor.options import room

log = logging.getLogger(__name__)

MONITOR_INTERVAL_S = 1.0
DRAIN_TIMEOUT_S = 600.0  # a draining executor's running invocations get this long to finish
PROBE_FAILURES = 3  # consecutive failed probes of a live process before it is restarted
REFUSED_PAUSE_S = 0.2  # an executor that refused as full gets no binding this long
JOIN_WAIT_S = 5.0  # a gateway starts serving after this, with the attached executors up by then

Queued = Callable[[], list[tuple[str, float]]]  # waiting invocations: (function, service s)
# phases whose executors are not the pool's capacity (the autoscaler's target)
NOT_CAPACITY = (ExecutorPhase.DRAINING, ExecutorPhase.SLEEPING)


class Fleet:
    """The executors and the functions deployed on them (event-loop state, no lock)."""

    def __init__(
        self,
        provider: Provider,
        link: ExecutorLink,
        *,
        on_capacity: Callable[[], None],
        queued: Queued,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
        sleep: SleepPolicy | None = None,
    ) -> None:
        self.provider = provider
        self.link = link
        self.on_capacity = on_capacity  # an executor may take work: bind waiting invocations
        self.queued = queued
        self.drain_timeout_s = drain_timeout_s
        self.executors: list[ExecutorHandle] = []
        self.deploys = Deployments(
            self.executors, link, self.refresh, on_capacity, self._in_background
        )
        self.cluster = ClusterView()
        self.startups = StartupTimes()  # measured cold starts and wakes, per model pool
        self.sleeping = SleepingExecutors(
            sleep or SleepPolicy(),
            self.executors,
            link,
            provider,
            self.startups,
            ready=self._become_ready,
            on_capacity=on_capacity,
            in_background=self._in_background,
        )
        self._arrived: defaultdict[str, Arrived] = defaultdict(Arrived)  # see take_arrived
        self._monitor: asyncio.Task | None = None
        self._restarts: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self.feeds = ChangeFeeds(self.executors, link, self.refresh)
        # executors being started: their task, and the model pool each is for
        self._spawning: dict[str, tuple[asyncio.Task, str | None]] = {}
        self._draining: dict[str, asyncio.Task] = {}

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self, *, static: bool) -> None:
        """A static fleet starts one executor per provider device and waits until they are
        ready; an autoscaled one starts empty (the autoscaler spawns). Executors that run on
        their own (attach) join as each answers: none waits for another, and one that is
        down joins when it is up."""
        if static and not self.provider.owns_processes:
            for i, slot in enumerate(self.provider.devices()):
                name = f"exec-{i}"
                task = asyncio.create_task(self._join(name, slot))
                self._spawning[name] = (task, None)
                task.add_done_callback(lambda _, name=name: self._spawning.pop(name, None))
            await asyncio.wait([task for task, _ in self._spawning.values()], timeout=JOIN_WAIT_S)
        elif static:
            devices = self.provider.devices()
            threads = self.provider.threads_per_executor(len(devices))
            names = [f"exec-{i}" for i in range(len(devices))]
            procs = await asyncio.gather(
                *(self.provider.start(n, d, threads) for n, d in zip(names, devices, strict=True))
            )
            self.executors.extend(
                ExecutorHandle(p, slot=d, overheads=self.cluster.overheads)
                for p, d in zip(procs, devices, strict=True)
            )
            await asyncio.gather(*(self._become_ready(e) for e in self.executors))
        self._monitor = asyncio.create_task(self._watch())

    async def close(self) -> None:
        tasks = [
            t
            for t in (
                self._monitor,
                *self._restarts.values(),
                *self._background,
                *self.feeds.followers.values(),
                *(task for task, _ in self._spawning.values()),
                *self._draining.values(),
            )
            if t is not None
        ]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(self.provider.stop(e.process) for e in self.executors))

    # ---- what the autoscaler sees (scaler.ScaledFleet) ----------------------------------
    def devices(self) -> list[str]:
        return self.provider.devices()

    def specs(self) -> list[FunctionSpec]:
        return [stored.spec for stored in self.deploys.functions.values()]

    def model_loads(self) -> dict[str, ModelLoad]:
        """Each model pool's predicted work, queued invocations and target count (the
        autoscaler's inputs, see :func:`~retouch.platform.fleet.scaler.split_load`), and
        what bringing back a victim of its scale-down takes, measured
        (:mod:`~retouch.platform.fleet.startups`)."""
        members = [
            Member(e.model, e.view.work_s(), e.phase not in NOT_CAPACITY) for e in self.executors
        ]
        members += [Member(m, 0.0, True) for m in self.unstarted().values()]
        model_of = {spec.name: spec.model for spec in self.specs()}
        loads = split_load(members, self.queued(), model_of)
        asleep = self.sleeping.asleep.policy.enabled  # a scale-down's victims sleep
        return {
            model: replace(load, startup_s=self.startups.estimate_s(model, woken=asleep))
            for model, load in loads.items()
        }

    def arrive(self, request: PlacementRequest) -> None:
        """Count ``request``'s executor-seconds into its model's demand, from the first
        executor with a profile of that model (none yet: the pool is starting, and work at
        an empty pool scales up on its own)."""
        for e in self.executors:
            executor_s = e.view.executor_s(request)
            if executor_s > 0:
                arrived = self._arrived[request.model]
                arrived.executor_s += executor_s
                arrived.count += 1
                return

    def take_arrived(self) -> dict[str, Arrived]:
        """The invocations that arrived since the last call, per model: executor-seconds
        (the autoscaler divides them by its tick) and how many."""
        arrived, self._arrived = dict(self._arrived), defaultdict(Arrived)
        return arrived

    def spawn(self, devices: list[str], model: str | None = None) -> bool:
        """One more executor for ``model``'s pool (None: every function), in its own task:
        its most recent sleeper woken, else a cold start on a free one of the provider's
        ``devices``, else on the device of the oldest sleeper (of any model), stopped
        first. False when every device is taken by an awake executor (draining included:
        none is taken over)."""
        if self.sleeping.wake(model):
            return True
        names = [f"exec-{i}" for i in range(len(devices))]  # one executor per device
        taken = {e.name for e in self.executors} | set(self._spawning)
        free = [i for i, name in enumerate(names) if name not in taken]
        evicted = None
        if not free:
            evicted = self.sleeping.give_up_device(names)
            if evicted is None:
                return False
            free = [names.index(evicted.name)]
        name, device = names[free[0]], devices[free[0]]
        task = asyncio.create_task(self._spawn(name, device, len(devices), model, evicted))
        self._spawning[name] = (task, model)
        task.add_done_callback(lambda _: self._spawning.pop(name, None))
        return True

    def scale_down_victims(self, count: int, model: str | None = None) -> list[ExecutorHandle]:
        """Whom to drain, among ``model``'s pool (None: every executor): least predicted
        work, then least host-resident templates (the cheapest cache to lose), then the
        newest."""
        ready = [e for e in self.executors if e.healthy and (model is None or e.model == model)]

        def cost(e: ExecutorHandle) -> tuple[float, int, float]:
            hosted = sum(tier is Residency.HOST for tier in e.view.residency.values())
            return (e.view.work_s(), hosted, -e.started_at)

        return sorted(ready, key=cost)[: max(0, count)]

    def retire(self, handle: ExecutorHandle) -> None:
        """Drain ``handle`` (no new placements; what runs there finishes), then put it to
        sleep (the fleet's :class:`SleepPolicy` allows it, the executor agrees) or stop it."""
        if handle.name in self._draining:
            return
        handle.phase = ExecutorPhase.DRAINING
        task = asyncio.create_task(self._drain(handle))
        self._draining[handle.name] = task
        task.add_done_callback(lambda _: self._draining.pop(handle.name, None))

    # ---- membership ---------------------------------------------------------------------
    def unstarted(self) -> dict[str, str | None]:
        """Executors being started whose process is not up yet (no handle), and their
        model. Once up, the handle (phase ``starting``) stands for it."""
        present = {e.name for e in self.executors}
        return {n: m for n, (_, m) in self._spawning.items() if n not in present}

    def candidates(self, function: str) -> list[ExecutorHandle]:
        """Executors that can take an invocation of ``function`` now: ready, holding it,
        of its model's pool (an autoscaled executor serves one model), and not pausing
        after a refusal."""
        stored = self.deploys.functions.get(function)
        model = stored.spec.model if stored is not None else None
        now = time.monotonic()
        return [
            e
            for e in self.executors
            if e.healthy and function in e.functions and e.serves(model) and e.refused_until <= now
        ]

    def refused(self, handle: ExecutorHandle) -> None:
        """``handle`` refused an invocation as full (other gateways' work fills it): bind
        nothing to it for :data:`REFUSED_PAUSE_S`, re-read its state, and wake the queue
        when the pause ends (an invocation of ours finishing there wakes it too)."""
        handle.refused_until = time.monotonic() + REFUSED_PAUSE_S
        self.refresh_soon(handle)
        asyncio.get_running_loop().call_later(REFUSED_PAUSE_S, self.on_capacity)

    async def _spawn(
        self,
        name: str,
        device: str,
        capacity: int,
        model: str | None,
        evicted: ExecutorHandle | None = None,
    ) -> None:
        threads = self.provider.threads_per_executor(capacity)
        started = time.monotonic()
        if evicted is not None:
            await self.sleeping.stop(evicted, f"its device is wanted for {model or 'a start'}")
        try:
            proc = await self.provider.start(name, device, threads)
        except RetouchError as exc:
            log.error("autoscaler could not start %s: %s", name, exc)
            return
        handle = ExecutorHandle(proc, device, model=model, overheads=self.cluster.overheads)
        self.executors.append(handle)
        if not await self._make_ready(handle, "started"):
            return  # no start-up to measure: the monitor keeps probing it
        self.startups.started(model, time.monotonic() - started)
        log.info(
            "%s (%s) ready in %.1f s", name, model or "every model", time.monotonic() - started
        )

    async def _join(self, name: str, slot: str) -> None:
        """Take in an executor that runs on its own once it answers."""
        handle = ExecutorHandle(
            await self._start_until_up(name, slot, 0), slot, overheads=self.cluster.overheads
        )
        self.executors.append(handle)
        await self._make_ready(handle, "attached")

    async def _make_ready(self, handle: ExecutorHandle, what: str) -> bool:
        """Bring a started executor to ready (True); one that is not stays ``starting``
        and the monitor keeps probing it."""
        try:
            await self._become_ready(handle)
        except (RetouchError, httpx.HTTPError) as exc:
            log.error("%s %s is not ready: %s", what, handle.name, exc)
            handle.phase = ExecutorPhase.STARTING
            return False
        return True

    async def _start_until_up(self, name: str, slot: str, threads: int) -> Executor:
        """The provider's start of ``name`` on ``slot``, retried until it succeeds."""
        while True:
            try:
                return await self.provider.start(name, slot, threads)
            except RetouchError as exc:
                log.error("could not start %s: %s; retrying", name, exc)
                await asyncio.sleep(MONITOR_INTERVAL_S * 5)

    async def _drain(self, handle: ExecutorHandle) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while handle.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if handle.inflight:
            log.warning(
                "%s still runs %d invocations after %.0f s of drain: they are re-placed",
                handle.name,
                handle.inflight,
                self.drain_timeout_s,
            )
        self.feeds.stop(handle.name)
        if await self.sleeping.put_to_sleep(handle):
            return
        if handle in self.executors:
            self.executors.remove(handle)
        await self.provider.stop(handle.process)
        log.info("%s drained and stopped", handle.name)

    # ---- state and change feed ----------------------------------------------------------
    async def refresh(self, handle: ExecutorHandle) -> None:
        """Read the executor's state into its view (after a deploy, a bake, an eviction).
        Reads of one executor are coalesced: a refresh asked for while one is under way
        makes that one read again when it ends (the first read may predate the change).
        A failed read changes nothing."""
        if handle.refreshing:
            handle.refresh_again = True
            return
        handle.refreshing = True
        try:
            while True:
                handle.refresh_again = False
                try:
                    state = ExecutorState.from_wire(
                        await self.link.call(handle, "GET", "/state", probe=True)
                    )
                except (RetouchError, httpx.HTTPError) as exc:
                    log.debug("state of %s not read: %r", handle.name, exc)
                    return
                handle.state = state
                handle.view.observe_state(state, self.cluster.costers)
                self.on_capacity()
                if not handle.refresh_again:
                    return
        finally:
            handle.refreshing = False

    def refresh_soon(self, handle: ExecutorHandle) -> None:
        """:meth:`refresh` in the background (after an invocation changed the store)."""
        self._in_background(self.refresh(handle))

    def _in_background(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- health and restarts ------------------------------------------------------------
    async def _become_ready(self, handle: ExecutorHandle) -> None:
        """Read the executor's capacity, push every function, then open it to invocations."""
        state = ExecutorState.from_wire(await self.link.call(handle, "GET", "/state", probe=True))
        handle.state = state
        handle.slots = room(state.engine.max_batch)
        handle.view.slots = handle.slots
        handle.view.observe_state(state, self.cluster.costers)
        await self.deploys.push_all(handle, state.generations)
        handle.phase = ExecutorPhase.READY
        self.feeds.follow(handle)
        self.on_capacity()

    def suspect(self, handle: ExecutorHandle, why: str) -> None:
        """Stop sending work to ``handle``; the monitor probes it and restarts it if needed."""
        if handle.phase is ExecutorPhase.READY:
            log.warning("executor %s is suspect: %s", handle.name, why)
            handle.phase = ExecutorPhase.STARTING
            handle.probe_failures = max(handle.probe_failures, 1)

    async def _watch(self) -> None:
        """The health monitor; it must outlive any one failed check."""
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            try:
                self.sleeping.check()  # a provider's liveness call (Ray's) may raise
            except Exception as exc:
                log.error("checking the sleepers failed: %r", exc)
            checked = [
                e
                for e in self.executors
                if e.name not in self._restarts and e.phase is not ExecutorPhase.SLEEPING
            ]
            results = await asyncio.gather(
                *(self._check(e) for e in checked), return_exceptions=True
            )
            for error in (r for r in results if isinstance(r, Exception)):
                log.error("health check failed: %r", error)

    async def _check(self, handle: ExecutorHandle) -> None:
        if not handle.process.alive:
            code = handle.process.exit_code
            self._schedule_restart(handle, f"process exited with code {code}")
            return
        try:
            await self.link.call(handle, "GET", "/healthz", probe=True)
        except RetouchError as exc:
            if exc.code == "engine_dead":
                self._schedule_restart(handle, exc.message)
                return
            self._probe_failed(handle, f"{exc.code}: {exc.message}")
            return
        except httpx.HTTPError as exc:
            self._probe_failed(handle, repr(exc))
            return
        handle.probe_failures = 0
        if handle.phase is ExecutorPhase.STARTING:
            handle.phase = ExecutorPhase.READY
            self.on_capacity()

    def _probe_failed(self, handle: ExecutorHandle, why: str) -> None:
        handle.probe_failures += 1
        self.suspect(handle, why)
        if handle.probe_failures >= PROBE_FAILURES:
            self._schedule_restart(handle, f"{handle.probe_failures} failed probes: {why}")

    def _schedule_restart(self, handle: ExecutorHandle, why: str) -> None:
        if handle.name in self._restarts or handle.name in self._draining:
            return  # a draining executor is going away anyway: its invocations are re-placed
        log.warning("restarting executor %s: %s", handle.name, why)
        handle.phase = ExecutorPhase.DEAD
        task = asyncio.create_task(self._restart(handle))
        self._restarts[handle.name] = task
        task.add_done_callback(lambda _: self._restarts.pop(handle.name, None))

    async def _restart(self, old: ExecutorHandle) -> None:
        await self.provider.stop(old.process, failed=True)
        threads = self.provider.threads_per_executor(len(self.executors))
        proc = await self._start_until_up(old.name, old.slot, threads)
        if old not in self.executors:  # dropped meanwhile (a failed wake stopped it)
            await self.provider.stop(proc)
            return
        handle = ExecutorHandle(
            proc,
            old.slot,
            restarts=old.restarts + 1,
            model=old.model,
            overheads=self.cluster.overheads,
        )
        self.executors[self.executors.index(old)] = handle
        await self._make_ready(handle, "restarted")
