"""Sparse blocks for diffusers' ``FluxTransformer2DModel`` (the ``flux-inpaint`` family), padded layout.

Every op of a Flux block is token-wise except the joint attention, so a run of sparse
blocks carries only the masked image tokens (``[rows, n_max, D]``) through diffusers' own
block forwards and the model's own forward; the text tokens always run in full. Only the
attention processor is wrapped: it gathers the RoPE rows of each row's masked tokens,
computes Q/K/V for text + masked tokens and attends to [text K,V ; image K,V] where the
unmasked image rows are the bake's K,V (recorded after qk-norm and RoPE, so nothing is
recomputed). Forward pre-hooks switch between sparse and full representation when a
per-step plan mixes the modes: a full block after a sparse one starts from the cached Y of
the block before it.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
)
from torch import nn

from retouch.runtime.maskaware.attention import Call, Processor, assemble, sdpa
from retouch.runtime.maskaware.context import ForwardContext, Mode, current
from retouch.runtime.maskaware.tokens import TokenBatch

INSTALLED = "_retouch_maskaware_block"
SPARSE_CARRY = "flux_sparse"  # scratch key: are the hidden states now in the sparse layout?
SPARSE_ROWS = ("k", "v")  # what a sparse block reads from the cache
EXIT_ROWS = ("y",)  # what a full block right after a sparse one reads (of that block)


def block_names(transformer: nn.Module) -> list[str]:
    """Block names in execution order."""
    dual = [f"transformer_blocks.{i}" for i in range(len(transformer.transformer_blocks))]
    single = [
        f"single_transformer_blocks.{i}" for i in range(len(transformer.single_transformer_blocks))
    ]
    return dual + single


def install(transformer: nn.Module) -> list[str]:
    """Wrap every block of ``transformer`` once; returns the block names in order."""
    names = block_names(transformer)
    previous: str | None = None
    for name in names:
        block = transformer.get_submodule(name)
        if not isinstance(block, FluxTransformerBlock | FluxSingleTransformerBlock):
            raise ValueError(f"{name}: unsupported Flux block {type(block).__name__}")
        if block.attn.fused_projections:
            raise ValueError(f"{name}: fused QKV projections are not supported")
        declare(block, name, previous, JointAttention)
        previous = name
    return names


def declare(block: nn.Module, name: str, previous: str | None, processor: type[Processor]) -> None:
    """Declare a DiT block's mask-aware attention ``processor`` (wrapping the one it has)
    and its layout hooks, once; ``previous``: the block before it (None for the first)."""
    if getattr(block, INSTALLED, None) is not None:
        return
    block.attn.set_processor(processor(name, block.attn.processor))
    block.register_forward_pre_hook(switch_layout(name, previous), with_kwargs=True)
    block.register_forward_hook(record_output(name))
    setattr(block, INSTALLED, name)


def switch_layout(name: str, previous: str | None, *, text_first: bool = False) -> Any:
    """Pre-hook: the block starts; bring the incoming image hidden states into its layout.

    ``text_first``: the block's ``hidden_states`` are [text ; image] (FLUX.2's single-stream
    blocks, handed the joint sequence by the model); only the image part changes layout."""

    def hook(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        ctx = current()
        if ctx is None:
            return None
        ctx.enter_block(name)
        if ctx.grid is None:
            return None
        want_sparse = ctx.mode(name) is Mode.SPARSE
        if ctx.scratch[SPARSE_CARRY] == want_sparse:
            return None
        hidden = kwargs["hidden_states"]
        text_len = ctx.text_len if text_first else 0
        image = hidden[:, text_len:]
        if want_sparse:
            image = ctx.grid.gather(image)
        else:
            if previous is None:
                raise RuntimeError("the first block cannot receive sparse input")
            image = assemble(ctx, ctx.grid, previous, "y", ctx.grid.real_rows(image))
        kwargs["hidden_states"] = torch.cat([hidden[:, :text_len], image], 1) if text_len else image
        ctx.scratch[SPARSE_CARRY] = want_sparse
        return args, kwargs

    return hook


def record_output(name: str, *, text_first: bool = False) -> Any:
    """Forward hook: a bake records the block's image output Y; the block has ended.
    ``text_first``: the block returns one [text ; image] tensor (FLUX.2's single-stream
    blocks), not an ``(encoder, image)`` pair."""

    def hook(block: nn.Module, args: tuple, output: Any) -> None:
        ctx = current()
        if ctx is None:
            return
        if ctx.recording:
            ctx.record(name, "y", output[:, ctx.text_len :] if text_first else output[1])
        ctx.exit_block(name)

    return hook


def sparse_rope(
    ctx: ForwardContext, rope: tuple[torch.Tensor, torch.Tensor], text_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row RoPE tables ``[rows * (L + n_max), D]`` for [text ; masked tokens] (memoised)."""
    key = ("rope", id(rope[0]))
    if key not in ctx.scratch:
        tokens = ctx.grid
        positions = tokens.positions + text_len  # [rows, n_max]
        text = torch.arange(text_len, device=positions.device).expand(tokens.rows, text_len)
        index = torch.cat([text, positions], dim=1).reshape(-1)
        ctx.scratch[key] = (rope[0][index], rope[1][index])
    return ctx.scratch[key]


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb``; a table of ``rows * seq`` entries is per (row, token)."""
    rows, seq = x.shape[:2]
    if rope[0].shape[0] == seq:
        return apply_rotary_emb(x, rope, sequence_dim=1)
    flat = x.reshape(1, rows * seq, *x.shape[2:])
    return apply_rotary_emb(flat, rope, sequence_dim=1).view_as(x)


class JointAttention(Processor):
    """The Flux attention processor, sparse- and record-aware."""

    def run(self, ctx: ForwardContext, call: Call) -> torch.Tensor | tuple[torch.Tensor, ...]:
        attn, encoder_hidden_states = call.attn, call.encoder_hidden_states
        image_rotary_emb = call.rest[0] if call.rest else None
        joint = encoder_hidden_states is not None
        text_len = encoder_hidden_states.shape[1] if joint else ctx.text_len
        query, key, value = qkv(attn, call.hidden_states, encoder_hidden_states)
        out = self.attend(ctx, (query, key, value), image_rotary_emb, text_len)
        return finish(attn, out, text_len if joint else None)

    def attend(
        self,
        ctx: ForwardContext,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor],
        text_len: int,
    ) -> torch.Tensor:
        """RoPE and attention of normed ``[B, L + S, H, D]`` Q, K, V (text rows first): a
        sparse block's K/V completed with the unmasked image rows from the cache, a full
        one's image rows of K/V recorded (a bake)."""
        query, key, value = qkv
        sparse = self.sparse(ctx)
        if sparse:
            rope = sparse_rope(ctx, rope, text_len)
        query, key = rotate(query, rope), rotate(key, rope)
        if sparse:
            key = with_cached(ctx, ctx.grid, self.block, "k", key, text_len)
            value = with_cached(ctx, ctx.grid, self.block, "v", value, text_len)
        else:
            ctx.record(self.block, "k", key[:, text_len:].flatten(2))
            ctx.record(self.block, "v", value[:, text_len:].flatten(2))
        return sdpa(query, key, value)


