from __future__ import annotations

import numpy as np

from retouch.runtime.costmodel import BlockProfile, CostModel, LinearFit


def test_fit_recovers_a_line_and_reports_r2() -> None:
    xs = list(range(0, 4096, 256))
    exact = LinearFit.fit(xs, [0.002 + 1e-6 * x for x in xs])
    assert (
        abs(exact.intercept - 0.002) < 1e-9
        and abs(exact.slope - 1e-6) < 1e-12
        and exact.r2 > 0.999999
    )
    rng = np.random.default_rng(0)
    noisy = LinearFit.fit(xs, [0.002 + 1e-6 * x + rng.normal(0, 1e-3) for x in xs])
    assert noisy.r2 < exact.r2
    assert LinearFit.fit([5.0, 5.0], [1.0, 3.0]) == LinearFit(2.0, 0.0, 1.0)


def test_block_costs_and_round_trip() -> None:
    block = BlockProfile(
        "b0", LinearFit(0.001, 1e-6, 0.99), bytes_per_token_sparse=1024, bytes_per_token_exit=512
    )
    model = CostModel("cpu", [block], LinearFit(0.0, 1e-9, 0.98))
    (cost,) = model.block_costs([(400, 2000)])
    assert abs(cost.sparse - (0.001 + 400e-6)) < 1e-12
    assert abs(cost.full - (0.001 + 2000e-6)) < 1e-12
    assert abs(cost.load_sparse - 1600 * 1024 * 1e-9) < 1e-12
    assert abs(cost.load_exit - 1600 * 512 * 1e-9) < 1e-12
    assert CostModel.from_dict(model.to_dict()) == model
    assert model.min_r2() == 0.98


def test_median_fit_ignores_a_slowed_repeat() -> None:
    xs = [100, 100, 100, 200, 200, 200, 400, 400, 400]
    ys = [1.0, 1.0, 9.0, 2.0, 2.0, 2.0, 4.0, 30.0, 4.0]  # two samples hit by other work
    fit = LinearFit.fit_medians(xs, ys)
    assert abs(fit.slope - 0.01) < 1e-12 and abs(fit.intercept) < 1e-9 and fit.r2 > 0.999999
    assert LinearFit.fit(xs, ys).r2 < 0.5


def test_block_level_round_trips_and_defaults_to_zero() -> None:
    block = BlockProfile("mid", LinearFit(0.0, 1e-6, 0.9), 2048, 0, level=2)
    model = CostModel("cpu", [block], LinearFit(0.0, 1e-9, 0.9))
    assert CostModel.from_dict(model.to_dict()).blocks[0].level == 2
    doc = model.to_dict()
    del doc["blocks"][0]["level"]  # profiles written before levels existed
    assert CostModel.from_dict(doc).blocks[0].level == 0
