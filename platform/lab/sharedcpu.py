"""A simulated CPU shared by several executors: processor sharing on a virtual clock.

On a machine without accelerators every executor's denoising steps, its pre/post worker
processes and the gateway all compute on the same few cores, and what bounds the pool is
those cores, not each engine alone (docs/simulator.md, "Validation"). The simulator models
that with :class:`SharedCPU`: each task is a piece of work in seconds of one core (one
thread); the cores are shared in proportion to the tasks' weights, none getting more than
one core, as the kernel's fair scheduler shares them (a task's weight is its niceness's:
``nice_weight``). Whenever a task starts or ends the others' finishing times change, so
only the earliest finish is kept on the clock, and a stale one is recognised by its
generation and ignored.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

# work left below this (seconds) counts as done: a float's rounding, not work
_DONE_S = 1e-9


def nice_weight(nice: int) -> float:
    """A task's share weight at ``nice`` relative to nice 0 (the kernel's table: each step
    of niceness is ~1.25x less CPU; nice 5 weighs 335 against nice 0's 1024)."""
    return 1.25 ** (-nice)


@dataclass
class _Task:
    left_s: float  # work left, in seconds of one core
    done: Callable[[], None]
    weight: float = 1.0
    rate: float = 1.0  # cores it gets now


class SharedCPU:
    """Processor sharing of ``cores`` among tasks on a virtual clock (``clock`` reads it,
    ``schedule(when, action)`` puts an action on it)."""

    def __init__(
        self,
        cores: int,
        clock: Callable[[], float],
        schedule: Callable[[float, Callable[[], None]], None],
    ) -> None:
        if cores < 1:
            raise ValueError(f"a shared CPU needs at least one core, not {cores}")
        self.cores = cores
        self._clock = clock
        self._schedule = schedule
        self._tasks: dict[int, _Task] = {}
        self._ids = itertools.count()
        self._since = clock()  # when the tasks' work left was last brought up to date
        self._generation = 0
        self._first = -1  # the task whose finish is on the clock
        self.busy_s = 0.0  # core-seconds of the work given to it

    @property
    def running(self) -> int:
        return len(self._tasks)

    def run(self, work_s: float, done: Callable[[], None], weight: float = 1.0) -> None:
        """Compute ``work_s`` seconds of one core, sharing the cores by ``weight`` (> 0);
        then call ``done``."""
        if not weight > 0:
            raise ValueError(f"a task's weight must be positive, not {weight}")
        self._advance()
        self._tasks[next(self._ids)] = _Task(max(0.0, work_s), done, weight)
        self.busy_s += max(0.0, work_s)
        self._share()
        self._plan()

    def _share(self) -> None:
        """Each task's cores: in proportion to its weight, at most one; what a capped task
        leaves goes to the others (the heaviest are capped first)."""
        cores = float(self.cores)
        weight = sum(task.weight for task in self._tasks.values())
        for task in sorted(self._tasks.values(), key=lambda t: -t.weight):
            task.rate = min(1.0, cores * task.weight / weight) if weight > 0 else 1.0
            cores -= task.rate
            weight -= task.weight

    def _advance(self) -> None:
        now = self._clock()
        elapsed, self._since = now - self._since, now
        if elapsed > 0:
            for task in self._tasks.values():
                task.left_s -= elapsed * task.rate

    def _plan(self) -> None:
        """Put the earliest finish on the clock (the ones planned before are stale)."""
        self._generation += 1
        if not self._tasks:
            return
        # (with positive weights every task gets some share: a rate is never 0)
        self._first, first = min(
            ((key, max(0.0, t.left_s) / t.rate) for key, t in self._tasks.items()),
            key=lambda item: item[1],
        )
        generation = self._generation
        self._schedule(self._clock() + first, lambda: self._finish(generation))

    def _finish(self, generation: int) -> None:
        if generation != self._generation:
            return  # a task came or went since: its finish was planned again
        self._advance()
        # the one planned finishes even if rounding left it a hair of work (on a clock far
        # from 0, now + a hair == now, and it would be planned at the same instant for ever)
        finished = [
            key for key, task in self._tasks.items() if task.left_s <= _DONE_S or key == self._first
        ]
        callbacks = [self._tasks.pop(key).done for key in finished]
        self._share()
        self._plan()
        for done in callbacks:
            done()
