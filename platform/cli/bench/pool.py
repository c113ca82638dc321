"""``retouch bench load|placement|sim|validate``: a pool of executors under a workload, real
(``load``), simulated (``sim``), both on the same arrivals (``validate``), and the time of
one placement decision (``placement``).

The flags of ``load``, ``sim`` and ``validate`` are their specs' knobs
(:mod:`retouch.platform.lab.bench.specs`, :class:`~retouch.platform.lab.workload.Workload`),
registered and read back from those declarations; only what is not part of a spec (the
output, where the data goes, a recorded run to replay) is declared here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path

from retouch.functions.knobs import add_flags, from_flags, words
from retouch.platform.cli.bench.options import add_builtin_model
from retouch.platform.cli.common import add_json, existing_file, one_line_error, report
from retouch.platform.lab.bench.specs import LoadSpec, SimScaling, SimSpec, ValidateSpec
from retouch.platform.lab.workload import Workload

# bench validate sends no other arrivals, mask files or template popularity than the default
VALIDATE_FIXED = ("arrivals", "cv", "mask_file", "zipf")


def add_load(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "load", help="load generator comparing executor configurations in one run"
    )
    add_builtin_model(p, "retouch:small-flux")
    add_flags(p, LoadSpec)
    add_flags(p, Workload)
    p.add_argument(
        "--placement",
        default=None,
        help="compare placement policies instead of --compare: comma-separated, e.g. "
        "maskaware,least-requests,round-robin (a policy may add +no-admission)",
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help="run the executors as Ray actors on a Ray cluster of --executors nodes started "
        "on this machine for the run (one executor slot each)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="platform data dir reused by every configuration (default: a temporary one)",
    )
    add_json(p)
    p.set_defaults(run=_run_load)


def _run_load(args: argparse.Namespace) -> None:
    from retouch.platform.lab.bench.load import markdown, run_load_bench, table

    spec = LoadSpec(
        args.model, workload=Workload(**from_flags(Workload, args)), **from_flags(LoadSpec, args)
    )
    if args.placement is not None:
        spec = replace(spec, configs=words(args.placement))
    with tempfile.TemporaryDirectory(prefix="retouch-bench-load-") as tmp, ExitStack() as stack:
        if args.ray:
            from retouch.platform.lab.bench.gateway import ray_cluster

            if importlib.util.find_spec("ray") is None:
                one_line_error("--ray needs the Ray extra: pip install 'retouch[ray]'")

            spec = replace(spec, ray_address=stack.enter_context(ray_cluster(spec.executors)))
        result = run_load_bench(spec, args.data_dir or Path(tmp))
    offered = ", ".join(f"{rps:.3f}/s ({label})" for label, rps in result["rates_rps"].items())
    heading = (
        f"model {result['model']}, offered load {offered}, "
        f"{result['requests']} measured requests per configuration and rate"
    )
    if spec.out is not None:
        spec.out.mkdir(parents=True, exist_ok=True)
        (spec.out / "load.json").write_text(json.dumps(result, indent=1))
        command = "retouch " + " ".join(sys.argv[1:])
        (spec.out / "load.md").write_text(
            f"`{command}`\n\n{heading}\n\n{markdown(result, spec.configs)}\n"
        )
    if args.json:
        print(json.dumps(result))
        return
    print(heading)
    print(table(result["configs"]))


def add_placement(bench_sub: argparse._SubParsersAction) -> None:
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
    from retouch.platform.control.placement import make_placement
    from retouch.platform.lab.bench.placement import run_placement_bench

    try:
        sizes = [int(v) for v in args.executors.split(",") if v]
    except ValueError:
        raise ValueError(f"--executors must be integers, not {args.executors!r}") from None
    if not sizes or min(sizes) < 1 or args.decisions < 1:
        raise ValueError("--executors and --decisions must be >= 1")
    make_placement(args.policy)  # an unknown policy fails before any work
    report(run_placement_bench(sizes, args.decisions, args.policy, args.seed), args.json)


def add_sim(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "sim",
        help="placement policies on a simulated pool (virtual clock, the gateway's own "
        "control-plane objects), the same arrivals for each",
    )
    add_flags(p, SimSpec)
    add_flags(p, SimScaling)
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
    from retouch.platform.lab.bench.gpuprofile import sim_profile
    from retouch.platform.lab.simulator import run_simulation

    cost_model = sim_profile(args.profile)  # a bad profile or plot path fails before the run
    if args.plot is not None:
        from retouch.platform.lab.bench.simplot import check_plot_path

        check_plot_path(args.plot)
    autoscale = SimScaling(**from_flags(SimScaling, args)).config()
    spec = SimSpec(**from_flags(SimSpec, args), autoscale=autoscale)
    result = run_simulation(spec, cost_model)
    result["profile"] = args.profile
    if args.plot is not None:
        from retouch.platform.lab.bench.simplot import plot_timelines

        plot_timelines(result, args.plot)
    report(result, args.json)


def add_validate(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "validate",
        help="the pool simulator against a real pool on this machine: the same arrivals, "
        "cost model, step fit and pre/post times; mean and P95 errors and policy rankings",
    )
    add_builtin_model(p, ValidateSpec.model)
    add_flags(p, ValidateSpec)
    add_flags(p, Workload, skip=VALIDATE_FIXED, defaults=asdict(ValidateSpec().workload))
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
    from retouch.platform.lab.bench.validate import load_runs, run_real, save_runs, table, validate

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
            workload=Workload(**from_flags(Workload, args)),
            **{
                **from_flags(ValidateSpec, args),
                "cpu_cores": args.cpu_cores or os.cpu_count() or 1,  # the machine the runs are on
            },
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
