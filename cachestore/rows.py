"""Row gathers out of host-resident tensors.

Tokens are dimension -2 of every gathered tensor (``[..., tokens, channels]``). The gather
is one ``index_select`` along dim 0 of a ``[lead * tokens, channels]`` view, ATen's
contiguous fast path (one memcpy per row); measured here it beats gathering along dim -2,
advanced indexing and numpy ``take`` by 1.3-3x.
"""

from __future__ import annotations

import torch


def _flat_rows(rows: torch.Tensor, lead: int, tokens: int) -> torch.Tensor:
    """Row indices into the ``[lead * tokens, channels]`` view for every leading index."""
    if lead == 1:
        return rows
    base = torch.arange(lead, dtype=rows.dtype).mul_(tokens)
    return (base.unsqueeze(1) + rows.unsqueeze(0)).reshape(-1)


def check_gather(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """Refuse a gather whose shapes or dtypes disagree, with a message that says how."""
    if src.dim() < 2:
        raise ValueError(f"row gathers need [..., tokens, channels], got shape {tuple(src.shape)}")
    if rows.dim() != 1 or rows.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"rows must be a 1-D int64/int32 tensor, got {rows.dtype} {tuple(rows.shape)}"
        )
    want = (*src.shape[:-2], rows.numel(), src.shape[-1])
    if tuple(out.shape) != want or out.dtype != src.dtype:
        raise ValueError(f"out must be {src.dtype} {want}, got {out.dtype} {tuple(out.shape)}")


def gather_rows(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy ``src[..., rows, :]`` into ``out`` (CPU or CUDA) and return ``out``.

    A CUDA ``out`` is filled from a pinned staging buffer with a non-blocking copy on the
    current stream; PyTorch's pinned allocator keeps the staging buffer alive until that
    copy has run, so the caller only orders its own work after it on the same stream.
    """
    check_gather(src, rows, out)
    rows = rows.to("cpu")
    tokens, channels = src.shape[-2], src.shape[-1]
    lead = src.numel() // max(tokens * channels, 1)
    flat = _flat_rows(rows, lead, tokens)
    table = src.reshape(lead * tokens, channels)
    direct = out.device.type == "cpu" and out.is_contiguous()
    if direct:
        target = out
    else:
        pin = out.device.type == "cuda"
        target = torch.empty(out.shape, dtype=out.dtype, pin_memory=pin)
    torch.index_select(table, 0, flat, out=target.view(-1, channels))
    if not direct:
        out.copy_(target, non_blocking=out.device.type == "cuda")
    return out
