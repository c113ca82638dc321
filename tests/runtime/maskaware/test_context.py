"""A forward's scratch lives for one run of the step's call: a graph runner runs the call more
than once (a CUDA graph's warm-up, then its capture; on a CPU, a later step's replay)."""

from __future__ import annotations

from typing import Any

from retouch.runtime.maskaware.context import ForwardContext, activate, current


class Twice:
    """A runner like a capture: the call once to warm up, then again (the one it keeps)."""

    def run(self, ctx: ForwardContext, fn: Any, tensors: dict[str, Any]) -> Any:
        fn(**tensors)
        return fn(**tensors)


class Replays:
    """A runner like a CPU replay: the first call it was given, run for every later step."""

    def __init__(self) -> None:
        self.fn: Any = None

    def run(self, ctx: ForwardContext, fn: Any, tensors: dict[str, Any]) -> Any:
        self.fn = self.fn or fn
        return self.fn(**tensors)


def test_each_run_of_the_call_starts_with_an_empty_scratch() -> None:
    """The blocks key their memos by ``id`` of the run's RoPE table: a second run whose table
    took the freed first one's address (as here, where the key is the same) must compute its
    own rows, not read those gathered for the first run's masks."""
    ctx = ForwardContext([], 1, {}, runner=Twice())
    positions = iter(([1, 2], [5, 6]))  # the bucket's buffers refilled for another mask

    def step(x: int) -> list[int]:
        scratch, key = current().scratch, ("rope", 42)  # the same address in both runs
        if key not in scratch:
            scratch[key] = [x * p for p in next(positions)]
        return scratch[key]

    with activate(ctx):
        assert ctx.call(step, x=10) == [50, 60]


def test_a_replayed_call_empties_the_scratch_of_the_step_it_runs_for() -> None:
    """The blocks read the running step's context (``current()``), not the one the replayed
    call was made in."""
    runner, seen = Replays(), []

    def step() -> None:
        seen.append(dict(current().scratch))
        current().scratch["rope"] = "rows of this run's masks"

    first, later = (ForwardContext([], 1, {}, runner=runner) for _ in range(2))
    with activate(first):
        first.call(step)
    later.scratch["rope"] = "rows of other masks"
    with activate(later):
        later.call(lambda: None)  # the runner replays the first step's call
    assert seen == [{}, {}]
