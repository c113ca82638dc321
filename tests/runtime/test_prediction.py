"""The prediction function and the cluster view: what placement and admission rely on."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from retouch.functions.wire.executor import BakeState, EngineStats, ExecutorState, TemplateStatus
from retouch.functions.wire.invoke import CacheRead, CacheTier, InvokePath, InvokeResult, Timings
from retouch.platform.control.cluster import ClusterView, PlacementRequest, Residency
from retouch.runtime.costmodel import BlockProfile, CostModel, LinearFit
from retouch.runtime.plan import bubble_free_plan
from retouch.runtime.prediction import (
    MaskFootprint,
    Member,
    StepCalibration,
    StepCoster,
    plan_table,
    predict,
)

GRID = 256  # tokens of one request (16 x 16 tokens of 16 px: a 256-pixel image)


def cost_model(blocks: int = 4) -> CostModel:
    """Compute 1 ms + 10 µs per token per block; loads 1 ms per MB (a slow link)."""
    return CostModel(
        "test",
        [BlockProfile(f"b{i}", LinearFit(1e-3, 1e-5, 1.0), 4096, 1024) for i in range(blocks)],
        LinearFit(0.0, 1e-9, 1.0),
        {"grids": [GRID]},
    )


def coster(max_batch: int = 4) -> StepCoster:
    model = cost_model()
    return StepCoster(model, [GRID], plan_table(model, [GRID], max_batch))


def member(c: StepCoster, steps: int, ratio: float) -> Member:
    return Member(c, steps, (round(ratio * GRID),))


def answer(mask_ratio: float, executor: str, path: InvokePath, **more: Any) -> InvokeResult:
    """An executor's answer as the cluster view learns from it (no image)."""
    return InvokeResult(
        image=b"",
        format="png",
        width=1,
        height=1,
        mask_ratio=mask_ratio,
        executor=executor,
        path=path,
        **more,
    )


def test_step_cost_is_the_bubble_free_plan_at_table_points_and_between() -> None:
    model = cost_model()
    c = StepCoster(model, [GRID], plan_table(model, [GRID], 2))
    for n, fraction in ((1, 0.25), (2, 0.5), (1, 1.0)):
        total = n * GRID
        exact = bubble_free_plan(model.block_costs([(int(fraction * total), total)] * 4)).latency
        assert c.step_s(n, (int(fraction * total),)) == pytest.approx(exact, rel=1e-9)
    # Between two table points the cost lies between theirs (monotone in the mask).
    low, mid, high = (c.step_s(1, (m,)) for m in (64, 72, 80))
    assert low < mid < high
    # A batch size beyond the table is planned on demand.
    assert c.step_s(3, (3 * GRID,)) > c.step_s(2, (2 * GRID,))


def test_alone_it_takes_its_steps_plus_pre_and_post() -> None:
    c = coster()
    cal = StepCalibration(step_intercept_s=0.002, step_slope=1.5, pre_s=0.05, post_s=0.03)
    newcomer = member(c, 10, 0.2)
    p = predict([], [], newcomer, 4, cal)
    step = 0.002 + 1.5 * c.step_s(1, newcomer.masked)
    assert p.start_s == pytest.approx(0.05)
    assert p.finish_s == pytest.approx(0.05 + 10 * step + 0.03)


def test_a_full_batch_makes_the_newcomer_wait_for_the_first_departure() -> None:
    c = coster()
    cal = StepCalibration()
    running = [member(c, 3, 0.1), member(c, 9, 0.1)]
    p = predict(running, [], member(c, 5, 0.1), 2, cal)
    assert p.start_s == pytest.approx(3 * c.step_s(2, (2 * round(0.1 * GRID),)))
    assert p.finish_s > p.start_s
    # With room it joins at once, and a bigger mask finishes later.
    small = predict(running, [], member(c, 5, 0.1), 4, cal)
    large = predict(running, [], member(c, 5, 0.9), 4, cal)
    assert small.start_s == 0.0 and small.finish_s < large.finish_s


def test_encodes_and_decodes_queue_for_their_workers() -> None:
    """With one pre worker a newcomer's encode waits for those placed before it; with one
    post worker its decode waits for the batch-mates that finish in its round. Unmodelled,
    a burst on one executor was predicted 267 ms each and took up to 591 ms."""
    c = coster()
    free = StepCalibration(pre_s=0.05, post_s=0.03)
    one = StepCalibration(pre_s=0.05, post_s=0.03, pre_workers=1, post_workers=1)
    waiting = [member(c, 5, 0.1) for _ in range(3)]
    alone = predict([], waiting, member(c, 5, 0.1), 8, free)
    queued = predict([], waiting, member(c, 5, 0.1), 8, one)
    assert queued.start_s >= 4 * 0.05 > alone.start_s  # three encodes ahead of it, then its own
    two = replace(one, pre_workers=2)
    assert alone.start_s < predict([], waiting, member(c, 5, 0.1), 8, two).start_s < queued.start_s

    running = [member(c, 5, 0.1), member(c, 5, 0.1)]  # both leave in its round
    nopre = replace(free, pre_s=0.0)
    lone = predict(running, [], member(c, 5, 0.1), 8, nopre)
    decode_q = predict(running, [], member(c, 5, 0.1), 8, replace(nopre, post_workers=1))
    assert decode_q.finish_s - lone.finish_s == pytest.approx(2 * 0.03)
    # Leaving 55 rounds after them, their decodes are long done: no wait.
    later = predict(running, [], member(c, 60, 0.1), 8, nopre)
    assert predict(running, [], member(c, 60, 0.1), 8, replace(nopre, post_workers=1)) == later
    # Leaving 4 short rounds after them, it still waits for the rest of their decodes.
    soon = predict(running, [], member(c, 9, 0.1), 8, replace(nopre, post_workers=1))
    assert soon.finish_s > predict(running, [], member(c, 9, 0.1), 8, nopre).finish_s


