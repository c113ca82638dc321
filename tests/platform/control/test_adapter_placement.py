"""Adapter-aware placement: an executor's resident adapter sets, the load and swap costs
its view predicts, and the choices ``maskaware`` makes with them (``adapter-blind`` is the
same policy without them)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from retouch.functions.wire.executor import AdapterStats, ExecutorState
from retouch.platform.control.cluster import ADAPTER_LOAD_S, ClusterView, PlacementRequest
from retouch.platform.control.placement import MaskAware, make_placement
from tests.runtime.test_prediction import Handle, request, view_with

STYLE = "lora-00000000000000aa"
OTHER = "lora-00000000000000bb"


def lora(ratio: float, adapter_set: str = STYLE, nbytes: int = 0) -> PlacementRequest:
    return replace(request(ratio), adapter_set=adapter_set, adapter_bytes=nbytes)


def holding(cluster: ClusterView, name: str, *sets: str):
    """An executor whose device holds ``sets``, as its state reports them."""
    view = view_with(cluster, name)
    view.observe_adapters(sets)
    return view


def test_a_set_the_device_lacks_is_predicted_with_its_load() -> None:
    cluster = ClusterView()
    held, bare = holding(cluster, "a", STYLE), holding(cluster, "b")
    with_set = held.predict(lora(0.2))
    without = bare.predict(lora(0.2))
    assert with_set.finish_s == pytest.approx(held.predict(request(0.2)).finish_s)
    # its join waits for the load (the encode here takes no time)
    assert without.start_s == pytest.approx(ADAPTER_LOAD_S)
    assert without.finish_s == pytest.approx(with_set.finish_s + ADAPTER_LOAD_S)
    # by size when the gateway knows it, and the executor's own mean once it reports one
    assert bare.adapter_load_s(lora(0.2, nbytes=360_000_000)) == pytest.approx(0.2)
    state = ExecutorState(
        name="b", pid=0, device="cpu", adapter_stats=AdapterStats(reads=1, loads=1, read_ms=80.0)
    )
    bare.observe_state(state, cluster.costers)
    assert bare.adapter_load_s(lora(0.2, nbytes=360_000_000)) == pytest.approx(0.08)
    # the bare model and an adapter-blind prediction load nothing
    assert bare.adapter_load_s(request(0.2)) == 0.0
    assert bare.predict(lora(0.2), adapters=False).start_s == pytest.approx(0.0)


def test_a_placed_set_is_expected_resident_and_the_state_replaces_it() -> None:
    cluster = ClusterView()
    view = holding(cluster, "a", OTHER)
    view.place(1, lora(0.2), 0.0)  # the executor fetches it on arrival
    assert list(view.adapters) == [OTHER, STYLE]
    assert view.adapter_load_s(lora(0.2)) == 0.0
    state = ExecutorState(name="a", pid=0, device="cpu", adapters=(STYLE,))  # it evicted OTHER
    view.observe_state(state, cluster.costers)
    assert list(view.adapters) == [STYLE]
    assert view.adapter_load_s(lora(0.2, OTHER)) == pytest.approx(ADAPTER_LOAD_S)


def test_batches_of_other_sets_cost_the_newcomer_their_swaps() -> None:
    cluster = ClusterView()
    mixed, same = holding(cluster, "a", STYLE, OTHER), holding(cluster, "b", STYLE, OTHER)
    mixed.place(1, lora(0.3, OTHER), 0.0)
    same.place(1, lora(0.3, STYLE), 0.0)
    swap = mixed.adapter_costs.swap_s
    # two groups take turns: two swaps a round over the newcomer's 10 steps
    assert mixed.adapter_swap_s(lora(0.3)) == pytest.approx(20 * swap)
    assert same.adapter_swap_s(lora(0.3)) == 0.0
    assert mixed.predict(lora(0.3)).finish_s == pytest.approx(
        same.predict(lora(0.3)).finish_s + 20 * swap
    )
    # a third set: three groups, three swaps a round
    mixed.place(2, lora(0.3, STYLE), 0.0)
    assert mixed.adapter_swap_s(lora(0.3, "lora-00000000000000cc")) == pytest.approx(30 * swap)
    # another set leaving soon costs only the rounds it stays
    same.progress(1, 8, 10)
    assert same.adapter_swap_s(lora(0.3, OTHER)) == pytest.approx(4 * swap)


def test_maskaware_sends_a_set_where_it_is_resident_over_an_equal_executor() -> None:
    for holder in "ab":  # whichever holds it (a tie would go to the same one both times)
        cluster = ClusterView()
        a, b = (Handle(holding(cluster, n)) for n in "ab")
        for h in (a, b):  # equally loaded, with the same set running
            h.view.place(1, lora(0.4), 0.0)
            h.view.observe_adapters([STYLE] if h.name == holder else [OTHER])
        for pool in ([a, b], [b, a]):
            assert MaskAware(seed=0).choose(pool, lora(0.2)).name == holder


def test_maskaware_avoids_an_executor_that_would_swap_between_sets() -> None:
    cluster = ClusterView()
    mixed = Handle(holding(cluster, "mixed", STYLE, OTHER))
    alike = Handle(holding(cluster, "alike", STYLE, OTHER))
    mixed.view.place(1, lora(0.4, OTHER), 0.0)
    alike.view.place(1, lora(0.4, STYLE), 0.0)
    assert MaskAware(seed=0).choose([mixed, alike], lora(0.2)) is alike
    assert MaskAware(seed=0).choose([alike, mixed], lora(0.2, OTHER)) is mixed


def test_a_load_is_outweighed_by_a_long_queue_but_not_a_short_one() -> None:
    cluster = ClusterView()
    held = Handle(holding(cluster, "held", STYLE))
    idle = Handle(holding(cluster, "idle"))
    policy = MaskAware(seed=0)
    held.view.place(1, lora(0.3), 0.0)  # one edit ahead: cheaper than a 0.5 s load
    assert policy.choose([held, idle], lora(0.3)) is held
    assert held.view.predict(lora(0.3)).finish_s < idle.view.predict(lora(0.3)).finish_s
    # a queue of large edits, more than a batch: waiting for it costs more than the load
    for token in range(2, 12):
        held.view.place(token, replace(lora(0.9), steps=200), 0.0)
    assert held.view.predict(lora(0.3)).finish_s > idle.view.predict(lora(0.3)).finish_s
    assert policy.choose([held, idle], lora(0.3)) is idle


def test_the_adapter_blind_baseline_ignores_residency() -> None:
    blind = make_placement("adapter-blind")
    assert isinstance(blind, MaskAware) and blind.name == "adapter-blind"
    cluster = ClusterView()
    a, b = (Handle(holding(cluster, n)) for n in "ab")
    choice = blind.choose([a, b], lora(0.2))
    choice.view.observe_adapters([OTHER])  # its chosen executor now lacks the set,
    other = b if choice is a else a
    other.view.observe_adapters([STYLE])  # the other holds it: the same choice
    assert blind.choose([a, b], lora(0.2)) is choice
    assert MaskAware(seed=0).choose([a, b], lora(0.2)) is other


def test_a_join_whose_new_set_would_make_a_deadline_late_is_not_taken() -> None:
    """A newcomer of another set makes a second batch group: every round gains two swaps,
    which the running invocation's deadline must absorb."""
    cluster = ClusterView()
    view = holding(cluster, "a", STYLE, OTHER)
    alone = view.predict(lora(0.3)).finish_s
    view.place(1, lora(0.3), 0.0, deadline=alone * 1.5)
    assert view.keeps_deadlines(lora(0.3), 0.0)
    assert not view.keeps_deadlines(lora(0.3, OTHER), 0.0)
