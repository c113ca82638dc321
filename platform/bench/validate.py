"""``retouch bench validate``: the pool simulator against a real pool on this machine.

For each load, each placement policy runs on a real gateway with its executor processes on
loopback (the ``bench load`` machinery, one shared capacity probe), and the exact arrival
sequence sent (offsets, masks, steps, templates) and every invocation's latency are
recorded. The simulator then replays the *same arrivals* 1:1 on the *same cost model*:
the profile the executors reported in their state, the step fit their engines reported
(``EngineStats.step_intercept_ms / step_slope``) and the pre/post times the run measured
(each result's ``timings.pre_ms / post_ms``). The simulator is given what the real pool
measured about itself, never the answers (the latencies). The report compares mean and
P95 per load and policy, and whether the policies rank alike.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from retouch.functions.imaging import decode_mask
from retouch.platform.bench.load import (
    LoadSpec,
    Outcome,
    Workload,
    bench_function,
    config_server,
    plan_requests,
    probe_capacity,
    replay,
    wait_baked,
)
from retouch.platform.client import Client
from retouch.platform.simulator import Arrival, SimSpec, run_simulation
from retouch.runtime.costmodel import CostModel
from retouch.runtime.prediction import MaskFootprint

log = logging.getLogger(__name__)

TOLERANCE = 0.15  # |simulated - real| / real the issue asks for, mean and P95


@dataclass(frozen=True)
class ValidateSpec:
    model: str = "retouch:tiny-flux"
    loads: tuple[float, ...] = (0.5, 0.7, 0.85)
    placements: tuple[str, ...] = ("maskaware", "least-requests", "round-robin")
    workload: Workload = field(default_factory=lambda: Workload(requests=100, warmup=5))
    steps: int = 8
    templates: int = 4
    max_batch: int = 8
    executors: int = 2
    threads: int = 1
    noise: float = 0.05  # the simulated steps' lognormal sigma
    rate_rps: float | None = None  # the capacity (invocations/s); None: probed once
    # "samples": each simulated invocation draws its pre/post from the run's measured ones;
    # "mean": every one takes the run's mean pre/post time
    overheads: str = "samples"


@dataclass
class RealRun:
    """One policy at one load on the real pool: what was sent, what came back, and what
    the pool reported about itself afterwards (its profile, step fits, overheads)."""

    placement: str
    load: float
    rate_rps: float
    arrivals: list[dict[str, Any]]  # sent_s, ratio, template, steps, footprint, latency_ms...
    cost_model: dict[str, Any]
    executors: list[dict[str, Any]]  # per executor: step fit, gateway calibration

    @property
    def measured(self) -> list[dict[str, Any]]:
        return [a for a in self.arrivals if not a["warmup"] and a["error"] is None]


# ---- the pure parts: what the simulator is given, and the comparison -----------------------
def sim_inputs(run: RealRun) -> dict[str, float]:
    """What the real pool measured about itself: its step fit (the executors' mean) and
    its mean pre/post times over the run's completed invocations."""
    fits = [e["engine"] for e in run.executors if e.get("engine")]
    done = [a for a in run.arrivals if a["error"] is None]
    return {
        "step_intercept_s": statistics.fmean(f["step_intercept_ms"] for f in fits) / 1e3
        if fits
        else 0.0,
        "step_slope": statistics.fmean(f["step_slope"] for f in fits) if fits else 1.0,
        "pre_s": statistics.fmean(a["pre_ms"] for a in done) / 1e3 if done else 0.0,
        "post_s": statistics.fmean(a["post_ms"] for a in done) / 1e3 if done else 0.0,
    }


def replayed(run: RealRun) -> list[Arrival]:
    """The run's arrivals as sent, 1:1, for the simulator."""
    return [
        Arrival(
            a["sent_s"],
            MaskFootprint(a["ratio"], a["pixels"], {int(k): v for k, v in a["masked"].items()}),
        )
        for a in sorted(run.arrivals, key=lambda a: a["sent_s"])
    ]


def simulate(run: RealRun, spec: ValidateSpec, seed: int = 0) -> dict[str, Any]:
    """The simulator on the run's arrivals, cost model, step fit and pre/post times (their
    mean, or drawn from the measured ones: ``spec.overheads``)."""
    if spec.overheads not in ("samples", "mean"):
        raise ValueError(f"overheads are samples or mean, not {spec.overheads!r}")
    inputs = sim_inputs(run)
    done = [a for a in run.arrivals if a["error"] is None]
    samples = spec.overheads == "samples"
    sim = SimSpec(
        executors=spec.executors,
        placements=(run.placement,),
        warmup=sum(1 for a in run.arrivals if a["warmup"]),
        steps=spec.steps,
        max_batch=spec.max_batch,
        pre_s=inputs["pre_s"],
        post_s=inputs["post_s"],
        noise=spec.noise,
        step_intercept_s=inputs["step_intercept_s"],
        step_slope=inputs["step_slope"],
        pre_samples=tuple(a["pre_ms"] / 1e3 for a in done) if samples else (),
        post_samples=tuple(a["post_ms"] / 1e3 for a in done) if samples else (),
        load=run.load,
        seed=seed,
    )
    model = CostModel.from_dict(run.cost_model)
    result = run_simulation(sim, model, replayed(run))["configs"][run.placement]
    return result


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def latency_figures(latencies_ms: list[float]) -> dict[str, float]:
    lat = np.array(latencies_ms or [np.nan])
    return {"mean_ms": float(lat.mean()), "p95_ms": float(np.percentile(lat, 95))}


def relative_error(simulated: float, real: float) -> float:
    return (simulated - real) / real if real else float("nan")


def ranking(figures: dict[str, dict[str, float]], key: str) -> list[str]:
    """Policies from fastest to slowest by ``key``."""
    return sorted(figures, key=lambda name: figures[name][key])


def compare(
    real: dict[str, dict[str, float]],
    simulated: dict[str, dict[str, float]],
    tolerance: float = TOLERANCE,
) -> dict[str, Any]:
    """One load: per policy the real and simulated mean and P95, their relative errors
    (simulated - real) / real and whether both are within ``tolerance``; and whether the
    policies rank alike by P95 and by mean."""
    configs = {}
    for name in real:
        r, s = real[name], simulated[name]
        mean_error = relative_error(s["mean_ms"], r["mean_ms"])
        p95_error = relative_error(s["p95_ms"], r["p95_ms"])
        configs[name] = {
            "real_mean_ms": r["mean_ms"],
            "sim_mean_ms": s["mean_ms"],
            "mean_error": mean_error,
            "real_p95_ms": r["p95_ms"],
            "sim_p95_ms": s["p95_ms"],
            "p95_error": p95_error,
            "within_tolerance": abs(mean_error) <= tolerance and abs(p95_error) <= tolerance,
        }
    out: dict[str, Any] = {"configs": configs}
    for key, label in (("p95_ms", "p95"), ("mean_ms", "mean")):
        real_rank, sim_rank = ranking(real, key), ranking(simulated, key)
        out[f"ranking_{label}_real"] = real_rank
        out[f"ranking_{label}_sim"] = sim_rank
        out[f"ranking_{label}_agrees"] = real_rank == sim_rank
    return out


def validate(
    runs: list[RealRun],
    spec: ValidateSpec,
    capacity_rps: float,
    against: list[RealRun] | None = None,
) -> dict[str, Any]:
    """Simulate every recorded run and compare, load by load. With ``against`` (another
    real run of the same arrivals), its real figures stand in for the simulation's: how
    far two real runs of one workload are apart on this machine."""
    pairs = {(r.placement, r.load): r for r in against or []}
    loads = []
    for load in spec.loads:
        mine = [r for r in runs if r.load == load]
        if against is not None:
            mine = [r for r in mine if (r.placement, load) in pairs]
        if not mine:
            continue
        real, simulated, inputs = {}, {}, {}
        for run in mine:
            real[run.placement] = latency_figures([a["latency_ms"] for a in run.measured])
            simulated_only: dict[str, Any] = {}
            if against is None:
                sim = simulate(run, spec, seed=spec.workload.seed)
                simulated[run.placement] = {"mean_ms": sim["mean_ms"], "p95_ms": sim["p95_ms"]}
                simulated_only["sim_utilisation"] = sim["utilisation"]
            else:
                other = pairs[(run.placement, load)]
                simulated[run.placement] = latency_figures(
                    [a["latency_ms"] for a in other.measured]
                )
            inputs[run.placement] = {
                **{k: round(v, 5) for k, v in sim_inputs(run).items()},
                **simulated_only,
                "real_errors": sum(
                    1 for a in run.arrivals if not a["warmup"] and a["error"] is not None
                ),
                "sent_late_ms_p95": float(
                    np.percentile([1e3 * (a["sent_s"] - a["at_s"]) for a in run.arrivals], 95)
                ),
                # not given to the simulator: the time outside the gateway queue and the
                # executor (HTTP, mask decode, result encoding), what it cannot model
                "outside_ms_p50": _median(
                    [
                        a["latency_ms"] - a.get("gateway_queue_ms", 0.0) - a.get("placed_ms", 0.0)
                        for a in run.measured
                        if a.get("placed_ms")
                    ]
                ),
            }
        row = compare(real, simulated)
        for name, extra in inputs.items():
            row["configs"][name]["inputs"] = extra
        loads.append({"load": load, "rate_rps": mine[0].rate_rps, **row})
    cells = [c for row in loads for c in row["configs"].values()]
    return {
        "model": spec.model,
        "executors": spec.executors,
        "threads": spec.threads,
        "masks": spec.workload.masks,
        "requests": spec.workload.requests,
        "warmup": spec.workload.warmup,
        "steps": spec.steps,
        "overheads": spec.overheads if against is None else "another real run",
        "noise": spec.noise,
        "capacity_rps": capacity_rps,
        "tolerance": TOLERANCE,
        "loads": loads,
        "within_tolerance": sum(1 for c in cells if c["within_tolerance"]),
        "cells": len(cells),
        "rankings_agree_p95": sum(1 for row in loads if row["ranking_p95_agrees"]),
        "rankings_agree_mean": sum(1 for row in loads if row["ranking_mean_agrees"]),
    }


def table(result: dict[str, Any]) -> str:
    other = "sim" if result["overheads"] != "another real run" else "real2"
    lines = [
        f"{result['model']}, {result['executors']} executors x {result['threads']} thread, "
        f"capacity {result['capacity_rps']:.2f}/s, {result['requests']} measured per run",
        f"{'load':>5} {'policy':<16}{'real mean':>11}{other + ' mean':>11}{'err':>8}"
        f"{'real p95':>11}{other + ' p95':>11}{'err':>8}  ok",
    ]
    for row in result["loads"]:
        for name, c in row["configs"].items():
            lines.append(
                f"{row['load']:>5} {name:<16}{c['real_mean_ms']:>11.1f}{c['sim_mean_ms']:>11.1f}"
                f"{c['mean_error']:>+8.1%}{c['real_p95_ms']:>11.1f}{c['sim_p95_ms']:>11.1f}"
                f"{c['p95_error']:>+8.1%}  {'yes' if c['within_tolerance'] else 'no'}"
            )
        for label in ("p95", "mean"):
            agree = "agrees" if row[f"ranking_{label}_agrees"] else "DIFFERS"
            lines.append(
                f"      ranking by {label}: real {' < '.join(row[f'ranking_{label}_real'])}; "
                f"{other} {' < '.join(row[f'ranking_{label}_sim'])} ({agree})"
            )
    lines.append(
        f"within {result['tolerance']:.0%}: {result['within_tolerance']} of {result['cells']}; "
        f"rankings agree: P95 {result['rankings_agree_p95']}, mean "
        f"{result['rankings_agree_mean']} of {len(result['loads'])} loads"
    )
    return "\n".join(lines)


# ---- the real runs --------------------------------------------------------------------------
def _load_spec(spec: ValidateSpec) -> LoadSpec:
    return LoadSpec(
        spec.model,
        list(spec.placements),
        "auto:1",
        spec.workload,
        spec.steps,
        spec.templates,
        spec.max_batch,
        executors=spec.executors,
        threads=spec.threads,
    )


def _record(
    plan: list, outcomes: list[Outcome], size: tuple[int, int], steps: int, halo: int
) -> list[dict[str, Any]]:
    rows = []
    for req, o in zip(plan, outcomes, strict=True):
        fp = MaskFootprint.of(decode_mask(req.mask, size), halo)  # as the gateway summarises it
        rows.append(
            {
                "at_s": req.at,
                "sent_s": o.sent_s,
                "ratio": fp.ratio,
                "pixels": fp.pixels,
                "masked": fp.masked,
                "template": req.template,
                "steps": steps,
                "warmup": o.warmup,
                "latency_ms": o.latency_ms,
                "error": o.error,
                "pre_ms": o.pre_ms,
                "post_ms": o.post_ms,
                "gateway_queue_ms": o.gateway_queue_ms,
                "queue_ms": o.queue_ms,
                "run_ms": o.run_ms,
                "placed_ms": o.placed_ms,
                "executor": o.executor,
            }
        )
    return rows


def _self_description(client: Client, model: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The profile the executors report, and each one's step fit and gateway calibration."""
    cost_model: dict[str, Any] = {}
    executors = []
    for e in client.executors()["executors"]:
        state = e.get("state") or {}
        engine = state.get("engine") or {}
        cost_model = cost_model or (state.get("cost_models") or {}).get(model) or {}
        executors.append(
            {
                "name": e["name"],
                "engine": {
                    "step_intercept_ms": float(engine.get("step_intercept_ms", 0.0)),
                    "step_slope": float(engine.get("step_slope", 1.0)),
                    "step_ms_p50": float(engine.get("step_ms_p50", 0.0)),
                    "batch_mean": float(engine.get("batch_mean", 0.0)),
                },
                "calibration": e.get("calibration"),
            }
        )
    if not cost_model:
        raise RuntimeError(f"the executors report no cost model of {model}")
    return cost_model, executors


def run_real(spec: ValidateSpec, data_dir: Path) -> tuple[float, list[RealRun]]:
    """Each policy on its own server (one after another); on each, every load in turn,
    each load replaying the same arrivals for every policy. One capacity probe sets every
    load's rate (unless ``spec.rate_rps`` is given); it runs on a server of its own, so
    that its full batches are not in the step fits the policies' executors report."""
    load_spec = _load_spec(spec)
    function, images = bench_function(spec.model, spec.steps, spec.templates)
    size = (function.width, function.height)
    capacity = spec.rate_rps
    if capacity is None:
        probe = config_server(load_spec, spec.placements[0], data_dir)
        probe.data_dir = data_dir / "probe"  # the same shared dir: the same profile
        with probe as server, Client(server.url) as client:
            client.deploy(function, images)
            wait_baked(client, function.name)
            capacity = probe_capacity(server.url, function.name, load_spec, list(images), size)
    runs = []
    for name in spec.placements:
        with config_server(load_spec, name, data_dir) as server, Client(server.url) as client:
            client.deploy(function, images)
            wait_baked(client, function.name)
            for k, load in enumerate(spec.loads):
                workload = replace(spec.workload, seed=spec.workload.seed + k)
                plan = plan_requests(workload, load * capacity, list(images), size)
                stats = asyncio.run(
                    replay(server.url, None, function.name, plan, spec.workload.warmup)
                )
                cost_model, executors = _self_description(client, spec.model)
                run = RealRun(
                    name,
                    load,
                    load * capacity,
                    _record(plan, stats.outcomes, size, spec.steps, function.halo or 0),
                    cost_model,
                    executors,
                )
                runs.append(run)
                log.info(
                    "%s at %.2f: %s",
                    name,
                    load,
                    json.dumps(latency_figures([a["latency_ms"] for a in run.measured])),
                )
    return float(capacity or 0.0), runs


def save_runs(path: Path, spec: ValidateSpec, capacity: float, runs: list[RealRun]) -> None:
    doc = {
        "spec": {**asdict(spec), "workload": {**asdict(spec.workload), "mask_file": None}},
        "capacity_rps": capacity,
        "runs": [asdict(r) for r in runs],
    }
    path.write_text(json.dumps(doc))


def load_runs(path: Path) -> tuple[ValidateSpec, float, list[RealRun]]:
    """Runs saved by ``--record``, to simulate again without the real pool."""
    try:
        doc = json.loads(path.read_text())
        raw = doc["spec"]
        spec = ValidateSpec(
            **{
                **raw,
                "loads": tuple(raw["loads"]),
                "placements": tuple(raw["placements"]),
                "workload": Workload(**raw["workload"]),
            }
        )
        runs = [RealRun(**r) for r in doc["runs"]]
        return spec, float(doc["capacity_rps"]), runs
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a run recorded by bench validate --record ({exc})") from exc
