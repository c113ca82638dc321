"""``retouch bench engine|plan|adapters``: the mask-aware engine against stock edits, the
bubble-free plan against naive loading, and LoRA adapters' memory and load latency."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from retouch.platform.cli.bench.options import (
    add_builtin_model,
    add_device,
    add_dtype,
    add_mask_ratio,
    add_repeats,
    add_steps,
    add_tier,
)
from retouch.platform.cli.common import (
    add_json,
    add_models_dir,
    floats,
    ints,
    models_dir,
    non_negative_int,
    positive_float,
    positive_int,
    report,
)


def add_engine(bench_sub: argparse._SubParsersAction) -> None:
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
    add_dtype(p)
    add_models_dir(p)
    add_json(p, "the rows")
    p.set_defaults(run=_run_engine)


def _run_engine(args: argparse.Namespace) -> None:
    from retouch.platform.lab.bench.engine import run_engine_bench

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
        dtype=args.dtype,
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


def add_plan(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "plan", help="bubble-free plan vs naive sequential loading, whole edits, same run"
    )
    add_builtin_model(p, "retouch:small-flux")
    add_mask_ratio(p)
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    add_tier(p)
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
    from retouch.platform.lab.bench.plan import run_plan_bench

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


def add_adapters(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "adapters",
        help="LoRA adapters: executor RSS (1 and 4 LoRAs vs 4 model copies), a newcomer's "
        "load against the running batch's steps, swaps",
    )
    add_builtin_model(p, "retouch:tiny-sd")
    p.add_argument(
        "--batch", type=positive_int, default=2, help="the running batch's size (default 2)"
    )
    add_steps(p, 40)
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="where LoRA files, model copies and the servers' data go (default: a temporary folder)",
    )
    add_models_dir(p)
    add_json(p)
    p.set_defaults(run=_run_adapters)


def _run_adapters(args: argparse.Namespace) -> None:
    from retouch.platform.lab.bench.adapters import run_adapters_bench

    with tempfile.TemporaryDirectory(prefix="retouch-bench-adapters-") as scratch:
        result = run_adapters_bench(
            args.model,
            models_dir(args),
            args.work_dir or Path(scratch),
            batch=args.batch,
            steps=args.steps,
        )
    report(result, args.json)


def add_mixed_adapters(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "mixed-adapters",
        help="a step whose rows run different LoRA sets against one set and the bare model "
        "(CPU time, wall time, ops; side by side in one run)",
    )
    add_builtin_model(p, "retouch:small-sd")
    p.add_argument(
        "--batch", type=positive_int, default=4, help="requests, each its own LoRA (default 4)"
    )
    p.add_argument("--rank", type=positive_int, default=16, help="the LoRAs' rank (default 16)")
    p.add_argument("--rounds", type=positive_int, default=7, help="timed rounds (default 7)")
    add_models_dir(p)
    add_json(p)
    p.set_defaults(run=_run_mixed_adapters)


def _run_mixed_adapters(args: argparse.Namespace) -> None:
    from retouch.platform.lab.bench.mixedadapters import run_mixed_bench

    with tempfile.TemporaryDirectory(prefix="retouch-bench-mixed-") as scratch:
        result = run_mixed_bench(
            args.model,
            models_dir(args),
            Path(scratch),
            batch=args.batch,
            rank=args.rank,
            rounds=args.rounds,
        )
    report(result, args.json)
