"""FLOPs of one denoising step of a family's model, full and mask-aware.

The formulas are each family's (``Family.step_flops``, written with the primitives of
:mod:`retouch.runtime.maskaware.flops`); this module dispatches on the family's name and
scales by the batch's model rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from retouch.runtime import families
from retouch.runtime.maskaware.flops import StepFlops


def step_flops(
    family: str, config: Mapping[str, Any], mask_ratio: float, batch: int, **shape: Any
) -> tuple[float, float]:
    """(full, mask-aware) FLOPs of one step for ``batch`` requests at ``mask_ratio``
    (``shape``: ``latent_size`` and ``text_len``, see :func:`step_flop_breakdown`)."""
    flops = step_flop_breakdown(family, config, mask_ratio, batch, **shape)
    return flops.full.total, flops.maskaware.total


def step_flop_breakdown(
    family: str,
    config: Mapping[str, Any],
    mask_ratio: float,
    batch: int,
    *,
    latent_size: tuple[int, int],
    text_len: int,
) -> StepFlops:
    """(full, mask-aware) FLOPs of one step for ``batch`` requests at ``mask_ratio``, dense
    and attention apart (the formulas are the family's). ``config`` is the denoiser's
    config (``unet.config`` or ``transformer.config``), ``latent_size`` the VAE latent grid
    and ``text_len`` the prompt length in tokens."""
    if not 0.0 <= mask_ratio <= 1.0:
        raise ValueError(f"mask ratio {mask_ratio} is not in [0, 1]")
    model = families.family(family)
    full = model.step_flops(config, latent_size, text_len, 1.0)
    sparse = model.step_flops(config, latent_size, text_len, mask_ratio)
    rows = model.rows_per_request * batch
    return StepFlops(full * rows, sparse * rows)


def pipeline_step_flops(
    pipe: Any, family: str, height: int, width: int, mask_ratio: float, batch: int
) -> StepFlops:
    """:func:`step_flop_breakdown` for a loaded pipeline at an image size."""
    config, latent, text_len = families.family(family).flop_shape(pipe, height, width)
    return step_flop_breakdown(
        family, config, mask_ratio, batch, latent_size=latent, text_len=text_len
    )
