"""Which path an edit takes: mask-aware (masked tokens only) or stock (every token).

Mask-aware steps win where the masked tokens are few and the device is compute-bound; at
large masks, or on a small model whose step is all launch overhead, the stock step can be
as fast or faster (the gather, scatter and cached-row reads are extra work). The executor
decides per edit from step times it knows for this model: measured at graph warm-up (the
steps it will replay, per bucket) or, without graphs, the profile's planned steps. Pure and
torch-free: the decision and its reason travel with the answer (``path``, ``path_reason``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from retouch.functions.wire.invoke import InvokePath

MARGIN = 0.05  # stock only when it is faster by more than the step times' noise


@dataclass(frozen=True)
class StepTimes:
    """One request's step time (batch 1) on each path: mask-aware at masked fractions of
    the finest token grid (ascending; a fraction between two is costed at the next one up,
    as a bucketed step pads to it), and stock. ``source`` says where they come from."""

    fractions: tuple[float, ...]
    sparse_s: tuple[float, ...]
    stock_s: float
    source: str  # "graph replays at warm-up" or "profiled plan"

    def __post_init__(self) -> None:
        if not self.fractions or len(self.fractions) != len(self.sparse_s):
            raise ValueError("step times need one mask-aware time per fraction")
        if list(self.fractions) != sorted(self.fractions):
            raise ValueError("step time fractions must ascend")

    def sparse_at(self, fraction: float) -> float:
        i = min(bisect.bisect_left(self.fractions, fraction - 1e-9), len(self.fractions) - 1)
        return self.sparse_s[i]

    @classmethod
    def from_plan(cls, row: Sequence[float]) -> StepTimes:
        """From a profile's plan-table row of batch 1 (latencies at masked fractions 0, 1/16,
        ..., 1); the stock step is the plan at fraction 1 (every token, nothing loaded)."""
        n = len(row)
        fractions = tuple(i / (n - 1) for i in range(n))
        return cls(fractions, tuple(row), row[-1], "profiled plan")


@dataclass(frozen=True)
class PathChoice:
    path: InvokePath  # MASKAWARE or STOCK
    reason: str


def choose_path(times: StepTimes | None, fraction: float) -> PathChoice:
    """The faster path for an edit whose mask covers ``fraction`` of the finest grid's
    tokens: mask-aware unless stock is faster by more than ``MARGIN``, or when nothing is
    known (it is what the bake is for)."""
    if times is None:
        return PathChoice(InvokePath.MASKAWARE, "no step times for this model yet")
    sparse, stock = times.sparse_at(fraction), times.stock_s
    figures = (
        f"{sparse * 1e3:.2f} ms a step at {fraction:.0%} of the tokens against stock "
        f"{stock * 1e3:.2f} ms ({times.source})"
    )
    if sparse > stock * (1 + MARGIN):
        return PathChoice(InvokePath.STOCK, "stock is faster: mask-aware " + figures)
    return PathChoice(InvokePath.MASKAWARE, "mask-aware is faster: " + figures)
