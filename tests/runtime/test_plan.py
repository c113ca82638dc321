"""The bubble-free plan on synthetic costs: load-bound, compute-bound, mixed, feasibility."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from retouch.runtime.plan import (
    BlockCost,
    Mode,
    bubble_free_plan,
    evaluate,
    greedy_plan,
    sequential_latency,
)

S, F = Mode.SPARSE, Mode.FULL


def test_compute_bound_uses_the_cache_everywhere() -> None:
    costs = [BlockCost(sparse=0.2, full=1.0, load_sparse=0.1)] * 6
    plan = bubble_free_plan(costs)
    assert plan.modes == (S,) * 6
    assert abs(plan.latency - (0.1 + 6 * 0.2)) < 1e-12  # only the first load is exposed
    assert plan.latency < sequential_latency(costs)


def test_load_bound_computes_everything_fully() -> None:
    costs = [BlockCost(sparse=0.2, full=1.0, load_sparse=5.0)] * 4
    plan = bubble_free_plan(costs)
    assert plan.modes == (F,) * 4 and plan.latency == 4.0 and plan.load_time == 0.0


def test_mixed_interleaves_to_hide_loads() -> None:
    # Loads take 1.0, sparse compute 0.2, full 1.0: while a full block computes, the next
    # sparse block's rows arrive, so alternating beats both extremes.
    costs = [BlockCost(sparse=0.2, full=1.0, load_sparse=1.0)] * 6
    plan = bubble_free_plan(costs)
    assert S in plan.modes and F in plan.modes
    assert plan.latency < evaluate(costs, (F,) * 6)
    assert plan.latency < evaluate(costs, (S,) * 6)
    assert plan.latency <= greedy_plan(costs).latency + 1e-12


def test_full_after_sparse_pays_for_the_exit_rows() -> None:
    cheap_exit = [BlockCost(0.1, 1.0, 0.05, load_exit=0.0), BlockCost(10.0, 1.0, 0.05)]
    dear_exit = [BlockCost(0.1, 1.0, 0.05, load_exit=5.0), BlockCost(10.0, 1.0, 0.05)]
    assert bubble_free_plan(cheap_exit).modes == (S, F)
    assert bubble_free_plan(dear_exit).modes == (F, F)  # sparse then full would wait for Y


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.01, 2), st.floats(0.01, 2), st.floats(0, 3), st.floats(0, 3)).map(
            lambda t: BlockCost(*t)
        ),
        min_size=1,
        max_size=7,
    )
)
def test_dp_is_optimal_and_never_worse_than_greedy(costs: list[BlockCost]) -> None:
    plan = bubble_free_plan(costs)
    best = min(evaluate(costs, modes) for modes in itertools.product((S, F), repeat=len(costs)))
    assert abs(plan.latency - best) < 1e-9
    assert abs(evaluate(costs, plan.modes) - plan.latency) < 1e-9
    assert plan.latency <= greedy_plan(costs).latency + 1e-9
