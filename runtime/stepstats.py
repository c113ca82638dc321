"""What an engine's steps took: each step's record, the engine's counters, and the fit of
measured against planned step times that the gateway's predictions apply."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from retouch.runtime.costmodel import LinearFit
from retouch.runtime.maskaware.editor import MaskAwareEditor
from retouch.runtime.maskaware.loader import attached

STEP_HISTORY = 512  # per-step records kept for /state
MIN_LINE_STEPS = 12  # fewer steps give the median ratio, not a line
LINE_STEPS = 96  # the latest steps a line is fitted on (4 560 pairs: ~1 ms per /state)


@dataclass
class StepRecord:
    batch: int
    overhead_ms: float  # engine-thread time assembling the batch before the forward
    step_ms: float
    load_wait_ms: float  # time blocks waited for cached rows during the step
    sparse_blocks: int
    blocks: int
    predicted_ms: float = 0.0  # the plan's latency of the profiled blocks (0: no planner)
    model: str = ""  # whose group stepped (a step runs one model's group)


@dataclass
class EngineCounters:
    steps: int = 0
    interruptions: int = 0
    bakes: int = 0
    canceled: int = 0
    history: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=STEP_HISTORY))
    # (planned, measured) ms pairs a previous engine left per model (``steprecords``): they
    # fill the step fit's window until this engine's own steps displace them. Replaced
    # whole (never mutated) by the deploy thread; the state path reads a snapshot.
    prior: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)

    def own_pairs(self, model: str) -> list[tuple[float, float]]:
        """This engine's planned steps of ``model`` as (planned, measured) ms pairs."""
        return [
            (r.predicted_ms, r.step_ms)
            for r in list(self.history)
            if r.model == model and r.predicted_ms > 0
        ]

    def summary(self) -> dict[str, Any]:
        recent = list(self.history)
        overhead = [r.overhead_ms for r in recent]
        return {
            "steps": self.steps,
            "interruptions": self.interruptions,
            "bakes": self.bakes,
            "canceled": self.canceled,
            "batch_overhead_ms_p50": statistics.median(overhead) if overhead else 0.0,
            "step_ms_p50": statistics.median(r.step_ms for r in recent) if recent else 0.0,
            "load_wait_ms_p50": statistics.median(r.load_wait_ms for r in recent)
            if recent
            else 0.0,
            "batch_mean": statistics.fmean(r.batch for r in recent) if recent else 0.0,
            "last_plan": {"sparse": recent[-1].sparse_blocks, "blocks": recent[-1].blocks}
            if recent
            else None,
            **step_overhead(recent, [p for pairs in list(self.prior.values()) for p in pairs]),
        }


def step_overhead(
    records: list[StepRecord], prior: list[tuple[float, float]] | None = None
) -> dict[str, float]:
    """How steps really took against what the plan predicted for them: ``step_ms =
    step_intercept_ms + step_slope × planned_ms``, fitted on the recent steps. It absorbs
    the time outside the profiled blocks and a profile taken while the device was busier
    or quieter than now; the gateway's predictions apply it to every planned step. With
    too few steps or too little spread in the planned times for a line, the slope is the
    median ratio. ``prior`` (planned, measured) pairs, a previous engine's, fill the
    window while this engine has fewer than ``LINE_STEPS`` of its own."""
    own = [(r.predicted_ms, r.step_ms) for r in records if r.predicted_ms > 0]
    room = max(0, LINE_STEPS - len(own))
    pairs = (prior[-room:] if prior and room else []) + own
    if not pairs:
        return {}
    counts = {"step_fit_prior": len(pairs) - len(own)}
    xs = [p for p, _ in pairs]
    ys = [m for _, m in pairs]
    mean = sum(xs) / len(xs)
    if len(xs) >= MIN_LINE_STEPS and max(xs) - min(xs) > 0.3 * mean:
        # The intercept may be negative: a profile with too large a fixed cost per block
        # (taken while the device was shared) is corrected by a steeper, shifted line.
        fit = LinearFit.fit_theil_sen(xs[-LINE_STEPS:], ys[-LINE_STEPS:])
        if fit.slope > 0:
            return {"step_intercept_ms": fit.intercept, "step_slope": fit.slope, **counts}
    return {
        "step_intercept_ms": 0.0,
        "step_slope": statistics.median(y / x for x, y in zip(xs, ys, strict=True)),
        **counts,
    }


def predicted_ms(editor: MaskAwareEditor) -> float:
    """What the step just run was expected to take: its layout's replay time from graph
    warm-up (the gateway's tables hold the same), else the planner's latency (0 without
    a cost model)."""
    if editor.last_expected_s is not None:
        return editor.last_expected_s * 1e3
    plan = getattr(editor.plan, "last", None)
    return plan.latency * 1e3 if plan is not None else 0.0


def load_wait_ms(editor: MaskAwareEditor) -> float:
    """How long the step's blocks waited for cached rows (0 without a row loader)."""
    loader = attached(editor)
    return loader.last.wait_s * 1e3 if loader is not None and loader.last is not None else 0.0
