"""The simulated pool: the gateway's control-plane objects on a virtual clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from retouch.platform.lab.bench.placement import flux_like_cost_model
from retouch.platform.lab.bench.specs import SimSpec
from retouch.platform.lab.simulator import run_simulation
from retouch.platform.lab.simworkload import footprint
from retouch.runtime.costmodel import CostModel
from retouch.runtime.prediction import StepCoster

SMALL = SimSpec(executors=4, requests=600, warmup=60, steps=8, noise=0.0)


def test_every_invocation_completes_and_the_same_seed_gives_the_same_figures():
    a = run_simulation(SMALL, flux_like_cost_model())
    b = run_simulation(SMALL, flux_like_cost_model())
    for name in SMALL.placements:
        fig_a, fig_b = a["configs"][name], b["configs"][name]
        for key in ("p50_ms", "p95_ms", "p99_ms", "executor_seconds"):
            assert fig_a[key] == fig_b[key]
        assert 0 < fig_a["utilisation"] <= 1
        assert fig_a["speedup"] > 1  # faster than real time


def test_a_lone_invocation_takes_its_steps_plus_pre_and_post():
    spec = SimSpec(
        executors=1,
        requests=12,
        warmup=0,
        load=0.001,
        steps=8,
        noise=0.0,
        placements=("maskaware",),
    )
    model = flux_like_cost_model()
    got = run_simulation(spec, model)["configs"]["maskaware"]
    coster = StepCoster(CostModel.from_dict(model.to_dict()), model.extra["grids"])
    # Invocations far apart: each alone on the executor. The first two teach the view the
    # time around the steps (the first result of an executor is not learnt: it is cold).
    fp = footprint(0.19, spec.size)
    one = spec.pre_s + spec.steps * coster.step_s0(1, fp.on(coster.grids)[0]) + spec.post_s
    assert got["p50_ms"] == pytest.approx(one * 1e3, rel=0.6)  # masks differ (Beta draws)
    assert got["prediction_error_p50"] < 0.01  # no noise: predictions are exact when alone


def test_bad_workloads_are_refused_before_running():
    with pytest.raises(ValueError, match="gamma"):
        run_simulation(SimSpec(arrivals="gamma:0", requests=10, warmup=0), flux_like_cost_model())
    with pytest.raises(ValueError, match="unknown placement"):
        run_simulation(SimSpec(placements=("fastest",)), flux_like_cost_model())
    with pytest.raises(ValueError, match="requests"):
        run_simulation(SimSpec(requests=10, warmup=10), flux_like_cost_model())


def test_admission_in_the_simulation_is_the_gateways_and_averts_the_collapse():
    spec = SimSpec(
        executors=4,
        requests=1500,
        warmup=150,
        steps=8,
        load=2.0,
        slo_factor=5.0,
        placements=("maskaware", "maskaware+no-admission"),
    )
    got = run_simulation(spec, flux_like_cost_model())
    on, off = got["configs"]["maskaware"], got["configs"]["maskaware+no-admission"]
    assert on["rejected"] > 0 and off["rejected"] == 0
    assert on["goodput_rps"] > 5 * off["goodput_rps"]
    # admitted work keeps its SLO (binding keeps the deadlines of what runs), and the pool
    # still does nearly all it can
    assert on["slo_attainment_accepted"] >= 0.99
    assert on["goodput_rps"] >= 0.9 * got["capacity_rps"]
    assert on["p95_ms"] < off["p95_ms"]
    with pytest.raises(ValueError, match="no-admission"):
        run_simulation(SimSpec(placements=("maskaware+fast",)), flux_like_cost_model())


def test_an_autoscaled_pool_grows_from_one_executor_under_load_and_loses_nothing():
    from retouch.platform.control.autoscaler import AutoscalingConfig

    spec = SimSpec(
        executors=1,
        requests=1500,
        warmup=100,
        steps=8,
        load=0.5,  # of the pool at its maximum size
        placements=("maskaware",),
        autoscale=AutoscalingConfig(min_executors=1, max_executors=8, target_s=4.0),
        startup_s=10.0,
    )
    got = run_simulation(spec, flux_like_cost_model())["configs"]["maskaware"]
    assert got["executors_started"] > 2
    assert got["first_scale_up_s"] is not None and got["first_scale_up_s"] <= 10.0
    assert got["rejected"] == 0 and got["p99_ms"] < float("inf")


def test_a_replayed_trace_keeps_its_shape_at_the_asked_load(tmp_path):
    from retouch.platform.lab.simworkload import plan_jobs
    from retouch.platform.lab.workload import read_trace

    trace = tmp_path / "trace.csv"
    times = [0.0, 1.0, 1.5, 4.0, 10.0] + [10.0 + 0.1 * i for i in range(1, 400)]
    trace.write_text("arrival_s,other\n" + "".join(f"{t},x\n" for t in times))
    spec = SimSpec(executors=4, requests=100, warmup=10, steps=8, noise=0.0,
                   arrivals=f"trace:{trace}", load=0.5)  # fmt: skip
    jobs, rate = plan_jobs(spec, flux_like_cost_model())
    assert len(jobs) == len(times)  # the whole trace, not --requests
    arrivals = [j.arrival for j in jobs]
    scale = arrivals[1] / times[1]
    assert all(abs(a - t * scale) < 1e-9 for a, t in zip(arrivals, times, strict=True))
    assert abs((len(jobs) - 1) / arrivals[-1] - rate) < 1e-6 * rate  # compressed to the load
    got = run_simulation(spec, flux_like_cost_model())
    assert got["requests"] == len(times) - 10

    with_masks = tmp_path / "masks.csv"
    with_masks.write_text("arrival_s,mask_ratio\n0,0.25\n2,0.5\n")
    assert list(read_trace(with_masks).mask_ratio) == [0.25, 0.5]
    with_templates = tmp_path / "templates.csv"
    with_templates.write_text("arrival_s,template\n0,shirt\n2,mug\n3,shirt\n")
    spec = replace(spec, arrivals=f"trace:{with_templates}", warmup=0)
    jobs, _ = plan_jobs(spec, flux_like_cost_model())
    assert [j.request.template for j in jobs] == ["shirt", "mug", "shirt"]


def test_host_tiers_hold_what_placement_sends_them_and_maskaware_keeps_templates_apart():
    """Bounded host tiers (LRU, empty at the start) over a pool-wide disk: loads, hits,
    and a template-affine policy hitting the host tier more than least-requests."""
    spec = SimSpec(executors=8, requests=800, warmup=80, steps=8, noise=0.0, load=0.5,
                   templates=24, host_templates=6, disk_load_s=2.0,
                   placements=("maskaware", "least-requests"))  # fmt: skip
    got = run_simulation(spec, flux_like_cost_model())["configs"]
    ma, lr = got["maskaware"], got["least-requests"]
    for fig in (ma, lr):
        assert 0 < fig["host_hit_rate"] < 1 and fig["template_loads"] > 0
        assert fig["full_path"] == 0 and fig["bakes"] == 0  # every template baked at first
    assert ma["host_hit_rate"] > lr["host_hit_rate"] + 0.15
    assert ma["p95_ms"] < lr["p95_ms"]  # a load (2 s) is longer than an edit here


def test_cold_templates_run_the_full_path_until_baked_once_for_the_pool():
    spec = SimSpec(executors=4, requests=400, warmup=0, steps=8, noise=0.0, load=0.5,
                   templates=6, host_templates=2, cold_templates=True,
                   placements=("maskaware", "round-robin"))  # fmt: skip
    got = run_simulation(spec, flux_like_cost_model())["configs"]
    for fig in got.values():
        assert fig["bakes"] == 6  # each template baked once, whoever ran it first
        assert 0 < fig["full_path"] < 100  # only until its bake committed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("time\n1\n2\n", "arrival_s column"),
        ("arrival_s\n2\n1\n", ":3: arrival_s must be sorted"),
        ("arrival_s\n1\nx\n", ":3: not a number"),
        ("arrival_s,mask_ratio\n1,0.5\n2,1.5\n", ":3: arrival_s finite"),
        ("arrival_s\n1\n", "at least two arrivals"),
    ],
)
def test_a_bad_trace_is_refused_naming_the_line(tmp_path, text, message):
    from retouch.platform.lab.workload import read_trace

    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_trace(path)


def test_step_and_diurnal_arrivals_change_the_rate_where_they_say():
    import numpy as np

    from retouch.platform.lab.workload import arrival_times

    rng = np.random.default_rng(0)
    step = arrival_times("step:2@100", 6000, 10.0, rng)
    before = np.sum(step < 100) / 100
    after = np.sum((step >= 100) & (step < 300)) / 200
    assert abs(before - 10) < 1.5 and abs(after - 20) < 2.0
    cycle = arrival_times("diurnal:400:0.5", 20000, 10.0, rng)
    peak = np.sum((cycle % 400 >= 50) & (cycle % 400 < 150))  # around the sine's maximum
    trough = np.sum((cycle % 400 >= 250) & (cycle % 400 < 350))
    assert peak > 2 * trough
    for bad in ("step:0@10", "step:2", "diurnal:100:1.5", "wave"):
        with pytest.raises(ValueError):
            arrival_times(bad, 10, 10.0, rng)


def test_after_a_step_the_autoscaled_pool_reports_its_reaction():
    from retouch.platform.control.autoscaler import AutoscalingConfig

    spec = SimSpec(executors=2, requests=1500, warmup=50, steps=8, noise=0.0, load=0.3,
                   placements=("maskaware",), arrivals="step:2@40", slo_factor=5.0,
                   autoscale=AutoscalingConfig(1, 8, target_s=0.5), startup_s=5.0)  # fmt: skip
    got = run_simulation(spec, flux_like_cost_model())["configs"]["maskaware"]
    assert got["step_at_s"] == 40.0
    assert got["scale_up_after_step_s"] is not None and got["scale_up_after_step_s"] >= 0
    assert got["p95_by_window_ms"] and "p95_under_slo_after_s" in got


def test_the_timeline_counts_arrivals_refusals_and_executors_per_window():
    spec = SimSpec(executors=4, requests=1500, warmup=150, steps=8, load=2.0, slo_factor=5.0,
                   placements=("maskaware",))  # fmt: skip
    got = run_simulation(spec, flux_like_cost_model())["configs"]["maskaware"]
    timeline = got["timeline"]
    assert sum(w["arrivals"] for w in timeline) == spec.requests
    assert sum(w["rejected"] for w in timeline) >= got["rejected"]  # warm-up ones too
    assert all(w["ready"] == 4 and w["starting"] == 0 for w in timeline)
    assert [w["t_s"] for w in timeline] == [10.0 * k for k in range(len(timeline))]
    assert any(w["p95_ms"] for w in timeline)


def test_scaled_down_executors_sleep_and_wake_instead_of_starting_cold():
    """With ``wake_s`` a scale-down puts executors to sleep and a scale-up wakes them
    before it starts cold ones; sleep holds no device, so GPU-seconds fall below the
    executors' lifetimes; without it GPU-seconds are the lifetimes and the cold starts."""
    from retouch.platform.control.autoscaler import AutoscalingConfig

    scaling = AutoscalingConfig(1, 8, target_s=0.5, downscale_delay_s=20.0,
                                downscale_to_zero_delay_s=20.0)  # fmt: skip
    base = SimSpec(executors=4, requests=3000, warmup=50, steps=8, noise=0.0, load=0.4,
                   placements=("maskaware",), arrivals="diurnal:200:0.9:1", autoscale=scaling,
                   startup_s=20.0)  # fmt: skip
    cold = run_simulation(base, flux_like_cost_model())["configs"]["maskaware"]
    asleep = replace(base, wake_s=1.0)
    warm = run_simulation(asleep, flux_like_cost_model())["configs"]["maskaware"]
    assert cold["wakes"] == cold["sleeps"] == 0 and cold["cold_starts"] > 0
    held = cold["executor_seconds"] + cold["cold_starts"] * base.startup_s
    assert cold["gpu_seconds"] == pytest.approx(held)
    assert warm["sleeps"] > 0 and warm["wakes"] > 0
    assert warm["cold_starts"] < cold["cold_starts"]
    assert warm["gpu_seconds"] < warm["executor_seconds"]
    assert warm["gpu_seconds"] < cold["gpu_seconds"]


