"""The executor's choice of path per edit: the faster of mask-aware and stock at the
edit's masked share, from the model's step times, with its reason."""

from __future__ import annotations

import pytest

from retouch.functions.wire.invoke import InvokePath
from retouch.runtime.pathchoice import StepTimes, choose_path

# a small model: a mask-aware step pays its gathers and cached-row reads at every size
SMALL = StepTimes((0.125, 0.25, 0.5, 1.0), (0.004, 0.005, 0.007, 0.011), 0.006, "graph warm-up")


def test_small_masks_run_mask_aware_and_large_ones_stock() -> None:
    small = choose_path(SMALL, 0.1)
    assert small.path is InvokePath.MASKAWARE
    assert "4.00 ms" in small.reason and "stock 6.00 ms" in small.reason
    assert "graph warm-up" in small.reason
    large = choose_path(SMALL, 0.3)  # padded to the 0.5 bucket: 7 ms against 6
    assert large.path is InvokePath.STOCK and large.reason.startswith("stock is faster")


def test_a_share_between_buckets_is_costed_at_the_next_one_up() -> None:
    assert SMALL.sparse_at(0.125) == 0.004
    assert SMALL.sparse_at(0.13) == 0.005
    assert SMALL.sparse_at(1.0) == SMALL.sparse_at(1.5) == 0.011


def test_a_tie_and_an_unknown_model_run_mask_aware() -> None:
    tie = StepTimes((1.0,), (0.01,), 0.01, "profiled plan")
    assert choose_path(tie, 0.9).path is InvokePath.MASKAWARE
    assert choose_path(None, 0.9).path is InvokePath.MASKAWARE


def test_times_from_a_plan_row_take_stock_as_every_token_computed() -> None:
    times = StepTimes.from_plan([0.001 * (1 + i) for i in range(17)])
    assert times.stock_s == pytest.approx(0.017) and times.fractions[-1] == 1.0
    assert choose_path(times, 0.2).path is InvokePath.MASKAWARE


def test_step_times_refuse_what_cannot_be_looked_up() -> None:
    with pytest.raises(ValueError, match="one mask-aware time"):
        StepTimes((0.5, 1.0), (0.01,), 0.01, "x")
    with pytest.raises(ValueError, match="ascend"):
        StepTimes((1.0, 0.5), (0.01, 0.02), 0.01, "x")
