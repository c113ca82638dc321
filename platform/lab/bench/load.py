"""``retouch bench load``: an open-loop load generator that compares configurations.

The workload is :mod:`retouch.platform.lab.workload`'s, drawn as the simulator draws it:
arrivals Poisson or Gamma (burstiness set by the coefficient of variation, as in
LegoDiffusion); mask ratios from a Beta with the mean of a FlashPS trace (0.11 production,
0.19 public, 0.35 VITON-HD), the bimodal mix, or a file; templates with Zipf popularity.
Masks have irregular shapes. Every configuration sees the *same* request sequence, one
after another in the same run, so their ratios are comparable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from retouch.functions.adapters import AdapterSpec
from retouch.functions.demo.images import SHAPES, mask_of_ratio, template_image
from retouch.functions.errors import RetouchError
from retouch.functions.imaging import encode_image, encode_mask
from retouch.functions.models import builtin_model
from retouch.functions.spec import FunctionSpec, parse_spec
from retouch.platform.api.client import AsyncClient, Client
from retouch.platform.api.server import ServerProcess
from retouch.platform.lab.bench.specs import LoadSpec
from retouch.platform.lab.workload import Draws, Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedRequest:
    at: float  # seconds after the start
    template: str
    mask: bytes
    ratio: float
    seed: int
    function: int = 0  # which of the replayed functions (one per adapter set)


@dataclass
class Outcome:
    latency_ms: float = 0.0
    queue_ms: float = 0.0
    interruptions: int = 0
    error: str | None = None
    warmup: bool = False
    tier: str = ""  # where its template was when it reached its executor (before the prefetch)
    predicted_ms: float = 0.0  # the gateway's prediction when it placed it
    placed_ms: float = 0.0  # and what it took from there
    rejected_ms: float = 0.0  # how long a refusal (429) took to arrive
    dropped: bool = False  # the 429 came after queueing (SLO out of reach), not on arrival
    executor: str = ""  # where it ran
    template: str = ""
    mask_ratio: float = 0.0
    sent_s: float = 0.0  # when it was sent, seconds after the replay's start
    pre_ms: float = 0.0  # the executor's own timings: encode (with its wait for a worker)
    post_ms: float = 0.0  # and decode
    gateway_queue_ms: float = 0.0  # waiting in the gateway's queue for an executor slot
    run_ms: float = 0.0  # the executor's: from joining the batch to the last step
    path: str = ""  # how the executor ran it: maskaware or stock (InvokePath)
    path_reason: str = ""  # and why (its step times, or a pinned choice)


REJECTIONS = ("overloaded", "slo_unattainable")


@dataclass
class RunStats:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    slo_ms: float | None = None

    def summary(self) -> dict[str, Any]:
        measured = [o for o in self.outcomes if not o.warmup]
        ok = [o for o in measured if o.error is None]
        rejected = [o for o in measured if o.error in REJECTIONS]
        lat = np.array([o.latency_ms for o in ok]) if ok else np.array([np.nan])
        queue = np.array([o.queue_ms for o in ok]) if ok else np.array([np.nan])
        out: dict[str, float | int] = {
            "p50_ms": float(np.percentile(lat, 50)),
            "p95_ms": float(np.percentile(lat, 95)),
            "p99_ms": float(np.percentile(lat, 99)),
            "mean_ms": float(lat.mean()),
            "throughput_rps": len(ok) / self.wall_s if self.wall_s else 0.0,
            "queue_p95_ms": float(np.percentile(queue, 95)),
            "interruptions": sum(o.interruptions for o in ok),
            "errors": len(measured) - len(ok) - len(rejected),
            "rejected": len(rejected),
            "host_hit_rate": _share(ok, lambda o: o.tier == "host", lambda o: o.tier != ""),
            "prediction_error_p50": _median(
                [abs(o.predicted_ms - o.placed_ms) / o.placed_ms for o in ok if o.predicted_ms]
            ),
        }
        predicted = [o for o in ok if o.predicted_ms and o.placed_ms]
        # signed: > 0 when the gateway predicted longer than it took
        out["prediction_bias_p50"] = _median(
            [(o.predicted_ms - o.placed_ms) / o.placed_ms for o in predicted]
        )
        out["per_executor"] = _per_executor(ok)
        out["paths"] = dict(Counter(o.path for o in ok))  # invocations per path taken
        # why, for the last edit of each path (the figures the executor compared)
        out["path_reasons"] = {o.path: o.path_reason for o in ok}
        # a 429 on arrival is admission's answer; one after queueing was accepted and then
        # missed its SLO, so it counts against the accepted ones' attainment
        refused = [o for o in rejected if not o.dropped]
        out["dropped"] = len(rejected) - len(refused)
        if refused:
            out["reject_p99_ms"] = float(np.percentile([o.rejected_ms for o in refused], 99))
        if self.slo_ms is not None:
            met = [o for o in ok if o.latency_ms <= self.slo_ms]
            accepted = len(measured) - len(refused)
            out["slo_attainment"] = len(met) / len(measured) if measured else 0.0
            out["slo_attainment_accepted"] = len(met) / accepted if accepted else 0.0
            out["goodput_rps"] = len(met) / self.wall_s if self.wall_s else 0.0
        return out


def _per_executor(ok: list[Outcome]) -> dict[str, dict[str, float]]:
    """How the work was spread: invocations, summed mask ratio and p95 per executor."""
    names = sorted({o.executor for o in ok if o.executor})
    spread = {}
    for name in names:
        mine = [o for o in ok if o.executor == name]
        spread[name] = {
            "invocations": len(mine),
            "mask_sum": round(sum(o.mask_ratio for o in mine), 3),
            "p95_ms": round(float(np.percentile([o.latency_ms for o in mine], 95)), 1),
        }
    return spread


def _share(items: list[Outcome], hit: Any, counted: Any) -> float:
    pool = [o for o in items if counted(o)]
    return sum(1 for o in pool if hit(o)) / len(pool) if pool else 0.0


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def plan_requests(
    workload: Workload,
    rate: float,
    templates: list[str],
    size: tuple[int, int],
    functions: int = 1,
    function_zipf: float = 1.1,
) -> list[PlannedRequest]:
    """The request sequence every configuration replays: the workload's draws
    (:class:`~retouch.platform.lab.workload.Draws`, as the simulator draws them), the first
    arrival at 0, and each mask's shape; with several ``functions`` (one per adapter set),
    each request's function drawn with Zipf popularity as the simulator draws sets."""
    draws = Draws(workload.seed)
    n = workload.requests + workload.warmup
    ratios = draws.masks(workload.mix, n)
    at = draws.arrivals(workload.process, n, rate)
    chosen = draws.templates(n, len(templates), workload.zipf)
    shapes = draws.rng.choice(SHAPES, n)
    owners = draws.adapters(n, functions, function_zipf) if functions > 1 else np.zeros(n, int)
    return [
        PlannedRequest(
            float(at[i] - at[0]),
            templates[chosen[i]],
            encode_mask(mask_of_ratio(size, float(ratios[i]), str(shapes[i]), seed=i)),
            float(ratios[i]),
            i,
            int(owners[i]),
        )
        for i in range(n)
    ]


