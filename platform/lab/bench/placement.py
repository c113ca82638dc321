"""``retouch bench placement``: how long one placement decision takes against N executors.

Synthetic executors with realistic running batches (up to ``max_batch`` invocations each,
random steps left, the workload's bimodal 0.05 / 0.6 mask mix and Zipf template
popularity (:mod:`retouch.platform.lab.workload`), a Flux-like cost model of 57 blocks at
4096 tokens, a dozen templates spread over host tier, disk and absent), driven as the
gateway drives them: between two decisions the chosen executor takes the newcomer, a few
executors report a step and now and then one finishes an invocation — so each decision sees
fresh state on several executors, as in serving, not a warm memo of an idle pool.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from retouch.functions.wire.executor import ExecutorPhase, ExecutorState
from retouch.platform.control.cluster import (
    ClusterView,
    ExecutorView,
    PlacementRequest,
    Residency,
)
from retouch.platform.control.placement import make_placement
from retouch.platform.lab.workload import MaskMix, zipf_ranks
from retouch.runtime.costmodel import BlockProfile, CostModel, LinearFit
from retouch.runtime.prediction import MaskFootprint, plan_table

SIZE = 1024  # pixels: 64 x 64 = 4096 tokens of 16 px
TEMPLATES = 12
STEPS = 28
ZIPF = 1.2  # template popularity
TIERS = (Residency.HOST, Residency.HOST, Residency.DISK, Residency.ABSENT)


@dataclass(eq=False)
class SyntheticExecutor:
    """What the queue hands a policy: a name, its load, its slots and its view."""

    name: str
    view: ExecutorView
    inflight: int = 0
    slots: int = 16
    tokens: list[int] = field(default_factory=list)


def flux_like_cost_model() -> CostModel:
    """57 blocks (19 double-stream, 38 single-stream) with GPU-like fits: compute linear in
    tokens, K/V (and Y for double blocks) loaded over a ~20 GB/s link."""
    blocks = [
        BlockProfile(
            f"{kind}.{i}",
            LinearFit(1.5e-4, (2.4e-7 if kind == "double" else 1.2e-7), 0.99),
            bytes_per_token_sparse=3072 * 2 * 2 * (2 if kind == "double" else 1),
            bytes_per_token_exit=3072 * 2,
        )
        for kind, n in (("double", 19), ("single", 38))
        for i in range(n)
    ]
    return CostModel("cuda-synthetic", blocks, LinearFit(2e-5, 1 / 20e9, 0.99), {"grids": [4096]})


def footprints(rng: np.random.Generator, count: int) -> list[MaskFootprint]:
    """Masks of the bimodal mix (rectangles at 0.05 or 0.6 of the image)."""
    out = []
    for ratio in MaskMix("bimodal").draw(count, rng):
        side = int(SIZE * ratio**0.5)
        mask = np.zeros((SIZE, SIZE), dtype=bool)
        y, x = (int(v) for v in rng.integers(0, SIZE - side, 2))
        mask[y : y + side, x : x + side] = True
        out.append(MaskFootprint.of(mask))
    return out


def build_pool(n: int, seed: int, max_batch: int = 8) -> tuple[list[SyntheticExecutor], list]:
    rng = np.random.default_rng(seed)
    cluster = ClusterView()
    model = flux_like_cost_model()
    # As an executor ships it: the profile with its plan table (built once, not timed).
    model.extra["step_table"] = plan_table(model, model.extra["grids"], max_batch)
    doc = model.to_dict()
    masks = footprints(rng, 64)
    executors = []
    state = ExecutorState(name="x", pid=0, device="cuda-synthetic", cost_models={"flux": doc})
    for i in range(n):
        view = cluster.add(f"exec-{i}", max_batch=max_batch, slots=2 * max_batch)
        view.observe_state(state, cluster.costers)
        view.phase = ExecutorPhase.READY
        tiers = random.Random(seed + i)
        for t in range(TEMPLATES):
            view.residency[("fn", f"t{t}")] = tiers.choice(TIERS)
        view.host_capacity = 3
        ex = SyntheticExecutor(view.name, view, slots=2 * max_batch)
        for _ in range(int(rng.integers(0, max_batch + 1))):
            _place(
                ex, cluster, _request(rng, masks), started=True, steps=int(rng.integers(1, STEPS))
            )
        executors.append(ex)
    return executors, masks


def _request(rng: np.random.Generator, masks: list[MaskFootprint]) -> PlacementRequest:
    fp = masks[int(rng.integers(len(masks)))]
    template = f"t{zipf_ranks(1, TEMPLATES, ZIPF, rng)[0]}"
    return PlacementRequest("fn", template, fp.ratio, "flux", STEPS, fp)


def _place(
    ex: SyntheticExecutor,
    cluster: ClusterView,
    request: PlacementRequest,
    started: bool = False,
    steps: int = STEPS,
) -> None:
    token = cluster.token()
    placed = ex.view.place(token, request, 0.0)
    if placed is not None and started:
        ex.view.progress(token, STEPS - steps, STEPS)
    ex.tokens.append(token)
    ex.inflight += 1


def run_placement_bench(
    sizes: list[int], decisions: int = 2000, policy: str = "maskaware", seed: int = 0
) -> dict[str, Any]:
    """Decision time (policy choice over every executor with room) per pool size."""
    rows = []
    for n in sizes:
        executors, masks = build_pool(n, seed)
        cluster_tokens = ClusterView()  # token source for the newcomers
        placement = make_placement(policy)
        rng = np.random.default_rng(seed + 1)
        times = []
        for _ in range(decisions):
            request = _request(rng, masks)
            room = [e for e in executors if e.inflight < e.slots]
            started = time.perf_counter()
            chosen = placement.choose(room, request)
            times.append(time.perf_counter() - started)
            _place(chosen, cluster_tokens, request)
            _events(rng, executors)
        times_ms = sorted(t * 1e3 for t in times)
        rows.append(
            {
                "executors": n,
                "decisions": decisions,
                "p50_ms": round(statistics.median(times_ms), 4),
                "p99_ms": round(times_ms[int(0.99 * (len(times_ms) - 1))], 4),
                "max_ms": round(times_ms[-1], 4),
            }
        )
    out: dict[str, Any] = {"policy": policy, "rows": rows}
    if len(rows) == 1:
        out.update({k: rows[0][k] for k in ("executors", "p50_ms", "p99_ms")})
    return out


def _events(rng: np.random.Generator, executors: list[SyntheticExecutor], steps: int = 3) -> None:
    """A few executors report a step; one in four of those finishes its oldest invocation."""
    for _ in range(steps):
        ex = executors[int(rng.integers(len(executors)))]
        if not ex.tokens:
            continue
        token = ex.tokens[0]
        placed = ex.view.placed.get(token)
        if placed is None or rng.random() < 0.25:
            ex.view.finish(token, 0.0, None)
            ex.tokens.pop(0)
            ex.inflight -= 1
        else:
            left = max(0, placed.member.steps_left - 1)
            ex.view.progress(token, STEPS - left, STEPS)