def test_results_that_queued_for_a_worker_do_not_teach_the_service_time() -> None:
    cluster = ClusterView()
    view = view_with(cluster, "a")
    view.workers = (1, 1)
    result = answer(
        0.2,
        "a",
        InvokePath.MASKAWARE,
    )
    result.timings = Timings(pre_ms=40.0, post_ms=60.0)
    for token in range(2):  # the first result is cold, the second teaches
        view.place(token, request(0.2), now=10.0 * token)
        view.finish(token, 10.0 * token + 1.0, result)
    assert (view.overheads.pre_s, view.overheads.post_s) == pytest.approx((0.04, 0.06))
    view.place(5, request(0.2), now=100.0)
    view.place(6, request(0.2), now=100.0)  # encodes after 5: its pre_ms includes the wait
    first = answer(
        0.2,
        "a",
        InvokePath.MASKAWARE,
    )
    first.timings = Timings(pre_ms=40.0, post_ms=60.0)
    view.finish(5, 101.0, first)
    second = answer(
        0.2,
        "a",
        InvokePath.MASKAWARE,
    )
    second.timings = Timings(pre_ms=400.0, post_ms=600.0)  # queued behind the first
    view.finish(6, 101.05, second)  # and its decode waited for the first's
    assert (view.overheads.pre_s, view.overheads.post_s) == pytest.approx((0.04, 0.06))


def test_each_overhead_average_starts_at_its_own_first_observation() -> None:
    from retouch.platform.control.calibration import Overheads

    overheads = Overheads()
    overheads.observe(0.5, 0.06, pre_queued=True)  # its encode queued: the decode teaches
    overheads.observe(0.04, 0.9, post_queued=True)  # and here the encode
    assert (overheads.pre_s, overheads.post_s) == pytest.approx((0.04, 0.06))


def test_a_pools_cold_first_results_do_not_linger_in_its_overheads() -> None:
    """A new pool's first decodes are slow (cold workers, contended cores): once most
    recent ones are warm, the prediction uses a warm time, not a blend that stays long."""
    from retouch.platform.control.calibration import Overheads

    overheads = Overheads()
    for post_s in (1.85, 1.6, 0.8, 0.78, 0.82):
        overheads.observe(0.55, post_s)
    assert overheads.post_s == pytest.approx(0.82)
    assert len(overheads.post_samples) == 5


def test_drift_scales_the_steps() -> None:
    c = coster()
    base = predict([member(c, 4, 0.3)], [], member(c, 4, 0.3), 4, StepCalibration())
    slow = predict([member(c, 4, 0.3)], [], member(c, 4, 0.3), 4, StepCalibration(scale=2.0))
    assert slow.finish_s == pytest.approx(2 * base.finish_s)


def test_mask_footprint_counts_tokens_a_pixel_touches() -> None:
    mask = np.zeros((64, 64), dtype=bool)
    mask[0:8, 0:8] = True  # one 8-px token, one 16-px token
    mask[16:24, 40:48] = True  # one more of each
    fp = MaskFootprint.of(mask)
    assert fp.masked[8] == 2 and fp.masked[16] == 2 and fp.masked[32] == 2
    assert fp.on([16 * 16]) == (2,)  # 4-px tokens on a 64-px mask: the nearest size, 8 px
    assert fp.ratio == pytest.approx(128 / 4096)


def test_a_grid_with_a_reference_images_tokens_counts_the_images_own() -> None:
    """Kontext's grid is the image's 16-px grid and the reference's after it (2 x 16
    tokens of a 64-px image): its masked tokens are the 16-px grid's, not those of the
    8-px grid whose size is nearest by area."""
    mask = np.zeros((64, 64), dtype=bool)
    for top, left in ((0, 0), (8, 0), (0, 16), (40, 40)):  # the first two: one 16-px token
        mask[top : top + 8, left : left + 8] = True
    fp = MaskFootprint.of(mask)
    assert (fp.masked[8], fp.masked[16]) == (4, 3)
    assert fp.on([16]) == (3,) and fp.on([2 * 16]) == (3,)


