"""Replay times from graph warm-up: the layout a batch pads to gives its step time, and the
gateway's prediction table is laid out as the profile's plan table was."""

from __future__ import annotations

import pytest

from retouch.runtime.costmodel import CostModel, LinearFit
from retouch.runtime.prediction import TABLE_POINTS, StepCoster
from retouch.runtime.replaytimes import ReplayTimes

TIMES = ReplayTimes(
    batch_sizes=(1, 2, 4),
    fractions=(0.125, 0.25, 0.5),
    sparse_s=((0.010, 0.012, 0.016), (0.014, 0.018, 0.026), (0.020, 0.030, 0.046)),
    stock_s=(0.020, 0.034, 0.060),
)


def test_a_batch_takes_the_time_of_the_layout_it_pads_to() -> None:
    assert TIMES.step_s(1, 0.05) == 0.010  # the smallest bucket
    assert TIMES.step_s(1, 0.125) == 0.010  # exactly a bucket: that bucket
    assert TIMES.step_s(1, 0.2) == 0.012  # padded up to 0.25
    assert TIMES.step_s(3, 0.3) == 0.046  # three requests replay the graph of four
    assert TIMES.step_s(2, 0.8) == 0.034  # past the largest bucket every token: stock
    assert TIMES.stock_step_s(3) == 0.060


def test_beyond_the_largest_batch_time_grows_in_proportion() -> None:
    assert TIMES.step_s(8, 0.1) == pytest.approx(0.040)
    assert TIMES.stock_step_s(6) == pytest.approx(0.090)


def test_the_table_has_a_row_per_batch_size_and_a_point_per_fraction() -> None:
    table = TIMES.table(4)
    assert len(table) == 4 and all(len(row) == TABLE_POINTS for row in table)
    assert table[0][0] == 0.010 and table[0][-1] == 0.020  # fraction 1: stock
    assert table[2] == table[3]  # three requests run as four
    assert all(row == sorted(row) for row in table)
    # the gateway's coster interpolates it as it did the plan's
    empty = CostModel("cpu", [], LinearFit(0.0, 0.0, 1.0))  # the table stands in for it
    coster = StepCoster(empty, (1024,), table, table)
    assert coster.step_s0(1, 128) == pytest.approx(0.010)
    assert coster.step_s0(4, 4 * 1024) == pytest.approx(0.060)


def test_batch_one_is_what_the_path_choice_compares() -> None:
    one = TIMES.batch_one()
    assert one.fractions == TIMES.fractions and one.stock_s == 0.020
    assert one.sparse_at(0.3) == 0.016 and one.source == "graph warm-up"


@pytest.mark.parametrize(
    "fields",
    [
        {"batch_sizes": (2, 1)},
        {"fractions": (0.5, 0.25, 0.125)},
        {"stock_s": (0.02, 0.03)},
        {"sparse_s": ((0.01,), (0.01,), (0.01,))},
    ],
)
def test_inconsistent_times_are_refused(fields) -> None:
    values = {
        "batch_sizes": TIMES.batch_sizes,
        "fractions": TIMES.fractions,
        "sparse_s": TIMES.sparse_s,
        "stock_s": TIMES.stock_s,
    }
    with pytest.raises(ValueError):
        ReplayTimes(**{**values, **fields})
