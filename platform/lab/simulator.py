"""A discrete-event simulation of a pool of executors on a virtual clock.

The pool is driven by the gateway's own control-plane objects: one
:class:`~retouch.platform.control.cluster.ExecutorView` per executor (placed into, stepped
and finished exactly as the pool does it), the placement policies of
:mod:`retouch.platform.control.placement`, and their predictions. The only things simulated are
what a real pool would measure: the executors' step-level engines and the arrivals.

A simulated engine follows the real one:
* an invocation bound to it pre-processes for ``pre_s`` (in workers, beside the steps);
* it then joins the running batch at the next step boundary while there is room
  (``max_batch``);
* each step of the batch costs what the profile's bubble-free plan says, times a lognormal
  noise;
* finished invocations post-process for ``post_s``.

Encodes and decodes wait for one of the executor's ``pre_workers``/``post_workers`` when
those are set. With ``cpu_cores`` the executors do not compute alone: every step, encode,
decode and the gateway's own work (``outside_s``, ``background_s``) shares those cores
(:class:`~retouch.platform.lab.sharedcpu.SharedCPU`), as on a machine without accelerators.

Which executors can take an invocation depends on the policy. A late-binding one
(``maskaware``) has an invocation wait in the gateway queue until an executor has batch
room and, with an SLO, until joining keeps every deadline there
(``ExecutorView.keeps_deadlines``, as the gateway queue does); the queue's head is dropped
when it can no longer make its SLO. The baselines bind to any free slot
(2 × ``max_batch``).

Templates: by default there is one, always in host memory. With ``host_templates`` > 0 each
executor has a host tier of that many templates (LRU, as the real store evicts), empty
when it starts, above the pool's disk tier (one node's store, shared by its executors). An
invocation whose template is on disk only starts its load when it is bound (the real
prefetch), overlapping its encode. With ``cold_templates`` no template is baked at first:
an invocation of an unbaked template runs the full path (every token computed) and queues
the template's bake on its executor, which runs it when its batch is empty or after the
bake waited ``BAKE_STARVATION_S`` (the real engine's rule); then the template is on disk
and in that executor's host tier. Templates are drawn with Zipf popularity. The gateway's
view learns residency as the real one does: from placements (the prefetch), results
(``ExecutorView.finish``) and, for bakes, from the executor's report.

Adapters: with ``adapters`` > 0 the invocations belong to functions on the one base model,
each with an adapter set of its own (Zipf popularity). Each executor's device holds
``resident_adapters`` sets (LRU; a set in use is not evicted); an invocation whose set it
lacks has it loaded (``adapter_load_s``) from when it is bound, beside its encode, as the
executor's asynchronous fetch does. With ``adapter_batching`` ``turns`` the engine runs one
set per batch group: the groups of a batch take turns step by step, and each turn to
another set than the one applied costs ``adapter_swap_s``; with ``mixed`` the whole batch
steps at once, a step with adapters ``mixed_step_overhead`` longer, and no swaps. A template's bake is per set (its name carries the set). The view
learns the resident sets from placements and from the executor's report of its loads and
evictions.

SLO admission is the gateway's own (``InvocationQueue.admit_slo`` on the virtual clock,
told the service queued ahead by the simulation, which owns its queue). With ``autoscale``
the pool's :class:`~retouch.platform.control.autoscaler.Autoscaler` ticks every
``tick_s`` on the work and the demand (``ExecutorView.executor_s`` of the arrivals, as the
real pool counts it): new executors become ready ``startup_s`` after the decision, and
victims drain (no new work) and stop once idle. Arrivals are drawn (Poisson, Gamma, steps,
bursty days), replayed from a CSV trace compressed to a load, or replayed 1:1
(``run_simulation(arrivals=...)``, ``retouch bench validate``). What is not built is listed
in docs/simulator.md.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import json
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from retouch.functions.errors import Overloaded
from retouch.functions.wire.executor import AdapterStats, EngineStats, ExecutorPhase, ExecutorState
from retouch.functions.wire.invoke import CacheRead, CacheTier, InvokePath, InvokeResult, Timings
from retouch.platform.control.autoscaler import Autoscaler
from retouch.platform.control.cluster import (
    ClusterView,
    ExecutorView,
    PlacementRequest,
    Residency,
)
from retouch.platform.control.placement import MaskAware, Placement, make_placement
from retouch.platform.control.queue import InvocationQueue, QueueLimits, bindable, has_room
from retouch.platform.lab.bench.specs import SimSpec
from retouch.platform.lab.sharedcpu import SharedCPU, nice_weight
from retouch.platform.lab.workload import (
    DEFAULT_TEMPLATE,
    Draws,
    MaskMix,
    read_trace,
    step_change,
    trace_path,
)
from retouch.runtime.costmodel import CostModel
from retouch.runtime.executor.options import room
from retouch.runtime.prediction import (
    TOKEN_PX,
    MaskFootprint,
    StepCoster,
    fitted_step_s,
    plan_table,
)

MODEL = "sim-model"
FUNCTION = "sim"
TEMPLATE = DEFAULT_TEMPLATE
STEP_WINDOW_S = 10.0  # the windows of P95 after a step change
TIMELINE_S = 10.0  # the timeline's windows (arrivals, queue, executors, P95 over time)
# the queue's first invocations a dispatch tries (the gateway's queue tries all): with
# late binding an invocation's room depends on its template's load there, so one that
# waits must not hold back one behind it that an executor can take now
DISPATCH_SCAN = 16
BAKE_STARVATION_S = 30.0  # a queued bake runs between steps after this (EngineConfig's)


@dataclass(eq=False)
class Job:
    index: int
    arrival: float
    request: PlacementRequest
    token: int = -1
    steps_left: int = 0
    done_at: float = math.nan
    predicted_s: float = 0.0
    placed_at: float = 0.0
    service_s: float = 0.0  # admission's predicted service, while it waits in the queue
    rejected: bool = False
    dropped: bool = False  # admitted, then dropped from the queue: it could no longer make its SLO
    pre_s: float = 0.0  # its own encode and decode (spec.pre_s/post_s, or drawn from samples)
    post_s: float = 0.0
    pre_elapsed: float = 0.0  # its encode and decode as the executor reports them: with the
    post_elapsed: float = 0.0  # wait for a worker and for the shared cores
    found: Residency = Residency.HOST  # where its template was when it was bound
    full: bool = False  # its template was not baked: every token computed
    load_s: float = 0.0  # its template's disk -> host load (overlapping its encode)
    adapter_s: float = 0.0  # what is left of its adapter set's load when it is bound
    masked0: int = 0  # masked tokens of the finest grid as its executor computes them


@dataclass
class WorkerLine:
    """An executor's pre (or post) worker processes: as many encodes (decodes) at once as
    there are workers (0: no limit); the others wait in line, each with its work and what
    follows it."""

    workers: int
    busy: int = 0
    waiting: deque[tuple[float, Callable[[], None]]] = field(default_factory=deque)


@dataclass(eq=False)
class SimExecutor:
    """What the policy sees (name, inflight, slots, view) and the simulated engine."""

    name: str
    view: ExecutorView
    slots: int
    inflight: int = 0
    running: list[Job] = field(default_factory=list)
    ready: deque[Job] = field(default_factory=deque)  # encoded, waiting to join
    stepping: bool = False
    busy_s: float = 0.0
    started_at: float = 0.0
    stopped_at: float | None = None
    draining: bool = False  # chosen for scale-down: no new work, stops once idle
    host: OrderedDict[str, None] = field(default_factory=OrderedDict)  # host tier, LRU first
    bakes: deque[tuple[str, float]] = field(default_factory=deque)  # (template, queued at)
    loads: dict[str, float] = field(default_factory=dict)  # template -> when its load ends
    encoders: WorkerLine = field(default_factory=lambda: WorkerLine(0))  # its pre workers
    decoders: WorkerLine = field(default_factory=lambda: WorkerLine(0))  # its post workers
    adapters: OrderedDict[str, None] = field(default_factory=OrderedDict)  # on device, LRU first
    adapter_loads: dict[str, float] = field(default_factory=dict)  # set -> when its load ends
    adapter_users: dict[str, int] = field(default_factory=dict)  # set -> invocations bound
    applied: str = ""  # the adapter set whose weights the model runs with ("": none)


class Simulation:
    """One placement policy on one pool, run to the last arrival's completion."""

    def __init__(
        self,
        spec: SimSpec,
        cost_model: CostModel,
        policy: Placement,
        jobs: list[Job],
        admission: bool = True,
    ) -> None:
        self.spec = spec
        self.policy = policy
        self.jobs = jobs
        self.cluster = ClusterView()
        model = cost_model
        if "step_table" not in model.extra:  # as an executor ships its profile
            model = with_plan_table(cost_model, spec.max_batch)
        engine = EngineStats(
            max_batch=spec.max_batch,
            step_intercept_ms=spec.step_intercept_s * 1e3,
            step_slope=spec.step_slope,
            pre_workers=spec.pre_workers,  # as an executor reports them: its predictions
            post_workers=spec.post_workers,  # count the wait for a worker
        )
        adapters = AdapterStats(  # as an executor reports its loads and swaps
            reads=1,
            loads=1,
            swaps=1,
            read_ms=spec.adapter_load_s * 1e3,
            swap_ms=spec.adapter_swap_s * 1e3,
        )
        self._state = ExecutorState(
            "sim",
            0,
            model.device,
            mixed_adapters=spec.adapter_batching == "mixed",
            engine=engine,
            cost_models={MODEL: model.to_dict()},
            adapter_stats=adapters,
        )
        self.executors: list[SimExecutor] = []
        self._names = itertools.count()
        self.now = 0.0
        self.templates = list(dict.fromkeys(j.request.template for j in jobs))
        # without either, every template is host-resident on every executor, always
        self.tiers = spec.host_templates > 0 or spec.cold_templates
        self.disk: set[str] = set() if spec.cold_templates else set(self.templates)
        self.baking: set[str] = set()  # queued or running on some executor
        self.bakes_run = 0
        self.adapter_loads = 0  # adapter sets loaded from disk, all executors
        self.adapter_swaps = 0  # turns of an engine to another adapter set
        self.mixed_steps = 0  # steps whose rows ran their own adapter sets' updates
        for _ in range(spec.executors):
            self._add_executor()
        self.coster = self.executors[0].view.costers[MODEL]
        # a bake: a full-path run of every step at batch 1, as the engine records it
        full = fitted_step_s(
            self.coster.step_s0(1, self.coster.grids[0]), spec.step_intercept_s, spec.step_slope
        )
        self.bake_s = spec.steps * full
        self.rng = np.random.default_rng(spec.seed + 7)
        self._overhead_rng = np.random.default_rng(spec.seed + 11)  # pre/post samples
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.queue: deque[Job] = deque()
        self.errors: list[float] = []
        self.decision_s: list[float] = []
        # Admission is the gateway's own (InvocationQueue.admit_slo on this virtual clock);
        # the simulation owns the queue itself and tells it the service queued ahead.
        self.admission = InvocationQueue(
            QueueLimits(admission=admission),
            policy,
            lambda function: self.active(),
            clock=lambda: self.now,
        )
        self.queued_s = 0.0
        self.scaler = None if spec.autoscale is None else Autoscaler(spec.autoscale)
        self.starting = 0
        self.scale_events: list[tuple[float, int]] = []
        self._pending = len(jobs)  # arrivals not yet answered (the ticks stop after them)
        self.samples: list[tuple[float, int, int, int, int]] = []  # the timeline's counts
        self._arrived_s = 0.0  # executor-seconds of the arrivals since the last tick
        self._arrivals = 0  # ... and their number
        self._last_tick = 0.0
        self.cpu = (
            SharedCPU(spec.cpu_cores, lambda: self.now, self.at) if spec.cpu_cores > 0 else None
        )

    def _add_executor(self) -> SimExecutor:
        view = self.cluster.add(
            f"exec-{next(self._names)}", self.spec.max_batch, room(self.spec.max_batch)
        )
        view.observe_state(self._state, self.cluster.costers)
        view.phase = ExecutorPhase.READY
        ex = SimExecutor(
            view.name,
            view,
            view.slots,
            started_at=self.now,
            encoders=WorkerLine(self.spec.pre_workers),
            decoders=WorkerLine(self.spec.post_workers),
        )
        if not self.tiers:
            for template in self.templates:
                view.residency[(FUNCTION, template)] = Residency.HOST
        else:  # a new executor's host tier is empty; it reports what the disk holds
            view.host_capacity = self.spec.host_templates or None
            for template in self.templates:
                if template in self.disk:
                    view.residency[(FUNCTION, template)] = Residency.DISK
        self.executors.append(ex)
        return ex

    def active(self) -> list[SimExecutor]:
        """Executors that take new work (not draining, not stopped)."""
        return [e for e in self.executors if not e.draining and e.stopped_at is None]

    # ---- the event loop -----------------------------------------------------------------
    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), action))

    def run(self) -> dict[str, Any]:
        for job in self.jobs:
            self.at(job.arrival, lambda job=job: self._received(job))
        if self.scaler is not None:
            self.at(0.0, self._tick)
        self.at(TIMELINE_S, self._sample)
        started = time.perf_counter()
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
        wall_s = time.perf_counter() - started
        return self._summary(wall_s)

    def _compute(self, seconds: float, then: Callable[[], None], executor: bool = True) -> None:
        """``seconds`` of work, on the shared cores if there are any (else alone); an
        executor's at its niceness, the gateway's (``executor=False``) at 0."""
        if self.cpu is not None:
            weight = nice_weight(self.spec.executor_nice) if executor else 1.0
            self.cpu.run(seconds, then, weight)
        else:
            self.at(self.now + seconds, then)

    # ---- the gateway --------------------------------------------------------------------
    def _received(self, job: Job) -> None:
        """The gateway's own work on an arrival (``outside_s``), then its admission."""
        if self.cpu is not None and self.spec.background_s > 0:
            self.cpu.run(self.spec.background_s, lambda: None)
        if self.spec.outside_s > 0:
            self._compute(self.spec.outside_s, lambda: self._arrive(job), executor=False)
        else:
            self._arrive(job)

    def _arrive(self, job: Job) -> None:
        self._arrived_s += self._executor_s(job)  # refused or not: it is demand
        self._arrivals += 1
        try:
            job.service_s = self.admission.admit_slo(job.request, queued_s=self.queued_s)
        except Overloaded:
            job.rejected = True
            self._pending -= 1
            return
        self.queued_s += job.service_s
        self.queue.append(job)
        self._dispatch()
        if self.scaler is not None and not job.service_s and job.token < 0 and not job.rejected:
            # Without an SLO admission predicts nothing, but the autoscaler still needs to
            # know what waits in the queue (predicted only for those that do wait: a
            # prediction over the shortlist is most of an arrival's cost).
            job.service_s = self.admission.service_s(job.request)
            self.queued_s += job.service_s

    def _keeps_deadlines(self, ex: SimExecutor, job: Job) -> bool:
        """With an SLO and admission on, late binding joins only where what runs keeps its
        deadlines (``keeps_deadlines``), as the gateway's queue does."""
        if not self.policy.late_binding:
            return True
        if job.request.slo_s is None or not self.admission.limits.admission:
            return True
        return ex.view.keeps_deadlines(job.request, self.now)

    def _dispatch(self) -> None:
        """Bind the queue's head while an executor has room for it (FIFO: every invocation
        has the same SLO here, so least slack is arrival order); a head that can no longer
        make its SLO is dropped first. A head with no room yet does not hold back the
        invocations behind it that need a longer lead (a template load: ``has_room``); one
        held by the deadlines of what runs does."""
        late, horizon = self.policy.late_binding, self.admission.limits.prefetch_horizon_s
        i = 0
        while i < min(len(self.queue), DISPATCH_SCAN):
            job = self.queue[i]
            if not self._infeasible(job):
                active = self.active()
                options = bindable(
                    active, late, horizon, job.request, lambda e, j=job: self._keeps_deadlines(e, j)
                )
                if not options:
                    if any(has_room(e, late, horizon, job.request) for e in active):
                        return  # held by the deadlines of what runs: FIFO
                    i += 1
                    continue
                started = time.perf_counter()
                chosen = self.policy.choose(options, job.request)
                self.decision_s.append(time.perf_counter() - started)
                self._bind(chosen, job)
            del self.queue[i]
            self.queued_s -= job.service_s

    def _executor_s(self, job: Job) -> float:
        """Executor-seconds ``job`` takes as one of a full batch of its like: the demand it
        adds (the pool's own computation, ``ExecutorView.executor_s``)."""
        return self.executors[0].view.executor_s(job.request)

    def _infeasible(self, job: Job) -> bool:
        """The gateway queue's rule: a queued invocation whose predicted service, started
        now, ends past its deadline is dropped (429 ``slo_unattainable``), not run late."""
        slo = job.request.slo_s
        if slo is None or not self.admission.limits.admission or job.service_s <= 0:
            return False
        if self.now + job.service_s <= job.arrival + slo:
            return False
        job.rejected = job.dropped = True
        self._pending -= 1
        return True

    def _bind(self, ex: SimExecutor, job: Job) -> None:
        job.token = self.cluster.token()
        slo = job.request.slo_s
        deadline = None if slo is None else job.arrival + slo
        placed = ex.view.place(job.token, job.request, self.now, deadline)
        job.predicted_s = placed.predicted.finish_s if placed is not None else 0.0
        job.placed_at = self.now
        job.steps_left = self.spec.steps
        ex.inflight += 1
        job.pre_s = self._drawn(self.spec.pre_samples, self.spec.pre_s)
        job.post_s = self._drawn(self.spec.post_samples, self.spec.post_s)
        self._template_for(ex, job)
        self._adapter_for(ex, job)
        if self._alone(self.spec.pre_workers):
            job.pre_elapsed = job.pre_s
            lead = max(job.pre_s, job.load_s, job.adapter_s)
            self.at(self.now + lead, lambda: self._encoded(ex, job))
            return
        bound, loaded = self.now, self.now + max(job.load_s, job.adapter_s)
        self._in_worker(ex.encoders, job.pre_s, lambda: self._encode_done(ex, job, bound, loaded))

    def _template_for(self, ex: SimExecutor, job: Job) -> None:
        """Where ``job``'s template is on ``ex`` as it arrives there, and what that costs
        it: nothing (host), the load from disk started now (the prefetch), or the full path
        with the template's bake queued here (not baked anywhere yet)."""
        job.masked0 = job.request.footprint.on(self.coster.grids)[0]
        if not self.tiers:
            return
        template = job.request.template
        if template in ex.host:
            ex.host.move_to_end(template)
            pending = ex.loads.get(template, 0.0) - self.now
            if pending > 0:  # its prefetch is under way: it waits for the same load
                job.found, job.load_s = Residency.DISK, pending
        elif template in self.disk:
            job.found, job.load_s = Residency.DISK, self.spec.disk_load_s
            self._host_insert(ex, template)
            ex.loads[template] = self.now + job.load_s
        else:
            job.found, job.full, job.masked0 = Residency.ABSENT, True, self.coster.grids[0]
            if template not in self.baking:
                self.baking.add(template)
                ex.bakes.append((template, self.now))

    def _adapter_for(self, ex: SimExecutor, job: Job) -> None:
        """``job``'s adapter set on ``ex``: held (its load may still be under way: it waits
        for the same load) or loaded from disk from now on, the least recently used set not
        in use evicted to make room; the executor reports its sets when they change."""
        adapter_set = job.request.adapter_set
        if not adapter_set:
            return
        ex.adapter_users[adapter_set] = ex.adapter_users.get(adapter_set, 0) + 1
        if adapter_set in ex.adapters:
            ex.adapters.move_to_end(adapter_set)
            job.adapter_s = max(0.0, ex.adapter_loads.get(adapter_set, 0.0) - self.now)
            return
        self.adapter_loads += 1
        job.adapter_s = self.spec.adapter_load_s
        ex.adapters[adapter_set] = None
        ex.adapter_loads[adapter_set] = self.now + job.adapter_s
        idle = [s for s in ex.adapters if not ex.adapter_users.get(s)]
        for gone in idle[: max(0, len(ex.adapters) - self.spec.resident_adapters)]:
            del ex.adapters[gone]
            ex.adapter_loads.pop(gone, None)
        ex.view.observe_adapters(list(ex.adapters))

    def _host_insert(self, ex: SimExecutor, template: str) -> None:
        """``template`` into ``ex``'s host tier, evicting its least recently used."""
        ex.host[template] = None
        ex.host.move_to_end(template)
        while self.spec.host_templates and len(ex.host) > self.spec.host_templates:
            gone, _ = ex.host.popitem(last=False)
            ex.loads.pop(gone, None)

    def _drawn(self, samples: tuple[float, ...], constant: float) -> float:
        if not samples:
            return constant
        return samples[int(self._overhead_rng.integers(len(samples)))]

    # ---- a simulated engine -------------------------------------------------------------
    def _alone(self, workers: int) -> bool:
        """Whether an encode (decode) just takes its time: no shared cores, and no line
        for a worker (GPU pools, the default). One event then, as before the shared-CPU
        model: the same events in the same order give the same figures."""
        return self.cpu is None and not workers

    def _in_worker(self, line: WorkerLine, seconds: float, then: Callable[[], None]) -> None:
        """``seconds`` of work in one of ``line``'s workers, or in line for one; then
        ``then``. The worker it frees takes the next in line."""
        if line.workers and line.busy >= line.workers:
            line.waiting.append((seconds, then))
            return
        line.busy += 1

        def finished() -> None:
            line.busy -= 1
            if line.waiting:
                self._in_worker(line, *line.waiting.popleft())
            then()

        self._compute(seconds, finished)

    def _encode_done(self, ex: SimExecutor, job: Job, bound: float, loaded: float) -> None:
        """Its encode ended (``bound``: when it was bound there; ``loaded``: when its
        template's load ends)."""
        job.pre_elapsed = self.now - bound
        if loaded > self.now:  # its template's load outlasts the encode
            self.at(loaded, lambda: self._encoded(ex, job))
        else:
            self._encoded(ex, job)

    def _encoded(self, ex: SimExecutor, job: Job) -> None:
        ex.ready.append(job)
        if not ex.stepping:
            self._step(ex)

    def _step(self, ex: SimExecutor) -> None:
        """Join what is ready while there is room, then run one step of the batch (or a
        queued bake: when nothing else runs, or when it waited too long)."""
        if ex.bakes and (
            not (ex.running or ex.ready) or self.now - ex.bakes[0][1] > BAKE_STARVATION_S
        ):
            template, _ = ex.bakes.popleft()
            ex.stepping = True
            ex.busy_s += self.bake_s
            self._compute(self.bake_s, lambda: self._baked(ex, template))
            return
        while ex.ready and len(ex.running) < self.spec.max_batch:
            ex.running.append(ex.ready.popleft())
        if not ex.running:
            ex.stepping = False
            return
        ex.stepping = True
        group = self._next_group(ex)
        masked = sum(j.masked0 for j in group)
        planned = self.coster.step_s0(len(group), masked)
        seconds = fitted_step_s(planned, self.spec.step_intercept_s, self.spec.step_slope)
        seconds *= float(self.rng.lognormal(0.0, self.spec.noise)) if self.spec.noise else 1.0
        sets = {j.request.adapter_set for j in group}
        if self.spec.adapter_batching == "mixed" and sets != {""}:  # each row its updates
            seconds *= 1.0 + self.spec.mixed_step_overhead
            self.mixed_steps += 1
        elif (adapter_set := group[0].request.adapter_set) != ex.applied:
            self.adapter_swaps += 1  # the engine turns to another set's weights
            seconds += self.spec.adapter_swap_s
            ex.applied = adapter_set
        ex.busy_s += seconds
        self._compute(seconds, lambda: self._stepped(ex, group))

    def _next_group(self, ex: SimExecutor) -> list[Job]:
        """The batch group that steps next: every running invocation in mixed batching,
        else the running invocations of one adapter set. The sets take turns in the order
        they joined, from the one after the set applied now (the first, once the applied
        set's group has left)."""
        if self.spec.adapter_batching == "mixed":
            return list(ex.running)
        order = list(dict.fromkeys(j.request.adapter_set for j in ex.running))
        turn = order[0]
        if len(order) > 1 and ex.applied in order:
            turn = order[(order.index(ex.applied) + 1) % len(order)]
        return [j for j in ex.running if j.request.adapter_set == turn]

    def _baked(self, ex: SimExecutor, template: str) -> None:
        """A bake committed: the template is on the pool's disk and in ``ex``'s host tier,
        as ``ex`` reports it (its view: host; the others': on disk)."""
        self.bakes_run += 1
        self.baking.discard(template)
        self.disk.add(template)
        self._host_insert(ex, template)
        key = (FUNCTION, template)
        for other in self.executors:
            if other is not ex and other.view.residency.get(key) in (None, Residency.BAKING):
                other.view.residency[key] = Residency.DISK
        ex.view.hosted(key)
        self._step(ex)

    def _stepped(self, ex: SimExecutor, group: list[Job]) -> None:
        stepped = set(group)
        still = []
        for job in ex.running:
            if job not in stepped:
                still.append(job)
                continue
            job.steps_left -= 1
            ex.view.progress(job.token, self.spec.steps - job.steps_left, self.spec.steps)
            if job.steps_left > 0:
                still.append(job)
            else:
                self._release_adapter(ex, job)
                self._decode(ex, job)
        leaving = len(still) < len(ex.running) or any(j.steps_left <= 1 for j in still)
        ex.running = still
        if leaving and self.queue:  # the pool's rule: room within a step binds the head
            self._dispatch()
        self._step(ex)

    @staticmethod
    def _release_adapter(ex: SimExecutor, job: Job) -> None:
        """Its steps are done: its set may be evicted once no other invocation uses it."""
        adapter_set = job.request.adapter_set
        if adapter_set:
            ex.adapter_users[adapter_set] -= 1

    def _decode(self, ex: SimExecutor, job: Job) -> None:
        if self._alone(self.spec.post_workers):
            job.post_elapsed = job.post_s
            self.at(self.now + job.post_s, lambda: self._done(ex, job))
            return
        stepped = self.now

        def decoded() -> None:
            job.post_elapsed = self.now - stepped
            self._done(ex, job)

        self._in_worker(ex.decoders, job.post_s, decoded)

    def _done(self, ex: SimExecutor, job: Job) -> None:
        job.done_at = self.now
        result = InvokeResult(
            b"",
            "png",
            1,
            1,
            job.request.mask_ratio,
            ex.name,
            InvokePath.STOCK if job.full else InvokePath.MASKAWARE,
            # the executor's whole account (no network here): queue and steps as one
            timings=Timings(
                pre_ms=job.pre_elapsed * 1e3,
                run_ms=(self.now - job.placed_at - job.pre_elapsed - job.post_elapsed) * 1e3,
                post_ms=job.post_elapsed * 1e3,
            ),
            cache=self._cache_read(job),
        )
        error = ex.view.finish(job.token, self.now, result)
        if error is not None and job.index >= self.spec.warmup:
            self.errors.append(error)
        if job.predicted_s > 0:
            self.admission.observe_outcome((self.now - job.placed_at) / job.predicted_s)
        ex.inflight -= 1
        self._pending -= 1
        if ex.draining and ex.inflight == 0:
            ex.stopped_at = self.now
        self._dispatch()

    @staticmethod
    def _cache_read(job: Job) -> CacheRead:
        """What the executor's result says of the template read (``found``: before the
        prefetch; the wait: what of the load its encode did not hide)."""
        if job.full:
            return CacheRead(CacheTier.NONE, 0.0, CacheTier.NONE)
        if job.found is Residency.DISK:
            wait_ms = max(0.0, job.load_s - job.pre_elapsed) * 1e3
            return CacheRead(CacheTier.DISK, wait_ms, CacheTier.DISK)
        return CacheRead(CacheTier.HOST, 0.0, CacheTier.HOST)

    # ---- the autoscaler -----------------------------------------------------------------
    def _tick(self) -> None:
        """One autoscaler period: the pool's predicted work, a decision, and its actions
        (starts that complete after ``startup_s``; victims that drain, then stop)."""
        active = self.active()
        work = sum(e.view.work_s() for e in active) + self.queued_s
        target = len(active) + self.starting
        demand = self._arrived_s / max(1e-9, self.now - self._last_tick) if self.now else 0.0
        arrivals, self._arrivals = self._arrivals, 0
        self._arrived_s, self._last_tick = 0.0, self.now
        decision = self.scaler.tick(self.now, work, len(self.queue), target, demand, arrivals)
        change = decision.desired - target
        if change > 0:
            self.starting += change
            self.at(self.now + self.spec.startup_s, lambda n=change: self._started(n))
        elif change < 0:
            for victim in self._victims(active, -change):
                victim.draining = True
                if victim.inflight == 0:
                    victim.stopped_at = self.now
        if change:
            self.scale_events.append((self.now, change))
        if self._pending > 0 or any(e.inflight for e in self.executors):
            self.at(self.now + self.spec.tick_s, self._tick)

    def _sample(self) -> None:
        """The pool's counts at the end of a timeline window (for ``--plot``)."""
        draining = sum(1 for e in self.executors if e.draining and e.stopped_at is None)
        self.samples.append(
            (self.now, len(self.queue), len(self.active()), self.starting, draining)
        )
        if self._pending > 0:
            self.at(self.now + TIMELINE_S, self._sample)

    def _started(self, count: int) -> None:
        self.starting -= count
        for _ in range(count):
            self._add_executor()
        self._dispatch()

    def _victims(self, active: list[SimExecutor], count: int) -> list[SimExecutor]:
        """Least predicted work first, newest first among equals (a cold cache is the
        cheapest to lose)."""
        ranked = sorted(active, key=lambda e: (e.view.work_s(), -e.started_at))
        return ranked[: min(count, len(active))]

    # ---- figures ------------------------------------------------------------------------
    def _after_step(self, at: float, accepted: list[Job]) -> dict[str, Any]:
        """How the autoscaler met a step in the arrival rate at ``at``: its first scale-up
        after it, and when the P95 of 10 s windows (by arrival) fell back under the SLO for
        good (None: it never did, or there is no SLO)."""
        first_up = next((t for t, c in self.scale_events if c > 0 and t >= at), None)
        out: dict[str, Any] = {
            "step_at_s": at,
            "scale_up_after_step_s": None if first_up is None else first_up - at,
        }
        slo_s = self.jobs[0].request.slo_s
        windows: dict[int, list[float]] = {}
        for j in accepted:
            if j.arrival >= at:
                windows.setdefault(int((j.arrival - at) // STEP_WINDOW_S), []).append(
                    j.done_at - j.arrival
                )
        p95 = {k: float(np.percentile(v, 95)) for k, v in sorted(windows.items())}
        out["p95_by_window_ms"] = [round(v * 1e3, 1) for v in p95.values()]
        if slo_s is not None and p95:
            late = [k for k, v in p95.items() if v > slo_s]
            recovered = not late or max(late) < max(p95)
            out["p95_under_slo_after_s"] = (
                (max(late, default=-1) + 1) * STEP_WINDOW_S if recovered else None
            )
        return out

    def _summary(self, wall_s: float) -> dict[str, Any]:
        measured = [j for j in self.jobs if j.index >= self.spec.warmup]
        accepted = [j for j in measured if not j.rejected]
        latency = np.array([j.done_at - j.arrival for j in accepted] or [math.nan]) * 1e3
        span = max((j.done_at for j in self.jobs if not j.rejected), default=0.0)
        decisions = np.array(self.decision_s) * 1e3 if self.decision_s else np.zeros(1)
        lifetimes = sum(
            (span if e.stopped_at is None else e.stopped_at) - e.started_at for e in self.executors
        )
        window = span - self.jobs[self.spec.warmup].arrival  # the measured arrivals' span
        out: dict[str, Any] = {
            "p50_ms": float(np.percentile(latency, 50)),
            "p95_ms": float(np.percentile(latency, 95)),
            "p99_ms": float(np.percentile(latency, 99)),
            "mean_ms": float(latency.mean()),
            "prediction_error_p50": float(np.median(self.errors)) if self.errors else math.nan,
            "utilisation": sum(e.busy_s for e in self.executors) / max(1e-9, lifetimes),
            "executor_seconds": lifetimes,
            "simulated_s": span,
            "wall_s": wall_s,
            "speedup": span / wall_s if wall_s > 0 else math.inf,
            "decision_ms_p99": float(np.percentile(decisions, 99)),
            "rejected": len(measured) - len(accepted),
            "dropped": sum(1 for j in measured if j.dropped),
            "throughput_rps": len(accepted) / window,
        }
        if self.cpu is not None:
            out["cpu_busy_s"] = self.cpu.busy_s
        if self.scaler is not None:
            out["scale_events"] = len(self.scale_events)
            out["reversals"] = self.scaler.reversals
            out["executors_started"] = len(self.executors)
            out["first_scale_up_s"] = next(
                (at for at, change in self.scale_events if change > 0), None
            )
            step = step_change(self.spec.arrivals)
            if step is not None:
                out |= self._after_step(step[1], accepted)
        slo_s = self.jobs[0].request.slo_s
        if slo_s is not None:
            met = int((latency <= slo_s * 1e3).sum())
            out["slo_attainment"] = met / len(measured)
            # one dropped from the queue was accepted and then missed: it counts against
            admitted = sum(1 for j in measured if j.dropped or not j.rejected)
            out["slo_attainment_accepted"] = met / admitted if admitted else 0.0
            out["goodput_rps"] = met / window
        if self.tiers:
            found = [j.found for j in accepted]
            out["host_hit_rate"] = found.count(Residency.HOST) / max(1, len(found))
            out["template_loads"] = found.count(Residency.DISK)
            out["full_path"] = sum(1 for j in accepted if j.full)
            out["bakes"] = self.bakes_run
        if self.spec.adapters:
            minutes = max(1e-9, span / 60.0)
            out["adapter_loads"] = self.adapter_loads
            out["adapter_swaps"] = self.adapter_swaps
            out["adapter_loads_per_min"] = self.adapter_loads / minutes
            out["adapter_swaps_per_min"] = self.adapter_swaps / minutes
            out["mixed_steps"] = self.mixed_steps
        out["timeline"] = self._timeline()
        return out

    def _timeline(self) -> list[dict[str, Any]]:
        """Per window of ``TIMELINE_S``: arrivals and refusals (by arrival), the P95 of the
        accepted ones that arrived in it, and the queue and executor counts at its end."""
        by_window: dict[int, list[Job]] = {}
        for job in self.jobs:
            by_window.setdefault(int(job.arrival // TIMELINE_S), []).append(job)
        counts = {round(at / TIMELINE_S) - 1: rest for at, *rest in self.samples}
        last = (0, self.spec.executors, 0, 0)
        out = []
        for k in range(max(by_window, default=-1) + 1):
            jobs = by_window.get(k, [])
            done = [j.done_at - j.arrival for j in jobs if not j.rejected]
            queued, ready, starting, draining = last = tuple(counts.get(k, last))
            out.append(
                {
                    "t_s": k * TIMELINE_S,
                    "arrivals": len(jobs),
                    "rejected": sum(1 for j in jobs if j.rejected),
                    "queued": queued,
                    "ready": ready,
                    "starting": starting,
                    "draining": draining,
                    "p95_ms": round(float(np.percentile(done, 95)) * 1e3, 1) if done else None,
                }
            )
        return out


# ---- workloads --------------------------------------------------------------------------
def footprint(ratio: float, size: int) -> MaskFootprint:
    """A mask of ``ratio`` summarised directly (a compact square: no pixels drawn)."""
    masked = {}
    for px in TOKEN_PX:
        side = -(-size // px)
        masked[px] = min(side * side, math.ceil(ratio * side * side))
    return MaskFootprint(ratio, size * size, masked)


@dataclass(frozen=True)
class Arrival:
    """One arrival replayed 1:1 (``run_simulation(..., arrivals=...)``): when it came, in
    seconds from the start, and its mask as the gateway summarised it."""

    at_s: float
    footprint: MaskFootprint


def capacity_rps(spec: SimSpec, cost_model: CostModel, ratios: np.ndarray) -> float:
    """Invocations per second the pool (at its maximum size, when autoscaled) sustains
    with full batches of the mean mask."""
    coster = _coster(cost_model)
    grid = coster.grids[0]
    masked = spec.max_batch * math.ceil(float(ratios.mean()) * grid)
    step = coster.step_s0(spec.max_batch, masked)
    pool = spec.autoscale.max_executors if spec.autoscale is not None else spec.executors
    return pool * spec.max_batch / (spec.steps * step)


def plan_jobs(
    spec: SimSpec, cost_model: CostModel, arrivals: list[Arrival] | None = None
) -> tuple[list[Job], float]:
    """The arrivals every placement replays, and their rate. A trace is replayed with its
    time compressed (or stretched) so its mean rate is ``load`` of the pool's capacity;
    ``arrivals`` are replayed as they are (times and masks: a real run's, bench validate)."""
    slo_s = None if spec.slo_factor is None else spec.slo_factor * standalone_s(spec, cost_model)
    if arrivals is not None:
        jobs = []
        for i, a in enumerate(arrivals):
            fp = a.footprint
            request = PlacementRequest(FUNCTION, TEMPLATE, fp.ratio, MODEL, spec.steps, fp, slo_s)
            jobs.append(Job(i, a.at_s, request))
        span = arrivals[-1].at_s - arrivals[0].at_s
        return jobs, (len(arrivals) - 1) / span if span > 0 else math.inf
    draws = Draws(spec.seed)
    path = trace_path(spec.arrivals)
    trace = None if path is None else read_trace(path)
    if trace is None:
        ratios = draws.masks(mask_mix(spec), spec.requests)
    else:
        ratios = trace.mask_ratio
        if ratios is None:
            ratios = draws.masks(mask_mix(spec), len(trace.arrival_s))
    rate = spec.load * capacity_rps(spec, cost_model, ratios)
    if trace is None:
        arrivals = draws.arrivals(spec.arrivals, spec.requests, rate)
    else:
        arrivals = (trace.arrival_s - trace.arrival_s[0]) * (trace.rate / rate)
    templates = trace.templates if trace is not None else None
    if templates is None:
        templates = draw_templates(spec, draws, len(arrivals))
    adapter_sets = draw_adapter_sets(spec, draws, len(arrivals))
    jobs = []
    for i, (at, ratio, template, adapter_set) in enumerate(
        zip(arrivals, ratios, templates, adapter_sets, strict=True)
    ):
        fp = footprint(float(ratio), spec.size)
        if adapter_set:  # a template's bake is per adapter set
            template = f"{template}@{adapter_set}"
        request = PlacementRequest(
            FUNCTION, template, fp.ratio, MODEL, spec.steps, fp, slo_s, adapter_set=adapter_set
        )
        jobs.append(Job(i, float(at), request))
    return jobs, rate


def draw_templates(spec: SimSpec, draws: Draws, count: int) -> list[str]:
    """Each arrival's template: Zipf popularity over ``spec.templates``."""
    if spec.templates == 1:
        return [TEMPLATE] * count
    return [f"t{k}" for k in draws.templates(count, spec.templates, spec.zipf)]


def draw_adapter_sets(spec: SimSpec, draws: Draws, count: int) -> list[str]:
    """Each arrival's adapter set: Zipf popularity over ``spec.adapters`` ("" for none)."""
    if not spec.adapters:
        return [""] * count
    return [f"a{k}" for k in draws.adapters(count, spec.adapters, spec.adapter_zipf)]


def mask_mix(spec: SimSpec) -> MaskMix:
    return MaskMix(spec.masks, spec.mask_mean)


def standalone_s(spec: SimSpec, cost_model: CostModel) -> float:
    """One invocation of the mean mask alone on an executor: the SLO's unit."""
    coster = _coster(cost_model)
    masked = footprint(mask_mix(spec).expected, spec.size)
    step = coster.step_s0(1, masked.on(coster.grids)[0])
    return spec.pre_s + spec.steps * step + spec.post_s


def _coster(cost_model: CostModel) -> StepCoster:
    """The prediction's step coster of ``cost_model`` (its plan table when it has one)."""
    return StepCoster(cost_model, cost_model.extra["grids"], cost_model.extra.get("step_table"))


def solo_steps_s(
    cost_model: CostModel, invocations: list[tuple[MaskFootprint, int]]
) -> list[float]:
    """Each invocation's steps at batch 1 as ``cost_model`` plans them (seconds): what it
    costs when it runs alone."""
    coster = _coster(with_plan_table(cost_model, 1))
    return [steps * coster.step_s0(1, fp.on(coster.grids)[0]) for fp, steps in invocations]


def with_plan_table(cost_model: CostModel, max_batch: int) -> CostModel:
    """A copy of ``cost_model`` with the plan table an executor would ship with it. The
    table is planned once per cost model and batch size in a process (about 3 s of CPU for
    a 57-block model at batch 8): a bench or a test suite simulates one model many times."""
    model = CostModel.from_dict(cost_model.to_dict())
    key = json.dumps(model.to_dict(), sort_keys=True)
    model.extra["step_table"] = [list(row) for row in _plan_table(key, max_batch)]
    return model


@functools.lru_cache(maxsize=8)
def _plan_table(cost_model_json: str, max_batch: int) -> tuple[tuple[float, ...], ...]:
    model = CostModel.from_dict(json.loads(cost_model_json))
    return tuple(tuple(row) for row in plan_table(model, model.extra["grids"], max_batch))


def run_simulation(
    spec: SimSpec, cost_model: CostModel, arrivals: list[Arrival] | None = None
) -> dict[str, Any]:
    """Every placement of ``spec`` on the same arrivals; one summary per placement.
    ``arrivals``: replay these 1:1 (sorted; ``spec.arrivals``, ``load`` and ``requests``
    are then not used to draw any)."""
    requests = spec.requests if arrivals is None else len(arrivals)
    if spec.executors < 1 or requests <= spec.warmup or spec.max_batch < 1:
        raise ValueError("need executors >= 1, max batch >= 1 and requests > warmup")
    if arrivals is not None and any(b.at_s < a.at_s for a, b in itertools.pairwise(arrivals)):
        raise ValueError("replayed arrivals must be sorted by time")
    path = trace_path(spec.arrivals)
    if arrivals is None and path is not None:
        traced = len(read_trace(path).arrival_s)
        if traced <= spec.warmup:
            raise ValueError(f"the trace has {traced} arrivals, not more than the warm-up")
    if not spec.load > 0:
        raise ValueError(f"load must be positive, not {spec.load}")
    if spec.templates < 1 or spec.host_templates < 0:
        raise ValueError("need templates >= 1 and host templates >= 0")
    if not (spec.zipf >= 0 and spec.disk_load_s >= 0):
        raise ValueError("the Zipf exponent and the disk load time must not be negative")
    if spec.adapters < 0 or spec.resident_adapters < 1:
        raise ValueError("need adapters >= 0 and resident adapters >= 1")
    if not (spec.adapter_zipf >= 0 and spec.adapter_load_s >= 0 and spec.adapter_swap_s >= 0):
        raise ValueError("the adapter Zipf exponent, load and swap must not be negative")
    for name in spec.placements:
        _config(name)  # a typo fails before any run
    if spec.slo_factor is not None and not spec.slo_factor > 0:
        raise ValueError(f"the SLO factor must be positive, not {spec.slo_factor}")
    cost_model = with_plan_table(cost_model, spec.max_batch)  # planned once, for every run
    configs = {}
    rate = 0.0
    for name in spec.placements:
        jobs, rate = plan_jobs(spec, cost_model, arrivals)
        policy, admission = _config(name)
        if isinstance(policy, MaskAware):  # an upload's near-ties are random: seeded
            policy = dataclasses.replace(policy, seed=spec.seed)
        configs[name] = Simulation(spec, cost_model, policy, jobs, admission).run()
    out = {
        "executors": spec.executors,
        "rate_rps": rate,
        "capacity_rps": rate / spec.load,
        "load": spec.load,
        "arrivals": spec.arrivals if arrivals is None else "replayed",
        "masks": mask_mix(spec).label,
        "requests": len(jobs) - spec.warmup,
        "configs": configs,
    }
    if spec.adapters:
        out["adapters"] = spec.adapters
    if spec.slo_factor is not None:
        out["slo_ms"] = spec.slo_factor * standalone_s(spec, cost_model) * 1e3
    return out


def _config(name: str) -> tuple[Placement, bool]:
    """``policy`` or ``policy+no-admission``."""
    policy, *flags = name.split("+")
    if any(flag != "no-admission" for flag in flags):
        raise ValueError(f"unknown option in {name!r}: only +no-admission is known")
    return make_placement(policy), "no-admission" not in flags
