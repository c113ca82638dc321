"""``retouch bench ops|production``: production-shaped models, stock against mask-aware, on
the accelerator (ops dispatched per step as the CPU proxy)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from retouch.platform.cli.bench.options import (
    add_device,
    add_mask_ratio,
    add_repeats,
    add_steps,
    add_tier,
)
from retouch.platform.cli.common import (
    _checked,
    _listed,
    add_json,
    add_models_dir,
    builtin,
    floats,
    ints,
    models_dir,
    positive_int,
    ratio,
)


def add_ops(bench_sub: argparse._SubParsersAction) -> None:
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
    add_tier(p)
    p.add_argument(
        "--layout",
        choices=("exact", "bucketed"),
        default="exact",
        help="the sparse steps' token layout: exact (each mask's shapes; default) or "
        "bucketed (masked tokens padded to a bucket, as a served GPU step is captured)",
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
    from retouch.platform.lab.bench.ops import run_ops_bench

    rows = run_ops_bench(
        args.models,
        args.mask_ratio,
        args.batch,
        args.steps,
        models_dir(args),
        tier=args.tier,
        layout=args.layout,
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


def add_production(bench_sub: argparse._SubParsersAction) -> None:
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
        "--compile-stock",
        type=ints,
        default=[],
        help="batch sizes at which stock is also timed with its repeated blocks under "
        "torch.compile (regional compilation; minutes of compiling per shape on a GPU; "
        "default none)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="folder for gpu-bench.json and gpu-bench.md"
    )
    add_device(p)
    add_json(p, "the reports")
    p.set_defaults(run=_run_production)


def _run_production(args: argparse.Namespace) -> None:
    import sys

    from retouch.platform.lab.bench.production import (
        as_json,
        markdown,
        run_production_bench,
        write_outputs,
    )
    from retouch.platform.lab.torchsettings import device_name

    done: list = []
    command = "retouch " + " ".join(sys.argv[1:])

    def keep(shape_report: object) -> None:  # a later shape's failure keeps this one
        done.append(shape_report)
        if args.out is not None:
            write_outputs(done, args.out, device_name(args.device), command)

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
        compile_batches=tuple(args.compile_stock),
        on_shape=keep,
    )
    print(as_json(reports) if args.json else markdown(reports, device_name(args.device), command))
