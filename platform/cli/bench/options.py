"""The flags several benchmarks share: the model, the device, steps, repeats and the mask ratio."""

from __future__ import annotations

import argparse

from retouch.functions.modelsource import DTYPES
from retouch.platform.cli.common import (
    builtin,
    non_negative_int,
    positive_float,
    positive_int,
    ratio,
)


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the model runs: auto = CUDA when there is one (default), cpu, cuda",
    )


def add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="compute dtype, as a spec's dtype: auto = the family's on the device (default)",
    )


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


def add_tier(p: argparse.ArgumentParser) -> None:
    """Where a mask-aware benchmark's template rows rest."""
    p.add_argument(
        "--tier",
        choices=("device", "host"),
        default="device",
        help="where the template's rows rest: device (resident, copied whole: a GPU's hot "
        "path; default) or host (gathered per request)",
    )