@pytest.mark.parametrize("shape", ["rect", "ellipse", "blob"])
@pytest.mark.parametrize("ratio", [0.05, 0.2, 0.6])
@pytest.mark.parametrize("halo", [0, 2])
def test_mask_footprint_is_what_the_executor_computes(shape: str, ratio: float, halo: int) -> None:
    """The gateway's token counts equal the executor's own: the pipeline's nearest resize
    onto the latent grid, the halo, max-pooled per level (``runtime/maskaware``). An
    any-pixel count put a 0.6 blob at every token where the executor computes 83 %."""
    torch = pytest.importorskip("torch")
    from retouch.functions.demo.images import mask_of_ratio
    from retouch.runtime.maskaware.inpaint import latent_mask
    from retouch.runtime.maskaware.request import token_sets
    from retouch.runtime.maskaware.tokens import level_sizes

    size = 512
    mask = np.asarray(mask_of_ratio((size, size), ratio, shape, seed=3)) > 0
    condition = torch.from_numpy(mask.astype(np.float32))[None, None]
    latent = latent_mask(condition, (size // 8, size // 8))[0, 0] > 0.5
    sets = token_sets(latent, level_sizes(size // 8, size // 8, 4), halo=halo)
    fp = MaskFootprint.of(mask, halo)
    for (h, _w), tokens in sets.items():
        assert fp.masked[size // h] == tokens.count, (size // h, shape, ratio)


def view_with(cluster: ClusterView, name: str, max_batch: int = 4, host: bool = True):
    model = cost_model()
    model.extra["step_table"] = plan_table(model, [GRID], max_batch)
    state = ExecutorState(
        name=name,
        pid=0,
        device="cpu",
        engine=EngineStats(max_batch=max_batch),
        cost_models={"m": model.to_dict()},
        templates={"fn": {"t": TemplateStatus(state=BakeState.BAKED, host=host)}},
    )
    view = cluster.add(name, max_batch, 2 * max_batch)
    view.observe_state(state, cluster.costers)
    return view


def request(ratio: float, template: str = "t", slo_s: float | None = None) -> PlacementRequest:
    mask = np.zeros((256, 256), dtype=bool)
    side = int(256 * ratio**0.5)
    mask[:side, :side] = True
    fp = MaskFootprint.of(mask)
    return PlacementRequest("fn", template, fp.ratio, "m", 10, fp, slo_s)


class Handle:
    """A stand-in for the pool's ``ExecutorHandle``: what the queue and the policies read.
    ``inflight`` follows the view until the queue counts its own bindings into it."""

    def __init__(self, view, slots: int | None = None) -> None:
        self.view, self.name = view, view.name
        self.slots = view.slots if slots is None else slots
        self._inflight: int | None = None

    @property
    def inflight(self) -> int:
        return self.view.inflight if self._inflight is None else self._inflight

    @inflight.setter
    def inflight(self, count: int) -> None:
        self._inflight = count


def test_view_follows_place_progress_finish_and_learns_drift() -> None:
    cluster = ClusterView()
    view = view_with(cluster, "a", host=False)
    assert view.tier("fn", "t") is Residency.DISK
    idle = view.predict(request(0.2))
    hosted = view_with(cluster, "b")
    # on disk, it joins once its load (beyond what its encode hides) is done
    assert idle.start_s == pytest.approx(view.overheads.disk_load_s)
    assert idle.finish_s == pytest.approx(
        hosted.predict(request(0.2)).finish_s + view.overheads.disk_load_s
    )
    # the load starts with the encode (the executor's prefetch): the longer of the two
    view.overheads.pre_s, view.overheads.version = 0.5 * view.overheads.disk_load_s, 1
    assert view.predict(request(0.2)).start_s == pytest.approx(view.overheads.disk_load_s)
    view.overheads.pre_s, view.overheads.version = 2 * view.overheads.disk_load_s, 2
    assert view.predict(request(0.2)).start_s == pytest.approx(view.overheads.pre_s)
    view.overheads.pre_s, view.overheads.version = 0.0, 3
    placed = view.place(1, request(0.2), now=100.0)
    assert placed is not None and placed.predicted == idle
    # the executor prefetches a template on disk as the invocation arrives
    assert view.tier("fn", "t") is Residency.HOST
    idle = hosted.predict(request(0.2))
    view.place(9, request(0.2, template="new"), now=100.0)
    assert view.tier("fn", "new") is Residency.BAKING  # not baked there: its bake is queued
    view.finish(9, 100.0, None)
    busier = view.predict(request(0.2))
    assert busier.finish_s > idle.finish_s  # it shares the batch now
    view.progress(1, 9, 10)  # nearly done: the newcomer barely waits for it
    assert view.predict(request(0.2)).finish_s < busier.finish_s
    result = answer(
        0.2,
        "a",
        InvokePath.MASKAWARE,
        cache=CacheRead(tier=CacheTier.DISK, wait_ms=5.0),
    )
    error = view.finish(1, 100.0 + 2 * placed.predicted.finish_s, result)  # twice as long
    assert error == pytest.approx(0.5)
    assert view.calibration.drift == {}  # an executor's first result is cold: not learnt
    assert view.tier("fn", "t") is Residency.HOST  # read: now host-resident
    assert view.inflight == 0
    again = view.place(2, request(0.2), now=200.0)
    assert again is not None
    view.finish(2, 200.0 + 2 * again.predicted.finish_s, result)
    assert view.calibration.scale(0) > 1.0  # learnt: its drift with nothing else placed


def test_an_edit_that_reads_no_row_is_predicted_in_full_and_moves_no_template() -> None:
    """An edit with its own reference image computes every token: on an executor holding
    its template in host memory it is predicted as where the template is not baked, costs
    no load or bake there, and neither its placement nor its result changes the mirror."""
    cluster = ClusterView()
    view = view_with(cluster, "a")
    unbaked = view.predict(request(0.2, template="other"))
    own = dataclasses.replace(request(0.2), full=True)
    assert view.predict(own).finish_s == pytest.approx(unbaked.finish_s)
    assert view.predict(own).finish_s > view.predict(request(0.2)).finish_s
    assert view.residency_cost_s(own) == view.load_s(own) == 0.0
    placed = view.place(1, own, now=100.0)
    assert placed is not None and view.tier("fn", "t") is Residency.HOST
    result = answer(
        0.2,
        "a",
        InvokePath.STOCK,
    )
    view.finish(1, 100.0 + placed.predicted.finish_s, result)
    assert view.tier("fn", "t") is Residency.HOST  # a stock result would mark it baking


def test_pre_and_post_times_are_learnt_pool_wide() -> None:
    """An executor that got no work since its slow, cold start is not predicted slow for
    ever: the time around the steps is the pool's, learnt from every executor."""
    cluster = ClusterView()
    busy, idle = view_with(cluster, "busy"), view_with(cluster, "idle")
    timings = Timings(pre_ms=40.0, post_ms=60.0)
    result = answer(
        0.2,
        "busy",
        InvokePath.MASKAWARE,
    )
    result.timings = timings
    for token in range(3):
        placed = busy.place(token, request(0.2), now=float(token))
        assert placed is not None
        busy.finish(token, token + placed.predicted.finish_s, result)
    assert idle.overheads is busy.overheads
    assert idle.overheads.pre_s == pytest.approx(0.04) and idle.overheads.post_s == 0.06
    assert idle.predict(request(0.2)).finish_s == pytest.approx(busy.predict(request(0.2)).finish_s)


def test_maskaware_prefers_less_work_not_fewer_requests() -> None:
    from retouch.platform.control.placement import LeastRequests, MaskAware

    cluster = ClusterView()

    a, b = (Handle(view_with(cluster, n)) for n in "ab")
    a.view.place(1, request(0.9), 0.0)  # one large edit
    for token in (2, 3):
        b.view.place(token, request(0.02), 0.0)  # two small ones
    new = request(0.3)
    assert LeastRequests().choose([a, b], new) is a
    assert MaskAware(seed=0).choose([a, b], new) is b


def test_a_non_finite_prediction_places_by_requests_instead_of_failing() -> None:
    """A NaN from a broken profile or fit made every score incomparable: the near-tie band
    was empty and the invocation answered 500. It is placed as if unprofiled."""
    from retouch.platform.control.placement import LeastRequests, MaskAware
    from retouch.runtime.prediction import Prediction

    cluster = ClusterView()
    a, b = (Handle(view_with(cluster, n)) for n in "ab")
    a.view.place(1, request(0.9), 0.0)
    a.view.predict = lambda *args, **kw: Prediction(float("nan"), float("nan"))
    for pool in ([a, b], [b, a]):
        chosen = MaskAware(seed=0).choose(pool, request(0.3))
        assert chosen is LeastRequests().choose(pool, request(0.3)) is b


def test_maskaware_in_a_large_pool_predicts_only_a_shortlist_and_finds_the_idle_one() -> None:
    from retouch.platform.control.placement import MaskAware

    cluster = ClusterView()

    pool = [Handle(view_with(cluster, f"e{i}")) for i in range(20)]
    token = 0
    for h in pool[:-1]:  # all busy but the last
        for ratio in (0.5, 0.3):
            token += 1
            h.view.place(token, request(ratio), 0.0)
    exact = []  # executors asked for the newcomer's own prediction

    def counting(view):
        original = view.predict

        def predict(newcomer, **kwargs):
            if newcomer is not None:
                exact.append(view.name)
            return original(newcomer, **kwargs)

        return predict

    for h in pool:
        h.view.predict = counting(h.view)
    assert MaskAware(seed=0, shortlist=4).choose(pool, request(0.2)) is pool[-1]
    assert len(exact) == 4 and "e19" in exact


def test_maskaware_follows_the_template_unless_it_piles_up() -> None:
    from retouch.platform.control.placement import MaskAware

    cluster = ClusterView()

    a, b = (Handle(view_with(cluster, n)) for n in "ab")
    b.view.residency[("fn", "t")] = Residency.ABSENT  # a bake there
    policy = MaskAware(seed=0)
    assert all(policy.choose([a, b], request(0.2)) is a for _ in range(5))
    for token in range(4):  # a is now far busier than b
        a.view.place(token, request(0.9), 0.0)
    assert policy.choose([a, b], request(0.2)) is b


def test_maskaware_splits_templates_between_equal_executors() -> None:
    """Near-ties go to the template's rendezvous-hash home: each template keeps to one of two
    equal executors, and the templates are split between them (each host tier then holds
    its share instead of every template); an upload has no template to keep."""
    from retouch.platform.control.placement import MaskAware

    cluster = ClusterView()
    a, b = (Handle(view_with(cluster, n)) for n in "ab")
    policy = MaskAware(seed=0)
    homes = {}
    for i in range(12):
        chosen = {policy.choose([a, b], request(0.2, f"t{i}")).name for _ in range(6)}
        assert len(chosen) == 1  # the same home every time
        homes[f"t{i}"] = chosen.pop()
    assert set(homes.values()) == {"a", "b"}
    uploads = {policy.choose([a, b], request(0.2, "")).name for _ in range(20)}
    assert uploads == {"a", "b"}  # at random


def test_maskaware_keeps_host_tiers_apart_by_what_a_load_would_evict() -> None:
    """Among equal executors a template stays where the host tier holds it, and one held
    nowhere goes where loading it evicts nothing, else the least popular template: the
    hash home alone could crowd one tier with popular templates while the other had room."""
    from retouch.platform.control.placement import MaskAware

    cluster = ClusterView()
    a, b = (Handle(view_with(cluster, n, host=False)) for n in "ab")
    for view in (a.view, b.view):
        view.host_capacity = 2
    for hot in ("hot1", "hot2"):
        a.view.residency[("fn", hot)] = Residency.HOST
    policy = MaskAware(seed=0)
    for _ in range(20):  # the held templates stay on a, and make them popular
        assert policy.choose([a, b], request(0.2, "hot1")) is a
        assert policy.choose([a, b], request(0.2, "hot2")) is a
    news = {policy.choose([a, b], request(0.2, f"new{i}")).name for i in range(12)}
    assert news == {"b"}  # b has room; a would evict a popular template
    for cold in ("cold1", "cold2"):
        b.view.residency[("fn", cold)] = Residency.HOST
        assert policy.choose([a, b], request(0.2, cold)) is b
    # Both full: a load evicts a's hot1 or b's cold1 (each tier's least recently used).
    assert {policy.choose([a, b], request(0.2, f"next{i}")).name for i in range(12)} == {"b"}
    # Unknown tier sizes: the rendezvous-hash split of before.
    for view in (a.view, b.view):
        view.host_capacity = None
    homes = {policy.choose([a, b], request(0.2, f"other{i}")).name for i in range(12)}
    assert homes == {"a", "b"}


def test_template_hash_is_consistent_and_moves_little() -> None:
    from retouch.platform.control.placement import TemplateHash

    class Named:  # consistent hashing reads names only
        def __init__(self, name: str) -> None:
            self.name, self.inflight, self.slots = name, 0, 8

    pool = [Named(f"e{i}") for i in range(4)]
    policy = TemplateHash()
    reqs = [PlacementRequest("fn", f"t{i}", 0.1) for i in range(40)]
    before = {r.template: policy.choose(pool, r).name for r in reqs}
    assert before == {r.template: policy.choose(pool, r).name for r in reqs}
    assert len(set(before.values())) >= 3  # spread over the pool
    after = {r.template: policy.choose(pool[:3], r).name for r in reqs}
    moved = [t for t in before if before[t] != after[t]]
    assert all(before[t] == "e3" for t in moved)  # only the removed executor's share moves


def test_slo_admission_refuses_with_retry_after_and_drops_the_infeasible() -> None:
    import asyncio

    from retouch.functions.errors import Overloaded
    from retouch.platform.control.placement import MaskAware
    from retouch.platform.control.queue import InvocationQueue, QueueLimits

    cluster = ClusterView()

    handle = Handle(view_with(cluster, "a", max_batch=1), slots=1)
    alone = handle.view.predict(request(0.5)).finish_s

    async def scenario() -> None:
        now = [0.0]
        queue = InvocationQueue(
            QueueLimits(), MaskAware(seed=0), lambda fn: [handle], lambda: now[0]
        )
        assert queue.admit_slo(request(0.5, slo_s=10 * alone)) > 0  # feasible: admitted
        with pytest.raises(Overloaded) as err:
            queue.admit_slo(request(0.5, slo_s=alone / 2))
        assert err.value.code == "slo_unattainable" and err.value.retry_after_s >= 1
        assert err.value.detail is not None and err.value.detail["stage"] == "arrival"
        assert queue.stats.slo_rejected == 1
        # One runs; a second waits for its slot; time passes beyond what its SLO allows.
        first = await queue.acquire(request(0.5, slo_s=10 * alone), 1e9, token=1)
        waiting = asyncio.create_task(
            queue.acquire(request(0.5, slo_s=1.5 * alone), 1e9, token=2, service_s=alone)
        )
        await asyncio.sleep(0)
        now[0] = alone  # the first is still running: the second can no longer make it
        queue.release(first, token=1)
        with pytest.raises(Overloaded) as dropped:
            await waiting
        assert dropped.value.detail == {"stage": "queued", "queued_ms": round(alone * 1e3, 1)}
        assert queue.stats.slo_dropped == 1
        # Admission off: nothing is refused.
        off = InvocationQueue(
            QueueLimits(admission=False), MaskAware(seed=0), lambda fn: [handle], lambda: now[0]
        )
        off.admit_slo(request(0.5, slo_s=alone / 2))

    asyncio.run(scenario())


def test_every_placement_a_spec_may_name_exists_and_bad_ones_are_refused() -> None:
    from retouch.functions.errors import InvalidSpec
    from retouch.functions.spec import PLACEMENTS, parse_spec
    from retouch.platform.control.placement import POLICIES

    assert set(PLACEMENTS) == set(POLICIES)
    doc = {"name": "f", "model": "retouch:tiny-flux", "family": "flux-inpaint", "resolution": 128}
    doc["templates"] = {"t": {"prompt": "p", "seed": 1}}
    assert parse_spec({**doc, "placement": "template-hash"}).placement == "template-hash"
    assert parse_spec(doc).placement is None
    with pytest.raises(InvalidSpec) as err:
        parse_spec({**doc, "placement": "random"})
    assert err.value.field == "placement"
    for bad in (0, -5, "fast"):
        with pytest.raises(InvalidSpec) as err:
            parse_spec({**doc, "slo": {"latency_ms": bad}})
        assert err.value.field == "slo.latency_ms"


def test_expected_arrivals_slow_the_newcomer_where_the_batch_costs_more() -> None:
    from retouch.runtime.prediction import Arrivals

    c = coster()
    cal = StepCalibration()
    newcomer = member(c, 10, 0.3)
    alone = predict([], [], newcomer, 4, cal)
    step = alone.finish_s / 10
    busy = predict([], [], newcomer, 4, cal, Arrivals(2 * step, member(c, 10, 0.3)))
    rare = predict([], [], newcomer, 4, cal, Arrivals(100 * alone.finish_s, member(c, 10, 0.3)))
    assert busy.finish_s > alone.finish_s  # others join its batch and every step costs more
    assert rare.finish_s == pytest.approx(alone.finish_s)
    assert predict([], [], None, 4, cal, Arrivals(step, member(c, 10, 0.3))).finish_s == 0.0


def test_an_idle_executor_expects_no_arrivals_so_admission_cannot_lock_out() -> None:
    """A burst teaches a short placement gap; once the executor is idle again, predictions
    (and so SLO admission) must not keep counting that burst's arrivals."""
    cluster = ClusterView()
    view = view_with(cluster, "a")
    alone = view.predict(request(0.3)).finish_s
    for token in range(6):  # a burst: six placements 1 ms apart
        view.place(token, request(0.3), now=token * 0.001)
    assert view.predict(request(0.3)).finish_s > alone  # busy, and more expected
    for token in range(6):
        view.finish(token, 10.0, None)
    assert view.predict(request(0.3)).finish_s == pytest.approx(alone)


def test_time_outside_the_executors_account_is_learnt_and_predicted() -> None:
    """What the executor's timings leave out (the request and answer between gateway and
    executor) is measured from every result and added to later completions: predictions
    came out ~10 % short at half load without it."""
    cluster = ClusterView()
    view, fresh = view_with(cluster, "a"), view_with(cluster, "b")
    before = fresh.predict(request(0.3)).finish_s
    timings = Timings(queue_ms=5.0, run_ms=130.0)  # no encode or decode to learn
    result = answer(
        0.3,
        "a",
        InvokePath.MASKAWARE,
        timings=timings,
    )
    for token in range(4):  # placed one at a time, each answered 0.045 s after its 0.135 s
        view.place(token, request(0.3), now=10.0 * token)
        view.finish(token, 10.0 * token + 0.180, result)
    assert view.overheads.hop_s == pytest.approx(0.045)
    # pool-wide, like the encode and decode times
    assert fresh.predict(request(0.3)).finish_s == pytest.approx(before + 0.045, abs=0.02)


def test_drift_learnt_under_load_does_not_apply_to_an_idle_executor() -> None:
    cluster = ClusterView()
    view = view_with(cluster, "a")
    alone = view.predict(request(0.3)).finish_s
    view.calibration.drift = {1: 2.0}  # learnt in a burst, with one placed
    assert view.predict(request(0.3)).finish_s == pytest.approx(alone)
    view.place(1, request(0.3), now=0.0)
    assert view.predict(request(0.3)).finish_s > 2 * alone  # busy: drift applies


def test_drift_is_learnt_per_occupancy_and_applied_only_there() -> None:
    """Results that came out twice as long as predicted, for invocations placed beside one
    other, lengthen later predictions made beside one other, not those made on a full
    executor, where nobody unforeseen could join (one drift for both had admission refuse
    work near the SLO that would have made it)."""
    cluster = ClusterView()
    view, fresh = view_with(cluster, "a"), view_with(cluster, "b")
    result = answer(
        0.3,
        "a",
        InvokePath.MASKAWARE,
    )
    for token in range(0, 12, 2):
        view.place(token, request(0.3), now=float(token))
        placed = view.place(token + 1, request(0.3), now=float(token))  # beside one other
        view.finish(token + 1, token + 2 * placed.predicted.finish_s, result)
        view.finish(token, token + 2 * placed.predicted.finish_s, None)
    assert view.calibration.scale(1) > 1.5 and view.calibration.scale(4) == 1.0
    for token, other in ((100, view), (100, fresh)):
        other.place(token, request(0.3), now=0.0)
    beside_one = view.predict(request(0.3)).finish_s
    assert beside_one > 1.5 * fresh.predict(request(0.3)).finish_s
    for token in range(101, 104):  # four placed: the batch is full
        view.place(token, request(0.3), now=0.0)
        fresh.place(token, request(0.3), now=0.0)
    assert view.predict(request(0.3)).finish_s == pytest.approx(
        fresh.predict(request(0.3)).finish_s
    )


def test_admission_probes_a_learnt_refusal_once_per_interval_on_an_idle_executor() -> None:
    """Learnt pre/post times above the SLO refused everything on an idle pool for ever;
    the half-open probe lets one through per interval when the profile alone says the SLO
    can be met, and never when the executor is busy or the profile itself misses it."""
    from retouch.functions.errors import Overloaded
    from retouch.platform.control.placement import MaskAware
    from retouch.platform.control.queue import PROBE_INTERVAL_S, InvocationQueue, QueueLimits

    cluster = ClusterView()

    handle = Handle(view_with(cluster, "a"), slots=4)
    alone = handle.view.predict(request(0.5)).finish_s
    cluster.overheads.observe(2 * alone, 2 * alone)  # learnt in a burst

    now = [0.0]
    queue = InvocationQueue(QueueLimits(), MaskAware(seed=0), lambda fn: [handle], lambda: now[0])
    queue.admit_slo(
        request(0.5, slo_s=2 * alone)
    )  # refused by what was learnt, admitted as a probe
    assert queue.stats.slo_probes == 1
    with pytest.raises(Overloaded):
        queue.admit_slo(request(0.5, slo_s=2 * alone))  # within the interval: refused
    with pytest.raises(Overloaded):
        queue.admit_slo(request(0.5, slo_s=alone / 2))  # the profile itself misses it: never probed
    now[0] += PROBE_INTERVAL_S
    handle.view.place(1, request(0.5), now[0])
    with pytest.raises(Overloaded):
        queue.admit_slo(request(0.5, slo_s=2 * alone))  # the executor is busy: no probe
    assert queue.stats.slo_probes == 1
    now[0] += PROBE_INTERVAL_S
    handle.view.finish(1, now[0], None)
    queue.admit_slo(
        request(0.5, slo_s=2 * alone), early=True
    )  # the check before the body: not used up
    queue.admit_slo(request(0.5, slo_s=2 * alone))  # so the check after decoding can use it
    assert queue.stats.slo_probes == 2


def test_admission_margin_follows_how_late_admitted_invocations_ran() -> None:
    from retouch.functions.errors import Overloaded
    from retouch.platform.control.placement import MaskAware
    from retouch.platform.control.queue import InvocationQueue, QueueLimits

    cluster = ClusterView()

    handle = Handle(view_with(cluster, "a"), slots=4)
    alone = handle.view.predict(request(0.5)).finish_s
    fits = request(0.5, slo_s=1.5 * alone)
    queue = InvocationQueue(QueueLimits(), MaskAware(seed=0), lambda fn: [handle], lambda: 0.0)
    queue.admit_slo(fits)  # the prediction fits: admitted
    for _ in range(32):
        queue.observe_outcome(2.0)  # invocations took twice their prediction
    assert queue.margin == 2.0
    queue.admit_slo(fits)  # refused by the margin, let through as the idle pool's probe
    assert queue.stats.slo_probes == 1
    with pytest.raises(Overloaded):
        queue.admit_slo(fits)
    # The margin is a quantile of the ratios: the default 0.8 follows the slow fifth.
    mixed = InvocationQueue(QueueLimits(), MaskAware(seed=0), lambda fn: [handle], lambda: 0.0)
    median = InvocationQueue(
        QueueLimits(margin_quantile=0.5), MaskAware(seed=0), lambda fn: [handle], lambda: 0.0
    )
    for k in range(40):
        ratio = 1.6 if k % 4 == 0 else 1.1  # a quarter ran 60 % late
        mixed.observe_outcome(ratio)
        median.observe_outcome(ratio)
    assert mixed.margin == 1.6 and median.margin == 1.1


def test_a_join_that_would_make_a_running_invocation_late_is_not_taken() -> None:
    """PatchedServe's rule at binding: a newcomer joins only if every invocation already
    there still meets its deadline with it in the batch."""
    cluster = ClusterView()
    view = view_with(cluster, "a")
    alone = view.predict(request(0.5)).finish_s
    view.place(1, request(0.5), 0.0, deadline=alone * 1.001)  # no slack at all
    assert not view.keeps_deadlines(request(0.5), 0.0)
    loose = view_with(cluster, "b")
    loose.place(1, request(0.5), 0.0, deadline=alone * 10)
    assert loose.keeps_deadlines(request(0.5), 0.0)
    free = view_with(cluster, "c")
    free.place(1, request(0.5), 0.0)  # no deadline: nothing to keep
    assert free.keeps_deadlines(request(0.5), 0.0)


def test_a_member_decoding_frees_one_batch_place_not_the_executor() -> None:
    """Late binding binds when batch room opens within a step: a member whose steps are
    done is decoding and holds no place, but it frees one place, not room for a burst."""
    from retouch.platform.control.queue import has_room

    HORIZON = 0.01  # s: shorter than the 9 steps left (this cost model's steps are short)
    cluster = ClusterView()
    handle = Handle(view_with(cluster, "a", max_batch=2), slots=4)
    view = handle.view
    for token in (1, 2):
        view.place(token, request(0.3), now=0.0)
        view.progress(token, 1, 10)  # both running, 9 steps left
    assert view.next_start_s() > HORIZON and not has_room(handle, True, HORIZON, request(0.3))
    view.progress(1, 10, 10)  # its last step is done: decoding, out of the batch
    assert view.next_start_s() == 0.0 and has_room(handle, True, HORIZON, request(0.3))
    view.place(3, request(0.3), now=0.0)  # bound into that place
    assert view.next_start_s() > HORIZON and not has_room(handle, True, HORIZON, request(0.3))


def test_late_binding_binds_a_template_load_ahead_of_batch_room() -> None:
    """With late binding an invocation binds once batch room is predicted within what it
    needs before joining there: its template's load from disk runs during the wait, as it
    would have in the executor's own queue. One whose template is in host memory still
    waits for the room itself."""
    from retouch.platform.control.queue import has_room

    HORIZON = 0.001  # s: shorter than one step of this cost model
    cluster = ClusterView()
    handle = Handle(view_with(cluster, "a", max_batch=2, host=False), slots=4)
    view = handle.view
    for token in (1, 2):
        view.place(token, request(0.3), now=0.0)  # template "t" is prefetched: host
        view.progress(token, 9, 10)  # both running, 1 step left
    start = view.next_start_s()
    assert 0 < start < 1.0
    view.residency[("fn", "cold")] = Residency.DISK
    view.overheads.disk_load_s = 2 * start
    assert not has_room(handle, True, HORIZON, request(0.3))  # host: waits for the room
    assert has_room(handle, True, HORIZON, request(0.3, template="cold"))  # loads meanwhile
    view.overheads.disk_load_s = 0.5 * start  # a load shorter than the wait: not yet
    assert not has_room(handle, True, HORIZON, request(0.3, template="cold"))


def test_each_invocation_bound_ahead_waits_for_a_departure_of_its_own() -> None:
    """Invocations bound to an executor before they joined take the places that free
    first, so the next one's room is a later departure: a burst does not all see the
    same room (and pile onto one executor)."""
    cluster = ClusterView()
    view = view_with(cluster, "a", max_batch=2)
    for token, done in ((1, 2), (2, 6)):
        view.place(token, request(0.3), now=0.0)
        view.progress(token, done, 10)  # running: 8 and 4 steps left
    first = view.next_start_s()
    view.place(3, request(0.3), now=0.0)  # bound ahead, not joined yet
    second = view.next_start_s()
    assert 0 < first < second  # it waits for the second departure
    assert second == pytest.approx(2 * first)  # 8 steps left against 4, same batch


def test_late_binding_chooses_among_all_executors_once_one_has_room() -> None:
    """The moment to bind is when some executor has batch room; the choice is then among
    every executor with a free slot (the prediction counts each one's wait for room)."""
    from retouch.platform.control.queue import bindable

    cluster = ClusterView()
    full = Handle(view_with(cluster, "full", max_batch=1), slots=2)
    full.view.place(1, request(0.3), now=0.0)
    full.view.progress(1, 1, 10)
    idle = Handle(view_with(cluster, "idle", max_batch=1), slots=2)

    def everything(c: Handle) -> bool:
        return True

    assert bindable([full], True, 0.0, request(0.3), everything) == []  # it waits
    assert bindable([full, idle], True, 0.0, request(0.3), everything) == [full, idle]
    assert bindable([full, idle], False, 0.0, request(0.3), everything) == [full, idle]
    full.view.place(2, request(0.3), now=0.0)  # both its slots taken
    assert bindable([full, idle], True, 0.0, request(0.3), everything) == [idle]


def test_a_decode_that_queued_stands_in_until_an_unqueued_one_is_seen() -> None:
    """Left at 0 while every decode of a burst queued for the one post worker, the
    prediction saw no decode backlog anywhere, and one executor took all 12 edits of a
    burst, predicted ~10x short (tests/e2e/test_placement.py)."""
    from retouch.platform.control.calibration import Overheads

    o = Overheads()
    o.observe(0.02, 0.09, post_queued=True)
    o.observe(0.02, 0.07, post_queued=True)
    assert o.post_s == 0.07  # the shortest queued time: an upper bound, better than 0
    o.observe(0.02, 0.03)
    assert o.post_s == 0.03  # a decode that did not queue is its service time
    o.observe(0.02, 0.5, post_queued=True)
    assert o.post_s == 0.03  # once one is known, queued times teach nothing
    assert o.pre_s == 0.02


def slow_link_model() -> CostModel:
    """The test cost model behind a link so slow that loading the unmasked rows bounds
    every sparse step (100 ms per MB)."""
    return replace(cost_model(), load=LinearFit(0.0, 1e-7, 1.0))


def test_a_batch_of_device_resident_members_is_costed_without_loads() -> None:
    model = slow_link_model()
    c = StepCoster(
        model,
        [GRID],
        plan_table(model, [GRID], 2),
        plan_table(model, [GRID], 2, resident=True),
    )
    masked = round(0.2 * 2 * GRID)
    per_block = [(masked, 2 * GRID, 0)] * 4
    compute_only = bubble_free_plan(model.block_costs(per_block)).latency
    assert c.step_s0(2, masked, resident=2) == pytest.approx(compute_only, rel=0.02)
    streamed, half = c.step_s0(2, masked), c.step_s0(2, masked, resident=1)
    assert compute_only < half < streamed
    assert half == pytest.approx((streamed + c.step_s0(2, masked, resident=2)) / 2)
    # without a shipped table the gateway plans the resident rows itself, once
    lazy = StepCoster(model, [GRID], plan_table(model, [GRID], 2))
    assert lazy.step_s0(2, masked, resident=2) == pytest.approx(c.step_s0(2, masked, 2))


def test_a_device_resident_template_is_predicted_faster_and_placed_first() -> None:
    """An executor that reports the template in its device tier: the gateway knows it
    (``Residency.DEVICE``), predicts no loads for its steps, and ties go there."""
    cluster = ClusterView()
    model = slow_link_model()
    model.extra["step_table"] = plan_table(model, [GRID], 4)
    model.extra["resident_step_table"] = plan_table(model, [GRID], 4, resident=True)
    views = {}
    for name, device in (("host", False), ("gpu", True)):
        status = TemplateStatus(state=BakeState.BAKED, host=True, device=device)
        state = ExecutorState(
            name=name,
            pid=0,
            device="cpu",
            engine=EngineStats(max_batch=4),
            cost_models={"m": model.to_dict()},
            templates={"fn": {"t": status}},
        )
        views[name] = cluster.add(name, 4, 8)
        views[name].observe_state(state, cluster.costers)
    assert views["gpu"].tier("fn", "t") is Residency.DEVICE
    assert views["host"].tier("fn", "t") is Residency.HOST
    on_gpu, on_host = (views[n].predict(request(0.2)) for n in ("gpu", "host"))
    assert on_gpu.finish_s < 0.5 * on_host.finish_s
    assert views["gpu"].load_s(request(0.2)) == 0.0
    from retouch.platform.control.placement import MaskAware

    policy = MaskAware(seed=0)
    handles = [Handle(views["host"]), Handle(views["gpu"])]
    assert {policy.choose(handles, request(0.2)).name for _ in range(8)} == {"gpu"}
    # placing an edit there keeps the template in the device tier (not demoted to host)
    views["gpu"].place(1, request(0.2), now=0.0)
    assert views["gpu"].tier("fn", "t") is Residency.DEVICE


def test_template_status_carries_device_residency_on_the_wire() -> None:
    status = TemplateStatus(state=BakeState.BAKED, host=True, device=True)
    assert TemplateStatus.from_wire(status.to_wire()) == status
    assert TemplateStatus.from_wire({"state": "baked"}).device is False


def test_a_copy_in_another_dtype_is_predicted_from_its_own_cost_model() -> None:
    """An executor reports a cost model per loaded copy (``ModelSource.key``): a function
    on the bf16 copy of model ``m`` is predicted from that copy's profile, not the fp32 one."""
    cluster = ClusterView()
    fp32 = cost_model()
    faster = [replace(b, compute=LinearFit(5e-4, 5e-6, 1.0)) for b in fp32.blocks]
    bf16 = replace(fp32, blocks=faster, extra=dict(fp32.extra))
    copy = '{"dtype": "bf16", "model": "m"}'
    docs = {}
    for key, model in (("m", fp32), (copy, bf16)):
        model.extra["step_table"] = plan_table(model, [GRID], 4)
        docs[key] = model.to_dict()
    state = ExecutorState(
        name="e", pid=0, device="cpu", engine=EngineStats(max_batch=4), cost_models=docs
    )
    view = cluster.add("e", 4, 8)
    view.observe_state(state, cluster.costers)
    plain = request(0.5)
    on_copy = replace(plain, copy=copy)
    assert plain.cost_key == "m" and on_copy.cost_key == copy
    assert 0 < view.executor_s(on_copy) < view.executor_s(plain)  # the faster copy's profile
