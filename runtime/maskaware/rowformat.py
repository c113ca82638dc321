"""How cached rows rest: in the compute dtype, or in 8 bits with per-channel scales.

K, V and Y are most of a template's bytes, and streamed from the host K and V are all of a
DiT step's PCIe traffic. ``fp8`` stores every one in 8 bits: half of bf16's bytes, plus one
scale per channel (and one offset for Y). Each channel gets its own scale, so one outlier
channel does not crush the others' precision. Rows are decoded on the device that computes
with them (``decode_into``: a converting copy, then the scale), so the host and the PCIe
link only ever see the codes.

* **K and V: float8 e4m3**, scaled so the channel's largest magnitude maps to e4m3's
  largest finite value. A sparse block reads them through a softmax, which averages their
  rounding away (SSIM 1.0000 against compute-dtype rows on ``retouch:shapes-sd``).
* **Y: int8 with a per-channel offset and scale**, the channel's range mapped onto
  −127…127. A cached block output *is* the unmasked rows' result: e4m3's 3 mantissa bits
  there cost those edits 0.18 SSIM, while 8 uniform bits over each channel's own range
  (residual-stream channels sit off zero, hence the offset) keep SSIM at 0.98
  (docs/benchmarks.md, "fp8 row storage on the trained model").
"""

from __future__ import annotations

from enum import StrEnum

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
INT8_MAX = 127


class RowFormat(StrEnum):
    NATIVE = "native"  # the dtype the bake recorded (the model's compute dtype)
    FP8 = "fp8"  # K and V in float8 e4m3, Y in int8 with offsets; per-channel scales


def encodes(fmt: RowFormat, name: str) -> bool:
    """Whether ``fmt`` stores tensor ``name`` (``k*``, ``v*``, ``y``) in 8 bits."""
    return fmt is RowFormat.FP8


def encode(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., N, C]`` → (8-bit codes, float32 scales): a block output ``y`` in int8 with
    offsets (:func:`encode_int8`), keys and values in e4m3 (:func:`encode_fp8`)."""
    return encode_int8(tensor) if name == "y" else encode_fp8(tensor)


def encode_fp8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., N, C]`` → (fp8 codes, float32 scales ``[..., 1, C]``). The scales stay in
    float32: in fp16 the scale of a channel whose values are all small would be
    subnormal, and imprecise."""
    amax = tensor.abs().amax(dim=-2, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def encode_int8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., N, C]`` → (int8 codes, float32 ``[2, ..., 1, C]``: each channel's scale and
    offset), the channel's range ``[min, max]`` mapped onto −127…127."""
    low = tensor.amin(dim=-2, keepdim=True).float()
    high = tensor.amax(dim=-2, keepdim=True).float()
    scale = ((high - low) / (2 * INT8_MAX)).clamp_min(torch.finfo(torch.float32).tiny)
    offset = (high + low) / 2
    codes = ((tensor.float() - offset) / scale).round().clamp(-INT8_MAX, INT8_MAX)
    return codes.to(torch.int8), torch.stack([scale, offset])


def decode_into(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None) -> None:
    """``out`` ← the rows ``codes`` stand for (a plain copy when ``scale`` is None)."""
    out.copy_(codes)
    if scale is None:
        return
    scale = scale.to(out.device, non_blocking=True)
    if codes.dtype == torch.int8:  # per-channel scale and offset
        out.mul_(scale[0]).add_(scale[1])
    else:
        out.mul_(scale)


def decode(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``codes`` stand for, in ``dtype`` (the codes themselves without a scale)."""
    if scale is None:
        return codes
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    decode_into(out, codes, scale)
    return out
