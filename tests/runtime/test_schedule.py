"""``engine.schedule``: which ready invocations join the running batch before the next step,
decided as a pure function of the queue, the running groups and the configuration."""

from __future__ import annotations

from dataclasses import dataclass

from retouch.runtime.batching import schedule
from retouch.runtime.engineconfig import EngineConfig, EngineMode


@dataclass(eq=False)
class Ready:
    """What ``schedule`` reads of a work: its batch key and its adapter set."""

    key: str
    adapters: object = None


@dataclass
class Adapters:
    resident: bool


def test_joins_in_arrival_order_while_its_group_has_room() -> None:
    ready = [Ready("a"), Ready("b"), Ready("a"), Ready("a")]
    admission = schedule(ready, {"a": 2}, EngineConfig(max_batch=3))
    assert admission.joining == (ready[0], ready[1])  # "a" had room for one more
    assert admission.loading == ()


def test_this_iterations_admissions_count_towards_the_group() -> None:
    first, second = Ready("a"), Ready("a")
    admission = schedule([second], {}, EngineConfig(max_batch=1), joined=[first])
    assert admission.joining == ()


def test_an_adapter_set_not_resident_loads_between_steps_while_a_batch_runs() -> None:
    cold, warm = Ready("a", Adapters(False)), Ready("a", Adapters(True))
    admission = schedule([cold, warm], {"b": 1}, EngineConfig(max_batch=4))
    assert admission.joining == (warm,) and admission.loading == (cold,)
    idle = schedule([cold], {}, EngineConfig(max_batch=4))  # idle: it loads in one piece
    assert idle.joining == (cold,) and idle.loading == ()


def test_static_batches_form_only_when_idle_from_the_oldest_group() -> None:
    config = EngineConfig(EngineMode.STATIC, max_batch=2)
    ready = [Ready("a"), Ready("b"), Ready("a"), Ready("a")]
    assert schedule(ready, {"a": 1}, config).joining == ()
    assert schedule(ready, {}, config).joining == (ready[0], ready[2])
