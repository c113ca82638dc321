"""Row gathers out of host-resident tensors.

Tokens are dimension -2 of every gathered tensor (``[..., tokens, channels]``). The gather
is one ``index_select`` along dim 0 of a ``[lead * tokens, channels]`` view, ATen's
contiguous fast path; measured here it beats gathering along dim -2, advanced indexing and
numpy ``take`` by 1.3-3x. A :class:`RowSelection` prepares the flat indices once per mask,
which matters because one mask is gathered from every block of a step (preparing them
costs about a third of a 1 MB gather).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class RowSelection:
    """Token rows to gather (sorted rows read fastest), with flat indices cached per
    ``(lead, tokens)`` shape."""

    rows: torch.Tensor
    _flat: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        rows = self.rows
        if rows.dim() != 1 or rows.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"rows must be a 1-D int64/int32 tensor, got {rows.dtype} {tuple(rows.shape)}"
            )
        self.rows = rows.to("cpu", torch.int64).contiguous()

    def __len__(self) -> int:
        return self.rows.numel()

    def flat(self, lead: int, tokens: int) -> torch.Tensor:
        """Row indices into the ``[lead * tokens, channels]`` view, for every lead index."""
        key = (lead, tokens)
        found = self._flat.get(key)
        if found is None:
            if lead == 1:
                found = self.rows
            else:
                base = torch.arange(lead, dtype=torch.int64).mul_(tokens)
                found = (base.unsqueeze(1) + self.rows.unsqueeze(0)).reshape(-1)
            self._flat[key] = found
        return found


Rows = torch.Tensor | RowSelection


def check_gather(src: torch.Tensor, count: int, out: torch.Tensor) -> None:
    """Refuse a gather whose shapes or dtypes disagree, with a message that says how."""
    if src.dim() < 2:
        raise ValueError(f"row gathers need [..., tokens, channels], got shape {tuple(src.shape)}")
    want = (*src.shape[:-2], count, src.shape[-1])
    if tuple(out.shape) != want or out.dtype != src.dtype:
        raise ValueError(f"out must be {src.dtype} {want}, got {out.dtype} {tuple(out.shape)}")


def gather_rows(src: torch.Tensor, rows: Rows, out: torch.Tensor) -> torch.Tensor:
    """Copy ``src[..., rows, :]`` into ``out`` (CPU or CUDA) and return ``out``.

    A CUDA ``out`` is filled from a pinned staging buffer with a non-blocking copy on the
    current stream; PyTorch's pinned allocator keeps the staging buffer alive until that
    copy has run, so the caller only orders its own work after it on the same stream.
    """
    selection = rows if isinstance(rows, RowSelection) else RowSelection(rows)
    check_gather(src, len(selection), out)
    tokens, channels = src.shape[-2], src.shape[-1]
    lead = src.numel() // max(tokens * channels, 1)
    table = src.reshape(lead * tokens, channels)
    direct = out.device.type == "cpu" and out.is_contiguous()
    if direct:
        target = out
    else:
        pin = out.device.type == "cuda"
        target = torch.empty(out.shape, dtype=out.dtype, pin_memory=pin)
    torch.index_select(table, 0, selection.flat(lead, tokens), out=target.view(-1, channels))
    if not direct:
        out.copy_(target, non_blocking=out.device.type == "cuda")
    return out
