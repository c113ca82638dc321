"""What the pool reports of itself: its executors' documents and states, placement and
admission timings, executors by phase and the autoscaler's decisions, read from the parts
that own them when ``/v1/executors`` or ``/metrics`` asks (the API renders them)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from retouch.functions.wire.executor import ExecutorPhase, ExecutorState
from retouch.platform.fleet.dispatch import Dispatcher
from retouch.platform.fleet.fleet import Fleet
from retouch.platform.fleet.scaler import PoolScaler


class PoolReport:
    """The pool's documents and summaries, read from its parts when asked for."""

    def __init__(self, fleet: Fleet, dispatcher: Dispatcher, scaler: PoolScaler | None) -> None:
        self.fleet = fleet
        self.dispatcher = dispatcher
        self.scaler = scaler

    def describe(self) -> list[dict[str, Any]]:
        """Each executor as ``/v1/executors`` lists it."""
        return [e.describe() for e in self.fleet.executors]

    async def states(self) -> list[ExecutorState]:
        """Each ready or sleeping executor's own state (models, templates, engine, cache
        counters; a sleeper's says it sleeps, and how long its last sleep and wake took)."""
        ready = [e for e in self.fleet.executors if e.healthy or e.phase is ExecutorPhase.SLEEPING]
        results = await asyncio.gather(
            *(self.fleet.link.call(e, "GET", "/state", probe=True) for e in ready),
            return_exceptions=True,
        )
        out = []
        for handle, result in zip(ready, results, strict=True):
            if isinstance(result, dict):
                handle.state = ExecutorState.from_wire(result)
                out.append(handle.state)
        return out

    def placement_summary(self) -> dict[str, float]:
        """Decision and admission times and the prediction error (recent invocations)."""
        queue, stats = self.dispatcher.queue, self.dispatcher.stats
        return {
            "decision_ms_p50": _quantile(queue.decision_s, 0.5, 1e3),
            "decision_ms_p99": _quantile(queue.decision_s, 0.99, 1e3),
            "admission_ms_p50": _quantile(stats.admission_s, 0.5, 1e3),
            "admission_ms_p99": _quantile(stats.admission_s, 0.99, 1e3),
            "refusal_ms_p50": _quantile(stats.refusal_s, 0.5, 1e3),
            "refusal_ms_p99": _quantile(stats.refusal_s, 0.99, 1e3),
            "prediction_error_p50": _quantile(stats.prediction_error, 0.5),
            "prediction_error_p90": _quantile(stats.prediction_error, 0.9),
            "admission_margin": round(queue.margin, 3),
        }

    def pool_summary(self) -> dict[str, float]:
        """Executors by phase, the autoscaler's last decision and its scale events (summed
        over the model pools), and the start-up times it saw (``/metrics``)."""
        times = self.fleet.startups
        startups = sorted(times.cold)
        scaler = self.scaler
        desired = scaler.desired() if scaler is not None else None
        return {
            **self._counts(),
            "desired": float(len(self.fleet.executors) if desired is None else desired),
            "scale_ups": float(scaler.ups if scaler else 0),
            "scale_downs": float(scaler.downs if scaler else 0),
            "startup_s_p50": startups[len(startups) // 2] if startups else 0.0,
            "startup_s_max": startups[-1] if startups else 0.0,
            "startup_s_last": times.cold[-1] if times.cold else 0.0,
            "wakes": float(len(times.wakes)),
            "wake_s_last": times.wakes[-1] if times.wakes else 0.0,
            "wake_s_p50": _quantile(times.wakes, 0.5),
            "wake_s_max": max(times.wakes, default=0.0),
            "sleeping_host_bytes": float(self.fleet.sleeping.asleep.host_bytes()),
        }

    def model_pool_summaries(self) -> dict[str, dict[str, float]]:
        """Per model pool (autoscaled only): executors by phase, the last desired count,
        scale events and the ticks whose scale-up found no free device (``/metrics``)."""
        if self.scaler is None:
            return {}
        out = {}
        for model, pool in sorted(self.scaler.models.items()):
            out[model] = {
                **self._counts(model),
                "desired": float(pool.last.desired if pool.last else 0),
                "scale_ups": float(pool.ups),
                "scale_downs": float(pool.downs),
                "no_device": float(pool.no_device),
            }
        return out

    def describe_autoscaler(self) -> dict[str, Any] | None:
        """The autoscaler's document (``/v1/executors``), each model pool with its
        executors by phase and by name."""
        if self.scaler is None:
            return None
        doc = self.scaler.describe()
        for model, pool in doc["models"].items():
            pool.update({k: int(v) for k, v in self._counts(model).items()})
            pool["executors"] = sorted(
                [e.name for e in self.fleet.executors if e.model == model]
                + [n for n, m in self.fleet.unstarted().items() if m == model]
            )
        return doc

    def _counts(self, model: str | None = None) -> dict[str, float]:
        """Executors ready, starting, draining, sleeping and waking, of ``model``'s pool
        (None: all). One
        being started counts as starting once, before and after its process is up."""
        phases = [e.phase for e in self.fleet.executors if model is None or e.model == model]
        spawning = [n for n, m in self.fleet.unstarted().items() if model is None or m == model]
        return {
            "ready": float(phases.count(ExecutorPhase.READY)),
            "starting": float(phases.count(ExecutorPhase.STARTING) + len(spawning)),
            "draining": float(phases.count(ExecutorPhase.DRAINING)),
            "sleeping": float(phases.count(ExecutorPhase.SLEEPING)),
            "waking": float(phases.count(ExecutorPhase.WAKING)),
        }


def _quantile(values: Iterable[float], fraction: float, scale: float = 1.0) -> float:
    """The ``fraction`` quantile of ``values`` (nearest rank, 0 when empty), times ``scale``."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[int(fraction * (len(ordered) - 1))] * scale