def _names(functions: str | Sequence[str]) -> list[str]:
    """The replayed functions, indexed by ``PlannedRequest.function``."""
    return [functions] if isinstance(functions, str) else list(functions)


async def replay(
    url: str,
    token: str | None,
    functions: str | Sequence[str],
    plan: list[PlannedRequest],
    warmup: int,
    prompt: str = "a small red bird",
) -> RunStats:
    """Send each planned request at its time (open loop) and wait for all answers."""
    names = _names(functions)
    stats = RunStats(outcomes=[Outcome(warmup=i < warmup) for i in range(len(plan))])
    bar = tqdm(total=len(plan), desc=f"load {names[0]}", unit="req", leave=False)
    async with AsyncClient(url, token) as client:
        start = time.perf_counter()

        async def one(i: int, req: PlannedRequest) -> None:
            await asyncio.sleep(max(0.0, start + req.at - time.perf_counter()))
            t0 = time.perf_counter()
            outcome = stats.outcomes[i]
            outcome.sent_s = t0 - start
            outcome.template = req.template or ""
            try:
                result = await client.invoke(
                    names[req.function], req.template, req.mask, prompt, seed=req.seed
                )
                outcome.queue_ms = result.timings.queue_ms
                outcome.interruptions = result.engine.interruptions
                outcome.tier = result.cache.found.value
                outcome.predicted_ms = result.timings.predicted_ms
                outcome.placed_ms = result.timings.placed_ms
                outcome.executor = result.executor
                outcome.path = str(result.path.value)
                outcome.path_reason = result.path_reason
                outcome.mask_ratio = result.mask_ratio
                outcome.pre_ms = result.timings.pre_ms
                outcome.post_ms = result.timings.post_ms
                outcome.gateway_queue_ms = result.timings.gateway_queue_ms
                outcome.run_ms = result.timings.run_ms
            except RetouchError as exc:
                outcome.error = exc.code
                outcome.rejected_ms = (time.perf_counter() - t0) * 1e3
                outcome.dropped = (exc.detail or {}).get("stage") == "queued"
            outcome.latency_ms = (time.perf_counter() - t0) * 1e3
            bar.update()

        await asyncio.gather(*(one(i, r) for i, r in enumerate(plan)))
        measured_start = plan[warmup].at if warmup < len(plan) else 0.0
        stats.wall_s = time.perf_counter() - start - measured_start
    bar.close()
    return stats