def qkv(
    attn: FluxAttention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V ``[B, L + S, H, D]`` after qk-norm, text rows first (FluxAttnProcessor's order)."""
    head = (-1, attn.head_dim)
    query = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, head))
    key = attn.norm_k(attn.to_k(hidden_states).unflatten(-1, head))
    value = attn.to_v(hidden_states).unflatten(-1, head)
    if encoder_hidden_states is None:
        return query, key, value
    text_q = attn.norm_added_q(attn.add_q_proj(encoder_hidden_states).unflatten(-1, head))
    text_k = attn.norm_added_k(attn.add_k_proj(encoder_hidden_states).unflatten(-1, head))
    text_v = attn.add_v_proj(encoder_hidden_states).unflatten(-1, head)
    return (
        torch.cat([text_q, query], dim=1),
        torch.cat([text_k, key], dim=1),
        torch.cat([text_v, value], dim=1),
    )


def with_cached(
    ctx: ForwardContext,
    tokens: TokenBatch,
    block: str,
    name: str,
    fresh: torch.Tensor,
    text_len: int,
) -> torch.Tensor:
    """[text rows ; all N image rows] of K or V, unmasked image rows from the cache."""
    heads = fresh.shape[2:]
    image = assemble(ctx, tokens, block, name, tokens.real_rows(fresh[:, text_len:].flatten(2)))
    return torch.cat([fresh[:, :text_len], image.unflatten(-1, heads)], dim=1)


def finish(
    attn: FluxAttention, out: torch.Tensor, text_len: int | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Output projections as FluxAttnProcessor applies them (none for single blocks)."""
    if text_len is None:
        return out
    text, image = out[:, :text_len], out[:, text_len:]
    image = attn.to_out[1](attn.to_out[0](image.contiguous()))
    return image, attn.to_add_out(text.contiguous())
