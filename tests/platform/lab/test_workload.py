"""The workload (arrivals, masks, template popularity) is one definition per name: its
statistics, and the simulator and ``bench load`` drawing the same one for a name and seed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from retouch.platform.lab.bench.load import plan_requests
from retouch.platform.lab.bench.placement import flux_like_cost_model, footprints
from retouch.platform.lab.bench.specs import SimSpec
from retouch.platform.lab.simworkload import plan_jobs
from retouch.platform.lab.workload import (
    BETA_CONCENTRATION,
    BIMODAL,
    Draws,
    MaskMix,
    Workload,
    arrival_times,
    zipf_ranks,
)

TEMPLATES = ["t0", "t1", "t2", "t3"]


@pytest.mark.parametrize("masks", ["beta", "bimodal"])
@pytest.mark.parametrize("seed", [0, 5])
def test_the_simulator_and_bench_load_draw_the_same_workload(masks: str, seed: int) -> None:
    """Same name and seed: the same mask ratios, templates and arrivals (up to the rate)."""
    measured, warmup = 300, 20
    sim = SimSpec(
        masks=masks, mask_mean=0.35, seed=seed, requests=measured + warmup, warmup=warmup,
        templates=len(TEMPLATES), zipf=1.1,
    )  # fmt: skip
    jobs, sim_rate = plan_jobs(sim, flux_like_cost_model())
    load = Workload(
        requests=measured, warmup=warmup, masks=masks, mask_mean=0.35, seed=seed, zipf=1.1
    )
    plan = plan_requests(load, 2.0, TEMPLATES, (64, 64))

    assert [j.request.mask_ratio for j in jobs] == [p.ratio for p in plan]
    assert [j.request.template for j in jobs] == [p.template for p in plan]
    sim_at = np.array([j.arrival for j in jobs])
    load_at = np.array([p.at for p in plan])
    assert np.allclose((sim_at - sim_at[0]) * sim_rate, load_at * 2.0)


def test_beta_masks_have_the_named_mean_and_spread() -> None:
    for mean in (0.11, 0.19, 0.35):
        ratios = MaskMix("beta", mean).draw(40000, np.random.default_rng(1))
        assert ratios.mean() == pytest.approx(mean, abs=0.005)
        # the spread of Beta(mean c, (1 - mean) c): a concentration of 4 would be twice as wide
        spread = (mean * (1 - mean) / (BETA_CONCENTRATION + 1)) ** 0.5
        assert ratios.std() == pytest.approx(spread, rel=0.05)
        assert ratios.min() >= 0.01 and ratios.max() <= 1.0


def test_bimodal_masks_are_half_small_half_large() -> None:
    ratios = MaskMix("bimodal").draw(20000, np.random.default_rng(2))
    assert set(ratios) == set(BIMODAL)
    assert np.mean(ratios == BIMODAL[0]) == pytest.approx(0.5, abs=0.02)
    assert MaskMix("bimodal").expected == pytest.approx(0.325)


def test_the_placement_bench_draws_the_bimodal_mix() -> None:
    ratios = [fp.ratio for fp in footprints(np.random.default_rng(3), 400)]
    small = sum(1 for r in ratios if abs(r - BIMODAL[0]) < 0.01)
    large = sum(1 for r in ratios if abs(r - BIMODAL[1]) < 0.01)
    assert small + large == len(ratios) and 150 < small < 250


def test_mask_ratios_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "ratios.txt"
    path.write_text("0.1\n0.4\n")
    ratios = Draws(2).masks(Workload(mask_file=path).mix, 100)
    assert set(ratios) == {0.1, 0.4}
    path.write_text("0.1 1.5")
    with pytest.raises(ValueError, match="ratios in"):
        _ = Workload(mask_file=path).mix


@pytest.mark.parametrize(
    ("kind", "mean", "message"),
    [("uniform", 0.2, "beta or bimodal"), ("beta", 0.0, r"mean must be in \(0, 1\)")],
)
def test_an_unknown_mix_or_mean_is_refused(kind: str, mean: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MaskMix(kind, mean)


def test_arrivals_have_the_rate_and_burstiness_asked_for() -> None:
    rng = np.random.default_rng(0)
    poisson = np.diff(arrival_times("poisson", 20000, 2.0, rng))
    bursty = np.diff(arrival_times("gamma:3", 20000, 2.0, rng))
    assert poisson.mean() == pytest.approx(0.5, rel=0.05)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)
    assert bursty.mean() == pytest.approx(0.5, rel=0.1)
    assert bursty.std() / bursty.mean() == pytest.approx(3.0, rel=0.15)
    assert Workload(arrivals="gamma", cv=3.0).process == "gamma:3.0"
    with pytest.raises(ValueError, match="arrivals must be poisson, gamma:CV"):
        arrival_times("uniform", 3, 1.0, rng)


def test_zipf_makes_the_first_template_the_most_popular() -> None:
    ranks = zipf_ranks(5000, 4, 1.1, np.random.default_rng(3))
    counts = [int(np.sum(ranks == k)) for k in range(4)]
    assert counts == sorted(counts, reverse=True) and counts[0] > 2 * counts[3]


def test_a_seeds_masks_do_not_depend_on_its_templates() -> None:
    one = plan_requests(Workload(requests=50, warmup=0, seed=4), 1.0, ["a"], (32, 32))
    many = plan_requests(Workload(requests=50, warmup=0, seed=4), 1.0, TEMPLATES, (32, 32))
    assert [p.ratio for p in one] == [p.ratio for p in many]
    assert [p.at for p in one] == [p.at for p in many]
