"""A discrete-event simulation of a pool of executors on a virtual clock.

The pool is driven by the gateway's own control-plane objects: one
:class:`~retouch.platform.control.cluster.ExecutorView` per executor (placed into, stepped
and finished exactly as the pool does it), the placement policies of
:mod:`retouch.platform.control.placement`, and their predictions. The only things simulated are
what a real pool would measure: the executors' step-level engines and the arrivals.

A simulated engine follows the real one: an invocation bound to it pre-processes for
``pre_s`` (in workers, beside the steps), joins the running batch at the next step boundary
while there is room (``max_batch``), steps at what the profile's bubble-free plan says
times a lognormal noise, and post-processes for ``post_s``.

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
executor's asynchronous fetch does. With ``adapter_batching`` ``turns`` the groups of a
batch take turns step by step, each turn to another set than the one applied costing
``adapter_swap_s``; with ``mixed`` the whole batch steps at once, ``mixed_step_overhead``
longer, and no swaps. A template's bake is per set. The view learns the resident sets from
placements and from the executor's report of its loads and evictions.

SLO admission is the gateway's own (``InvocationQueue.admit_slo`` on the virtual clock,
told the service queued ahead by the simulation, which owns its queue). With ``autoscale``
the pool's :class:`~retouch.platform.control.autoscaler.Autoscaler` ticks every
``tick_s`` on the work and the demand (``ExecutorView.executor_s`` of the arrivals, as the
real pool counts it): new executors become ready ``startup_s`` after the decision (sleepers
woken first, ready after ``wake_s``: ``simsleep.py``), and victims drain (no new work) and
sleep or stop once idle. Arrivals are drawn (Poisson, Gamma, steps, bursty days), replayed
from a CSV trace compressed to a load, or replayed 1:1 (``run_simulation(arrivals=...)``,
``retouch bench validate``). What is not built is listed in docs/simulator.md.

Its parts: the workload it replays (``simworkload.py``), a simulated executor's state and
rules (``simexecutor.py``), sleeping executors (``simsleep.py``) and the figures of a finished run (``simreport.py``).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from retouch.functions.errors import Overloaded
from retouch.functions.wire.executor import AdapterStats, EngineStats, ExecutorPhase, ExecutorState
from retouch.functions.wire.invoke import InvokePath, InvokeResult, Timings
from retouch.platform.control.autoscaler import Autoscaler
from retouch.platform.control.cluster import ClusterView, Residency
from retouch.platform.control.placement import MaskAware, Placement, make_placement
from retouch.platform.control.queue import InvocationQueue, QueueLimits, bindable, has_room
from retouch.platform.lab.bench.specs import SimSpec
from retouch.platform.lab.sharedcpu import SharedCPU, nice_weight
from retouch.platform.lab.simexecutor import SimExecutor, WorkerLine, victims
from retouch.platform.lab.simreport import TIMELINE_S, summary
from retouch.platform.lab.simsleep import Sleepers
from retouch.platform.lab.simworkload import (
    FUNCTION,
    MODEL,
    Arrival,
    Job,
    mask_mix,
    plan_jobs,
    standalone_s,
    with_plan_table,
)
from retouch.platform.lab.workload import read_trace, trace_path
from retouch.runtime.costmodel import CostModel
from retouch.runtime.executor.options import room
from retouch.runtime.prediction import fitted_step_s

# the queue's first invocations a dispatch tries (the gateway's queue tries all): with
# late binding an invocation's room depends on its template's load there, so one that
# waits must not hold back one behind it that an executor can take now
DISPATCH_SCAN = 16
BAKE_STARVATION_S = 30.0  # a queued bake runs between steps after this (EngineConfig's)


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
            name="sim",
            pid=0,
            device=model.device,
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
        self.cold_starts = 0  # executors the autoscaler started (not woken)
        self.sleepers = Sleepers(spec.wake_s, spec.sleeping_max, spec.sleep_keep_s)
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
        """Executors that take new work (not draining, asleep or stopped)."""
        return [
            e
            for e in self.executors
            if not e.draining and e.stopped_at is None and e.asleep_since is None
        ]

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
        return summary(self, wall_s)

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
        if ex.bind_adapter(job, self.now, self.spec.adapter_load_s, self.spec.resident_adapters):
            self.adapter_loads += 1
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
            ex.host_insert(template, self.spec.host_templates)
            ex.loads[template] = self.now + job.load_s
        else:
            job.found, job.full, job.masked0 = Residency.ABSENT, True, self.coster.grids[0]
            if template not in self.baking:
                self.baking.add(template)
                ex.bakes.append((template, self.now))

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
        group = ex.next_group(self.spec.adapter_batching == "mixed")
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

    def _baked(self, ex: SimExecutor, template: str) -> None:
        """A bake committed: the template is on the pool's disk and in ``ex``'s host tier,
        as ``ex`` reports it (its view: host; the others': on disk)."""
        self.bakes_run += 1
        self.baking.discard(template)
        self.disk.add(template)
        ex.host_insert(template, self.spec.host_templates)
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
                ex.release_adapter(job)
                self._decode(ex, job)
        leaving = len(still) < len(ex.running) or any(j.steps_left <= 1 for j in still)
        ex.running = still
        if leaving and self.queue:  # the pool's rule: room within a step binds the head
            self._dispatch()
        self._step(ex)

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
            image=b"",
            format="png",
            width=1,
            height=1,
            mask_ratio=job.request.mask_ratio,
            executor=ex.name,
            path=InvokePath.STOCK if job.full else InvokePath.MASKAWARE,
            # the executor's whole account (no network here): queue and steps as one
            timings=Timings(
                pre_ms=job.pre_elapsed * 1e3,
                run_ms=(self.now - job.placed_at - job.pre_elapsed - job.post_elapsed) * 1e3,
                post_ms=job.post_elapsed * 1e3,
            ),
            cache=job.cache_read(),
        )
        error = ex.view.finish(job.token, self.now, result)
        if error is not None and job.index >= self.spec.warmup:
            self.errors.append(error)
        if job.predicted_s > 0:
            self.admission.observe_outcome((self.now - job.placed_at) / job.predicted_s)
        ex.inflight -= 1
        self._pending -= 1
        if ex.draining and ex.inflight == 0:
            self.sleepers.retire(ex, self.now, self.at)
        self._dispatch()

    # ---- the autoscaler -----------------------------------------------------------------
    def _tick(self) -> None:
        """One autoscaler period: the pool's predicted work, a decision, and its actions
        (sleepers woken in ``wake_s``, then starts that complete after ``startup_s``;
        victims that drain, then sleep or stop)."""
        active = self.active()
        work = sum(e.view.work_s() for e in active) + self.queued_s
        target = len(active) + self.starting + self.sleepers.waking
        demand = self._arrived_s / max(1e-9, self.now - self._last_tick) if self.now else 0.0
        arrivals, self._arrivals = self._arrivals, 0
        self._arrived_s, self._last_tick = 0.0, self.now
        # the least a scale-down waits, as the real pool measures it
        up_s = self.sleepers.return_s(self.spec.startup_s) if self.spec.startup_aware else 0
        decision = self.scaler.tick(self.now, work, len(self.queue), target, demand, arrivals, up_s)
        change = decision.desired - target
        if change > 0:
            woken = self.sleepers.wake(change)
            for ex in woken:
                self.at(self.now + self.spec.wake_s, lambda ex=ex: self._started(0, ex))
            cold = change - len(woken)
            if cold:
                self.starting += cold
                self.cold_starts += cold
                self.at(self.now + self.spec.startup_s, lambda n=cold: self._started(n))
        elif change < 0:
            for victim in victims(active, -change):
                victim.draining = True
                if victim.inflight == 0:
                    self.sleepers.retire(victim, self.now, self.at)
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

    def _started(self, count: int, woken: SimExecutor | None = None) -> None:
        """``count`` cold starts, or ``woken``, are ready."""
        self.starting -= count
        for _ in range(count):
            self._add_executor()
        if woken is not None:
            self.sleepers.woke(woken, self.now)
        self._dispatch()


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
