"""Sparse blocks for diffusers' ``QwenImageTransformer2DModel`` (the ``qwen-image`` family),
padded layout.

A Qwen-Image block is an MMDiT block: every op is token-wise (adaLN modulation per model
row, LayerNorms, MLPs) except the joint attention, so a run of sparse blocks carries only
the masked image tokens (``[rows, n_max, D]``, two rows per request: the classifier-free
guidance halves) through diffusers' own block forwards; the text stream runs in full.
Only the attention processor is replaced: it computes Q/K/V of the text and the masked
image tokens, rotates them with their own rows of Qwen's RoPE (``QwenEmbedRope``: complex
frequencies per image position and per text position), and attends [text ; image] queries
to [text K,V ; image K,V] where the unmasked image rows are the bake's K,V (recorded after
qk-norm and RoPE, so nothing is recomputed). The text keys keep the pipeline's mask
(``encoder_hidden_states_mask``: padding of the shorter prompt of a batch); image keys are
never masked. Layout switches between sparse and full blocks are Flux's hooks (a full block
after a sparse one starts from the cached Y of the block before it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock
from torch import nn

from retouch.runtime.maskaware.attention import Processor, assemble
from retouch.runtime.maskaware.context import ForwardContext, current
from retouch.runtime.maskaware.flux_blocks import declare

Rope = tuple[torch.Tensor, torch.Tensor]  # (image [N, D/2], text [L, D/2]) complex


def install(transformer: nn.Module) -> list[str]:
    """Declare the mask-aware processor and layout hooks on every block once; the block
    names in execution order."""
    names = [f"transformer_blocks.{i}" for i in range(len(transformer.transformer_blocks))]
    previous: str | None = None
    for name in names:
        block = transformer.get_submodule(name)
        if not isinstance(block, QwenImageTransformerBlock) or block.zero_cond_t:
            raise ValueError(f"{name}: unsupported Qwen-Image block (zero_cond_t: Edit-2511)")
        declare(block, name, previous, JointAttention)
        previous = name
    return names


class JointAttention(Processor):
    """``QwenDoubleStreamAttnProcessor2_0``, sparse- and record-aware (text rows first).

    diffusers' ``Attention`` passes a processor only the keyword arguments its ``__call__``
    names, so this one names Qwen's (the text mask and the rotary embedding)."""

    def __call__(  # type: ignore[override]
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Rope | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = current()
        if ctx is None or not (self.sparse(ctx) or ctx.recording):
            return self.inner(
                attn,
                hidden_states,
                encoder_hidden_states,
                encoder_hidden_states_mask=encoder_hidden_states_mask,
                attention_mask=attention_mask,
                image_rotary_emb=image_rotary_emb,
            )
        if attention_mask is not None or encoder_hidden_states is None or image_rotary_emb is None:
            raise ValueError("the mask-aware Qwen-Image attention takes text, RoPE, no mask")
        return self.attend(ctx, attn, hidden_states, encoder_hidden_states,
                           encoder_hidden_states_mask, image_rotary_emb)  # fmt: skip

    def attend(
        self,
        ctx: ForwardContext,
        attn: Attention,
        image: torch.Tensor,
        text: torch.Tensor,
        text_mask: torch.Tensor | None,
        rope: Rope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Joint attention of [text ; image] queries; a sparse block's image queries are
        the masked tokens and its unmasked image K/V rows the bake's."""
        sparse = self.sparse(ctx)
        image_freqs, text_freqs = rope
        # each row's masked tokens' frequencies [rows, n_max, D/2], or every token's
        image_freqs = sparse_freqs(ctx, image_freqs) if sparse else image_freqs.unsqueeze(0)
        q, k, v = _projections(attn, image, text=False)
        text_q, text_k, text_v = _projections(attn, text, text=True)
        q, k = rotate(q, image_freqs), rotate(k, image_freqs)
        text_q, text_k = rotate(text_q, text_freqs[None]), rotate(text_k, text_freqs[None])
        heads = q.shape[2:]
        if sparse:
            grid = ctx.grid
            k = assemble(ctx, grid, self.block, "k", grid.real_rows(k, 2)).unflatten(-1, heads)
            v = assemble(ctx, grid, self.block, "v", grid.real_rows(v, 2)).unflatten(-1, heads)
        else:
            ctx.record(self.block, "k", k.flatten(2))
            ctx.record(self.block, "v", v.flatten(2))
        text_len = text.shape[1]
        joint = (torch.cat([text_q, q], 1), torch.cat([text_k, k], 1), torch.cat([text_v, v], 1))
        out = masked_sdpa(*joint, text_mask)
        image_out = attn.to_out[1](attn.to_out[0](out[:, text_len:].contiguous()))
        return image_out, attn.to_add_out(out[:, :text_len].contiguous())


def masked_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_mask: torch.Tensor | None
) -> torch.Tensor:
    """Joint attention ``[rows, S, H*D]`` of ``[rows, S, H, D]`` tensors, the text rows'
    padding masked off (``text_mask`` ``[rows, L]``; every image key on), as the pipeline
    attends a batch of prompts."""
    mask = None
    if text_mask is not None:
        image = text_mask.new_ones(text_mask.shape[0], k.shape[1] - text_mask.shape[1])
        mask = torch.cat([text_mask, image], dim=1)[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    )
    return out.transpose(1, 2).flatten(2).to(q.dtype)


def _projections(
    attn: Attention, states: torch.Tensor, *, text: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V ``[B, S, H, D]`` after the RMS qk-norm (the ``add_*`` projections for text)."""
    head = (-1, attn.inner_dim // attn.heads)
    if text:
        q, k, v = attn.add_q_proj(states), attn.add_k_proj(states), attn.add_v_proj(states)
        norm_q, norm_k = attn.norm_added_q, attn.norm_added_k
    else:
        q, k, v = attn.to_q(states), attn.to_k(states), attn.to_v(states)
        norm_q, norm_k = attn.norm_q, attn.norm_k
    q, k, v = q.unflatten(-1, head), k.unflatten(-1, head), v.unflatten(-1, head)
    return norm_q(q), norm_k(k), v


def sparse_freqs(ctx: ForwardContext, freqs: torch.Tensor) -> torch.Tensor:
    """The RoPE frequencies of each row's masked tokens ``[rows, n_max, D/2]`` (memoised
    per forward: every block reads the same)."""
    key = ("qwen-rope", id(freqs))
    if key not in ctx.scratch:
        ctx.scratch[key] = freqs[ctx.grid.positions]
    return ctx.scratch[key]


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb_qwen`` (complex form) with ``freqs`` ``[B or 1, S,
    D/2]``: one rotation per row and token, shared by the heads."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs.unsqueeze(2)).flatten(3).type_as(x)
