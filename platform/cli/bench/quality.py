"""``retouch bench fidelity|edits``: what mask-aware edits look like against the stock
pipeline (PSNR, SSIM, the unmasked region) and whether edits succeed."""

from __future__ import annotations

import argparse
from pathlib import Path

from retouch.platform.cli.bench.options import (
    add_builtin_model,
    add_device,
    add_guidance_and_threads,
    add_steps,
)
from retouch.platform.cli.common import (
    _listed,
    add_json,
    add_models_dir,
    floats,
    model,
    models_dir,
    non_negative_int,
    non_negative_ints,
    positive_int,
    report,
)


def add_fidelity(bench_sub: argparse._SubParsersAction) -> None:
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
    from retouch.functions.models import builtin_model
    from retouch.platform.lab.bench.edits import load_editor
    from retouch.platform.lab.bench.fidelity import run_edit_grid, run_fidelity_bench
    from retouch.platform.lab.torchsettings import use_threads

    use_threads(args.threads)
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


def add_edits(bench_sub: argparse._SubParsersAction) -> None:
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
    from retouch.platform.lab.bench.edits import load_editor, run_edit_bench
    from retouch.platform.lab.torchsettings import use_threads

    use_threads(args.threads)
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
