"""Self-attention of masked queries against [fresh masked K,V ; cached unmasked K,V].

The keys of a row are assembled in natural token order into one ``[rows, N, C]`` buffer:
cached rows of the unmasked tokens (staged by the row loader when the forward has one,
else gathered from the store right here) and the freshly computed rows of the masked ones.
Attention is invariant to key order, and keeping the stock order keeps the result within
rounding of the stock block when the cache is exact. Every row then attends with its full
key set, so the padded layout needs no attention mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from retouch.runtime.maskaware.context import ForwardContext, Mode, current
from retouch.runtime.maskaware.store import copy_resident, device_resident, fetch_rows
from retouch.runtime.maskaware.tokens import TokenBatch


def assemble(
    ctx: ForwardContext, tokens: TokenBatch, block: str, name: str, fresh: torch.Tensor
) -> torch.Tensor:
    """``[rows, N, C]``: each request's cached rows of ``name`` plus the ``fresh`` ``[T, C]`` rows."""
    whole = resident_with_fresh(ctx, tokens, block, name, fresh)
    if whole is not None:
        return whole
    full = fresh.new_empty(tokens.rows, tokens.n_tokens, fresh.shape[-1])
    fill_cached(ctx, tokens, block, name, full)
    return tokens.scatter_rows(fresh, full)


def resident_with_fresh(
    ctx: ForwardContext, tokens: TokenBatch, block: str, name: str, fresh: torch.Tensor
) -> torch.Tensor | None:
    """``[rows, N, C]`` when every request's cached tensor rests whole on the compute
    device in the compute dtype: those tensors with the ``fresh`` ``[T, C]`` masked rows
    written in. One request: one out-of-place ``index_copy``; several: one ``cat`` and
    one scatter (no buffer to allocate, fill per request and patch: the fewest ops and
    launches a step can spend on it). ``None`` where that does not apply."""
    stored = []
    shape = (tokens.rows_per_request, tokens.n_tokens, fresh.shape[-1])
    for slot in ctx.slots:
        if slot.reader is None:
            return None
        whole = device_resident(slot.reader, slot.step, block, name, fresh.device)
        if whole is None or whole.dtype != fresh.dtype or tuple(whole.shape) != shape:
            return None  # not resident, or fp8 codes (decoded by a copy)
        stored.append(whole)
    if len(stored) != 1:
        return tokens.scatter_rows(fresh, torch.cat(stored))
    per = tokens.rows_per_request
    fresh = tokens.dedupe(fresh)
    return stored[0].index_copy(1, tokens.masked_index(0), fresh.view(per, -1, fresh.shape[-1]))


def fill_cached(
    ctx: ForwardContext, tokens: TokenBatch, block: str, name: str, full: torch.Tensor
) -> None:
    """Write each request's cached rows of ``name`` into ``full`` ``[rows, N, C]`` (a view is
    fine); the masked rows are left for the caller to write."""
    per = tokens.rows_per_request
    for r, (slot, token_set) in enumerate(zip(ctx.slots, tokens.sets, strict=True)):
        if token_set.unmasked.numel() == 0:
            continue
        if slot.reader is None:
            raise RuntimeError(f"block {block!r} runs sparse but request {r} has no cache")
        rows = full if tokens.rows == per else full[r * per : (r + 1) * per]
        if copy_resident(slot.reader, slot.step, block, name, rows):
            continue  # device tier: one contiguous copy, the masked rows follow
        if ctx.loader is not None:  # staged ahead by the row loader
            cached = ctx.loader.rows(r, block, name).to(full.dtype)
        else:
            cached = full.new_empty(per, token_set.unmasked.numel(), full.shape[-1])
            fetch_rows(slot.reader, slot.step, block, name, token_set.unmasked, cached)
        rows.index_copy_(1, tokens.unmasked_index(r), cached)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Attention on ``[B, S, H, D]`` tensors; returns ``[B, Sq, H * D]``."""
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    )
    return out.transpose(1, 2).flatten(2).to(query.dtype)


def sdpa_segments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: list[tuple[int, int]],
) -> torch.Tensor:
    """Packed attention: query rows ``[1, S, H, D]`` split in ``(start, length)`` segments,
    segment ``r`` attending to row ``r`` of ``key``/``value`` ``[rows, Sk, H, D]``."""
    heads = query.shape[2] * query.shape[3]
    lengths = {length for _, length in segments}
    if len(lengths) == 1 and len(segments) == key.shape[0]:  # equal rows: one batched call
        rows = query.view(len(segments), lengths.pop(), *query.shape[2:])
        return sdpa(rows, key, value).view(1, query.shape[1], heads)
    out = query.new_empty(1, query.shape[1], heads)
    for row, (start, length) in enumerate(segments):
        if length:
            q = query[:, start : start + length]
            out[:, start : start + length] = sdpa(q, key[row : row + 1], value[row : row + 1])
    return out


@dataclass(frozen=True)
class Call:
    """One attention call as diffusers made it: the module, its inputs and the rest of the
    positional arguments (Flux passes its rotary embedding there)."""

    attn: Any
    hidden_states: torch.Tensor
    encoder_hidden_states: torch.Tensor | None
    rest: tuple[Any, ...] = ()


class Processor:
    """A mask-aware attention processor, declared on one block's attention module with
    diffusers' ``set_processor``: outside a mask-aware forward, or when :meth:`active`
    says this forward does not need it, it hands the call unchanged to the processor it
    replaced (``inner``); else :meth:`run` computes it (attention masks are refused)."""

    def __init__(self, block: str, inner: Any) -> None:
        self.block, self.inner = block, inner

    def active(self, ctx: ForwardContext, call: Call) -> bool:
        """By default: the block runs sparse, or the forward records (a bake)."""
        return self.sparse(ctx) or ctx.recording

    def sparse(self, ctx: ForwardContext) -> bool:
        return ctx.grid is not None and ctx.mode(self.block) is Mode.SPARSE

    def run(self, ctx: ForwardContext, call: Call) -> Any:
        raise NotImplementedError

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        ctx = current()
        call = Call(attn, hidden_states, encoder_hidden_states, args)
        if ctx is None or not self.active(ctx, call):
            return self.inner(
                attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs
            )
        if attention_mask is not None:
            raise ValueError(f"{type(self).__name__} (mask-aware) takes no attention mask")
        return self.run(ctx, call)