async def measure_capacity(
    url: str,
    token: str | None,
    functions: str | Sequence[str],
    plan: list[PlannedRequest],
    concurrency: int,
) -> float:
    """Closed-loop throughput (invocations/s) with ``concurrency`` requests always in flight."""
    names = _names(functions)
    async with AsyncClient(url, token) as client:
        queue = list(plan)
        done = 0
        start = time.perf_counter()

        async def worker() -> None:
            nonlocal done
            while queue:
                req = queue.pop()
                try:
                    await client.invoke(
                        names[req.function], req.template, req.mask, "capacity", seed=req.seed
                    )
                except RetouchError as exc:  # refused by admission: it is not throughput
                    if exc.code not in REJECTIONS:
                        raise
                    queue.append(req)
                    await asyncio.sleep(0.05)
                    continue
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


def plot_cdfs(results: dict[str, RunStats], path: Path, size: tuple[int, int] = (800, 500)) -> None:
    """Latency CDFs, one line per configuration (drawn with PIL: no plotting dependency)."""
    w, h, pad = size[0], size[1], 60
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    series = {
        name: np.sort([o.latency_ms for o in r.outcomes if not o.warmup and o.error is None])
        for name, r in results.items()
    }
    top = max((float(s[-1]) for s in series.values() if len(s)), default=1.0)
    draw.rectangle([pad, pad // 2, w - pad // 2, h - pad], outline="black")
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = h - pad - frac * (h - 1.5 * pad)
        draw.text((5, y - 6), f"{frac:.2f}", fill="black")
        x = pad + frac * (w - 1.5 * pad)
        draw.text((x - 15, h - pad + 8), f"{frac * top:.0f}", fill="black")
    draw.text((w // 2 - 40, h - 22), "latency (ms)", fill="black")
    colors = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
    for k, (name, lat) in enumerate(series.items()):
        if not len(lat):
            continue
        pts = [
            (pad + v / top * (w - 1.5 * pad), h - pad - (i + 1) / len(lat) * (h - 1.5 * pad))
            for i, v in enumerate(lat)
        ]
        color = colors[k % len(colors)]
        draw.line(pts, fill=color, width=2)
        draw.text(
            (pad + 10, pad // 2 + 8 + 14 * k),
            f"{name} (p95 {np.percentile(lat, 95):.0f} ms)",
            fill=color,
        )
    img.save(path)


def table(summaries: dict[str, dict[str, Any]]) -> str:
    cols = (
        "p50_ms",
        "p95_ms",
        "p99_ms",
        "mean_ms",
        "throughput_rps",
        "queue_p95_ms",
        "interruptions",
        "errors",
        "rejected",
        "dropped",
        "host_hit_rate",
        "prediction_error_p50",
        "slo_attainment",
        "goodput_rps",
    )
    width = {c: max(15, len(c) + 2) for c in cols}
    first = max(12, *(len(name) + 2 for name in summaries))
    lines = [f"{'config':<{first}}" + "".join(f"{c:>{width[c]}}" for c in cols)]
    for name, s in summaries.items():
        cells = (
            f"{s.get(c, 0):>{width[c]}.{3 if c == 'batch_overhead_ms_p50' else 1}f}"
            if isinstance(s.get(c), float)
            else f"{s.get(c, ''):>{width[c]}}"
            for c in cols
        )
        lines.append(f"{name:<{first}}" + "".join(cells))
    return "\n".join(lines)


def markdown(result: dict[str, Any], configs: tuple[str, ...]) -> str:
    """The figures as a markdown table, each latency also as a ratio to the first
    configuration's at the same rate (the baseline: name it first in ``--compare``)."""
    rates = list(result["rates_rps"])
    rows = [
        "| config | rate | p50 ms | p95 ms | p50 / base | p95 / base | throughput/s "
        "| step ms p50 | batch mean | prediction error p50 | paths |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate in rates:
        named = [c if len(rates) == 1 else f"{c}@{rate}" for c in configs]
        base = result["configs"][named[0]]
        for config, key in zip(configs, named, strict=True):
            s = result["configs"][key]
            paths = ", ".join(f"{k} {v}" for k, v in sorted(s.get("paths", {}).items()))
            rows.append(
                f"| {config} | {rate} ({result['rates_rps'][rate]:.2f}/s) | {s['p50_ms']:.0f} "
                f"| {s['p95_ms']:.0f} | {_ratio(s['p50_ms'], base['p50_ms'])} "
                f"| {_ratio(s['p95_ms'], base['p95_ms'])} | {s['throughput_rps']:.2f} "
                f"| {s.get('step_ms_p50', 0.0):.1f} | {s.get('batch_mean', 0.0):.2f} "
                f"| {s['prediction_error_p50']:.2f} | {paths} |"
            )
    return "\n".join(rows)


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base > 0 and np.isfinite(value / base) else "n/a"


# ---- configurations compared side by side ---------------------------------------------

CONFIG_TOKENS = {
    "continuous": ("--engine", "continuous"),
    "static": ("--engine", "static"),
    "maskaware": (),
    "stock": ("--no-maskaware",),
    "disaggregated": (),
    "naive": ("--inline-prepost",),
    "no-admission": ("--no-admission",),
    "graphs": ("--cuda-graphs",),  # device-resident steps replayed from CUDA graphs
    "no-device-tier": ("--device-cache-bytes", "0"),
    # placement policies (``--placement A,B``); "maskaware" above is the default policy
    "least-requests": ("--placement", "least-requests"),
    "round-robin": ("--placement", "round-robin"),
    "least-masked-tokens": ("--placement", "least-masked-tokens"),
    "template-hash": ("--placement", "template-hash"),
    # adapter batching (``--adapters N``): mixed is the default
    "mixed": (),
    "turns": ("--adapter-batching", "turns"),
}


def config_args(name: str) -> list[str]:
    """``retouch serve`` flags of a configuration named by ``+``-joined tokens, e.g.
    ``continuous`` (mask-aware, disaggregated: full retouch), ``static+stock`` (the
    baseline), ``continuous+naive`` (pre/post on the engine thread)."""
    args: list[str] = []
    for token in name.split("+"):
        if token not in CONFIG_TOKENS:
            raise ValueError(
                f"unknown configuration token {token!r} in {name!r}; use {sorted(CONFIG_TOKENS)}"
            )
        args += CONFIG_TOKENS[token]
    return args


def bench_function(
    model: str, steps: int, templates: int, slo_ms: float | None = None
) -> tuple[FunctionSpec, dict[str, bytes]]:
    """A function on ``model`` with procedurally generated templates."""
    demo = builtin_model(model)
    size = demo.resolution
    doc: dict[str, Any] = {
        "name": "bench",
        "model": model,
        "family": demo.family,
        "resolution": size,
        "steps": steps,
        "templates": {
            f"t{i}": {"prompt": f"template scene {i}", "seed": 100 + i} for i in range(templates)
        },
    }
    if slo_ms is not None:
        doc["slo"] = {"latency_ms": slo_ms}
    images = {
        f"t{i}": encode_image(template_image((size, size), 500 + i), "png")
        for i in range(templates)
    }
    return parse_spec(doc), images


def parse_rate(text: str) -> tuple[float | None, float]:
    """``"2.5"`` -> (2.5, 1.0); ``"auto:0.7"`` -> (None, 0.7): measured later, times 0.7."""
    auto = text.startswith("auto:")
    try:
        value = float(text.split(":", 1)[1] if auto else text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise ValueError(f"--rate must be a positive number or auto:F with F > 0, not {text!r}")
    return (None, value) if auto else (value, 1.0)


def parse_rates(text: str) -> dict[str, tuple[float | None, float]]:
    """``--rate``: one rate or several, comma-separated (``auto:0.5,auto:0.8``), each as
    :func:`parse_rate` reads it; every configuration replays each on the same server."""
    items = [item.strip() for item in text.split(",")]
    if len(set(items)) != len(items):
        raise ValueError(f"--rate names a rate twice: {text!r}")
    return {item: parse_rate(item) for item in items}


def run_load_bench(spec: LoadSpec, data_dir: Path) -> dict[str, Any]:
    """Each configuration on its own server, one server at a time (memory: a few GiB per
    executor of a 512-pixel model), each in its own data dir so its bakes survive between
    rounds, models and profiles shared through one ``--shared-dir``. ``rounds`` rounds
    replay the same planned arrivals on each configuration in turn, the order reversed
    every other round (A B, B A, ...), so a machine that gets busier or quieter during the
    run weighs on all alike. With several rates, each server replays every rate in turn
    (its start, profile, graph warm-up and bakes paid once: what a GPU's minutes allow),
    and results are named ``config@rate``."""
    if not spec.configs:
        raise ValueError("--compare names no configuration")
    for name in spec.configs:
        config_args(name)  # reject a typo before any server starts
    if spec.slo_ms is not None and not spec.slo_ms > 0:
        raise ValueError(f"--slo must be a positive number of milliseconds, not {spec.slo_ms}")
    if spec.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, not {spec.rounds}")
    rates = parse_rates(spec.rate)
    function, images = bench_function(spec.model, spec.steps, spec.templates, spec.slo_ms)
    functions = adapter_functions(function, spec.adapters, data_dir)
    names = [f.name for f in functions]
    size = (function.width, function.height)
    runs = [(name, label) for name in spec.configs for label in rates]
    named = {run: run[0] if len(rates) == 1 else f"{run[0]}@{run[1]}" for run in runs}
    results = {named[run]: RunStats(slo_ms=spec.slo_ms) for run in runs}
    summaries: dict[str, dict[str, Any]] = {}
    capacity: float | None = None
    rps: dict[str, float] = {}
    for r in range(spec.rounds):
        for name in spec.configs if r % 2 == 0 else spec.configs[::-1]:
            with config_server(spec, name, data_dir) as server, Client(server.url) as client:
                # Capacity is measured without the SLO: admission's refusals are not lost
                # throughput (with them, a 2x-overload run once measured 4.8/s of 19.6).
                probing = capacity is None and any(rate is None for rate, _ in rates.values())
                baked = "stock" not in name.split("+")
                _deploy(client, functions, images, slo=not probing, baked=baked)
                if probing:
                    capacity = probe_capacity(server.url, names, spec, list(images), size)
                    if function.slo_ms is not None:  # same templates: no new bakes
                        _deploy(client, functions, images, slo=True, baked=baked)
                for label, (rate, factor) in rates.items():
                    rps[label] = rate if rate is not None else factor * (capacity or 0.0)
                    plan = plan_requests(
                        replace(spec.workload, seed=spec.workload.seed + r),
                        rps[label],
                        list(images),
                        size,
                        len(functions),
                        spec.adapter_zipf,
                    )
                    stats = asyncio.run(replay(server.url, None, names, plan, spec.workload.warmup))
                    key = named[(name, label)]
                    results[key].outcomes += stats.outcomes
                    results[key].wall_s += stats.wall_s
                    summaries[key] = server_figures(client)  # of its last round
                    # each run's figures as soon as it ends: a run cut short keeps them
                    log.info(
                        "%s after round %d: %s", key, r + 1, json.dumps(results[key].summary())
                    )
    for key, stats in results.items():
        summaries[key] = {**stats.summary(), **summaries[key]}
    if spec.plot is not None:
        plot_cdfs(results, spec.plot)
    return {
        "model": spec.model,
        "rate_rps": next(iter(rps.values())),
        "rates_rps": rps,
        "capacity_rps": capacity,
        "requests": spec.workload.requests * spec.rounds,
        "rounds": spec.rounds,
        "executors": spec.executors,
        "threads": spec.threads,
        "provider": "local" if spec.ray_address is None else "ray",
        "masks": spec.workload.masks,
        "slo_ms": spec.slo_ms,
        "configs": summaries,
    }


def adapter_functions(function: FunctionSpec, count: int, data_dir: Path) -> list[FunctionSpec]:
    """``function`` alone (``count`` 0), or ``count`` copies on its model, each with a LoRA
    of its own (rank 4, written under ``data_dir/loras``): a template marketplace's long
    tail of styles."""
    if count == 0:
        return [function]
    from retouch.runtime.demoloras import write_lora  # torch: only where adapters are asked

    models = data_dir / "shared" / "models"
    loras = [
        write_lora(
            function.model, models, data_dir / "loras" / f"l{i}", family=function.family, seed=i
        )
        for i in tqdm(range(count), desc="LoRA files", unit="file")
    ]
    return [
        replace(function, name=f"{function.name}-a{i}", adapters=(AdapterSpec(str(lora), 0.8),))
        for i, lora in enumerate(loras)
    ]


def _deploy(
    client: Client,
    functions: list[FunctionSpec],
    images: dict[str, bytes],
    *,
    slo: bool,
    baked: bool,
) -> None:
    """Deploy every function (without its SLO while the capacity is probed: admission's
    refusals are not lost throughput) and wait for their bakes."""
    for function in functions:
        client.deploy(function if slo else replace(function, slo_ms=None), images)
    if baked:
        for function in functions:
            wait_baked(client, function.name)


def config_server(spec: LoadSpec, name: str, data_dir: Path) -> ServerProcess:
    extra = [
        *config_args(name),
        "--max-batch", str(spec.max_batch),
        "--shared-dir", str(data_dir / "shared"),
    ]  # fmt: skip
    if spec.host_cache_bytes is not None:
        extra += ["--host-cache-bytes", str(spec.host_cache_bytes)]
    if spec.threads:
        extra += ["--threads", str(spec.threads)]
    if spec.ray_address is not None:
        extra += ["--provider", "ray", "--ray-address", spec.ray_address]
    return ServerProcess(data_dir / name, executors=spec.executors, extra_args=extra)


def probe_capacity(
    url: str,
    functions: str | Sequence[str],
    spec: LoadSpec,
    templates: list[str],
    size: tuple[int, int],
) -> float:
    """Closed-loop throughput of the first configuration: the unit of ``auto:F`` rates."""
    probe = plan_requests(
        Workload(
            requests=3 * spec.max_batch * spec.executors,
            warmup=0,
            mask_mean=spec.workload.mask_mean,
            masks=spec.workload.masks,
            seed=spec.workload.seed + 1000,
        ),
        1.0,
        templates,
        size,
        len(_names(functions)),
        spec.adapter_zipf,
    )
    capacity = asyncio.run(
        measure_capacity(url, None, functions, probe, spec.max_batch * spec.executors)
    )
    log.info("capacity: %.3f invocations/s", capacity)
    return capacity


ENGINE_FIGURES = ("batch_overhead_ms_p50", "step_ms_p50", "batch_mean", "load_wait_ms_p50")


def server_figures(client: Client) -> dict[str, float]:
    """Per-step figures of the executors' engines over their recent steps (the run just
    replayed plus the capacity probe): the medians of the first executor, whose steps
    are all of this configuration; and the gateway's p99 time to a 429 on arrival."""
    doc = client.executors()
    executors = doc["executors"]
    state = (executors[0].get("state") or {}) if executors else {}
    engine = state.get("engine") or {}
    figures = {key: round(float(engine.get(key) or 0.0), 3) for key in ENGINE_FIGURES}
    # the gateway's own time to a 429 on arrival, without the load generator's side
    figures["gateway_refusal_ms_p99"] = round(float(doc["control"].get("refusal_ms_p99", 0.0)), 3)
    return figures


def wait_baked(client: Client, function: str, timeout: float = 1800.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {t["state"] for t in client.get(function)["templates"].values()}
        if states == {"baked"}:
            return
        if "failed" in states:
            raise RetouchError(f"baking {function} failed", code="bake_failed")
        time.sleep(0.5)
    raise RetouchError(f"{function} not baked after {timeout:.0f} s", code="bake_timeout")
