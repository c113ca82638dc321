"""The simulated shared CPU: processor sharing on a virtual clock."""

from __future__ import annotations

import heapq
import itertools

import pytest

from retouch.platform.lab.sharedcpu import SharedCPU


class Clock:
    """A minimal event loop: what the simulation gives the shared CPU."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()

    def at(self, when: float, action) -> None:
        heapq.heappush(self._events, (when, next(self._seq), action))

    def run(self) -> None:
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()


def _cpu(cores: int) -> tuple[Clock, SharedCPU, dict[str, float]]:
    clock = Clock()
    return clock, SharedCPU(cores, lambda: clock.now, clock.at), {}


def test_tasks_beyond_the_cores_share_them_and_finish_later():
    clock, cpu, done = _cpu(1)
    cpu.run(1.0, lambda: done.setdefault("a", clock.now))
    cpu.run(1.0, lambda: done.setdefault("b", clock.now))
    clock.run()
    assert done == {"a": pytest.approx(2.0), "b": pytest.approx(2.0)}
    assert cpu.busy_s == pytest.approx(2.0) and cpu.running == 0


def test_a_task_never_runs_faster_than_one_core():
    clock, cpu, done = _cpu(2)
    cpu.run(1.0, lambda: done.setdefault("a", clock.now))
    clock.run()
    cpu.run(0.5, lambda: done.setdefault("b", clock.now))
    cpu.run(0.5, lambda: done.setdefault("c", clock.now))
    clock.run()
    assert done == {"a": pytest.approx(1.0), "b": pytest.approx(1.5), "c": pytest.approx(1.5)}


def test_a_task_that_comes_later_slows_the_ones_running():
    """One core: a runs alone for 0.5 s, then shares with b (each at half speed) until a's
    remaining 0.5 s are done at 1.5 s; b has 0.5 s left then and finishes alone at 2.0 s."""
    clock, cpu, done = _cpu(1)
    cpu.run(1.0, lambda: done.setdefault("a", clock.now))
    clock.at(0.5, lambda: cpu.run(1.0, lambda: done.setdefault("b", clock.now)))
    clock.run()
    assert done == {"a": pytest.approx(1.5), "b": pytest.approx(2.0)}


def test_a_cpu_needs_a_core():
    with pytest.raises(ValueError, match="core"):
        SharedCPU(0, lambda: 0.0, lambda when, action: None)


def test_a_heavier_task_gets_more_of_a_core_but_never_more_than_one():
    """One core, weights 3 and 1: the heavy task gets 0.75 of it and its 0.75 s of work
    ends at 1.0 s; the light one has done 0.25 s by then and its last 0.75 s run alone."""
    clock, cpu, done = _cpu(1)
    cpu.run(0.75, lambda: done.setdefault("heavy", clock.now), weight=3.0)
    cpu.run(1.0, lambda: done.setdefault("light", clock.now))
    clock.run()
    assert done == {"heavy": pytest.approx(1.0), "light": pytest.approx(1.75)}
    # Two cores, weights 3, 1, 1: the heavy one is capped at one core, the others split one.
    clock, cpu, done = _cpu(2)
    cpu.run(1.0, lambda: done.setdefault("heavy", clock.now), weight=3.0)
    cpu.run(0.5, lambda: done.setdefault("b", clock.now))
    cpu.run(0.5, lambda: done.setdefault("c", clock.now))
    clock.run()
    assert done == {"heavy": pytest.approx(1.0), "b": pytest.approx(1.0), "c": pytest.approx(1.0)}
