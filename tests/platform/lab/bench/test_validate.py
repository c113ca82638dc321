"""bench validate's pure parts: the 1:1 replay through the simulator and the comparison."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace

import numpy as np
import pytest

from retouch.platform.control.placement import make_placement
from retouch.platform.lab.bench.placement import flux_like_cost_model
from retouch.platform.lab.bench.specs import SimSpec, ValidateSpec
from retouch.platform.lab.bench.validate import (
    RealRun,
    compare,
    load_runs,
    machine_busy_s,
    sim_inputs,
    simulate,
    solo_inputs,
)
from retouch.platform.lab.simulator import Simulation, run_simulation
from retouch.platform.lab.simworkload import Arrival, footprint, plan_jobs, with_plan_table
from retouch.runtime.costmodel import CostModel
from retouch.runtime.prediction import StepCoster

# Batch room of one: plan tables of the 57-block model cost seconds per batch size; arrivals
# far apart never share a batch anyway.
BATCH = 1


def _alone_s(spec: SimSpec, ratio: float) -> float:
    model = flux_like_cost_model()
    coster = StepCoster(CostModel.from_dict(model.to_dict()), model.extra["grids"])
    planned = coster.step_s0(1, footprint(ratio, spec.size).on(coster.grids)[0])
    step = spec.step_intercept_s + spec.step_slope * planned
    return spec.pre_s + spec.steps * step + spec.post_s


def test_arrivals_far_apart_are_replayed_one_to_one_each_alone():
    spec = SimSpec(
        executors=2,
        placements=("maskaware", "round-robin"),
        warmup=0,
        max_batch=BATCH,
        steps=6,
        pre_s=0.03,
        post_s=0.02,
        noise=0.0,
        step_intercept_s=0.004,
        step_slope=1.5,
    )
    ratios = [0.05, 0.6, 0.2, 0.05, 0.6]
    arrivals = [Arrival(100.0 * i + 0.5, footprint(r, spec.size)) for i, r in enumerate(ratios)]
    model = with_plan_table(flux_like_cost_model(), BATCH)
    jobs, rate = plan_jobs(spec, model, arrivals)
    assert [j.arrival for j in jobs] == [a.at_s for a in arrivals]  # not rescaled
    assert rate == pytest.approx(4 / 400.0)
    sim = Simulation(spec, model, make_placement("maskaware"), jobs)
    sim.run()
    for job, ratio in zip(sim.jobs, ratios, strict=True):
        assert job.done_at - job.arrival == pytest.approx(_alone_s(spec, ratio), rel=1e-9)
    out = run_simulation(spec, model, arrivals)
    assert out["arrivals"] == "replayed" and out["requests"] == len(ratios)
    alone = [_alone_s(spec, r) * 1e3 for r in ratios]
    for name in spec.placements:
        assert out["configs"][name]["mean_ms"] == pytest.approx(sum(alone) / len(alone))
        assert out["configs"][name]["p95_ms"] == pytest.approx(np.percentile(alone, 95))


def test_replayed_arrivals_must_be_sorted():
    spec = SimSpec(executors=1, warmup=0, noise=0.0, max_batch=BATCH)
    arrivals = [Arrival(t, footprint(0.2, spec.size)) for t in (1.0, 0.5, 2.0)]
    with pytest.raises(ValueError, match="sorted"):
        run_simulation(spec, flux_like_cost_model(), arrivals)


def test_the_comparison_gives_relative_errors_and_whether_rankings_agree():
    real = {
        "maskaware": {"mean_ms": 100.0, "p95_ms": 200.0},
        "least-requests": {"mean_ms": 110.0, "p95_ms": 240.0},
        "round-robin": {"mean_ms": 120.0, "p95_ms": 220.0},
    }
    sim = {
        "maskaware": {"mean_ms": 90.0, "p95_ms": 230.0},  # -10 %, +15 %
        "least-requests": {"mean_ms": 100.0, "p95_ms": 300.0},  # +25 % on P95
        "round-robin": {"mean_ms": 130.0, "p95_ms": 250.0},
    }
    out = compare(real, sim)
    ma = out["configs"]["maskaware"]
    assert ma["mean_error"] == pytest.approx(-0.10)
    assert ma["p95_error"] == pytest.approx(0.15)
    assert ma["within_tolerance"]
    assert not out["configs"]["least-requests"]["within_tolerance"]
    assert out["ranking_p95_real"] == ["maskaware", "round-robin", "least-requests"]
    assert out["ranking_p95_sim"] == ["maskaware", "round-robin", "least-requests"]
    assert out["ranking_p95_agrees"]
    assert out["ranking_mean_real"] == ["maskaware", "least-requests", "round-robin"]
    assert out["ranking_mean_agrees"]
    sim["round-robin"]["mean_ms"] = 95.0
    assert not compare(real, sim)["ranking_mean_agrees"]


def test_the_simulator_is_given_the_pools_self_description_not_its_latencies():
    model = flux_like_cost_model()
    fp = footprint(0.3, 1024)
    rows = [
        {
            "at_s": 50.0 * i,
            "sent_s": 50.0 * i + 0.001,
            "ratio": fp.ratio,
            "pixels": fp.pixels,
            "masked": {str(k): v for k, v in fp.masked.items()},  # as saved in JSON
            "template": "t0",
            "steps": 4,
            "warmup": i == 0,
            "latency_ms": 1e6,  # the answer: never read by the simulation
            "error": None,
            "pre_ms": 20.0 + 10 * i,
            "post_ms": 10.0,
            "executor": "exec-0",
        }
        for i in range(4)
    ]
    executors = [
        {"engine": {"step_intercept_ms": 2.0, "step_slope": 1.2}},
        {"engine": {"step_intercept_ms": 4.0, "step_slope": 1.4}},
    ]
    run = RealRun("maskaware", 0.5, 1.0, rows, model.to_dict(), executors)
    inputs = sim_inputs(run)
    assert inputs == pytest.approx(
        {"step_intercept_s": 0.003, "step_slope": 1.3, "pre_s": 0.035, "post_s": 0.010}
    )
    spec = ValidateSpec(steps=4, noise=0.0, max_batch=BATCH, overheads="mean")
    got = simulate(run, spec)
    one = SimSpec(steps=4, pre_s=0.035, post_s=0.01, step_intercept_s=0.003, step_slope=1.3)
    assert got["mean_ms"] == pytest.approx(_alone_s(one, 0.3) * 1e3)
    # Drawn from the measured pre times instead: each one of them, never anything else.
    got = simulate(run, replace(spec, overheads="samples"))
    steps_ms = _alone_s(replace(one, pre_s=0.0, post_s=0.0), 0.3) * 1e3
    assert any(abs(got["p50_ms"] - steps_ms - 10.0 - pre) < 1e-6 for pre in (20, 30, 40, 50))


def _shared(**changes) -> SimSpec:
    base = SimSpec(
        executors=2,
        placements=("round-robin",),
        warmup=0,
        max_batch=BATCH,
        steps=4,
        pre_s=0.03,
        post_s=0.02,
        noise=0.0,
        cpu_cores=1,
        outside_s=0.005,
    )
    return replace(base, **changes)


def _latencies(spec: SimSpec, times: list[float]) -> list[float]:
    model = with_plan_table(flux_like_cost_model(), BATCH)
    arrivals = [Arrival(t, footprint(0.3, spec.size)) for t in times]
    jobs, _ = plan_jobs(spec, model, arrivals)
    sim = Simulation(spec, model, make_placement(spec.placements[0]), jobs)
    sim.run()
    return [j.done_at - j.arrival for j in sim.jobs]


def test_on_shared_cores_invocations_that_run_at_once_slow_each_other():
    alone = _alone_s(_shared(), 0.3) + 0.005  # its encode, steps and decode, and the gateway's
    assert _latencies(_shared(), [1.0, 100.0]) == pytest.approx([alone, alone])
    # Two at once on two executors: one core shared by both, each takes twice as long.
    assert _latencies(_shared(), [1.0, 1.0]) == pytest.approx([2 * alone, 2 * alone])
    # Two cores: each computes on its own again.
    assert _latencies(_shared(cpu_cores=2), [1.0, 1.0]) == pytest.approx([alone, alone])


def test_an_encode_waits_for_the_executors_pre_worker():
    """Two invocations at once on one executor with one pre worker: the second's encode, as
    the executor reports it, includes its wait for the first's; with two workers it does not."""

    def encodes(workers: int) -> list[float]:
        spec = _shared(executors=1, cpu_cores=4, pre_workers=workers, max_batch=2)
        model = with_plan_table(flux_like_cost_model(), 2)
        jobs, _ = plan_jobs(spec, model, [Arrival(1.0, footprint(0.3, spec.size))] * 2)
        sim = Simulation(spec, model, make_placement("round-robin"), jobs)
        sim.run()
        return [j.pre_elapsed for j in sim.jobs]

    assert encodes(1) == pytest.approx([0.03, 0.06])
    assert encodes(2) == pytest.approx([0.03, 0.03])


