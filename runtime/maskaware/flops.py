"""Analytic FLOPs of one denoising step, full and mask-aware, from a model's config.

The count is what the two paths compute: every convolution and every matmul (2 FLOPs per
multiply-add) and attention's QKᵀ and AV; norms, activations and elementwise ops are left
out, as ``torch.utils.flop_counter`` leaves them out. A mask-aware step computes the
token-wise matmuls of the ``m·N`` masked tokens of each grid, their queries against all
``N`` keys, and everything else (UNet convolutions, text tokens, timestep embeddings) in
full. The ratio of the two is the ideal that measured speed-ups are held against, and an
input of the cost model.

This module holds the values and the counting primitives the families' formulas are
written with; a whole step of a named family is counted by
:mod:`retouch.runtime.families.stepflops`.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def linear_flops(tokens: float, fan_in: int, fan_out: int) -> float:
    return 2.0 * tokens * fan_in * fan_out


def conv_flops(pixels: float, fan_in: int, fan_out: int, kernel: int = 3) -> float:
    return 2.0 * pixels * fan_in * fan_out * kernel * kernel
