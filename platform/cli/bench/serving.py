"""``retouch bench gateway|wire|coldstart|wake|deploy|store``: the platform's own costs around the model (the
gateway's time per invocation, decoding one, a cold start's weights, a deploy beside a served function, the activation store)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from retouch.platform.cli.bench.options import (
    add_builtin_model,
    add_device,
    add_dtype,
    add_repeats,
)
from retouch.platform.cli.common import (
    add_json,
    add_models_dir,
    existing_dir,
    models_dir,
    positive_int,
    report,
)


def add_gateway(bench_sub: argparse._SubParsersAction) -> None:
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
    p.add_argument(
        "--baseline",
        type=existing_dir,
        default=None,
        help="also a gateway running another checkout of retouch (e.g. a git worktree of an "
        "older commit), control on, beside this one: vs_baseline gives their p50 ratio",
    )
    p.add_argument(
        "--rounds", type=positive_int, default=1, help="measure every case this many times"
    )
    p.add_argument(
        "--conditions",
        nargs="+",
        choices=("quiet", "large_masks"),
        default=("quiet", "large_masks"),
        help="measured while quiet and while large masks arrive (default both)",
    )
    add_json(p)
    p.set_defaults(run=_run_gateway)


def _run_gateway(args: argparse.Namespace) -> None:
    from retouch.platform.lab.bench.gateway import run_gateway_bench
    from retouch.platform.lab.demo import find_examples

    figures = run_gateway_bench(
        find_examples(args.examples),
        args.requests,
        ray=args.ray,
        baseline=args.baseline,
        rounds=args.rounds,
        conditions=tuple(args.conditions),
    )
    report(figures, args.json)


def add_wire(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("wire", help="decoding one msgpack invocation, as the gateway does")
    p.add_argument(
        "--size-mb", type=float, default=1.0, help="megabytes of mask in the body (default 1)"
    )
    p.add_argument(
        "--baseline",
        type=existing_dir,
        default=None,
        help="also measure another checkout of retouch (e.g. a git worktree of an older "
        "commit), rounds alternating: ratio = this tree's median over the baseline's",
    )
    p.add_argument("--rounds", type=positive_int, default=5, help="rounds (default 5)")
    add_repeats(p, 300)
    add_json(p)
    p.set_defaults(run=_run_wire)


def _run_wire(args: argparse.Namespace) -> None:
    from retouch.platform.lab.bench.wire import run_wire_bench

    report(run_wire_bench(args.size_mb, args.repeats, args.rounds, args.baseline), args.json)


def add_coldstart(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "coldstart",
        help="a model's weights loaded by the executor's loader against a raw read of the "
        "same files, page cache cold and warm (same run)",
    )
    add_builtin_model(p, "retouch:small-sd")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds (default 3)")
    add_device(p)
    add_dtype(p)
    add_models_dir(p)
    add_json(p, "the rows")
    p.set_defaults(run=_run_coldstart)


def _run_coldstart(args: argparse.Namespace) -> None:
    from retouch.platform.lab.bench.coldstart import run_coldstart_bench
    from retouch.runtime.models import pick_device

    rows = run_coldstart_bench(
        args.model, models_dir(args), pick_device(args.device), args.dtype, args.rounds
    )
    report(rows, args.json)


def add_wake(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "wake",
        help="an autoscaled executor woken from sleep against the same executor started "
        "cold (real retouch serve, same run)",
    )
    add_builtin_model(p, "retouch:small-sd")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds (default 3)")
    p.add_argument("--steps", type=positive_int, default=4, help="denoising steps per invocation")
    add_json(p)
    p.set_defaults(run=_run_wake)


def _run_wake(args: argparse.Namespace) -> None:
    from retouch.platform.lab.bench.wake import run_wake_bench

    report(run_wake_bench(args.model, args.rounds, args.steps), args.json)


def add_deploy(bench_sub: argparse._SubParsersAction) -> None:
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
    from retouch.platform.lab.bench.deploy import run_deploy_bench
    from retouch.platform.lab.demo import find_examples

    report(run_deploy_bench(find_examples(args.examples), args.requests, args.steps), args.json)


def add_store(bench_sub: argparse._SubParsersAction) -> None:
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
    from retouch.platform.lab.bench.store import run_store_bench

    with tempfile.TemporaryDirectory(prefix="retouch-bench-store-") as tmp:
        report(run_store_bench(Path(tmp), size_mb=args.size_mb, repeats=args.repeats), args.json)


def add_memory(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "memory",
        help="the gateway's RSS under hostile uploads, uploads at the pixel limit and 1,000 "
        "finished jobs, the retention caps' 429s, and 16-Mpx uploads at the default limits",
    )
    p.add_argument("--hostile", type=positive_int, default=200, help="oversized uploads per kind")
    p.add_argument(
        "--at-limit", type=positive_int, default=20, help="concurrent uploads at the limit"
    )
    p.add_argument("--jobs", type=positive_int, default=1000, help="jobs with 4 MiB payloads")
    p.add_argument("--side", type=positive_int, default=512, help="the pixel limit's side")
    p.add_argument(
        "--only-default-limits",
        action="store_true",
        help="run only the last phase: six concurrent 4096 x 4096 uploads on a gateway with "
        "the default limits, its RSS growth beside the decode budget it logged",
    )
    add_json(p)
    p.set_defaults(run=_run_memory)


def _run_memory(args: argparse.Namespace) -> None:
    from retouch.platform.lab.bench.memory import run_default_budget_phase, run_memory_bench

    with tempfile.TemporaryDirectory() as tmp:
        if args.only_default_limits:
            result = {"uploads_at_the_default_limits": run_default_budget_phase(Path(tmp))}
        else:
            result = run_memory_bench(Path(tmp), args.hostile, args.at_limit, args.jobs, args.side)
        report(result, args.json)


def add_crop(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "crop",
        help="a photo larger than the function edited with padding_mask_crop and resized "
        "whole, side by side in one run",
    )
    p.add_argument("--model", default="retouch:tiny-sd", help="model (default retouch:tiny-sd)")
    p.add_argument("--resolution", type=positive_int, default=512, help="the function's (512)")
    p.add_argument("--steps", type=positive_int, default=10, help="denoising steps (default 10)")
    p.add_argument(
        "--photo", type=_size, default=(2048, 1536), help="WIDTHxHEIGHT (default 2048x1536)"
    )
    p.add_argument("--pad", type=positive_int, default=32, help="padding_mask_crop (default 32)")
    add_repeats(p, 3)
    add_json(p)
    p.set_defaults(run=_run_crop)


def _size(raw: str) -> tuple[int, int]:
    from retouch.functions.errors import BadRequest
    from retouch.functions.wire import parse_size

    try:
        return parse_size(raw, "--photo")
    except BadRequest as exc:
        raise argparse.ArgumentTypeError(exc.message) from exc


def _run_crop(args: argparse.Namespace) -> None:
    from retouch.platform.lab.bench.uploads import run_crop_bench

    with tempfile.TemporaryDirectory(prefix="retouch-bench-crop-") as tmp:
        result = run_crop_bench(
            args.model, args.resolution, args.steps, args.photo, args.pad, args.repeats, Path(tmp)
        )
    report(result, args.json)
