"""The cluster view: the gateway's one picture of every executor, updated on events.

Per executor it holds what placement, admission and the autoscaler need: its phase, cost
models (one :class:`~retouch.runtime.prediction.StepCoster` per model, from the profile the
executor reports), its calibration (time outside the profiled blocks, pre/post, drift), the
invocations placed on it (mask footprint, steps left, template), where each template is
(host tier, disk, baking, absent: ``platform/control/residency.py``) and which adapter
sets its device holds. It changes when the gateway places an invocation, when a
step-progress frame or a result arrives on the invocation's stream, and when the
executor's state is read after a deploy, a bake or an eviction — never by waiting for a
periodic scrape. Nothing here does I/O; time is a parameter (the simulator drives the same
objects on a virtual clock).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from retouch.functions.wire.executor import (
    AdapterStats,
    ExecutorPhase,
    ExecutorState,
)
from retouch.functions.wire.invoke import CacheTier, InvokeResult
from retouch.platform.control.calibration import EWMA, Calibration, Overheads
from retouch.platform.control.residency import BAKED, Residency, TemplateTiers
from retouch.runtime.costmodel import CostModel
from retouch.runtime.prediction import (
    Arrivals,
    MaskFootprint,
    Member,
    Prediction,
    StepCalibration,
    StepCoster,
    batch_step_s,
    departure_s,
    predict,
)

STEP_MEMO = 64  # step calibrations an executor view keeps (one per drift and idle)
MEMO_BUCKETS = 64  # mask resolution of the per-executor prediction memo
PROFILE_ONLY = StepCalibration()  # the profile alone, no learnt correction (immutable)
# Adapter costs until an executor reports its own: LegoDiffusion swaps a LoRA in ~100 ms;
# Katz et al. load an SDXL-sized one (886 MiB) from disk in ~0.5 s, about 1.8 GB/s.
ADAPTER_SWAP_S = 0.1
ADAPTER_LOAD_S = 0.5
ADAPTER_DISK_BPS = 1.8e9


@dataclass(frozen=True)
class PlacementRequest:
    """An invocation to place: what placement and the prediction need to know of it.
    Without a ``footprint`` (no mask summary) nothing can be predicted for it."""

    function: str
    template: str
    mask_ratio: float
    model: str = ""  # its model pool (the spec's model name)
    steps: int = 0
    footprint: MaskFootprint | None = None
    slo_s: float | None = None  # its function's latency objective
    optimistic: bool = False  # predict it as if its template were in host memory
    # It computes every token and reads no row (an edit with its own reference image): its
    # template's residency neither speeds it nor changes by it.
    full: bool = False
    copy: str = ""  # the loaded copy it runs on (ModelSource.key), whose cost model applies
    adapter_set: str = ""  # its function's adapter set (FunctionSpec.adapter_set; "": none)
    adapter_bytes: int = 0  # the set's files (0: not known), for a load's cost

    @property
    def cost_key(self) -> str:
        """The key of its cost model in an executor's state: its copy (a bf16 copy of a
        model is profiled apart from the fp32 one), else its model."""
        return self.copy or self.model


@dataclass
class AdapterCosts:
    """What an adapter set costs an executor: a load from disk when its device does not
    hold the set, and a swap whenever its engine turns from a batch group of one set to
    another's. The executor's own means (``AdapterStats.mean_load_ms`` /
    ``mean_swap_ms``) replace the defaults once it reports them."""

    swap_s: float = ADAPTER_SWAP_S
    load_s: float = ADAPTER_LOAD_S  # a load of a set whose size is not known
    disk_bps: float = ADAPTER_DISK_BPS
    measured_load_s: float = 0.0  # this executor's mean load (0: none measured)

    def load(self, nbytes: int) -> float:
        """Seconds to load a set of ``nbytes`` here: measured, else by size, else the default."""
        if self.measured_load_s > 0:
            return self.measured_load_s
        return nbytes / self.disk_bps if nbytes > 0 else self.load_s

    def observe(self, stats: AdapterStats) -> None:
        if stats.mean_load_ms > 0:
            self.measured_load_s = stats.mean_load_ms / 1e3
        if stats.mean_swap_ms > 0:
            self.swap_s = stats.mean_swap_ms / 1e3


@dataclass
class Placed:
    """An invocation on an executor: its cost member, when it was placed, what was
    predicted then, and whether it joined the running batch yet."""

    newcomer: PlacementRequest
    member: Member
    placed_at: float
    predicted: Prediction
    started: bool = False
    deadline: float | None = None  # when its SLO ends (clock time), if it has one
    pre_ahead: int = 0  # placed here before it and not yet in the batch: encodes ahead
    occupancy: int = 0  # invocations placed here when it was predicted (its drift's)


class ExecutorView:
    """One executor as the control plane sees it (event-loop state: no lock)."""

    def __init__(
        self, name: str, max_batch: int = 8, slots: int = 16, overheads: Overheads | None = None
    ) -> None:
        self.name = name
        self.phase = ExecutorPhase.STARTING
        self.max_batch = max_batch
        self.slots = slots
        self.device = ""
        self.costers: dict[str, StepCoster] = {}  # model -> coster
        self.calibration = Calibration()
        self.overheads = overheads or Overheads()  # the pool's, shared (see Overheads)
        self.placed: dict[int, Placed] = {}  # in placement order
        self.residency = TemplateTiers()  # where each template rests here, LRU first
        self.host_capacity: int | None = None  # templates the host tier holds (None: unknown)
        self.adapters: OrderedDict[str, None] = OrderedDict()  # sets on the device, LRU first
        self.adapter_costs = AdapterCosts()
        self.mixed_adapters = False  # its batches mix adapter sets: no swaps between them
        self.workers = (0, 0)  # its pre and post worker processes (0: not known)
        self._results: deque[float] = deque(maxlen=16)  # when its latest results came
        self.version = 0
        self.arrivals = ArrivalRate()  # placements here, to predict who joins later
        self._memo: dict[tuple, Prediction] = {}
        self._memo_version: tuple = ()
        self._solo_version, self._solo_work_s = -1, 0.0
        self._next_start: tuple[tuple, float] = ((), 0.0)  # next_start_s and its versions
        self._steps: dict[tuple, StepCalibration] = {}  # step calibrations by their values
        self._joined: tuple[tuple, float] = ((), 0.0)  # the last _joined_step_s and its key

    # ---- what the executor is -----------------------------------------------------------
    def observe_state(self, state: ExecutorState, costers: CosterCache) -> None:
        """Cost models, engine calibration and template residency from the executor's own
        state (read after it became ready, after a deploy and after bakes and evictions)."""
        self.device = state.device
        self.max_batch = max(1, state.engine.max_batch)
        for model, doc in state.cost_models.items():
            coster = costers.get(state.device, model, doc)
            if coster is not None:
                self.costers[model] = coster
        self.workers = (state.engine.pre_workers, state.engine.post_workers)
        if state.engine.step_slope > 0:
            self.calibration.step_intercept_s = state.engine.step_intercept_ms / 1e3
            self.calibration.step_slope = state.engine.step_slope
        capacity = self.residency.observe(state)
        if capacity is not None:
            self.host_capacity = capacity
        self.observe_adapters(state.adapters)
        self.mixed_adapters = state.mixed_adapters
        self.adapter_costs.observe(state.adapter_stats)
        self._changed()

    def observe_adapters(self, resident: Sequence[str]) -> None:
        """The adapter sets the executor reports on its device (least recently used first)."""
        self.adapters = OrderedDict.fromkeys(resident)
        self._changed()

    @property
    def inflight(self) -> int:
        return len(self.placed)

    # ---- events -------------------------------------------------------------------------
    def member(self, newcomer: PlacementRequest, adapters: bool = True) -> Member | None:
        """The newcomer's cost on this executor (None: no profile of its model here yet).
        ``adapters=False``: as if its adapter set were resident (an adapter-blind view)."""
        coster = self.costers.get(newcomer.cost_key)
        if coster is None or newcomer.footprint is None:
            return None
        tier = Residency.HOST if newcomer.optimistic else self.template_tier(newcomer)
        adapter_s = self.adapter_load_s(newcomer) if adapters else 0.0
        if tier not in BAKED:  # not baked here (or not read): every token
            return Member(coster, newcomer.steps, coster.full_masks(), adapter_s)
        # Its join waits for what its encode did not hide of the loads it needs: its
        # template from disk and its adapter set, fetched side by side.
        load_s = self.overheads.disk_load_s if tier is Residency.DISK else 0.0
        masked = newcomer.footprint.on(coster.grids)
        return Member(
            coster, newcomer.steps, masked, max(load_s, adapter_s), tier is Residency.DEVICE
        )

    def load_s(self, newcomer: PlacementRequest) -> float:
        """What the newcomer loads here before it can join: its template from disk (0: in
        host memory, or not baked here, which is a bake rather than a load) and its adapter
        set when the device lacks it, side by side."""
        template_s = (
            self.overheads.disk_load_s if self.template_tier(newcomer) is Residency.DISK else 0.0
        )
        return max(template_s, self.adapter_load_s(newcomer))

    def adapter_load_s(self, newcomer: PlacementRequest) -> float:
        """The load of the newcomer's adapter set here: 0 for the bare model, a set the
        device holds, or one whose load was already asked for (an optimistic request)."""
        if newcomer.optimistic or not newcomer.adapter_set or newcomer.adapter_set in self.adapters:
            return 0.0
        return self.adapter_costs.load(newcomer.adapter_bytes)

    def adapter_swap_s(self, newcomer: PlacementRequest) -> float:
        """The swaps the newcomer's steps wait for here. The engine runs one adapter set per
        batch group, and groups of different sets take turns step by step, one swap per
        group a round: each other set placed here costs the newcomer a swap a round for as
        long as it stays (its longest steps left, at most the newcomer's), and its own group
        one more a round while any other does. 0 where everything here runs its set, or
        where the executor's batches mix sets (each row its own updates, no turns)."""
        if newcomer.optimistic or self.mixed_adapters:
            return 0.0
        stays: dict[str, int] = {}
        for p in self.placed.values():
            other = p.newcomer.adapter_set
            if other != newcomer.adapter_set:
                rounds = min(p.member.steps_left, newcomer.steps)
                stays[other] = max(stays.get(other, 0), rounds)
        if not stays:
            return 0.0
        return self.adapter_costs.swap_s * (sum(stays.values()) + max(stays.values()))

    def _added_swaps_s(self, newcomer: PlacementRequest) -> float:
        """What the newcomer adds to every round here in swaps: a set not placed here yet
        makes one more group to turn to (two swaps a round when it makes the second)."""
        sets = {p.newcomer.adapter_set for p in self.placed.values()}
        if not sets or newcomer.adapter_set in sets or self.mixed_adapters:
            return 0.0
        before = len(sets) if len(sets) > 1 else 0
        return self.adapter_costs.swap_s * (len(sets) + 1 - before)

    def place(
        self, token: int, newcomer: PlacementRequest, now: float, deadline: float | None = None
    ) -> Placed | None:
        member = self.member(newcomer)
        if member is None:
            return None
        predicted = self.predict(newcomer) or Prediction(0.0, 0.0)
        ahead = sum(1 for p in self.placed.values() if not p.started)
        placed = Placed(
            newcomer,
            member,
            now,
            predicted,
            deadline=deadline,
            pre_ahead=ahead,
            occupancy=len(self.placed),
        )
        self.placed[token] = placed
        self.arrivals.observe(now, member)
        if not newcomer.full:  # an edit that reads no row moves no template
            self.residency.expect((newcomer.function, newcomer.template), self.host_capacity)
        if newcomer.adapter_set:  # the executor fetches a set it lacks on arrival
            self.adapters[newcomer.adapter_set] = None
            self.adapters.move_to_end(newcomer.adapter_set)
        self._changed()
        return placed

    def progress(self, token: int, step: int, total: int) -> None:
        placed = self.placed.get(token)
        if placed is None:
            return
        placed.started = True
        placed.member.steps_left = max(0, total - step)
        self._changed()

    def finish(self, token: int, now: float, result: InvokeResult | None) -> float | None:
        """The invocation left; learn from its result. Returns the relative prediction
        error (|predicted - actual| / actual) when it completed."""
        placed = self.placed.pop(token, None)
        self._changed()
        if placed is None or result is None:
            return None
        if not placed.newcomer.full:  # an edit that reads no row tells nothing of it
            key = (placed.newcomer.function, placed.newcomer.template)
            self.residency.touch(key, result, self.host_capacity)
        actual = now - placed.placed_at
        predicted = placed.predicted.finish_s
        self._calibrate(placed, result, now, actual, predicted)
        return abs(predicted - actual) / actual if actual > 0 and predicted > 0 else None

    def _calibrate(
        self, placed: Placed, result: InvokeResult, now: float, actual: float, predicted: float
    ) -> None:
        c = self.calibration
        c.observations += 1
        t = result.timings
        post_s = t.post_ms / 1e3
        # Its decode queued if as many results as there are post workers came back while
        # it was decoding; its encode if every pre worker had one placed before it.
        during = sum(1 for at in self._results if at > now - post_s)
        self._results.append(now)
        if c.observations == 1:
            return  # an executor's first result is cold (first loads, first allocations)
        pre_workers, post_workers = self.workers
        self.overheads.observe(
            t.pre_ms / 1e3,
            post_s,
            pre_queued=0 < pre_workers <= placed.pre_ahead,
            post_queued=0 < post_workers <= during,
        )
        if result.cache.tier is CacheTier.DISK:
            self.overheads.observe_disk_load(result.cache.wait_ms / 1e3)
        executor_s = (t.pre_ms + t.queue_ms + t.run_ms + t.post_ms) / 1e3  # arrived→done there
        if executor_s > 0:
            self.overheads.observe_hop(actual - executor_s)
        if predicted > 0 and actual > 0:
            c.learn(placed.occupancy, actual / predicted)

    def hosted(self, key: tuple[str, str]) -> None:
        """``key`` is now the host tier's most recent; what the LRU evicts goes to disk."""
        self.residency.hosted(key, self.host_capacity)

    def tier(self, function: str, template: str) -> Residency:
        return self.residency.tier(function, template)

    def template_tier(self, newcomer: PlacementRequest) -> Residency:
        """Where the newcomer's rows rest here; ``ABSENT`` for one that reads none."""
        if newcomer.full:
            return Residency.ABSENT
        return self.tier(newcomer.function, newcomer.template)

    def _changed(self) -> None:
        self.version += 1

    # ---- prediction ---------------------------------------------------------------------
    def predict(
        self, newcomer: PlacementRequest | None, *, learnt: bool = True, adapters: bool = True
    ) -> Prediction | None:
        """Predicted start and finish (seconds from now) of ``newcomer`` here, or of the
        work already here when None; memoised until the view changes. ``learnt=False``:
        from the profile alone, without the corrections learnt from results (admission's
        half-open probe compares the two). The newcomer's adapter set adds its load (in its
        lead, beside its encode) and the swaps it waits for; ``adapters=False`` leaves both
        out (an adapter-blind policy)."""
        prediction = self._predict(newcomer, learnt, adapters)
        if prediction is None or newcomer is None or not adapters:
            return prediction
        swaps_s = self.adapter_swap_s(newcomer)
        if swaps_s <= 0:
            return prediction
        return Prediction(prediction.start_s, prediction.finish_s + swaps_s)

    def _predict(
        self, newcomer: PlacementRequest | None, learnt: bool, adapters: bool
    ) -> Prediction | None:
        # The pool's overheads change with other executors' results: they count too.
        version = (self.version, self.overheads.version)
        if self._memo_version != version:
            self._memo.clear()
            self._memo_version = version
        member = None
        if newcomer is not None:
            member = self.member(newcomer, adapters)
            if member is None:
                return None
        # Newcomers whose masks differ by under 1/64 of the grid share a prediction.
        key = (
            learnt,
            None
            if member is None
            else (
                id(member.coster),
                member.steps_left,
                round(member.masked[0] * MEMO_BUCKETS / member.coster.grids[0]),
                member.load_s,
            ),
        )
        cached = self._memo.get(key)
        if cached is not None:
            return cached
        running, waiting = [], []
        for p in self.placed.values():
            (running if p.started else waiting).append(p.member)
        # Drift is learnt under load; an idle executor runs as its step fit says. Else a
        # burst's drift could keep admission refusing an idle pool, which would then never
        # observe anything to unlearn it.
        calibration = PROFILE_ONLY if not learnt else self.step_calibration(idle=not self.placed)
        result = predict(
            running,
            waiting,
            member,
            self.max_batch,
            calibration,
            # Arrivals are expected only while work is placed here: an idle executor has
            # no evidence of a stream, and admission must never refuse everything because
            # of a rate measured in a burst long gone.
            self.arrivals.expected() if self.placed else None,
        )
        self._memo[key] = result
        return result

    def step_calibration(
        self, *, idle: bool = False, occupancy: int | None = None
    ) -> StepCalibration:
        """The calibration predictions step with: the drift of ``occupancy`` placed here
        (default: as many as are; ``idle``: no drift, as an idle executor runs). Memoised by
        its values: every prediction asks for it, and building a frozen dataclass costs
        more than the rest of a memo hit."""
        c, o = self.calibration, self.overheads
        scale = 1.0 if idle else c.scale(len(self.placed) if occupancy is None else occupancy)
        key = (c.step_intercept_s, c.step_slope, scale, o.pre_s, o.post_s, o.hop_s, *self.workers)
        step = self._steps.get(key)
        if step is None:
            if len(self._steps) >= STEP_MEMO:
                self._steps.clear()
            step = self._steps[key] = c.step(o, self.workers, scale)
        return step

    def next_start_s(self) -> float:
        """Predicted seconds until the running batch has room for one more: after as many
        departures as places are taken beyond the batch (invocations placed here that have
        not joined yet take the first places that free). A member whose steps are done is
        decoding and holds no place. Counting only the first departure let every queued
        invocation see the same room, and a burst piled onto one executor (Gamma CV 4,
        bimodal masks, load 0.95, 64 simulated executors: P95 1.12x least-requests').
        Memoised until the view or the pool's overheads change: late binding asks it of
        every candidate for every queued invocation at each dispatch."""
        version = (self.version, self.overheads.version)
        if self._next_start[0] == version:
            return self._next_start[1]
        staying = [p for p in self.placed.values() if not p.started or p.member.steps_left]
        beyond = len(staying) - self.max_batch + 1
        running = [p.member for p in staying if p.started] if beyond > 0 else []
        start = departure_s(running, self.step_calibration(), beyond) if running else 0.0
        self._next_start = (version, start)
        return start

    def lead_s(self, newcomer: PlacementRequest) -> float:
        """What the newcomer needs here before it can join a batch: its encode, and beside
        it its template's load from disk. Binding this long before batch room hides both in
        the wait, as an executor's own queue does for work bound to it at once."""
        return max(self.overheads.pre_s, self.load_s(newcomer))

    def work_s(self) -> float:
        """Predicted seconds until everything placed here is done (0 when idle)."""
        if not self.placed:
            return 0.0
        prediction = self.predict(None)
        return prediction.finish_s if prediction is not None else 0.0

    def solo_work_s(self) -> float:
        """A cheap upper bound of the work placed here: every invocation's remaining steps
        as if it ran alone (no stepping of the batch). Ranks executors for the shortlist of
        exact predictions; kept until the view changes."""
        if self._solo_version == self.version:
            return self._solo_work_s
        total = 0.0
        for p in self.placed.values():
            m = p.member
            total += m.steps_left * m.coster.step_s0(1, m.masked[0])
        self._solo_version, self._solo_work_s = self.version, total
        return total

    def residency_cost_s(self, newcomer: PlacementRequest, adapters: bool = True) -> float:
        """What the template's place adds: nothing in host memory, a disk load, or a bake
        (the engine time of a full-path run) when it is not baked here; and with
        ``adapters`` what its adapter set adds: its load where the device lacks it, the
        swaps where other sets run."""
        tier = self.template_tier(newcomer)
        template_s = self.overheads.disk_load_s if tier is Residency.DISK else 0.0
        cost = template_s or self.bake_cost_s(newcomer)
        if adapters:
            cost += self.adapter_load_s(newcomer) + self.adapter_swap_s(newcomer)
        return cost

    def bake_cost_s(self, newcomer: PlacementRequest) -> float:
        """The engine time a bake of the template here would take (0 where it is baked):
        the part of the residency cost a prediction leaves out (it counts a disk load). An
        edit that reads no row queues no bake."""
        if newcomer.full or self.tier(newcomer.function, newcomer.template) in BAKED:
            return 0.0
        coster = self.costers.get(newcomer.cost_key)
        if coster is None:
            return 0.0
        c = self.calibration
        step = c.step_intercept_s + c.step_slope * coster.step_s(1, coster.full_masks())
        return newcomer.steps * step * c.scale(len(self.placed))

    def masked_tokens(self) -> int:
        """Masked tokens (finest grid) of the invocations placed here."""
        return sum(p.member.masked[0] for p in self.placed.values())

    def executor_s(self, newcomer: PlacementRequest) -> float:
        """Executor-seconds ``newcomer`` takes here as one of a full batch of its like: its
        share of the executor's capacity, the autoscaler's demand signal (0: no profile of
        its model here)."""
        member = self.member(newcomer)
        if member is None:
            return 0.0
        n = self.max_batch
        # the drift of a full executor's predictions: this is a share of a full batch
        step_s = batch_step_s([member] * n, self.step_calibration(occupancy=n))
        return member.steps_left * step_s / n

    def _joined_step_s(self, member: Member, calibration: StepCalibration) -> float:
        """One step of the batch with ``member`` joined (the first ``max_batch - 1`` placed
        here, then it). The gateway asks it of every executor with room for the queue's
        head, again on every arrival and result while that head waits: kept while the view,
        the calibration and the member's cost are the same."""
        key = (self.version, self.max_batch, calibration, member.coster, member.masked[0])
        if self._joined[0] != key:
            running = [p.member for p in self.placed.values()]
            batch = [*running[: self.max_batch - 1], member]
            self._joined = (key, batch_step_s(batch, calibration))
        return self._joined[1]

    def keeps_deadlines(self, newcomer: PlacementRequest, now: float) -> bool:
        """Whether every invocation here with a deadline still meets it once ``newcomer``
        joins (PatchedServe's rule for joining a batch). A join slows every step of the
        batch; admission predicted each invocation with the arrivals it expected, and a
        burst of joins beyond that would make admitted work late. Each member is stepped
        at the batch's new step time for its remaining steps (members that leave first
        only make it faster)."""
        member = self.member(newcomer)
        if member is None or not any(p.deadline is not None for p in self.placed.values()):
            return True
        calibration = self.step_calibration()
        step_s = self._joined_step_s(member, calibration)
        swaps_s = self._added_swaps_s(newcomer)  # a new set's group slows every round
        for p in self.placed.values():
            if p.deadline is None:
                continue
            before = 0.0 if p.started else calibration.pre_s
            rounds = p.member.steps_left
            added = min(rounds, newcomer.steps) * swaps_s
            finish = now + before + rounds * step_s + added + calibration.post_s
            if finish > p.deadline:
                return False
        return True


@dataclass
class ArrivalRate:
    """Running averages of the gap between placements on one executor and of what was
    placed (steps, masked tokens): the arrivals a prediction expects after its newcomer."""

    gap_s: float | None = None
    steps: float = 0.0
    masked: float = 0.0
    coster: StepCoster | None = None
    _last: float | None = None
    # the last expectation and the values it was built from (predictions ask on every call)
    _expected: tuple[tuple, Arrivals | None] = field(
        default=((), None), init=False, repr=False, compare=False
    )

    def observe(self, now: float, member: Member) -> None:
        if self._last is not None:
            gap = max(0.0, now - self._last)
            self.gap_s = gap if self.gap_s is None else (1 - EWMA) * self.gap_s + EWMA * gap
        self._last = now
        first = self.coster is None
        self.coster = member.coster
        self.steps = (
            member.steps_left if first else (1 - EWMA) * self.steps + EWMA * member.steps_left
        )
        self.masked = (
            member.masked[0] if first else (1 - EWMA) * self.masked + EWMA * member.masked[0]
        )

    def expected(self) -> Arrivals | None:
        """One ``typical`` arrival every ``gap_s`` (None: no stream seen yet). The same
        object while the averages are unchanged (predictions only read it)."""
        key = (self.gap_s, self.steps, self.masked, self.coster)
        if key != self._expected[0]:
            self._expected = (key, self._arrivals())
        return self._expected[1]

    def _arrivals(self) -> Arrivals | None:
        if self.gap_s is None or self.gap_s <= 0 or self.coster is None:
            return None
        typical = Member(self.coster, max(1, round(self.steps)), (round(self.masked),))
        return Arrivals(self.gap_s, typical)


class CosterCache:
    """Step costers shared by every executor with the same profile (same device type and
    model): their memoised plans are reused across the pool."""

    def __init__(self) -> None:
        self._costers: dict[tuple[str, str, str], StepCoster] = {}

    def get(self, device: str, model: str, doc: dict) -> StepCoster | None:
        grids = (doc.get("extra") or {}).get("grids")
        if not grids:
            return None  # a profile from before grids were recorded: no prediction
        key = (device, model, repr(sorted(doc.get("extra", {}).items())))
        coster = self._costers.get(key)
        if coster is None:
            extra = doc["extra"]
            coster = StepCoster(
                CostModel.from_dict(doc),
                grids,
                extra.get("step_table"),
                extra.get("resident_step_table"),
            )
            self._costers[key] = coster
        return coster


@dataclass
class ClusterView:
    """Every executor's view, and the tokens that name placed invocations."""

    executors: dict[str, ExecutorView] = field(default_factory=dict)
    costers: CosterCache = field(default_factory=CosterCache)
    overheads: Overheads = field(default_factory=Overheads)  # shared by every view
    _tokens: itertools.count = field(default_factory=itertools.count)

    def add(self, name: str, max_batch: int = 8, slots: int = 16) -> ExecutorView:
        view = ExecutorView(name, max_batch, slots, self.overheads)
        self.executors[name] = view
        return view

    def token(self) -> int:
        return next(self._tokens)