def test_scale_downs_that_wait_the_start_up_stop_fewer_executors_they_start_again():
    """Cold starts of 20 s, scale-down delays of 5 s, a bursty stream: a pool that waits
    the start-up before it stops an executor starts fewer again (and reverses less, and
    meets at least as many SLOs) than one that waits its delays only."""
    from retouch.platform.control.autoscaler import AutoscalingConfig

    scaling = AutoscalingConfig(1, 8, target_s=0.5, downscale_delay_s=5.0,
                                downscale_to_zero_delay_s=5.0)  # fmt: skip
    base = SimSpec(executors=4, requests=2000, warmup=50, steps=8, noise=0.0, load=0.4,
                   slo_factor=5.0, seed=1, placements=("maskaware+no-admission",),
                   arrivals="gamma:2", autoscale=scaling, startup_s=20.0)  # fmt: skip
    name = "maskaware+no-admission"
    waits = run_simulation(base, flux_like_cost_model())["configs"][name]
    blind = replace(base, startup_aware=False)
    hurries = run_simulation(blind, flux_like_cost_model())["configs"][name]
    assert waits["cold_starts"] < hurries["cold_starts"]
    assert waits["reversals"] < hurries["reversals"]
    assert waits["slo_attainment"] >= hurries["slo_attainment"]
