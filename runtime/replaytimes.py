"""Step times measured by replaying CUDA graphs at warm-up: the cost model of what runs.

A served step of a graphed executor replays one captured layout per (bucket, batch size):
its time is the layout's, whatever the mask inside the bucket. Warm-up times every layout
(``runtime/maskaware/warmup.py``), and these times then stand where the profile's plans
stood: the path choice compares batch 1's (:meth:`ReplayTimes.batch_one`), the gateway's
predictions interpolate the table of every batch size (:meth:`ReplayTimes.table`, in the
format of ``prediction.plan_table``), and the engine records each graphed step's expected
time (:meth:`ReplayTimes.step_s`) as the step fit's "planned" value, so the fit compares
like with like. Pure and torch-free (the gateway reads the table).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from retouch.runtime.pathchoice import StepTimes
from retouch.runtime.prediction import TABLE_POINTS


@dataclass(frozen=True)
class ReplayTimes:
    """Seconds of one replayed step per batch size the buckets pad to (``batch_sizes``,
    ascending): mask-aware at each bucket's padded share of the finest grid
    (``fractions``, ascending; ``sparse_s[b][f]``), and stock (every token, ``stock_s[b]``)."""

    batch_sizes: tuple[int, ...]
    fractions: tuple[float, ...]
    sparse_s: tuple[tuple[float, ...], ...]
    stock_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.batch_sizes or list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise ValueError("replay times need ascending batch sizes")
        if not self.fractions or list(self.fractions) != sorted(self.fractions):
            raise ValueError("replay times need ascending bucket fractions")
        rows = len(self.batch_sizes)
        if len(self.sparse_s) != rows or len(self.stock_s) != rows:
            raise ValueError("replay times need one row and one stock time per batch size")
        if any(len(row) != len(self.fractions) for row in self.sparse_s):
            raise ValueError("replay times need one time per bucket fraction in every row")

    def step_s(self, requests: int, fraction: float) -> float:
        """One mask-aware step of ``requests`` whose largest mask covers ``fraction`` of
        the finest grid: the layout it pads to (the next batch size and bucket up; past the
        largest bucket the step computes every token, as stock)."""
        i, extra = self._row(requests)
        j = bisect.bisect_left(self.fractions, fraction - 1e-9)
        seconds = self.stock_s[i] if j == len(self.fractions) else self.sparse_s[i][j]
        return seconds * extra

    def stock_step_s(self, requests: int) -> float:
        """One stock step (every token, no cached rows) of ``requests``."""
        i, extra = self._row(requests)
        return self.stock_s[i] * extra

    def _row(self, requests: int) -> tuple[int, float]:
        """The batch size ``requests`` pads to, and a factor beyond the largest measured
        (time taken to grow in proportion there)."""
        i = bisect.bisect_left(self.batch_sizes, requests)
        if i < len(self.batch_sizes):
            return i, 1.0
        return i - 1, requests / self.batch_sizes[-1]

    def table(self, max_batch: int) -> list[list[float]]:
        """Rows for 1..``max_batch`` requests at masked fractions 0, 1/16, ..., 1: the
        layout of each point, as ``prediction.plan_table`` lays out planned latencies."""
        points = [i / (TABLE_POINTS - 1) for i in range(TABLE_POINTS)]
        return [[self.step_s(n, f) for f in points] for n in range(1, max_batch + 1)]

    def batch_one(self) -> StepTimes:
        """A single request's times, which the path choice compares."""
        return StepTimes(self.fractions, self.sparse_s[0], self.stock_s[0], "graph warm-up")