def test_the_cpu_model_spreads_the_runs_other_busy_time_over_its_arrivals():
    """``--overheads cpu``: the machine was busier than the model computes (the client,
    HTTP, other work): the difference becomes background work per arrival, and the
    simulated latencies grow with it."""
    model = flux_like_cost_model()
    fp = footprint(0.3, 1024)
    rows = [
        {
            "at_s": 0.05 * i,
            "sent_s": 0.05 * i,
            "ratio": fp.ratio,
            "pixels": fp.pixels,
            "masked": {str(k): v for k, v in fp.masked.items()},
            "template": "t0",
            "steps": 4,
            "warmup": False,
            "latency_ms": 1e6,
            "error": None,
            "pre_ms": 20.0,
            "post_ms": 10.0,
            "gateway_queue_ms": 0.0,
            "placed_ms": 200.0,
            "executor": "exec-0",
        }
        for i in range(20)
    ]
    run = RealRun("round-robin", 0.5, 20.0, rows, model.to_dict(), [], cpu_busy_s=None)
    spec = ValidateSpec(steps=4, noise=0.0, max_batch=BATCH, overheads="cpu", cpu_cores=2)
    quiet = simulate(run, spec)
    assert "background_ms" not in quiet
    busy = simulate(replace(run, cpu_busy_s=quiet["cpu_busy_s"] + 20 * 0.05), spec)
    assert busy["background_ms"] == pytest.approx(50.0)
    assert busy["mean_ms"] > quiet["mean_ms"]


