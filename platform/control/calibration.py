"""What turns an executor's predictions into the time they take: the pool's overheads
around the steps (encode, decode, a template's disk load), learnt from every result, and
one executor's correction of its profile (its engine's step fit, a bounded drift per
occupancy). Pure values: the cluster view updates them on events, time is a parameter.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from retouch.runtime.prediction import StepCalibration

EWMA = 0.2  # weight of a new observation in the calibration's running averages
OVERHEAD_WINDOW = 15  # recent encodes (decodes) whose median the pool predicts with
SCALE_LIMITS = (0.5, 2.0)  # the drift correction never runs away on a burst
DRIFT_OCCUPANCIES = 32  # occupancies with a drift of their own (more placed share the last)
DISK_LOAD_S = 0.05  # a template's disk load before one was observed


def _service_s(samples: deque[float], seconds: float, queued: bool, current: float) -> float:
    """A worker's service time after one more observation (see ``Overheads.observe``)."""
    if not queued:
        samples.append(seconds)
        return statistics.median(samples)
    if samples:
        return current
    return seconds if current <= 0 else min(current, seconds)


@dataclass
class Overheads:
    """Time around the denoising steps (pre/post-processing, a template's disk load),
    learnt from every executor's results and shared by the pool's views.

    They are properties of the model and the machine rather than of one executor, and a
    per-executor average goes stale exactly where it matters: an executor whose first,
    cold invocations were slow looks slow, gets no more work, and never observes anything
    that would correct it (measured: one of two executors got 4 of 120 invocations).

    They are service times: the prediction adds the wait for a worker itself (see
    ``queued_share``), so a result that queued for one teaches only the step part."""

    pre_s: float = 0.0
    post_s: float = 0.0
    hop_s: float = 0.0  # gateway-to-executor and back, outside the executor's own timings
    disk_load_s: float = DISK_LOAD_S
    version: int = 0  # bumped on every change (the views' prediction memos follow it)
    pre_samples: deque[float] = field(default_factory=lambda: deque(maxlen=OVERHEAD_WINDOW))
    post_samples: deque[float] = field(default_factory=lambda: deque(maxlen=OVERHEAD_WINDOW))
    hop_samples: deque[float] = field(default_factory=lambda: deque(maxlen=OVERHEAD_WINDOW))

    def observe(
        self, pre_s: float, post_s: float, *, pre_queued: bool = False, post_queued: bool = False
    ) -> None:
        """One result's encode and decode times, and whether each queued for a worker.
        Each is the median of its recent unqueued observations: a new pool's first results
        are cold or contended (measured on small-flux: decodes of 1.6-1.8 s, then ~0.8 s),
        and an average that starts there stays long for a dozen results, a median for two.
        A time that queued includes its wait; the shortest such is used only until an
        unqueued one is seen. Left at 0, a burst whose every decode queued had an executor
        with a backlog of decodes look free: it took all 12 edits, predicted ~10x short."""
        self.pre_s = _service_s(self.pre_samples, pre_s, pre_queued, self.pre_s)
        self.post_s = _service_s(self.post_samples, post_s, post_queued, self.post_s)
        self.version += 1

    def observe_hop(self, seconds: float) -> None:
        """One result's time outside the executor's account (placed to answered, less the
        executor's end-to-end): the median of recent ones. Measured, not fitted to the
        predictions, so it cannot run away with them; at half load on tiny-flux on a CPU
        the completions came out ~10 % longer than predicted without it."""
        self.hop_samples.append(max(0.0, seconds))
        self.hop_s = statistics.median(self.hop_samples)
        self.version += 1

    def observe_disk_load(self, seconds: float) -> None:
        self.disk_load_s = (1 - EWMA) * self.disk_load_s + EWMA * seconds
        self.version += 1


@dataclass
class Calibration:
    """One executor's correction of its profile: the step fit its engine reports, and a
    bounded drift (actual / predicted) learnt from its own results, one per occupancy: how
    many invocations were placed here when the prediction was made (not applied while it
    is idle: ``ExecutorView.predict``).

    Why per occupancy: a prediction made on a nearly empty executor comes out short when
    later arrivals join its batch; one made on a full batch does not (nobody can join).
    One drift for both lengthened every prediction near the SLO in a rising, bursty load,
    and admission refused work that would have made it: on the simulated bursty day 71
    refused at 0.648x the static pool's executor-seconds, 65 at 0.633x with a drift per
    occupancy; at 2x overload goodput rose from 94 to 98 % of capacity (docs/simulator.md,
    "Where the refusals come from")."""

    step_intercept_s: float = 0.0
    step_slope: float = 1.0
    drift: dict[int, float] = field(default_factory=dict)  # occupancy -> drift
    observations: int = 0

    def scale(self, occupancy: int) -> float:
        """The drift of predictions made with ``occupancy`` placed here (1: none learnt)."""
        return self.drift.get(min(occupancy, DRIFT_OCCUPANCIES), 1.0)

    def learn(self, occupancy: int, ratio: float) -> None:
        """One result's actual / predicted, into the drift of its occupancy (bounded)."""
        if not 0.0 < ratio < math.inf:  # a zero or broken prediction teaches nothing
            return
        bucket = min(occupancy, DRIFT_OCCUPANCIES)
        drift = self.drift.get(bucket, 1.0) * ratio**EWMA
        self.drift[bucket] = min(SCALE_LIMITS[1], max(SCALE_LIMITS[0], drift))

    def step(
        self, overheads: Overheads, workers: tuple[int, int] = (0, 0), scale: float = 1.0
    ) -> StepCalibration:
        return StepCalibration(
            self.step_intercept_s,
            self.step_slope,
            scale,
            overheads.pre_s,
            overheads.post_s,
            *workers,
            hop_s=overheads.hop_s,
        )

    def describe(self, overheads: Overheads, occupancy: int = 0) -> dict[str, Any]:
        return {
            "step_intercept_ms": round(self.step_intercept_s * 1e3, 3),
            "step_slope": round(self.step_slope, 4),
            "scale": round(self.scale(occupancy), 4),
            "drift": {str(k): round(v, 4) for k, v in sorted(self.drift.items())},
            "observations": self.observations,
            "pre_ms": round(overheads.pre_s * 1e3, 2),
            "post_ms": round(overheads.post_s * 1e3, 2),
            "hop_ms": round(overheads.hop_s * 1e3, 2),
            "disk_load_ms": round(overheads.disk_load_s * 1e3, 2),
        }
