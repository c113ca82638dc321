"""Adapters in the simulated pool: functions on one base model with LoRAs of their own,
executors that hold a few adapter sets, loads and swaps at their cost, and placement that
knows them against placement that does not."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from retouch.platform.cli.main import main
from retouch.platform.lab.bench.placement import flux_like_cost_model
from retouch.platform.lab.bench.specs import SimSpec
from retouch.platform.lab.simulator import run_simulation
from retouch.platform.lab.simworkload import plan_jobs

POOL = SimSpec(
    executors=4,
    requests=800,
    warmup=80,
    steps=8,
    noise=0.0,
    load=0.5,
    adapters=6,
    resident_adapters=2,
    placements=("maskaware", "adapter-blind"),
)


def test_adapter_aware_placement_swaps_less_and_finishes_sooner() -> None:
    got = run_simulation(POOL, flux_like_cost_model())["configs"]
    aware, blind = got["maskaware"], got["adapter-blind"]
    for figures in (aware, blind):
        assert figures["rejected"] == 0 and figures["p95_ms"] > 0
        assert figures["adapter_swaps_per_min"] > 0 and figures["adapter_loads_per_min"] > 0
    assert aware["adapter_swaps"] < 0.8 * blind["adapter_swaps"]
    assert aware["p95_ms"] < 0.8 * blind["p95_ms"]


def test_one_set_loads_once_swaps_in_once_and_waits_for_its_load() -> None:
    alone = replace(
        POOL, executors=1, requests=6, warmup=0, load=0.001, adapters=1, placements=("maskaware",)
    )
    bare = replace(alone, adapters=0)
    one = run_simulation(alone, flux_like_cost_model())["configs"]["maskaware"]
    none = run_simulation(bare, flux_like_cost_model())["configs"]["maskaware"]
    assert one["adapter_loads"] == 1 and one["adapter_swaps"] == 1
    assert "adapter_loads" not in none
    # Each invocation runs alone; only the first waits for the load (0.5 s, beyond its
    # 50 ms encode) and the swap (0.1 s): the mean of six is a sixth of that slower.
    extra = (alone.adapter_load_s - alone.pre_s) + alone.adapter_swap_s
    assert one["mean_ms"] - none["mean_ms"] == pytest.approx(extra * 1e3 / 6)
    assert one["p50_ms"] == pytest.approx(none["p50_ms"])


def test_a_device_holding_one_set_reloads_as_two_sets_alternate() -> None:
    spec = replace(
        POOL, executors=1, requests=40, warmup=0, load=0.001, adapters=2, resident_adapters=1
    )
    got = run_simulation(replace(spec, placements=("maskaware",)), flux_like_cost_model())
    jobs, _ = plan_jobs(spec, flux_like_cost_model())
    sets = [j.request.adapter_set for j in jobs]
    changes = sum(1 for a, b in itertools.pairwise(sets) if a != b)
    # far apart, each alone: a load and a swap at every change of set, and the first
    figures = got["configs"]["maskaware"]
    assert figures["adapter_loads"] == changes + 1 == figures["adapter_swaps"]


def test_adapter_draws_leave_the_seeds_arrivals_masks_and_templates_as_they_were() -> None:
    model = flux_like_cost_model()
    spec = replace(POOL, templates=5)
    with_sets, _ = plan_jobs(spec, model)
    bare, _ = plan_jobs(replace(spec, adapters=0), model)
    assert [j.arrival for j in with_sets] == [j.arrival for j in bare]
    assert [j.request.mask_ratio for j in with_sets] == [j.request.mask_ratio for j in bare]
    # a template's bake is per adapter set: its name carries the set
    assert [j.request.template for j in with_sets] == [
        f"{b.request.template}@{a.request.adapter_set}"
        for a, b in zip(with_sets, bare, strict=True)
    ]
    counts = [sum(1 for j in with_sets if j.request.adapter_set == f"a{k}") for k in range(6)]
    assert counts[0] > counts[2] > counts[5] > 0  # Zipf: the first set the most popular
    assert all(j.request.adapter_set == "" for j in bare)


def test_bad_adapter_settings_are_refused_before_running() -> None:
    with pytest.raises(ValueError, match="resident adapters"):
        run_simulation(replace(POOL, resident_adapters=0), flux_like_cost_model())
    with pytest.raises(ValueError, match="adapter Zipf"):
        run_simulation(replace(POOL, adapter_swap_s=-0.1), flux_like_cost_model())


def test_bench_sim_compares_adapter_aware_and_blind_placement(capsys) -> None:
    args = ["bench", "sim", "--executors", "2", "--requests", "60", "--warmup", "6"]
    flags = ["--adapters", "5", "--resident-adapters", "2", "--adapter-swap-s", "0.05"]
    main([*args, *flags, "--steps", "4", "--placement", "maskaware,adapter-blind", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["adapters"] == 5
    for name in ("maskaware", "adapter-blind"):
        assert out["configs"][name]["adapter_loads"] >= 2


def test_mixed_batching_never_swaps_and_keeps_adapter_blind_placement_serving() -> None:
    """Mixed steps batch every set at once: no swap however the sets are placed, each step
    with adapters ``mixed_step_overhead`` longer; placement blind to adapters, which
    overloads a pool whose sets take turns, then serves about as well as aware placement."""
    blind = replace(POOL, requests=300, warmup=30, placements=("adapter-blind",))
    mixed = replace(blind, adapter_batching="mixed")
    turns_got = run_simulation(blind, flux_like_cost_model())["configs"]["adapter-blind"]
    mixed_got = run_simulation(mixed, flux_like_cost_model())["configs"]["adapter-blind"]
    assert mixed_got["adapter_swaps"] == 0 and mixed_got["mixed_steps"] > 0
    assert turns_got["adapter_swaps"] > 0 and turns_got["mixed_steps"] == 0
    assert mixed_got["p95_ms"] < 0.8 * turns_got["p95_ms"]
    free = replace(mixed, mixed_step_overhead=0.0)
    free_got = run_simulation(free, flux_like_cost_model())["configs"]["adapter-blind"]
    assert free_got["mean_ms"] < mixed_got["mean_ms"]  # the overhead is charged
