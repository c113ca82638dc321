"""The workload a simulation replays: its invocations (``Job``), drawn or replayed
arrivals with their masks, templates and adapter sets, and the figures the arrivals are
scaled by (the pool's capacity, one invocation alone: the SLO's unit), from the cost model
with the plan table an executor ships.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

import numpy as np

from retouch.functions.wire.invoke import CacheRead, CacheTier
from retouch.platform.control.cluster import PlacementRequest, Residency
from retouch.platform.lab.bench.specs import SimSpec
from retouch.platform.lab.workload import (
    DEFAULT_TEMPLATE,
    Draws,
    MaskMix,
    read_trace,
    trace_path,
)
from retouch.runtime.costmodel import CostModel
from retouch.runtime.prediction import TOKEN_PX, MaskFootprint, StepCoster, plan_table

MODEL = "sim-model"
FUNCTION = "sim"
TEMPLATE = DEFAULT_TEMPLATE


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

    def cache_read(self) -> CacheRead:
        """What the executor's result says of the template read (``found``: before the
        prefetch; the wait: what of the load its encode did not hide)."""
        if self.full:
            return CacheRead(tier=CacheTier.NONE, wait_ms=0.0, found=CacheTier.NONE)
        if self.found is Residency.DISK:
            wait_ms = max(0.0, self.load_s - self.pre_elapsed) * 1e3
            return CacheRead(tier=CacheTier.DISK, wait_ms=wait_ms, found=CacheTier.DISK)
        return CacheRead(tier=CacheTier.HOST, wait_ms=0.0, found=CacheTier.HOST)


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