def test_the_machines_busy_time_grows_while_it_computes():
    """``RealRun.cpu_busy_s`` is a difference of two readings of /proc/stat: busy work
    between them shows (the clock ticks at 100 Hz, so a quarter second is plenty)."""
    before = machine_busy_s()
    if before is None:
        pytest.skip("no /proc/stat here")
    deadline = time.perf_counter() + 0.25
    while time.perf_counter() < deadline:
        pass
    assert machine_busy_s() - before >= 0.2


def _row(i: int, pre_ms: float, post_ms: float, placed_ms: float, warmup: bool = False) -> dict:
    fp = footprint(0.3, 1024)
    return {
        "at_s": float(i),
        "sent_s": float(i),
        "ratio": fp.ratio,
        "pixels": fp.pixels,
        "masked": {str(k): v for k, v in fp.masked.items()},
        "template": "t0",
        "steps": 4,
        "warmup": warmup,
        "latency_ms": placed_ms + 5.0,
        "error": None,
        "pre_ms": pre_ms,
        "post_ms": post_ms,
        "gateway_queue_ms": 0.0,
        "placed_ms": placed_ms,
        "executor": "exec-0",
    }


def test_uncontended_times_come_from_the_solo_probe_else_the_runs_fast_ones():
    model = flux_like_cost_model().to_dict()
    loaded = [_row(i, 10.0 + i, 20.0, 100.0 + 10 * i) for i in range(20)]  # contended
    probe = [_row(i, 12.0, 22.0, 90.0) for i in range(5)] + [_row(9, 99.0, 99.0, 999.0, True)]
    with_probe = RealRun("round-robin", 0.5, 1.0, loaded, model, [], solo_arrivals=probe)
    solo = solo_inputs([with_probe])
    assert solo["pre_s"] == pytest.approx(0.012) and solo["post_s"] == pytest.approx(0.022)
    assert solo["outside_s"] == pytest.approx(0.005)  # latency - queue - placed
    # A record without a probe: the 10th percentile of what the runs measured.
    without = solo_inputs([replace(with_probe, solo_arrivals=[])])
    assert without["pre_s"] == pytest.approx(np.percentile([10.0 + i for i in range(20)], 10) / 1e3)


def test_a_record_from_before_the_shared_cpu_model_still_loads(tmp_path):
    """Records saved before runs carried their busy time and solo probe (and the spec its
    cores) replay as they did: those fields take their defaults."""
    run = RealRun("maskaware", 0.5, 1.0, [_row(0, 10.0, 20.0, 100.0)], {}, [])
    doc = {
        "spec": {**asdict(ValidateSpec()), "workload": asdict(ValidateSpec().workload)},
        "capacity_rps": 9.98,
        "runs": [asdict(run)],
    }
    del doc["spec"]["cpu_cores"]
    for key in ("cpu_busy_s", "solo_arrivals"):
        del doc["runs"][0][key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    spec, capacity, runs = load_runs(path)
    assert capacity == 9.98 and spec.cpu_cores == 0
    assert runs[0].cpu_busy_s is None and runs[0].solo_arrivals == []
