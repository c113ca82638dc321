"""How cached rows rest: in the compute dtype, or as fp8 with a scale per channel.

K, V and Y are most of a template's bytes, and streamed from the host K and V are all of a
DiT step's PCIe traffic. fp8 (e4m3) halves them against bf16. Each channel of a tensor gets its
own scale (its largest magnitude over the tokens maps to e4m3's largest finite value), so
one outlier channel does not crush the others' precision. Rows are decoded on the device
that computes with them (``decode_into``: a converting copy, then the scale), so the
host and the PCIe link only ever see fp8.
"""

from __future__ import annotations

from enum import StrEnum

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


class RowFormat(StrEnum):
    NATIVE = "native"  # the dtype the bake recorded (the model's compute dtype)
    FP8 = "fp8"  # K and V in float8 e4m3 with per-channel scales; Y as recorded


def encodes(fmt: RowFormat, name: str) -> bool:
    """Whether ``fmt`` stores tensor ``name`` in fp8. Only attention keys and values are:
    a sparse block reads them through a softmax, which averages their rounding away, while
    a cached block output Y *is* the unmasked rows' result, and e4m3's 3 mantissa bits there
    cost the shapes-sd edits 0.18 SSIM against compute-dtype storage (docs/benchmarks.md)."""
    return fmt is RowFormat.FP8 and name != "y"


def encode_fp8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., N, C]`` → (fp8 codes, float32 scales ``[..., 1, C]``). The scales stay in
    float32: in fp16 the scale of a channel whose values are all small would be
    subnormal, and imprecise."""
    amax = tensor.abs().amax(dim=-2, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def decode_into(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None) -> None:
    """``out`` ← the rows ``codes`` stand for (a plain copy when ``scale`` is None)."""
    out.copy_(codes)
    if scale is not None:
        out.mul_(scale.to(out.device, non_blocking=True))


def decode(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``codes`` stand for, in ``dtype`` (the codes themselves without a scale)."""
    if scale is None:
        return codes
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    decode_into(out, codes, scale)
    return out
