"""``retouch bench ...``: one registration function and one run function per benchmark.

The benchmarks themselves live in :mod:`retouch.platform.bench` (imported when run: most
of them need torch); this module only declares their options and prints their results.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from retouch.platform.commands.common import (
    _checked,
    _listed,
    add_json,
    add_models_dir,
    builtin,
    existing_dir,
    existing_file,
    floats,
    ints,
    model,
    models_dir,
    non_negative_float,
    non_negative_int,
    non_negative_ints,
    one_line_error,
    positive_float,
    positive_int,
    ratio,
    report,
)


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one run)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for add in (
        _gateway,
        _deploy,
        _engine,
        _fidelity,
        _load,
        _placement,
        _sim,
        _validate,
        _plan,
        _edits,
        _store,
        _ops,
        _production,
    ):
        add(bench_sub)


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the model runs: auto = CUDA when there is one (default), cpu, cuda",
    )


def _gateway(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("gateway", help="the gateway's own time per invocation")
    p.add_argument(
        "--requests", type=positive_int, default=50, help="invocations of each kind (default 50)"
    )
    p.add_argument("--examples", type=existing_dir, default=None, help="folder of example specs")
    p.add_argument(
        "--ray",
        action="store_true",
        help="also a gateway with --provider ray on a one-node Ray cluster (the ray extra)",
    )
    add_json(p)
    p.set_defaults(run=_run_gateway)


def _run_gateway(args: argparse.Namespace) -> None:
    from retouch.platform.bench.gateway import run_gateway_bench
    from retouch.platform.demo import find_examples

    report(run_gateway_bench(find_examples(args.examples), args.requests, ray=args.ray), args.json)


def _deploy(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "deploy",
        help="a served function's latency while a second model deploys and profiles (same run)",
    )
    p.add_argument(
        "--requests",
        type=positive_int,
        default=12,
        help="undisturbed invocations before and after",
    )
    p.add_argument("--steps", type=positive_int, default=10, help="denoising steps per invocation")
    p.add_argument("--examples", type=existing_dir, default=None, help="folder of example specs")
    add_json(p)
    p.set_defaults(run=_run_deploy)


def _run_deploy(args: argparse.Namespace) -> None:
    from retouch.platform.bench.deploy import run_deploy_bench
    from retouch.platform.demo import find_examples

    report(run_deploy_bench(find_examples(args.examples), args.requests, args.steps), args.json)


def _engine(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "engine", help="mask-aware vs stock diffusers edits, same model, same run"
    )
    add_builtin_model(p, "retouch:small-flux")
    p.add_argument(
        "--mask-ratios",
        type=floats,
        default=[0.05, 0.1, 0.2, 0.35, 0.5, 1.0],
        help="mask ratios, comma-separated (default 0.05,0.1,0.2,0.35,0.5,1.0)",
    )
    p.add_argument(
        "--batch", type=ints, default=[1, 4], help="batch sizes, comma-separated (default 1,4)"
    )
    add_steps(p, 8)
    add_repeats(p)
    p.add_argument(
        "--full-steps",
        type=non_negative_int,
        default=0,
        help="warm-up steps of the mask-aware edits computed over every token",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or process CPU time (steadier on a shared machine)",
    )
    add_device(p)
    add_models_dir(p)
    add_json(p, "the rows")
    p.set_defaults(run=_run_engine)


def _run_engine(args: argparse.Namespace) -> None:
    from retouch.platform.bench.engine import run_engine_bench

    rows = run_engine_bench(
        args.model,
        args.mask_ratios,
        args.batch,
        args.steps,
        args.repeats,
        models_dir(args),
        clock=args.clock,
        full_steps=args.full_steps,
        device=args.device,
    )
    if args.json:
        print(json.dumps(rows))
        return
    print(
        f"{'model':<20} {'mask':>6} {'batch':>6} {'stock s':>9} {'maskaware s':>12} {'ratio':>7} {'flop ratio':>11}"
    )
    for r in rows:
        print(
            f"{r['model']:<20} {r['mask_ratio']:>6.2f} {r['batch']:>6} {r['stock_s']:>9.3f} {r['maskaware_s']:>12.3f} {r['ratio']:>7.3f} {r['flop_ratio']:>11.3f}"
        )


def _fidelity(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "fidelity",
        help="mask-aware edits against the stock pipeline: PSNR, SSIM, unmasked region "
        "(a grid of held-out scenes, mask ratios and edit success on trained models)",
    )
    add_builtin_model(p, "retouch:small-sd")
    p.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="denoising steps (default 25 on trained models, 6 on random-weight ones)",
    )
    p.add_argument(
        "--full-steps",
        type=non_negative_ints,
        default=[0],
        help="warm-up steps to compare, e.g. 0,1,2 (default 0)",
    )
    p.add_argument(
        "--mask-ratios",
        type=floats,
        default=None,
        help="masked fractions (default 0.1,0.2,0.35 on trained models, 0.2 otherwise)",
    )
    p.add_argument(
        "--halos",
        type=non_negative_ints,
        default=None,
        help="latent pixels around the mask computed fresh, e.g. 0,2 (default: the family's)",
    )
    p.add_argument(
        "--storage",
        type=_listed(str, "row formats"),
        default=["native"],
        help="how cached rows rest, compared on trained models: native,fp8 (default native)",
    )
    p.add_argument(
        "--edits",
        type=positive_int,
        default=12,
        help="held-out scenes per mask ratio (trained models; default 12)",
    )
    add_guidance_and_threads(p)
    p.add_argument(
        "--feather-px",
        type=non_negative_int,
        default=3,
        help="soft edge of the composited rows (trained models; default 3)",
    )
    add_device(p)
    add_models_dir(p)
    add_json(p, "the rows")
    p.set_defaults(run=_run_fidelity)


def _run_fidelity(args: argparse.Namespace) -> None:
    import torch

    from retouch.functions.models import builtin_model
    from retouch.platform.bench.edits import load_editor
    from retouch.platform.bench.fidelity import run_edit_grid, run_fidelity_bench

    if args.threads:
        torch.set_num_threads(args.threads)
    if not builtin_model(args.model).trained:
        rows = []
        for ratio in args.mask_ratios or [0.2]:
            rows += run_fidelity_bench(
                args.model,
                args.steps or 6,
                args.full_steps,
                models_dir(args),
                mask_ratio=ratio,
                guidance=args.guidance,
                device=args.device,
                halo=args.halos[0] if args.halos else None,
            )
        report(rows, args.json)
        return
    rows = run_edit_grid(
        load_editor(args.model, models_dir(args), args.device),
        edits=args.edits,
        ratios=args.mask_ratios or [0.1, 0.2, 0.35],
        full_steps=args.full_steps,
        steps=args.steps or 25,
        guidance=args.guidance,
        halos=args.halos,
        feather_px=args.feather_px,
        storages=tuple(args.storage),
    )
    report(rows, args.json)


def _load(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "load", help="load generator comparing executor configurations in one run"
    )
    add_builtin_model(p, "retouch:small-flux")
    p.add_argument(
        "--compare",
        default="continuous,static",
        help="configurations: +-joined tokens of continuous|static, maskaware|stock, disaggregated|naive",
    )
    p.add_argument(
        "--rate",
        default="auto:0.7",
        help="invocations/s, or auto:F = F x measured capacity of the first configuration",
    )
    p.add_argument(
        "--requests",
        type=positive_int,
        default=60,
        help="measured invocations per configuration (default 60)",
    )
    p.add_argument(
        "--warmup",
        type=non_negative_int,
        default=4,
        help="invocations sent first and left out of the figures (default 4)",
    )
    p.add_argument(
        "--arrivals",
        choices=("poisson", "gamma"),
        default="poisson",
        help="inter-arrival distribution (default poisson)",
    )
    p.add_argument(
        "--cv", type=float, default=1.0, help="coefficient of variation of gamma inter-arrivals"
    )
    p.add_argument(
        "--mask-mean",
        type=float,
        default=0.19,
        help="beta mean: 0.11 (production), 0.19 (public), 0.35 (VITON-HD)",
    )
    p.add_argument(
        "--mask-file",
        type=existing_file,
        default=None,
        help="mask ratios, one per line (instead of the beta)",
    )
    p.add_argument(
        "--masks",
        choices=("beta", "bimodal"),
        default="beta",
        help="mask ratios: a beta with --mask-mean, or bimodal (0.05 and 0.6, half each)",
    )
    p.add_argument(
        "--placement",
        default=None,
        help="compare placement policies instead of --compare: comma-separated, e.g. "
        "maskaware,least-requests,round-robin (a policy may add +no-admission)",
    )
    p.add_argument("--executors", type=int, default=1, help="executors of each server")
    p.add_argument(
        "--ray",
        action="store_true",
        help="run the executors as Ray actors on a Ray cluster of --executors nodes started "
        "on this machine for the run (one executor slot each)",
    )
    p.add_argument(
        "--host-cache-bytes",
        type=int,
        default=None,
        help="each executor's host-RAM tier (e.g. room for ~3 templates to compare affinity)",
    )
    p.add_argument(
        "--threads",
        type=non_negative_int,
        default=0,
        help="torch threads of each executor (default 0: the machine's cores shared out)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="replays per configuration, the order reversed every other round (A B, B A)",
    )
    p.add_argument(
        "--slo", type=float, default=None, help="the function's latency SLO in ms (admission)"
    )
    p.add_argument(
        "--zipf",
        type=positive_float,
        default=1.1,
        help="Zipf exponent of template popularity (default 1.1)",
    )
    add_steps(p, 8)
    p.add_argument(
        "--templates", type=positive_int, default=4, help="templates of the function (default 4)"
    )
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=8,
        help="each executor's running batch limit (default 8)",
    )
    p.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed of arrivals and masks (default 0)"
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="platform data dir reused by every configuration (default: a temporary one)",
    )
    p.add_argument("--plot", type=Path, default=None, help="write latency CDFs to this PNG")
    add_json(p)
    p.set_defaults(run=_run_load)


def _run_load(args: argparse.Namespace) -> None:
    from retouch.platform.bench.load import LoadSpec, Workload, run_load_bench, table

    workload = Workload(
        args.requests,
        args.warmup,
        args.arrivals,
        args.cv,
        args.mask_mean,
        args.mask_file,
        args.zipf,
        args.seed,
        args.masks,
    )
    if args.executors < 1:
        raise ValueError("--executors must be >= 1")
    configs = args.placement if args.placement is not None else args.compare
    spec = LoadSpec(
        args.model,
        [c for c in configs.split(",") if c],
        args.rate,
        workload,
        args.steps,
        args.templates,
        args.max_batch,
        executors=args.executors,
        plot=args.plot,
        slo_ms=args.slo,
        rounds=args.rounds,
        host_cache_bytes=args.host_cache_bytes,
        threads=args.threads,
    )
    with tempfile.TemporaryDirectory(prefix="retouch-bench-load-") as tmp, ExitStack() as stack:
        if args.ray:
            from retouch.platform.bench.gateway import ray_cluster

            if importlib.util.find_spec("ray") is None:
                one_line_error("--ray needs the Ray extra: pip install 'retouch[ray]'")

            spec = replace(spec, ray_address=stack.enter_context(ray_cluster(args.executors)))
        result = run_load_bench(spec, args.data_dir or Path(tmp))
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"model {result['model']}, offered load {result['rate_rps']:.3f} invocations/s, {result['requests']} measured requests per configuration"
    )
    print(table(result["configs"]))


def _placement(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "placement",
        help="time of one placement decision against N synthetic executors with running batches",
    )
    p.add_argument(
        "--executors",
        default="64,256",
        help="pool sizes, comma-separated (one row each)",
    )
    p.add_argument("--decisions", type=int, default=2000, help="decisions timed per pool size")
    p.add_argument("--policy", default="maskaware", help="the placement policy to time")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic pool")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_run_placement)


def _run_placement(args: argparse.Namespace) -> None:
    from retouch.platform.bench.placement import run_placement_bench
    from retouch.platform.placement import make_placement

    try:
        sizes = [int(v) for v in args.executors.split(",") if v]
    except ValueError:
        raise ValueError(f"--executors must be integers, not {args.executors!r}") from None
    if not sizes or min(sizes) < 1 or args.decisions < 1:
        raise ValueError("--executors and --decisions must be >= 1")
    make_placement(args.policy)  # an unknown policy fails before any work
    report(run_placement_bench(sizes, args.decisions, args.policy, args.seed), args.json)


def _sim(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "sim",
        help="placement policies on a simulated pool (virtual clock, the gateway's own "
        "control-plane objects), the same arrivals for each",
    )
    p.add_argument("--executors", type=positive_int, default=64, help="pool size (default 64)")
    p.add_argument(
        "--placement",
        default="maskaware,least-requests,round-robin",
        help="policies, comma-separated (default maskaware,least-requests,round-robin)",
    )
    p.add_argument(
        "--arrivals",
        default="poisson",
        help="poisson, gamma:CV (e.g. gamma:2), step:F@T (rate x F from T s on), diurnal:P:A[:CV] (rate x (1 + A sin 2 pi t/P), "
        "Poisson or Gamma with that CV), or trace:FILE (a CSV with arrival_s and optionally "
        "mask_ratio, replayed at --load of the pool's capacity; default poisson)",
    )
    p.add_argument("--masks", choices=("beta", "bimodal"), default="beta", help="mask ratio mix")
    p.add_argument(
        "--mask-mean", type=ratio, default=0.19, help="mean of the Beta mask ratios (default 0.19)"
    )
    p.add_argument(
        "--load", type=positive_float, default=0.85, help="offered rate / capacity (default 0.85)"
    )
    p.add_argument("--requests", type=positive_int, default=20000, help="arrivals (default 20000)")
    p.add_argument(
        "--warmup", type=non_negative_int, default=1000, help="first arrivals left out (1000)"
    )
    add_steps(p, 28)
    p.add_argument("--max-batch", type=positive_int, default=8, help="batch limit (default 8)")
    p.add_argument(
        "--slo-factor",
        type=positive_float,
        default=None,
        help="an SLO of this many times the standalone latency, with admission (a policy "
        "may add +no-admission to compare)",
    )
    p.add_argument(
        "--autoscale",
        default=None,
        metavar="MIN,MAX",
        help="autoscale the pool between MIN and MAX executors (it starts with --executors; "
        "--load is then relative to MAX)",
    )
    p.add_argument(
        "--target-s",
        type=positive_float,
        default=30.0,
        help="autoscaling target: predicted seconds of work per executor (default 30)",
    )
    p.add_argument(
        "--target-utilisation",
        type=positive_float,
        default=0.8,
        help="autoscaling: the share of an executor's capacity the arrivals' demand may fill "
        "(default 0.8)",
    )
    p.add_argument(
        "--headroom-sigmas",
        type=non_negative_float,
        default=0.0,
        help="autoscaling: add this x sqrt(demand) executors (square-root staffing: room "
        "for bursts, relatively more in a small pool; default 0)",
    )
    p.add_argument(
        "--downscale-delay-s",
        type=positive_float,
        default=600.0,
        help="autoscaling: a scale-down takes the highest recommendation of this window "
        "(default 600)",
    )
    p.add_argument(
        "--startup-s",
        type=non_negative_float,
        default=60.0,
        help="a new executor's start-up time in the simulation (default 60)",
    )
    p.add_argument(
        "--templates",
        type=positive_int,
        default=1,
        help="templates, drawn with Zipf popularity (default 1)",
    )
    p.add_argument(
        "--zipf", type=non_negative_float, default=1.1, help="Zipf exponent (default 1.1)"
    )
    p.add_argument(
        "--host-templates",
        type=non_negative_int,
        default=0,
        help="templates each executor's host tier holds, LRU, empty at its start (default 0: "
        "every template always host-resident, no tiers simulated)",
    )
    p.add_argument(
        "--disk-load-s",
        type=non_negative_float,
        default=6.4,
        help="a template's disk -> host load (default 6.4: FlashPS, a 2.6 GiB template)",
    )
    p.add_argument(
        "--cold-templates",
        action="store_true",
        help="no template is baked at the start: the first invocations of each run the full "
        "path and queue its bake",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals, masks and noise")
    p.add_argument(
        "--profile",
        default="synthetic",
        metavar="FILE|flux-h800|synthetic",
        help="the executors' cost model: synthetic (the Flux-like profile of bench placement, "
        "the default), flux-h800 (Flux on an H800, derived from FlashPS's published figures: "
        "deploy/profiles/flux-h800-flashps.json) or a profile JSON file",
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE",
        help="also draw the timelines (arrivals, queue, executors, P95 per 10 s) of every "
        "placement to FILE (.png, .svg or .pdf; needs matplotlib)",
    )
    add_json(p)
    p.set_defaults(run=_run_sim)


def _run_sim(args: argparse.Namespace) -> None:
    from retouch.platform.bench.gpuprofile import sim_profile
    from retouch.platform.simulator import SimSpec, run_simulation

    cost_model = sim_profile(args.profile)  # a bad profile or plot path fails before the run
    if args.plot is not None:
        from retouch.platform.bench.simplot import check_plot_path

        check_plot_path(args.plot)

    autoscale = None
    if args.autoscale is not None:
        from retouch.platform.control.autoscaler import AutoscalingConfig

        try:
            low, high = (int(v) for v in args.autoscale.split(","))
        except ValueError:
            raise ValueError(f"--autoscale takes MIN,MAX, not {args.autoscale!r}") from None
        autoscale = AutoscalingConfig(
            min_executors=low,
            max_executors=high,
            target_s=args.target_s,
            target_utilisation=args.target_utilisation,
            headroom_sigmas=args.headroom_sigmas,
            downscale_delay_s=args.downscale_delay_s,
        )
    spec = SimSpec(
        executors=args.executors,
        autoscale=autoscale,
        startup_s=args.startup_s,
        placements=tuple(p for p in args.placement.split(",") if p),
        arrivals=args.arrivals,
        masks=args.masks,
        mask_mean=args.mask_mean,
        load=args.load,
        requests=args.requests,
        warmup=args.warmup,
        steps=args.steps,
        max_batch=args.max_batch,
        slo_factor=args.slo_factor,
        seed=args.seed,
        templates=args.templates,
        zipf=args.zipf,
        host_templates=args.host_templates,
        disk_load_s=args.disk_load_s,
        cold_templates=args.cold_templates,
    )
    result = run_simulation(spec, cost_model)
    result["profile"] = args.profile
    if args.plot is not None:
        from retouch.platform.bench.simplot import plot_timelines

        plot_timelines(result, args.plot)
    report(result, args.json)


def _validate(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "validate",
        help="the pool simulator against a real pool on this machine: the same arrivals, "
        "cost model, step fit and pre/post times; mean and P95 errors and policy rankings",
    )
    add_builtin_model(p, "retouch:tiny-flux")
    p.add_argument(
        "--loads",
        type=floats,
        default=(0.5, 0.7, 0.85),
        help="offered loads, fractions of the capacity in (0, 1] (default 0.5,0.7,0.85)",
    )
    p.add_argument(
        "--placement",
        default="maskaware,least-requests,round-robin",
        help="policies, comma-separated (default maskaware,least-requests,round-robin)",
    )
    p.add_argument("--executors", type=positive_int, default=2, help="executors (default 2)")
    p.add_argument(
        "--threads", type=positive_int, default=1, help="torch threads per executor (default 1)"
    )
    p.add_argument(
        "--requests", type=positive_int, default=100, help="measured invocations per run (100)"
    )
    p.add_argument("--warmup", type=non_negative_int, default=5, help="warm-up invocations (5)")
    p.add_argument("--masks", choices=("beta", "bimodal"), default="bimodal", help="mask mix")
    p.add_argument("--mask-mean", type=ratio, default=0.19, help="Beta mean (default 0.19)")
    add_steps(p, 8)
    p.add_argument("--templates", type=positive_int, default=4, help="templates (default 4)")
    p.add_argument("--max-batch", type=positive_int, default=8, help="batch limit (default 8)")
    p.add_argument(
        "--capacity",
        type=positive_float,
        default=None,
        help="the pool's capacity in invocations/s (default: one closed-loop probe)",
    )
    p.add_argument(
        "--noise", type=non_negative_float, default=0.05, help="simulated step noise sigma"
    )
    p.add_argument(
        "--overheads",
        choices=("samples", "mean", "cpu"),
        default="samples",
        help="the simulated pre/post times: drawn from the run's measured ones (default), "
        "or their mean; cpu: a shared-CPU model (steps, encodes, decodes and the gateway's "
        "own work share --cpu-cores, each at its uncontended time)",
    )
    p.add_argument(
        "--cpu-cores",
        type=non_negative_int,
        default=0,
        help="with --overheads cpu: the cores the model shares (default: those of the machine "
        "the runs were recorded on)",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of arrivals and masks")
    p.add_argument(
        "--record", type=Path, default=None, help="save the real runs (arrivals, latencies) here"
    )
    p.add_argument(
        "--from",
        dest="from_file",
        type=existing_file,
        default=None,
        help="simulate runs saved by --record again, without running the real pool",
    )
    p.add_argument(
        "--against",
        type=existing_file,
        default=None,
        help="with --from: compare with another recorded real run of the same arrivals "
        "instead of the simulation (real-run noise on this machine)",
    )
    p.add_argument("--data-dir", type=Path, default=None, help="platform data dir (default: temp)")
    add_json(p)
    p.set_defaults(run=_run_validate)


def _run_validate(args: argparse.Namespace) -> None:
    from retouch.platform.bench.load import Workload
    from retouch.platform.bench.validate import (
        ValidateSpec,
        load_runs,
        run_real,
        save_runs,
        table,
        validate,
    )

    if args.from_file is not None:
        spec, capacity, runs = load_runs(args.from_file)
        spec = replace(
            spec,
            noise=args.noise,
            overheads=args.overheads,
            cpu_cores=args.cpu_cores or spec.cpu_cores,
        )
    else:
        spec = ValidateSpec(
            model=args.model,
            loads=tuple(args.loads),
            placements=tuple(p for p in args.placement.split(",") if p),
            workload=Workload(
                requests=args.requests,
                warmup=args.warmup,
                masks=args.masks,
                mask_mean=args.mask_mean,
                seed=args.seed,
            ),
            steps=args.steps,
            templates=args.templates,
            max_batch=args.max_batch,
            executors=args.executors,
            threads=args.threads,
            noise=args.noise,
            rate_rps=args.capacity,
            overheads=args.overheads,
            cpu_cores=args.cpu_cores or os.cpu_count() or 1,  # the machine the runs are on
        )
        with tempfile.TemporaryDirectory(prefix="retouch-bench-validate-") as tmp:
            capacity, runs = run_real(spec, args.data_dir or Path(tmp))
        if args.record is not None:
            save_runs(args.record, spec, capacity, runs)
    against = None
    if args.against is not None:
        if args.from_file is None:
            one_line_error("--against needs --from (two recorded runs)")
        against = load_runs(args.against)[2]
    result = validate(runs, spec, capacity, against)
    if args.json:
        print(json.dumps(result))
        return
    print(table(result))


def _plan(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "plan", help="bubble-free plan vs naive sequential loading, whole edits, same run"
    )
    add_builtin_model(p, "retouch:small-flux")
    add_mask_ratio(p)
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    p.add_argument(
        "--tier",
        choices=("device", "host"),
        default="device",
        help="where the template's rows rest: device (resident, copied whole: a GPU's hot "
        "path; default) or host (gathered per request)",
    )
    add_steps(p, 4)
    add_repeats(p)
    p.add_argument(
        "--link-gbps",
        type=positive_float,
        default=None,
        help="emulate a host->device link of this bandwidth (GB/s) behind every row read",
    )
    add_device(p)
    add_models_dir(p)
    add_json(p)
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> None:
    from retouch.platform.bench.plan import run_plan_bench

    result = run_plan_bench(
        args.model,
        args.mask_ratio,
        args.batch,
        args.steps,
        args.repeats,
        models_dir(args),
        link_gbps=args.link_gbps,
        device=args.device,
    )
    report(result, args.json)


def _edits(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "edits",
        help="edit-success rate: does the masked region get the requested colour? (stock and mask-aware)",
    )
    p.add_argument(
        "--model",
        type=model,
        default="retouch:shapes-sd",
        help="a built-in model or a diffusers folder (default retouch:shapes-sd)",
    )
    p.add_argument(
        "--edits",
        type=positive_int,
        default=50,
        help="number of edits (half recolour, half replace)",
    )
    add_steps(p, 25)
    add_guidance_and_threads(p)
    p.add_argument(
        "--seed", type=non_negative_int, default=0, help="selects the held-out scenes and noise"
    )
    p.add_argument(
        "--full-steps",
        type=non_negative_int,
        default=0,
        help="warm-up steps of the mask-aware edits computed over every token (default 0)",
    )
    p.add_argument(
        "--halo",
        type=non_negative_int,
        default=None,
        help="latent pixels around the mask computed fresh (default: the family's)",
    )
    p.add_argument(
        "--stock-only",
        action="store_true",
        help="only the stock pipeline (no bake, no mask-aware edit)",
    )
    p.add_argument("--sheet", type=Path, default=None, help="write a PNG of every edit here")
    add_models_dir(p)
    p.add_argument("--json", action="store_true", help="print JSON with every edit's row")
    p.set_defaults(run=_run_edits)


def _run_edits(args: argparse.Namespace) -> None:
    import torch

    from retouch.platform.bench.edits import load_editor, run_edit_bench

    if args.threads:
        torch.set_num_threads(args.threads)
    editor = load_editor(args.model, models_dir(args))
    result = run_edit_bench(
        editor,
        args.edits,
        steps=args.steps,
        guidance=args.guidance,
        seed=args.seed,
        full_steps=args.full_steps,
        halo=args.halo,
        retouch=not args.stock_only,
        sheet=args.sheet,
    )
    if not args.json:
        result = {k: v for k, v in result.items() if k != "rows"}
    report(result, args.json)


def add_builtin_model(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--model", type=builtin, default=default, help=f"a built-in model (default {default})"
    )


def add_guidance_and_threads(p: argparse.ArgumentParser) -> None:
    """The options of the benchmarks that run a model in this process (edits, fidelity)."""
    p.add_argument(
        "--guidance", type=positive_float, default=5.0, help="classifier-free guidance (default 5)"
    )
    p.add_argument(
        "--threads", type=non_negative_int, default=0, help="CPU threads (default: torch's)"
    )


def add_steps(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument(
        "--steps", type=positive_int, default=default, help=f"denoising steps (default {default})"
    )


def add_repeats(p: argparse.ArgumentParser, default: int = 3) -> None:
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=default,
        help=f"timed runs of each case, alternating the order (default {default})",
    )


def add_mask_ratio(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mask-ratio", type=ratio, default=0.2, help="masked fraction of the image (default 0.2)"
    )


def _store(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("store", help="activation store vs memcpy and raw disk reads")
    p.add_argument(
        "--size-mb",
        type=positive_int,
        default=256,
        help="bytes of activations, in MB (default 256)",
    )
    add_repeats(p, 5)
    add_json(p)
    p.set_defaults(run=_run_store)


def _run_store(args: argparse.Namespace) -> None:
    from retouch.platform.bench.store import run_store_bench

    with tempfile.TemporaryDirectory(prefix="retouch-bench-store-") as tmp:
        report(run_store_bench(Path(tmp), size_mb=args.size_mb, repeats=args.repeats), args.json)


def _ops(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "ops", help="aten ops dispatched per denoising step, mask-aware vs stock (CPU proxy)"
    )
    p.add_argument(
        "--models",
        type=_listed(builtin, "built-in retouch: models"),
        default=["retouch:tiny-flux", "retouch:tiny-sd", "retouch:tiny-sd3"],
        help="built-in models, comma-separated (default retouch:tiny-flux,retouch:tiny-sd,retouch:tiny-sd3)",
    )
    add_mask_ratio(p)
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    p.add_argument(
        "--tier",
        choices=("device", "host"),
        default="device",
        help="where the template's rows rest: device (resident, copied whole: a GPU's hot "
        "path; default) or host (gathered per request)",
    )
    p.add_argument(
        "--steps",
        type=_checked(int, "an integer >= 3", lambda v: v >= 3),
        default=3,
        help="denoising steps of the edits; the first (it builds the layouts) and the last "
        "are not in the steady-state count (default 3, at least 3)",
    )
    add_models_dir(p)
    add_json(p, "the rows")
    p.set_defaults(run=_run_ops)


def _run_ops(args: argparse.Namespace) -> None:
    from retouch.platform.bench.ops import run_ops_bench

    rows = run_ops_bench(
        args.models, args.mask_ratio, args.batch, args.steps, models_dir(args), tier=args.tier
    )
    if args.json:
        print(json.dumps(rows))
        return
    print(
        f"{'model':<18} {'mask':>5} {'batch':>5} {'stock ops':>10} {'sparse ops':>11} {'ratio':>6} {'1st step':>9}  top extra ops"
    )
    for r in rows:
        top = ", ".join(f"{op.removeprefix('aten::')} +{n}" for op, n in r["top_extra"][:5])
        print(
            f"{r['model']:<18} {r['mask_ratio']:>5.2f} {r['batch']:>5} {r['stock_ops']:>10} {r['sparse_ops']:>11} {r['ratio']:>6.3f} {r['first_step_ops']:>9}  {top}"
        )


def _production(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "production",
        help="stock vs mask-aware on production-shaped models (Flux-dev, SD3-medium, SD2), "
        "template in the device tier and streamed from the host",
    )
    p.add_argument(
        "--shapes",
        type=_listed(str, "shape names"),
        default=["flux-dev", "sd3-medium", "sd2-inpaint"],
        help="production shapes, comma-separated (default flux-dev,sd3-medium,sd2-inpaint)",
    )
    p.add_argument(
        "--masks", type=floats, default=[0.1, 0.2, 0.35], help="mask ratios (default 0.1,0.2,0.35)"
    )
    p.add_argument("--batch", type=ints, default=[1, 4], help="batch sizes (default 1,4)")
    add_steps(p, 8)
    add_repeats(p)
    p.add_argument(
        "--tiers",
        type=_listed(str, "tiers"),
        default=["device", "graphs", "host", "host-fp8", "host-graphs", "host-fp8-graphs"],
        help="where the template rests: device (GPU memory), graphs (GPU memory, steps "
        "replayed from CUDA graphs), host (pinned, streamed), host-fp8 (the same in fp8), "
        "host-graphs and host-fp8-graphs (pinned rows copied a step ahead for graphs)",
    )
    p.add_argument(
        "--host-masks",
        type=floats,
        default=None,
        help="mask ratios measured with the host tier (default: all of --masks)",
    )
    p.add_argument(
        "--scale",
        type=ratio,
        default=1.0,
        help="width/depth scale of the shapes (default 1: the real configs)",
    )
    p.add_argument(
        "--resolution", type=positive_int, default=None, help="image size (default: the shape's)"
    )
    p.add_argument("--no-profile", action="store_true", help="skip the profiled steps")
    p.add_argument(
        "--out", type=Path, default=None, help="folder for gpu-bench.json and gpu-bench.md"
    )
    add_device(p)
    add_json(p, "the reports")
    p.set_defaults(run=_run_production)


def _run_production(args: argparse.Namespace) -> None:
    import sys

    from retouch.platform.bench.production import (
        as_json,
        markdown,
        run_production_bench,
        write_outputs,
    )

    done: list = []
    command = "retouch " + " ".join(sys.argv[1:])

    def keep(shape_report: object) -> None:  # a later shape's failure keeps this one
        done.append(shape_report)
        if args.out is not None:
            write_outputs(done, args.out, _device_label(args.device), command)

    reports = run_production_bench(
        args.shapes,
        args.masks,
        args.batch,
        steps=args.steps,
        repeats=args.repeats,
        tiers=tuple(args.tiers),
        device=args.device,
        scale=args.scale,
        resolution=args.resolution,
        profile=not args.no_profile,
        host_masks=None if args.host_masks is None else tuple(args.host_masks),
        on_shape=keep,
    )
    print(as_json(reports) if args.json else markdown(reports, _device_label(args.device), command))


def _device_label(device: str) -> str:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"
