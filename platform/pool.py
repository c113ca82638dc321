"""The executor pool: the gateway's view of its executors and the one way to reach them.

It starts executors through a provider, pushes every deployed function to them, runs each
invocation through the gateway queue (bound to an executor with room, see
``control/queue.py``), and keeps the pool whole: a health monitor probes every executor
with its own short timeout and restarts one whose process died, whose engine died or that
stopped answering, each restart in its own task so a slow one never stalls the monitor.

Nothing accepted is lost: edits are deterministic, so an invocation whose executor died or
became unreachable mid-run is queued again (at the head) and re-run on another executor,
or on the same one once restarted, within a bounded number of attempts and its deadline.

Invocations are sent on the executor's streaming endpoint, so the engine's step progress
reaches the caller (a job) as it happens; an invocation with an id can be canceled, in the
queue or on its executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Any

import httpx

from retouch.functions import wire
from retouch.functions.errors import (
    Canceled,
    GatewayTimeout,
    NotFound,
    RetouchError,
    Unavailable,
)
from retouch.platform.control.cluster import (
    ClusterView,
    ExecutorView,
    Overheads,
    Placed,
    Residency,
)
from retouch.platform.control.queue import InvocationQueue, QueueLimits
from retouch.platform.placement import Placement, PlacementRequest, make_placement
from retouch.platform.providers import Executor, Provider
from retouch.platform.registry import StoredFunction
from retouch.platform.scaler import Arrived, Member, ModelLoad, PoolScaler, split_load

log = logging.getLogger(__name__)

MONITOR_INTERVAL_S = 1.0
DRAIN_TIMEOUT_S = 600.0  # a draining executor's running invocations get this long to finish
PROBE_TIMEOUT_S = 2.0
CHANGES_WAIT_S = 20  # an executor's change-feed long poll answers within this when idle
PROBE_FAILURES = 3  # consecutive failed probes of a live process before it is restarted
RECALIBRATE_ERROR = 0.15  # a prediction this far off re-reads the executor's step fit
SLOTS_PER_BATCH = 2  # slots = max_batch x this: the running batch plus a pre-processing buffer
# Executor answers that mean "this executor lost the invocation; it never finished here".
LOST_CODES = frozenset({"engine_dead", "engine_unavailable"})

OnStart = Callable[[str, int], None]  # (executor name, attempt): the invocation left the queue
OnProgress = Callable[[wire.StepProgress], None]


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3  # executors an invocation may be sent to
    invoke_timeout_s: float = 600.0  # an invocation's whole life in the gateway


@dataclass(eq=False)
class ExecutorHandle:
    """One executor as the pool sees it (event-loop state, no lock needed)."""

    process: Executor
    view: ExecutorView = field(init=False)  # the control plane's picture of it
    inflight: int = 0
    slots: int = 1
    functions: set[str] = field(default_factory=set)
    probe_failures: int = 0
    state: wire.ExecutorState | None = None
    restarts: int = 0
    # The model pool it was started for (autoscaled): it is pushed, and placement sends it,
    # only that model's functions. None: it serves every function (a static pool).
    model: str | None = None
    refreshing: bool = False  # a state read is under way (reads are coalesced)
    refresh_again: bool = False  # something changed during that read: read once more
    started_at: float = field(default_factory=time.monotonic)
    overheads: InitVar[Overheads | None] = None  # the pool's, learnt from every executor

    def __post_init__(self, overheads: Overheads | None) -> None:
        self.view = ExecutorView(self.process.name, overheads=overheads)

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def phase(self) -> wire.ExecutorPhase:
        return self.view.phase

    @phase.setter
    def phase(self, phase: wire.ExecutorPhase) -> None:
        self.view.phase = phase

    @property
    def healthy(self) -> bool:
        return self.phase is wire.ExecutorPhase.READY

    def serves(self, model: str | None) -> bool:
        """Whether functions of ``model`` may be deployed to and placed on it."""
        return self.model is None or self.model == model

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model,
            "device": self.process.device,
            "node": self.process.node,
            "url": self.process.url,
            "phase": self.phase.value,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "slots": self.slots,
            "restarts": self.restarts,
            "functions": sorted(self.functions),
            "predicted_work_s": round(self.view.work_s(), 3),
            "calibration": self.view.calibration.describe(
                self.view.overheads, len(self.view.placed)
            ),
            "templates": {f"{fn}/{t}": tier.value for (fn, t), tier in self.view.residency.items()},
        }


@dataclass
class PlacementStats:
    """Recent decisions and predictions, for ``/metrics`` and the benches."""

    admission_s: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    startup_s: deque[float] = field(default_factory=lambda: deque(maxlen=256))  # autoscaled
    prediction_error: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    # from a request's arrival at the gateway (its headers) to its 429 on arrival: a refusal
    # after decoding includes reading the body, i.e. the client's upload
    refusal_s: deque[float] = field(default_factory=lambda: deque(maxlen=4096))


class ExecutorLost(Exception):
    """The executor died, stopped or became unreachable while it held an invocation."""


class ExecutorPool:
    def __init__(
        self,
        provider: Provider,
        placement: Placement,
        limits: QueueLimits | None = None,
        retry: RetryPolicy | None = None,
        *,
        autoscale: bool = False,
        autoscale_dry_run: bool = False,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
    ) -> None:
        limits = limits or QueueLimits()
        retry = retry or RetryPolicy()
        self.provider = provider
        self.retry = retry
        self.executors: list[ExecutorHandle] = []
        self.functions: dict[str, StoredFunction] = {}
        self.generations: dict[str, int] = {}  # latest control operation per function name
        self.cluster = ClusterView()
        self.placements: dict[str, Placement] = {}  # per function, where its spec names one
        self.queue = InvocationQueue(limits, placement, self.candidates, policy_of=self.policy)
        self.lost = 0  # invocations re-placed after their executor was lost
        self.stats = PlacementStats()
        self._arrived: defaultdict[str, Arrived] = defaultdict(Arrived)  # see take_arrived
        # Invocations with an id while the pool runs them: the executor holding each (None
        # while queued), and the ids whose cancel was asked for.
        self._active: dict[str, ExecutorHandle | None] = {}
        self._cancels: set[str] = set()
        headers = {
            "authorization": f"Bearer {provider.token}",
            "content-type": "application/msgpack",
        }
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(retry.invoke_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._probe = httpx.AsyncClient(headers=headers, timeout=PROBE_TIMEOUT_S)
        self._monitor: asyncio.Task | None = None
        self._restarts: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self._followers: dict[str, asyncio.Task] = {}  # change-feed long polls, per executor
        # Autoscaling: executors being started (by name) and drained; the scaler's task.
        self.drain_timeout_s = drain_timeout_s
        # executors being started: their task, and the model pool each is for
        self._spawning: dict[str, tuple[asyncio.Task, str | None]] = {}
        self._draining: dict[str, asyncio.Task] = {}
        self.scaler = PoolScaler(self, dry_run=autoscale_dry_run) if autoscale else None

    @property
    def placement(self) -> Placement:
        return self.queue.placement

    def policy(self, function: str) -> Placement:
        """The placement policy of ``function``: its own, or the server's."""
        return self.placements.get(function, self.queue.placement)

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        if self.scaler is not None:  # the scaler starts what the functions' tables ask for
            self._monitor = asyncio.create_task(self._watch())
            self.scaler.start()
            return
        devices = self.provider.devices()
        threads = self.provider.threads_per_executor(len(devices))
        names = [f"exec-{i}" for i in range(len(devices))]
        procs = await asyncio.gather(
            *(self.provider.start(n, d, threads) for n, d in zip(names, devices, strict=True))
        )
        self.executors = [ExecutorHandle(p, overheads=self.cluster.overheads) for p in procs]
        await asyncio.gather(*(self._become_ready(e) for e in self.executors))
        self._monitor = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self.scaler is not None:
            await self.scaler.close()
        tasks = [
            t
            for t in (
                self._monitor,
                *self._restarts.values(),
                *self._background,
                *self._followers.values(),
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
        await self._http.aclose()
        await self._probe.aclose()

    @property
    def ready(self) -> bool:
        """Able to serve: a healthy executor, or an autoscaled pool (it starts one)."""
        return self.scaler is not None or any(e.healthy for e in self.executors)

    # ---- autoscaling --------------------------------------------------------------------
    def target_executors(self) -> int:
        """Executors that count as capacity: ready, starting or restarting, not draining
        (one being started counts once, before and after its process is up)."""
        serving = [e for e in self.executors if e.phase is not wire.ExecutorPhase.DRAINING]
        return len(serving) + len(self._unstarted())

    def _unstarted(self) -> dict[str, str | None]:
        """Executors being started whose process is not up yet (no handle), and their
        model. Once up, the handle (phase ``starting``) stands for it."""
        present = {e.name for e in self.executors}
        return {n: m for n, (_, m) in self._spawning.items() if n not in present}

    def model_loads(self) -> dict[str, ModelLoad]:
        """Each model pool's predicted work, queued invocations and target count (the
        autoscaler's inputs, see :func:`~retouch.platform.scaler.split_load`)."""
        members = [
            Member(e.model, e.view.work_s(), e.phase is not wire.ExecutorPhase.DRAINING)
            for e in self.executors
        ]
        members += [Member(m, 0.0, True) for m in self._unstarted().values()]
        model_of = {name: stored.spec.model for name, stored in self.functions.items()}
        return split_load(members, self.queue.queued(), model_of)

    def spawn(self, devices: list[str], model: str | None = None) -> bool:
        """Start one more executor on a free one of the provider's ``devices`` (in its own
        task), for ``model``'s pool (None: every function); False when every device is
        taken (by an executor of any model, draining ones included: none is taken over)."""
        taken = {e.name for e in self.executors} | set(self._spawning)
        free = [i for i in range(len(devices)) if f"exec-{i}" not in taken]
        if not free:
            return False
        name, device = f"exec-{free[0]}", devices[free[0]]
        task = asyncio.create_task(self._spawn(name, device, len(devices), model))
        self._spawning[name] = (task, model)
        task.add_done_callback(lambda _: self._spawning.pop(name, None))
        return True

    async def _spawn(self, name: str, device: str, capacity: int, model: str | None) -> None:
        threads = self.provider.threads_per_executor(capacity)
        started = time.monotonic()
        try:
            proc = await self.provider.start(name, device, threads)
        except RetouchError as exc:
            log.error("autoscaler could not start %s: %s", name, exc)
            return
        handle = ExecutorHandle(proc, model=model, overheads=self.cluster.overheads)
        self.executors.append(handle)
        try:
            await self._become_ready(handle)
        except (RetouchError, httpx.HTTPError) as exc:
            log.error("started %s is not ready: %s", name, exc)
            handle.phase = wire.ExecutorPhase.STARTING  # the monitor keeps probing it
        self.stats.startup_s.append(time.monotonic() - started)
        log.info(
            "%s (%s) ready in %.1f s", name, model or "every model", time.monotonic() - started
        )

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
        """Drain ``handle`` (no new placements; what runs there finishes), then stop it."""
        if handle.name in self._draining:
            return
        handle.phase = wire.ExecutorPhase.DRAINING
        task = asyncio.create_task(self._drain(handle))
        self._draining[handle.name] = task
        task.add_done_callback(lambda _: self._draining.pop(handle.name, None))

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
        if handle in self.executors:
            self.executors.remove(handle)
        follower = self._followers.pop(handle.name, None)
        if follower is not None:
            follower.cancel()
        await self.provider.stop(handle.process)
        log.info("%s drained and stopped", handle.name)

    def candidates(self, function: str) -> list[ExecutorHandle]:
        """Executors that can take an invocation of ``function`` now: ready, holding it,
        and of its model's pool (an autoscaled executor serves one model)."""
        stored = self.functions.get(function)
        model = stored.spec.model if stored is not None else None
        return [
            e for e in self.executors if e.healthy and function in e.functions and e.serves(model)
        ]

    # ---- functions ----------------------------------------------------------------------
    async def load(self, stored: StoredFunction, generation: int) -> None:
        """Push a function to every ready executor; raise if none could load it.

        ``generation`` numbers the control operations on the name (the gateway's
        sequence): executors drop a deploy overtaken by a later deploy or delete."""
        self.functions[stored.spec.name] = stored
        self.generations[stored.spec.name] = generation
        if stored.spec.placement:
            self.placements[stored.spec.name] = make_placement(stored.spec.placement)
        else:
            self.placements.pop(stored.spec.name, None)
        model = stored.spec.model
        # A replaced function may have changed model: executors of the old model drop it.
        for e in self.executors:
            if stored.spec.name in e.functions and not e.serves(model):
                e.functions.discard(stored.spec.name)
                self._drop_from(e, stored.spec.name, generation)
        targets = [e for e in self.executors if e.healthy and e.serves(model)]
        results = await asyncio.gather(
            *(self._push(e, stored) for e in targets), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and len(errors) == len(targets):
            raise errors[0] if isinstance(errors[0], RetouchError) else Unavailable(str(errors[0]))

    async def unload(self, name: str, generation: int) -> None:
        """Remove a function everywhere; invocations still waiting for it fail."""
        self.functions.pop(name, None)
        self.placements.pop(name, None)
        self.generations[name] = generation
        for e in self.executors:
            e.functions.discard(name)
        self.queue.fail(
            name, NotFound(f"function {name!r} was deleted", field="name", code="function_deleted")
        )
        path = f"/functions/{name}?generation={generation}"
        await asyncio.gather(
            *(self._call(e, "DELETE", path) for e in self.executors if e.healthy),
            return_exceptions=True,
        )

    def _drop_from(self, handle: ExecutorHandle, name: str, generation: int) -> None:
        """Remove ``name`` from one executor, in the background (best effort: an executor
        that misses it keeps a copy placement never sends work to)."""

        async def drop() -> None:
            with contextlib.suppress(RetouchError, httpx.HTTPError):
                await self._call(handle, "DELETE", f"/functions/{name}?generation={generation}")

        task = asyncio.create_task(drop())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _push(self, handle: ExecutorHandle, stored: StoredFunction) -> None:
        generation = self.generations.get(stored.spec.name, 0)
        body = {
            "spec": stored.spec.to_dict(),
            "templates": stored.templates,
            "generation": generation,
        }
        await self._call(handle, "PUT", f"/functions/{stored.spec.name}", body)
        await self.refresh(handle)  # its cost model and templates, now deployed
        if self.functions.get(stored.spec.name) is stored:  # not deleted or replaced meanwhile
            handle.functions.add(stored.spec.name)
            self.queue.dispatch()

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
                    state = wire.ExecutorState.from_wire(
                        await self._call(handle, "GET", "/state", client=self._probe)
                    )
                except (RetouchError, httpx.HTTPError) as exc:
                    log.debug("state of %s not read: %r", handle.name, exc)
                    return
                handle.state = state
                handle.view.observe_state(state, self.cluster.costers)
                self.queue.dispatch()
                if not handle.refresh_again:
                    return
        finally:
            handle.refreshing = False

    def _follow(self, handle: ExecutorHandle) -> None:
        """(Re)start following ``handle``'s change feed (one follower per executor name)."""
        old = self._followers.pop(handle.name, None)
        if old is not None:
            old.cancel()
        self._followers[handle.name] = asyncio.create_task(self._follow_changes(handle))

    async def _follow_changes(self, handle: ExecutorHandle) -> None:
        """Long-poll the executor's change feed and re-read its state on every change: a
        bake that finished or a template that entered host memory changes placement, and
        an executor that gets no invocations would otherwise never tell (its view would
        say "baking" forever and affinity would never send it work). Ends when the
        executor is replaced; a failed poll is retried (health is the monitor's job)."""
        after = 0
        while handle in self.executors:  # handles compare by identity (eq=False)
            try:
                body = await self._call(
                    handle,
                    "GET",
                    f"/changes?after={after}&timeout={CHANGES_WAIT_S}",
                    timeout=CHANGES_WAIT_S + PROBE_TIMEOUT_S,
                )
                changes = wire.ExecutorChanges.from_wire(body)
            except (RetouchError, httpx.HTTPError, KeyError, ValueError) as exc:
                log.debug("change feed of %s: %r", handle.name, exc)
                await asyncio.sleep(MONITOR_INTERVAL_S)
                continue
            if changes.changes or changes.reset:
                log.debug("%s changed: %s", handle.name, [c.kind.value for c in changes.changes])
                await self.refresh(handle)
            after = changes.version

    def _refresh_soon(self, handle: ExecutorHandle) -> None:
        task = asyncio.create_task(self.refresh(handle))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- invocations --------------------------------------------------------------------
    def admit(self, function: str) -> None:
        self.queue.admit(function)

    def admit_slo(self, request: PlacementRequest, *, early: bool = False) -> None:
        """429 ``slo_unattainable`` when ``request`` is predicted to miss its SLO. Every
        decoded invocation passes here (refused or not): its demand is counted first."""
        if not early:
            self._arrive(request)
        started = time.perf_counter()
        try:
            self.queue.admit_slo(request, early=early)
        finally:
            self.stats.admission_s.append(time.perf_counter() - started)

    def _arrive(self, request: PlacementRequest) -> None:
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

    def queue_positions(self) -> dict[str, int]:
        """Waiting invocations (by id) and how many wait ahead of each."""
        return self.queue.positions()

    async def cancel(self, invocation_id: str) -> bool:
        """Cancel a running invocation: out of the queue when it waits there, else out of
        its executor's batch at the next step. False when the pool is not running it."""
        if invocation_id not in self._active:
            return False
        self._cancels.add(invocation_id)
        if self.queue.cancel(invocation_id):
            return True
        handle = self._active.get(invocation_id)
        if handle is not None:
            with contextlib.suppress(RetouchError, httpx.HTTPError):
                await self._call(
                    handle, "POST", f"/invocations/{invocation_id}/cancel", client=self._probe
                )
        return True

    async def invoke(
        self,
        inv: wire.ExecutorInvoke,
        request: PlacementRequest,
        on_start: OnStart | None = None,
        on_progress: OnProgress | None = None,
    ) -> wire.InvokeResult:
        """Run one invocation: wait for a slot, send it, and re-place it when its executor
        is lost (up to ``max_attempts`` executors, within ``invoke_timeout_s``).
        ``on_start`` hears each time it leaves the queue, ``on_progress`` each step."""
        if not inv.id:
            return await self._invoke(inv, request, on_start, on_progress)
        self._active[inv.id] = None
        try:
            return await self._invoke(inv, request, on_start, on_progress)
        finally:
            self._active.pop(inv.id, None)
            self._cancels.discard(inv.id)

    def _check_canceled(self, inv: wire.ExecutorInvoke) -> None:
        if inv.id and inv.id in self._cancels:
            raise Canceled(f"invocation {inv.id} was canceled")

    async def _invoke(
        self,
        inv: wire.ExecutorInvoke,
        request: PlacementRequest,
        on_start: OnStart | None,
        on_progress: OnProgress | None,
    ) -> wire.InvokeResult:
        deadline = time.monotonic() + self.retry.invoke_timeout_s
        service_s = self.queue.service_s(request)
        lost_on: list[str] = []
        queued_s = 0.0
        while True:
            self._check_canceled(inv)
            enqueued = time.monotonic()
            token = self.cluster.token()
            handle = await self.queue.acquire(
                request,
                deadline,
                front=bool(lost_on),
                tag=inv.id or None,
                token=token,
                service_s=service_s,
            )
            bound = time.monotonic()
            placed = handle.view.placed.get(token)
            queued_s += bound - enqueued
            try:
                self._check_canceled(inv)  # canceled between binding and this line
                if inv.id:
                    self._active[inv.id] = handle
                if on_start is not None:
                    on_start(handle.name, len(lost_on) + 1)
                result = await self._send(handle, inv, deadline, on_progress, token)
            except ExecutorLost as exc:
                self.queue.release(handle, token=token)
                if inv.id:
                    self._active[inv.id] = None  # back in the queue
                lost_on.append(handle.name)
                self.lost += 1
                if len(lost_on) >= self.retry.max_attempts:
                    raise Unavailable(
                        f"the invocation was lost with its executor {len(lost_on)} times "
                        f"({', '.join(lost_on)}); last: {exc}",
                        code="executor_lost",
                    ) from None
                log.warning("%s lost an invocation (%s); re-placing it", handle.name, exc)
                continue
            except BaseException:
                self.queue.release(handle, token=token)
                raise
            result.timings.placed_ms = (time.monotonic() - bound) * 1e3
            self._learn(handle, token, result, placed)
            self.queue.release(handle, time.monotonic() - bound, token=token)
            result.attempts = len(lost_on) + 1
            result.timings.gateway_queue_ms = queued_s * 1e3
            return result

    def _learn(
        self,
        handle: ExecutorHandle,
        token: int,
        result: wire.InvokeResult,
        placed: Placed | None,
    ) -> None:
        """Completion: the view learns (calibration, residency), the prediction is scored,
        and the executor's state is re-read when the store changed (a bake, a new host
        resident)."""
        error = handle.view.finish(token, time.monotonic(), result)
        if placed is not None:
            result.timings.predicted_ms = placed.predicted.finish_s * 1e3
            if placed.predicted.finish_s > 0 and result.timings.placed_ms > 0:
                self.queue.observe_outcome(result.timings.placed_ms / result.timings.predicted_ms)
        if error is not None:
            self.stats.prediction_error.append(error)
        if result.path is wire.InvokePath.TEMPLATE:
            return  # no model run: neither the store nor the step fit changed
        stale = error is not None and error > RECALIBRATE_ERROR  # the executor's fit moved
        if (
            stale
            or result.path is wire.InvokePath.STOCK
            or result.cache.tier not in (wire.CacheTier.HOST, wire.CacheTier.DEVICE)
        ):
            self._refresh_soon(handle)

    async def _send(
        self,
        handle: ExecutorHandle,
        inv: wire.ExecutorInvoke,
        deadline: float,
        on_progress: OnProgress | None = None,
        token: int = -1,
    ) -> wire.InvokeResult:
        timeout = max(0.1, deadline - time.monotonic())
        try:
            async with asyncio.timeout(timeout):
                return await self._stream(handle, inv, on_progress, token)
        except (httpx.TimeoutException, TimeoutError):
            raise GatewayTimeout(
                f"{handle.name} did not answer before the invocation's deadline", code="timeout"
            ) from None
        except httpx.TransportError as exc:
            self._suspect(handle, f"transport error: {exc!r}")
            raise ExecutorLost(f"{type(exc).__name__} talking to {handle.name}") from exc
        except RetouchError as exc:
            if exc.code in LOST_CODES:
                self._suspect(handle, exc.message)
                raise ExecutorLost(exc.message) from exc
            raise

    async def _stream(
        self,
        handle: ExecutorHandle,
        inv: wire.ExecutorInvoke,
        on_progress: OnProgress | None,
        token: int = -1,
    ) -> wire.InvokeResult:
        """``POST /invoke/stream``: step frames, then the result or the error."""
        reader = wire.FrameReader()
        url = handle.process.url + "/invoke/stream"
        async with self._http.stream("POST", url, content=wire.pack(inv.to_wire())) as resp:
            if resp.status_code >= 400:
                body = await resp.aread()
                raise RetouchError.from_wire(resp.status_code, wire.unpack(body) if body else {})
            async for chunk in resp.aiter_bytes():
                for frame in reader.feed(chunk):
                    if isinstance(frame, wire.StepProgress):
                        handle.view.progress(token, frame.step, frame.total)
                        if frame.step >= frame.total - 1 and len(self.queue):
                            # Batch room opens within a step: a late-bound invocation
                            # is bound now (the prefetch horizon), so its encode
                            # overlaps the last step instead of following the decode.
                            self.queue.dispatch()
                        if on_progress is not None:
                            on_progress(frame)
                    elif isinstance(frame, wire.InvokeResult):
                        return frame
                    else:
                        raise frame
        raise ExecutorLost(f"{handle.name} ended the invocation stream without an answer")

    def placement_summary(self) -> dict[str, float]:
        """Decision and admission times and the prediction error (recent invocations)."""

        def q(values: deque[float], fraction: float, scale: float = 1.0) -> float:
            if not values:
                return 0.0
            ordered = sorted(values)
            return ordered[int(fraction * (len(ordered) - 1))] * scale

        decisions, admissions = self.queue.decision_s, self.stats.admission_s
        errors = self.stats.prediction_error
        return {
            "decision_ms_p50": q(decisions, 0.5, 1e3),
            "decision_ms_p99": q(decisions, 0.99, 1e3),
            "admission_ms_p50": q(admissions, 0.5, 1e3),
            "admission_ms_p99": q(admissions, 0.99, 1e3),
            "refusal_ms_p50": q(self.stats.refusal_s, 0.5, 1e3),
            "refusal_ms_p99": q(self.stats.refusal_s, 0.99, 1e3),
            "prediction_error_p50": q(errors, 0.5),
            "prediction_error_p90": q(errors, 0.9),
            "admission_margin": round(self.queue.margin, 3),
        }

    # ---- state --------------------------------------------------------------------------
    def describe(self) -> list[dict[str, Any]]:
        return [e.describe() for e in self.executors]

    def pool_summary(self) -> dict[str, float]:
        """Executors by phase, the autoscaler's last decision and its scale events (summed
        over the model pools), and the start-up times it saw (``/metrics``)."""
        startups = sorted(self.stats.startup_s)
        scaler = self.scaler
        desired = scaler.desired() if scaler is not None else None
        return {
            **self._counts(),
            "desired": float(len(self.executors) if desired is None else desired),
            "scale_ups": float(scaler.ups if scaler else 0),
            "scale_downs": float(scaler.downs if scaler else 0),
            "startup_s_p50": startups[len(startups) // 2] if startups else 0.0,
            "startup_s_max": startups[-1] if startups else 0.0,
        }

    def model_pool_summaries(self) -> dict[str, dict[str, float]]:
        """Per model pool (autoscaled only): executors by phase, the last desired count,
        scale events and the ticks whose scale-up found no free device (``/metrics``)."""
        if self.scaler is None:
            return {}
        out = {}
        for model, pool in sorted(self.scaler.models.items()):
            out[model] = {
                **self._counts(model),
                "desired": float(pool.last.desired if pool.last else 0),
                "scale_ups": float(pool.ups),
                "scale_downs": float(pool.downs),
                "no_device": float(pool.no_device),
            }
        return out

    def describe_autoscaler(self) -> dict[str, Any] | None:
        """The autoscaler's document (``/v1/executors``), each model pool with its
        executors by phase and by name."""
        if self.scaler is None:
            return None
        doc = self.scaler.describe()
        for model, pool in doc["models"].items():
            pool.update({k: int(v) for k, v in self._counts(model).items()})
            pool["executors"] = sorted(
                [e.name for e in self.executors if e.model == model]
                + [n for n, m in self._unstarted().items() if m == model]
            )
        return doc

    def _counts(self, model: str | None = None) -> dict[str, float]:
        """Executors ready, starting and draining, of ``model``'s pool (None: all). One
        being started counts as starting once, before and after its process is up."""
        phases = [e.phase for e in self.executors if model is None or e.model == model]
        spawning = [n for n, m in self._unstarted().items() if model is None or m == model]
        return {
            "ready": float(phases.count(wire.ExecutorPhase.READY)),
            "starting": float(phases.count(wire.ExecutorPhase.STARTING) + len(spawning)),
            "draining": float(phases.count(wire.ExecutorPhase.DRAINING)),
        }

    async def states(self) -> list[wire.ExecutorState]:
        """Each ready executor's own state (models, templates, engine, cache counters)."""
        ready = [e for e in self.executors if e.healthy]
        results = await asyncio.gather(
            *(self._call(e, "GET", "/state", client=self._probe) for e in ready),
            return_exceptions=True,
        )
        out = []
        for handle, result in zip(ready, results, strict=True):
            if isinstance(result, dict):
                handle.state = wire.ExecutorState.from_wire(result)
                out.append(handle.state)
        return out

    async def _call(
        self,
        handle: ExecutorHandle,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> Any:
        content = wire.pack(body) if body is not None else None
        extra = {"timeout": timeout} if timeout is not None else {}
        resp = await (client or self._http).request(
            method, handle.process.url + path, content=content, **extra
        )
        payload = wire.unpack(resp.content) if resp.content else {}
        if resp.status_code >= 400:
            raise RetouchError.from_wire(resp.status_code, payload)
        return payload

    # ---- health and restarts ------------------------------------------------------------
    async def _become_ready(self, handle: ExecutorHandle) -> None:
        """Read the executor's capacity, push every function, then open it to invocations."""
        state = wire.ExecutorState.from_wire(
            await self._call(handle, "GET", "/state", client=self._probe)
        )
        handle.state = state
        handle.slots = max(1, state.engine.max_batch * SLOTS_PER_BATCH)
        handle.view.slots = handle.slots
        handle.view.observe_state(state, self.cluster.costers)
        for stored in list(self.functions.values()):
            if not handle.serves(stored.spec.model):
                continue  # another model pool's function: this executor never loads it
            try:
                await self._push(handle, stored)
            except (RetouchError, httpx.HTTPError) as exc:
                log.error("pushing %s to %s failed: %s", stored.spec.name, handle.name, exc)
        handle.phase = wire.ExecutorPhase.READY
        self._follow(handle)
        self.queue.dispatch()

    def _suspect(self, handle: ExecutorHandle, why: str) -> None:
        """Stop sending work to ``handle``; the monitor probes it and restarts it if needed."""
        if handle.phase is wire.ExecutorPhase.READY:
            log.warning("executor %s is suspect: %s", handle.name, why)
            handle.phase = wire.ExecutorPhase.STARTING
            handle.probe_failures = max(handle.probe_failures, 1)

    async def _watch(self) -> None:
        """The health monitor; it must outlive any one failed check."""
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            results = await asyncio.gather(
                *(self._check(e) for e in self.executors if e.name not in self._restarts),
                return_exceptions=True,
            )
            for error in (r for r in results if isinstance(r, Exception)):
                log.error("health check failed: %r", error)

    async def _check(self, handle: ExecutorHandle) -> None:
        if not handle.process.alive:
            code = handle.process.exit_code
            self._schedule_restart(handle, f"process exited with code {code}")
            return
        try:
            await self._call(handle, "GET", "/healthz", client=self._probe)
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
        if handle.phase is wire.ExecutorPhase.STARTING:
            handle.phase = wire.ExecutorPhase.READY
            self.queue.dispatch()

    def _probe_failed(self, handle: ExecutorHandle, why: str) -> None:
        handle.probe_failures += 1
        self._suspect(handle, why)
        if handle.probe_failures >= PROBE_FAILURES:
            self._schedule_restart(handle, f"{handle.probe_failures} failed probes: {why}")

    def _schedule_restart(self, handle: ExecutorHandle, why: str) -> None:
        if handle.name in self._restarts or handle.name in self._draining:
            return  # a draining executor is going away anyway: its invocations are re-placed
        log.warning("restarting executor %s: %s", handle.name, why)
        handle.phase = wire.ExecutorPhase.DEAD
        task = asyncio.create_task(self._restart(handle))
        self._restarts[handle.name] = task
        task.add_done_callback(lambda _: self._restarts.pop(handle.name, None))

    async def _restart(self, old: ExecutorHandle) -> None:
        await self.provider.stop(old.process)
        threads = self.provider.threads_per_executor(len(self.executors))
        while True:
            try:
                proc = await self.provider.start(old.name, old.process.device, threads)
                break
            except RetouchError as exc:
                log.error("could not restart %s: %s; retrying", old.name, exc)
                await asyncio.sleep(MONITOR_INTERVAL_S * 5)
        handle = ExecutorHandle(
            proc, restarts=old.restarts + 1, model=old.model, overheads=self.cluster.overheads
        )
        self.executors[self.executors.index(old)] = handle
        try:
            await self._become_ready(handle)
        except (RetouchError, httpx.HTTPError) as exc:
            log.error("restarted %s is not ready: %s", handle.name, exc)
            handle.phase = wire.ExecutorPhase.STARTING  # the monitor keeps probing it
