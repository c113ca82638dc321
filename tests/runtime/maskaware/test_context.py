"""A forward's memo lives for one run of the step's call: a graph runner runs the call more
than once (a CUDA graph's warm-up, then its capture; on a CPU, a later step's replay)."""

from __future__ import annotations

from typing import Any

from retouch.runtime.maskaware.context import ForwardContext


class Twice:
    """A runner like a capture: the call once to warm up, then again (the one it keeps)."""

    def run(self, ctx: ForwardContext, fn: Any, tensors: dict[str, Any]) -> Any:
        fn(**tensors)
        return fn(**tensors)


def test_each_run_of_the_call_starts_with_an_empty_memo() -> None:
    """The blocks key their memos by ``id`` of the run's RoPE table: a second run whose table
    took the freed first one's address (as here, where the key is the same) must compute its
    own rows, not read those gathered for the first run's masks."""
    ctx = ForwardContext([], 1, {}, runner=Twice())
    positions = iter(([1, 2], [5, 6]))  # the bucket's buffers refilled for another mask

    def step(x: int) -> list[int]:
        key = ("rope", 42)  # the same address in both runs
        if key not in ctx.memo:
            ctx.memo[key] = [x * p for p in next(positions)]
        return ctx.memo[key]

    assert ctx.call(step, x=10) == [50, 60]


def test_an_eager_call_starts_with_an_empty_memo() -> None:
    """A context whose call runs again (the profiler times one layout several times)."""
    ctx = ForwardContext([], 1, {})
    ctx.memo["rope"] = "the previous run's rows"
    assert ctx.call(lambda: dict(ctx.memo)) == {}
