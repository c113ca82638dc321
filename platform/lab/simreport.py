"""The figures of a finished simulation: latency quantiles, SLO attainment, utilisation,
the autoscaler's reaction to a step in the arrival rate, and the timeline ``--plot`` draws.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from retouch.platform.control.autoscaler import Autoscaler
from retouch.platform.control.cluster import Residency
from retouch.platform.lab.bench.specs import SimSpec
from retouch.platform.lab.sharedcpu import SharedCPU
from retouch.platform.lab.simexecutor import SimExecutor
from retouch.platform.lab.simsleep import Sleepers, gpu_seconds
from retouch.platform.lab.simworkload import Job
from retouch.platform.lab.workload import step_change

STEP_WINDOW_S = 10.0  # the windows of P95 after a step change
TIMELINE_S = 10.0  # the timeline's windows (arrivals, queue, executors, P95 over time)


class FinishedRun(Protocol):
    """What the figures read of a simulation run to its end."""

    spec: SimSpec
    jobs: list[Job]
    executors: list[SimExecutor]
    tiers: bool
    cpu: SharedCPU | None
    scaler: Autoscaler | None
    errors: list[float]  # prediction errors of the measured invocations
    decision_s: list[float]  # the placement's decision times
    scale_events: list[tuple[float, int]]  # (when, executors added or removed)
    samples: list[tuple[float, int, int, int, int]]  # the timeline's counts
    bakes_run: int
    adapter_loads: int
    adapter_swaps: int
    mixed_steps: int
    cold_starts: int  # executors the autoscaler started cold
    sleepers: Sleepers


def after_step(sim: FinishedRun, at: float, accepted: list[Job]) -> dict[str, Any]:
    """How the autoscaler met a step in the arrival rate at ``at``: its first scale-up
    after it, and when the P95 of 10 s windows (by arrival) fell back under the SLO for
    good (None: it never did, or there is no SLO)."""
    first_up = next((t for t, c in sim.scale_events if c > 0 and t >= at), None)
    out: dict[str, Any] = {
        "step_at_s": at,
        "scale_up_after_step_s": None if first_up is None else first_up - at,
    }
    slo_s = sim.jobs[0].request.slo_s
    windows: dict[int, list[float]] = {}
    for j in accepted:
        if j.arrival >= at:
            windows.setdefault(int((j.arrival - at) // STEP_WINDOW_S), []).append(
                j.done_at - j.arrival
            )
    p95 = {k: float(np.percentile(v, 95)) for k, v in sorted(windows.items())}
    out["p95_by_window_ms"] = [round(v * 1e3, 1) for v in p95.values()]
    if slo_s is not None and p95:
        late = [k for k, v in p95.items() if v > slo_s]
        recovered = not late or max(late) < max(p95)
        out["p95_under_slo_after_s"] = (
            (max(late, default=-1) + 1) * STEP_WINDOW_S if recovered else None
        )
    return out


def summary(sim: FinishedRun, wall_s: float) -> dict[str, Any]:
    measured = [j for j in sim.jobs if j.index >= sim.spec.warmup]
    accepted = [j for j in measured if not j.rejected]
    latency = np.array([j.done_at - j.arrival for j in accepted] or [math.nan]) * 1e3
    span = max((j.done_at for j in sim.jobs if not j.rejected), default=0.0)
    decisions = np.array(sim.decision_s) * 1e3 if sim.decision_s else np.zeros(1)
    lifetimes = sum(
        (span if e.stopped_at is None else e.stopped_at) - e.started_at for e in sim.executors
    )
    window = span - sim.jobs[sim.spec.warmup].arrival  # the measured arrivals' span
    out: dict[str, Any] = {
        "p50_ms": float(np.percentile(latency, 50)),
        "p95_ms": float(np.percentile(latency, 95)),
        "p99_ms": float(np.percentile(latency, 99)),
        "mean_ms": float(latency.mean()),
        "prediction_error_p50": float(np.median(sim.errors)) if sim.errors else math.nan,
        "utilisation": sum(e.busy_s for e in sim.executors) / max(1e-9, lifetimes),
        "executor_seconds": lifetimes,
        # device time: ready, starting and waking executors, not sleeping ones
        "gpu_seconds": gpu_seconds(sim.executors, span, sim.cold_starts, sim.spec.startup_s),
        "simulated_s": span,
        "wall_s": wall_s,
        "speedup": span / wall_s if wall_s > 0 else math.inf,
        "decision_ms_p99": float(np.percentile(decisions, 99)),
        "rejected": len(measured) - len(accepted),
        "dropped": sum(1 for j in measured if j.dropped),
        "throughput_rps": len(accepted) / window,
    }
    if sim.cpu is not None:
        out["cpu_busy_s"] = sim.cpu.busy_s
    if sim.scaler is not None:
        out["scale_events"] = len(sim.scale_events)
        out["reversals"] = sim.scaler.reversals
        out["executors_started"] = len(sim.executors)
        out["cold_starts"] = sim.cold_starts
        out["sleeps"], out["wakes"] = sim.sleepers.sleeps, sim.sleepers.wakes
        out["first_scale_up_s"] = next((at for at, change in sim.scale_events if change > 0), None)
        step = step_change(sim.spec.arrivals)
        if step is not None:
            out |= after_step(sim, step[1], accepted)
    slo_s = sim.jobs[0].request.slo_s
    if slo_s is not None:
        met = int((latency <= slo_s * 1e3).sum())
        out["slo_attainment"] = met / len(measured)
        # one dropped from the queue was accepted and then missed: it counts against
        admitted = sum(1 for j in measured if j.dropped or not j.rejected)
        out["slo_attainment_accepted"] = met / admitted if admitted else 0.0
        out["goodput_rps"] = met / window
    if sim.tiers:
        found = [j.found for j in accepted]
        out["host_hit_rate"] = found.count(Residency.HOST) / max(1, len(found))
        out["template_loads"] = found.count(Residency.DISK)
        out["full_path"] = sum(1 for j in accepted if j.full)
        out["bakes"] = sim.bakes_run
    if sim.spec.adapters:
        minutes = max(1e-9, span / 60.0)
        out["adapter_loads"] = sim.adapter_loads
        out["adapter_swaps"] = sim.adapter_swaps
        out["adapter_loads_per_min"] = sim.adapter_loads / minutes
        out["adapter_swaps_per_min"] = sim.adapter_swaps / minutes
        out["mixed_steps"] = sim.mixed_steps
    out["timeline"] = timeline(sim)
    return out


def timeline(sim: FinishedRun) -> list[dict[str, Any]]:
    """Per window of ``TIMELINE_S``: arrivals and refusals (by arrival), the P95 of the
    accepted ones that arrived in it, and the queue and executor counts at its end."""
    by_window: dict[int, list[Job]] = {}
    for job in sim.jobs:
        by_window.setdefault(int(job.arrival // TIMELINE_S), []).append(job)
    counts = {round(at / TIMELINE_S) - 1: rest for at, *rest in sim.samples}
    last = (0, sim.spec.executors, 0, 0)
    out = []
    for k in range(max(by_window, default=-1) + 1):
        jobs = by_window.get(k, [])
        done = [j.done_at - j.arrival for j in jobs if not j.rejected]
        queued, ready, starting, draining = last = tuple(counts.get(k, last))
        out.append(
            {
                "t_s": k * TIMELINE_S,
                "arrivals": len(jobs),
                "rejected": sum(1 for j in jobs if j.rejected),
                "queued": queued,
                "ready": ready,
                "starting": starting,
                "draining": draining,
                "p95_ms": round(float(np.percentile(done, 95)) * 1e3, 1) if done else None,
            }
        )
    return out
