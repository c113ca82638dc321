"""``retouch plan-capacity``: store bytes per template and memory per executor of a
function spec or of named production shapes (``platform/lab/capacity.py``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from retouch.platform.cli.common import (
    UsageError,
    add_json,
    add_models_dir,
    existing_file,
    ints,
    local_input,
    models_dir,
    positive_int,
    print_table,
)

# The production shapes' names (``functions/demo/production.SHAPES``, which imports torch:
# the parser checks names without it; tests/test_import_contract.py keeps the two alike).
SHAPE_NAMES = (
    "flux-dev",
    "flux-fill-dev",
    "flux-kontext",
    "flux2-klein",
    "qwen-image",
    "qwen-image-edit",
    "z-image",
    "sd3-medium",
    "sd2-inpaint",
    "sdxl-inpaint",
)
GIB, MIB = 1 << 30, 1 << 20


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan-capacity",
        help="store bytes per template, host/device memory per executor, disk per node",
        description="Size the activation store and executors of a function: from a spec "
        "(TOML; a built-in model, or --shape for a model folder) or from named production "
        "shapes. Bytes are what the store counts for a bake of that shape.",
    )
    p.add_argument("spec", type=existing_file, nargs="?", help="a function spec (TOML)")
    p.add_argument(
        "--shape",
        type=_shapes,
        default=None,
        help=f"production shapes, comma-separated ({', '.join(SHAPE_NAMES)}); with a spec: "
        "the architecture its model has",
    )
    p.add_argument(
        "--resolution",
        type=ints,
        default=None,
        help="square sizes, comma-separated (shapes only; default each shape's own)",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="denoising steps (shapes only; default a spec's default for the family)",
    )
    p.add_argument(
        "--storage", choices=("native", "fp8"), default=None, help="row storage (default native)"
    )
    p.add_argument("--templates", type=positive_int, default=1, help="templates per executor")
    p.add_argument("--executors", type=positive_int, default=1, help="executors per node")
    p.add_argument(
        "--resident",
        type=positive_int,
        default=1,
        help="templates each executor keeps resident (host tier, and as many on the device)",
    )
    add_models_dir(p)
    add_json(p, "the plans")
    p.set_defaults(run=_plan)


def _shapes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPE_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected shapes among {', '.join(SHAPE_NAMES)}, got {text!r}"
        )
    return names


def _check(args: argparse.Namespace) -> None:
    """Refuse option mixes before the models are imported and built."""
    if args.spec is None and args.shape is None:
        raise UsageError("give a spec, --shape, or both")
    if args.spec is None:
        return
    if args.resolution is not None or args.steps is not None:
        raise UsageError("--resolution and --steps are for shapes: a spec has its own")
    if args.shape is not None and len(args.shape) != 1:
        raise UsageError("with a spec, --shape names one architecture")


def _plan(args: argparse.Namespace) -> None:
    _check(args)
    from retouch.platform.lab import capacity
    from retouch.runtime.maskaware.rowformat import RowFormat

    sizing = capacity.Sizing(args.templates, args.executors, args.resident)
    if args.spec is not None:
        plans = [_spec_plan(args, sizing)]
    else:
        storage = RowFormat(args.storage or "native")
        plans = [
            capacity.plan(
                capacity.shape_editor(name),
                name,
                capacity.shape_workload(name, size, args.steps, storage),
                sizing,
            )
            for name in args.shape
            for size in args.resolution or [None]
        ]
    if args.json:
        print(json.dumps([p.as_dict() for p in plans]))
        return
    _print(plans)


def _spec_plan(args: argparse.Namespace, sizing: object) -> object:
    """A spec's plan: its model, or the one ``--shape`` named, at its size and steps."""
    import dataclasses

    from retouch.functions.spec import load_spec_file
    from retouch.platform.lab import capacity
    from retouch.runtime.maskaware.rowformat import RowFormat

    spec, _ = local_input(lambda: load_spec_file(Path(args.spec)))
    workload = capacity.spec_workload(spec)
    if args.storage is not None:
        workload = dataclasses.replace(workload, storage=RowFormat(args.storage))
    if args.shape is not None:
        editor = capacity.shape_editor(args.shape[0])
    else:
        editor = capacity.spec_editor(spec, models_dir(args))
    return capacity.plan(editor, spec.name, workload, sizing)


def _print(plans: list) -> None:
    sizing = plans[0].sizing
    unit, scale = ("GiB", GIB) if max(p.disk_per_node for p in plans) >= GIB else ("MiB", MIB)
    print(
        f"{sizing.templates} template(s) per executor, {sizing.executors} executor(s) per "
        f"node, {sizing.resident} resident per executor; {unit}"
    )

    def size(nbytes: int) -> str:
        return f"{nbytes / scale:.2f}"

    rows = [
        [
            p.name,
            p.family,
            f"{p.workload.width}x{p.workload.height}",
            p.workload.steps,
            f"{p.dtype}/{p.workload.storage.value}",
            size(p.template.disk),
            size(p.template.host),
            size(p.template.device),
            size(p.weights),
            size(p.host_per_executor),
            size(p.device_per_executor),
            size(p.disk_per_node),
        ]
        for p in plans
    ]
    headers = ["FUNCTION", "FAMILY", "SIZE", "STEPS", "ROWS", "DISK/TPL", "HOST/TPL"]
    headers += ["DEVICE/TPL", "DENOISER", "HOST/EXEC", "DEVICE/EXEC", "DISK/NODE"]
    print_table(headers, rows)
