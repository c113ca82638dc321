"""Analytic FLOPs of one denoising step, full and mask-aware, from a model's config.

The count is what the two paths compute: every convolution and every matmul (2 FLOPs per
multiply-add) and attention's QKᵀ and AV; norms, activations and elementwise ops are left
out, as ``torch.utils.flop_counter`` leaves them out. A mask-aware step computes the
token-wise matmuls of the ``m·N`` masked tokens of each grid, their queries against all
``N`` keys, and everything else (UNet convolutions, text tokens, timestep embeddings) in
full. The ratio of the two is the ideal that measured speed-ups are held against, and an
input of the cost model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from retouch.runtime import families


@dataclass(frozen=True)
class Flops:
    """FLOPs split into dense work (convs, token-wise matmuls) and attention (QKᵀ, AV)."""

    dense: float = 0.0
    attention: float = 0.0

    @property
    def total(self) -> float:
        return self.dense + self.attention

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.dense + other.dense, self.attention + other.attention)

    def __mul__(self, factor: float) -> Flops:
        return Flops(self.dense * factor, self.attention * factor)


@dataclass(frozen=True)
class StepFlops:
    """One step of a batch, both ways."""

    full: Flops
    maskaware: Flops

    @property
    def ratio(self) -> float:
        return self.maskaware.total / self.full.total


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


def linear_flops(tokens: float, fan_in: int, fan_out: int) -> float:
    return 2.0 * tokens * fan_in * fan_out


def conv_flops(pixels: float, fan_in: int, fan_out: int, kernel: int = 3) -> float:
    return 2.0 * pixels * fan_in * fan_out * kernel * kernel
