"""The engine on a real tiny Flux model with real pre/post worker processes: joins between
steps, static batches, interruptions, results independent of batching, and its lifecycle
(a dead loop fails every invocation and refuses more; stop fails what is unfinished; a
failed decode fails only its own invocation)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxInpaintPipeline

from retouch.functions.demo.images import mask_of_ratio, template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.errors import Canceled
from retouch.runtime.engine import (
    Engine,
    EngineConfig,
    EngineMode,
    EngineUnavailable,
    Work,
    WorkStatus,
)
from retouch.runtime.executor.stages import WorkerStages
from retouch.runtime.maskaware.editor import BakeCancelled, EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.workers import PrePostPool

MODEL = "retouch:tiny-flux"
STEPS = 30  # long enough for a newcomer to arrive mid-batch


@pytest.fixture(scope="module")
def editor(models_dir: Path) -> MaskAwareEditor:
    folder = ensure_demo_model(MODEL, models_dir)
    pipe = FluxInpaintPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return MaskAwareEditor(pipe, "flux-inpaint", torch.device("cpu"))


@pytest.fixture(scope="module")
def baked(editor: MaskAwareEditor) -> tuple[EditRequest, MemoryActivations]:
    image = template_image((128, 128), 3)
    store = MemoryActivations()
    editor.bake(image, "a shelf", 5, STEPS, 3.5, store.writer())
    return EditRequest(
        image, mask_of_ratio((128, 128), 0.2, "ellipse", 1), "a vase", 1, STEPS, 3.5, "a shelf", 5
    ), store


@pytest.fixture(scope="module")
def stages(models_dir: Path) -> Iterator[WorkerStages]:
    pool = PrePostPool(models_dir, "cpu", threads=1)
    for future in pool.load(MODEL, "flux-inpaint"):
        future.result(timeout=120)
    yield WorkerStages(pool)
    pool.close()


def _work(
    editor: MaskAwareEditor, request: EditRequest, store: MemoryActivations | None, seed: int = 1
) -> Work:
    req = EditRequest(
        request.image,
        request.mask,
        request.prompt,
        seed,
        request.steps,
        request.guidance,
        request.template_prompt,
        request.template_seed,
    )
    cache = (
        {"tier": "host", "wait_ms": 0.0} if store is not None else {"tier": "none", "wait_ms": 0.0}
    )
    return Work(
        key="k",
        model=MODEL,
        family="flux-inpaint",
        scheduler="flow-euler",
        editor=editor,
        request=req,
        fmt="raw",
        acquire=lambda: (store.reader() if store else None, cache),
    )


def _wait_steps(work: Work, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(work.batch_sizes) < n:
        assert time.monotonic() < deadline, "the batch did not make progress"
        time.sleep(0.005)


def test_continuous_newcomer_joins_within_one_step(editor, baked, stages) -> None:
    request, store = baked
    engine = Engine(EngineConfig(EngineMode.CONTINUOUS, max_batch=4), stages).start()
    try:
        first = _work(editor, request, store, seed=1)
        ended: list[float] = []  # when each of the first's steps ended
        first.on_step = lambda done, total: ended.append(time.perf_counter())
        f1 = engine.submit(first)
        _wait_steps(first, 3)
        second = _work(editor, request, store, seed=2)
        f2 = engine.submit(second)
        r2, r1 = f2.result(timeout=120), f1.result(timeout=120)
        # ready (encoded) during one of the first's steps, it ran in the next: at most the
        # step under way ended in between, however long a loaded machine made it
        waited = [t for t in ended if second.pre_done < t < second.first_step]
        assert len(waited) <= 1, (len(waited), second.pre_done, second.first_step, ended)
        assert second.first_step < first.last_step  # it ran while the first was running
        assert 2 in r2["engine"]["batch_sizes"] and 2 in r1["engine"]["batch_sizes"]
        assert r1["engine"]["interruptions"] == r2["engine"]["interruptions"] == 0
        assert r1["path"] == r2["path"] == "maskaware"
        assert r2["timings"]["pre_ms"] > 0 and r2["timings"]["post_ms"] > 0
    finally:
        engine.stop()


def test_static_newcomer_waits_for_the_batch(editor, baked, stages) -> None:
    request, store = baked
    engine = Engine(EngineConfig(EngineMode.STATIC, max_batch=4), stages).start()
    try:
        first = _work(editor, request, store, seed=1)
        f1 = engine.submit(first)
        _wait_steps(first, 2)
        second = _work(editor, request, store, seed=2)
        f2 = engine.submit(second)
        f1.result(timeout=120), f2.result(timeout=120)
        assert second.first_step >= first.last_step
        assert set(first.batch_sizes) == {1}
    finally:
        engine.stop()


def test_naive_mode_counts_interruptions(editor, baked) -> None:
    request, store = baked
    engine = Engine(
        EngineConfig(EngineMode.CONTINUOUS, max_batch=4, disaggregated=False), None
    ).start()
    try:
        first = _work(editor, request, store, seed=1)
        f1 = engine.submit(first)
        _wait_steps(first, 2)
        f2 = engine.submit(_work(editor, request, store, seed=2))
        r2, r1 = f2.result(timeout=120), f1.result(timeout=120)
        assert r1["engine"]["interruptions"] >= 1  # the newcomer's encode stalled the first
        assert r2["engine"]["interruptions"] >= 1  # the first's decode stalled the newcomer
        assert engine.counters.interruptions >= 2
    finally:
        engine.stop()


def test_results_do_not_depend_on_batching(editor, baked, stages) -> None:
    request, store = baked
    engine = Engine(EngineConfig(EngineMode.CONTINUOUS, max_batch=4), stages).start()
    try:
        solo = [
            engine.submit(_work(editor, request, store, seed=s)).result(timeout=120) for s in (1, 2)
        ]
        works = [_work(editor, request, store, seed=s) for s in (1, 2)] + [
            _work(editor, request, None, seed=3)
        ]
        together = [f.result(timeout=120) for f in [engine.submit(w) for w in works]]
    finally:
        engine.stop()
    for a, b in zip(solo, together[:2], strict=False):
        x = np.frombuffer(a["output"].image, np.uint8).astype(int)
        y = np.frombuffer(b["output"].image, np.uint8).astype(int)
        assert np.abs(x - y).max() <= 1  # uint8 rounding of float results within 1e-4
    assert together[2]["path"] == "stock"
    stock = editor.stock_edit(works[2].request)
    got = np.frombuffer(together[2]["output"].image, np.uint8).reshape(128, 128, 3).astype(int)
    assert np.abs(got - np.asarray(stock).astype(int)).max() <= 1


# ---- lifecycle: every accepted invocation ends, a dead engine is seen ---------------------


def test_engine_not_started_refuses_work(editor, baked) -> None:
    request, store = baked
    engine = Engine(EngineConfig(disaggregated=False), None)
    assert not engine.alive
    with pytest.raises(EngineUnavailable):
        engine.submit(_work(editor, request, store))


def test_dead_loop_fails_every_invocation_and_refuses_more(editor, baked) -> None:
    request, store = baked
    engine = Engine(EngineConfig(max_batch=2, disaggregated=False), None).start()
    works = [_work(editor, request, store, seed=s) for s in range(3)]  # 2 run, 1 waits
    futures = [engine.submit(w) for w in works]
    _wait_steps(works[0], 1)
    engine.inject_fault("a bug")
    for future in futures:
        with pytest.raises(EngineUnavailable) as err:
            future.result(timeout=60)
        assert err.value.code == "engine_dead"
    assert not engine.alive and "a bug" in (engine.error or "")
    with pytest.raises(EngineUnavailable) as err:
        engine.submit(_work(editor, request, store))
    assert err.value.code == "engine_dead"
    engine.stop()


def test_stop_fails_unfinished_invocations(editor, baked) -> None:
    request, store = baked
    engine = Engine(EngineConfig(max_batch=1, disaggregated=False), None).start()
    works = [_work(editor, request, store, seed=s) for s in range(2)]
    futures = [engine.submit(w) for w in works]
    _wait_steps(works[0], 1)
    engine.stop()
    outcomes = []
    for future in futures:
        try:
            future.result(timeout=60)
            outcomes.append("done")
        except EngineUnavailable as exc:
            outcomes.append(exc.code)
    assert "engine_unavailable" in outcomes  # the waiting one at least; none left hanging
    assert not engine.alive


def test_stop_cancels_a_running_bake_between_two_steps(editor) -> None:
    """A stopping executor (a scale-down, a restart) does not finish a bake nobody waits
    for: the bake stops at its next step and ``stop`` returns."""
    engine = Engine(EngineConfig(max_batch=1, disaggregated=False), None).start()
    asked: list[bool] = []
    outcome: list[str] = []
    started = threading.Event()

    def cancelled() -> bool:
        started.set()
        asked.append(engine.stopping)
        return asked[-1]

    def bake() -> None:
        image = template_image((128, 128), 4)
        try:
            editor.bake(
                image, "a shelf", 6, 100, 3.5, MemoryActivations().writer(), cancelled=cancelled
            )
            outcome.append("baked")
        except BakeCancelled:
            outcome.append("cancelled")

    engine.submit_background(bake)
    assert started.wait(60)
    engine.stop()
    assert outcome == ["cancelled"]
    assert len(asked) < 100 and asked[-1] is True


@dataclass
class FailingDecode:
    """Worker stages whose decode fails for one seed: only that invocation may fail."""

    inner: WorkerStages
    bad_seed: int

    def encode(self, work: Work) -> Future:
        return self.inner.encode(work)

    def decode(self, work: Work, latents: torch.Tensor) -> Future:
        if work.request.seed == self.bad_seed:
            failed: Future = Future()
            failed.set_exception(RuntimeError("decode exploded"))
            return failed
        return self.inner.decode(work, latents)


def test_a_failed_decode_fails_only_its_invocation(editor, baked, stages) -> None:
    request, store = baked
    engine = Engine(EngineConfig(max_batch=4), FailingDecode(stages, bad_seed=2)).start()
    try:
        futures = {s: engine.submit(_work(editor, request, store, seed=s)) for s in (1, 2, 3)}
        assert futures[1].result(timeout=120)["path"] == "maskaware"
        assert futures[3].result(timeout=120)["path"] == "maskaware"
        with pytest.raises(RuntimeError, match="decode exploded"):
            futures[2].result(timeout=120)
        assert engine.alive
    finally:
        engine.stop()


# ---- cancel and step progress ------------------------------------------------------------


def test_cancel_leaves_the_batch_at_the_next_step_and_others_go_on(editor, baked, stages) -> None:
    """A canceled running invocation leaves between two steps; its batch-mate finishes
    with the image it gives alone; one canceled while waiting to join never runs."""
    request, store = baked
    engine = Engine(EngineConfig(EngineMode.CONTINUOUS, max_batch=2), stages).start()
    try:
        solo = engine.submit(_work(editor, request, store, seed=2)).result(timeout=120)
        steps: dict[int, list[tuple[int, int]]] = {1: [], 2: []}
        works = {s: _work(editor, request, store, seed=s) for s in (1, 2, 3)}
        accepted: list[bool] = []

        def hear(seed: int, step: int, total: int) -> None:
            steps[seed].append((step, total))
            if seed == 1 and step == 3:  # cancel between steps 3 and 4, on the engine's thread
                accepted.extend([engine.cancel(works[1]), engine.cancel(works[3])])

        for seed in (1, 2):
            works[seed].on_step = lambda step, total, seed=seed: hear(seed, step, total)
        futures = {s: engine.submit(w) for s, w in works.items()}  # seed 3 waits: batch of 2
        with pytest.raises(Canceled):
            futures[1].result(timeout=60)
        with pytest.raises(Canceled):
            futures[3].result(timeout=60)
        together = futures[2].result(timeout=120)
        assert not engine.cancel(works[2])  # already finished: nothing to cancel
    finally:
        engine.stop()
    assert accepted == [True, True]
    assert [works[s].status for s in (1, 2, 3)] == [
        WorkStatus.CANCELED,
        WorkStatus.DONE,
        WorkStatus.CANCELED,
    ]
    ran = len(works[1].batch_sizes)
    assert ran == 3 < STEPS  # left at the next step boundary
    assert works[3].batch_sizes == []
    assert steps[2] == [(i, STEPS) for i in range(1, STEPS + 1)]  # every step, in order
    assert [s for s, _ in steps[1]] == list(range(1, ran + 1))
    assert engine.counters.canceled == 2
    x = np.frombuffer(solo["output"].image, np.uint8).astype(int)
    y = np.frombuffer(together["output"].image, np.uint8).astype(int)
    assert np.abs(x - y).max() <= 1


def test_a_work_whose_waiter_left_still_ends_done(editor, baked) -> None:
    """A waiter that goes away (asyncio cancels the future it wrapped when its task is
    canceled) leaves the work to finish in the engine: it still ends ``DONE``, not
    ``POSTPROCESSING`` for ever."""
    request, store = baked
    engine = Engine(EngineConfig(EngineMode.CONTINUOUS, disaggregated=False), None).start()
    try:
        work = _work(editor, request, store, seed=4)
        future = engine.submit(work)
        _wait_steps(work, 1)
        assert future.cancel()  # what asyncio.wrap_future does to it
        deadline = time.monotonic() + 120
        while not work.status.finished:
            assert time.monotonic() < deadline, f"the work stayed {work.status}"
            time.sleep(0.01)
    finally:
        engine.stop()
    assert work.status is WorkStatus.DONE
    assert len(work.batch_sizes) == STEPS


def test_step_fit_turns_planned_time_into_observed() -> None:
    """The calibration the gateway's prediction applies: a line when planned times spread,
    the median ratio when they do not (a profile taken on a busier machine: slope < 1)."""
    from retouch.runtime.stepstats import StepRecord, step_overhead

    planned = [100.0, 200.0, 300.0, 400.0, 500.0] * 4
    spread = [StepRecord(1, 0.0, 10 + 0.5 * p, 0.0, 0, 4, p) for p in planned]
    fit = step_overhead(spread)
    assert fit["step_intercept_ms"] == pytest.approx(10) and fit["step_slope"] == pytest.approx(0.5)
    # A quarter of the steps slowed 3x by other work on the device do not move the line.
    slowed = [StepRecord(1, 0.0, 3 * (10 + 0.5 * p), 0.0, 0, 4, p) for p in planned[:5]]
    fit = step_overhead(spread[:15] + slowed)
    assert fit["step_intercept_ms"] == pytest.approx(10, abs=5)
    assert fit["step_slope"] == pytest.approx(0.5, rel=0.05)
    assert step_overhead(spread[:5])["step_intercept_ms"] == 0.0  # too few for a line
    flat = [StepRecord(1, 0.0, 0.25 * 400, 0.0, 0, 4, 400.0) for _ in range(5)]
    assert step_overhead(flat) == {
        "step_intercept_ms": 0.0,
        "step_slope": pytest.approx(0.25),
        "step_fit_prior": 0,
    }
    assert step_overhead([StepRecord(1, 0.0, 5.0, 0.0, 0, 4)]) == {}  # no planner: nothing


def test_kept_steps_seed_the_fit_until_the_engines_own_displace_them() -> None:
    """A new engine fits on the steps a previous one left (``runtime/steprecords``):
    with none of its own it already has the line; its own steps take the window over."""
    from retouch.runtime.stepstats import LINE_STEPS, StepRecord, step_overhead

    planned = [100.0, 200.0, 300.0, 400.0, 500.0] * 20
    kept = [(p, 10 + 0.5 * p) for p in planned]  # the previous engine's line
    fit = step_overhead([], kept)
    assert fit["step_intercept_ms"] == pytest.approx(10) and fit["step_slope"] == pytest.approx(0.5)
    assert fit["step_fit_prior"] == LINE_STEPS
    # This device is twice as slow: 40 own steps are outvoted, a full window is not.
    own = [StepRecord(1, 0.0, 2 * (10 + 0.5 * p), 0.0, 0, 4, p) for p in planned]
    assert step_overhead(own[:40], kept)["step_fit_prior"] == LINE_STEPS - 40
    fit = step_overhead(own[:LINE_STEPS], kept)
    assert fit["step_fit_prior"] == 0
    assert fit["step_intercept_ms"] == pytest.approx(20) and fit["step_slope"] == pytest.approx(1.0)
