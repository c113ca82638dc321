"""Flux blocks in the packed layout: the masked tokens of every request in one sequence.

The padded layout reuses diffusers' block forwards unchanged, which is possible because
every request's tokens form one batch row that adaLN modulates with that row's timestep
embedding. Packed tokens share one sequence, so their modulation must be per token: this
module runs the same blocks from their own submodules (norms, projections, FFNs, the
model's embedders), expanding each row's modulation to its tokens. Text tokens stay batched
per request (every request has the same text length). Attention loops over requests: each
request's [text ; masked tokens] queries attend to its [text ; all image] keys.

A block planned full runs the same code on every token of every request (no cache read).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxSingleTransformerBlock,
    FluxTransformer2DModel,
    FluxTransformerBlock,
)

from retouch.runtime.maskaware.attention import assemble, fill_cached, resident_with_fresh, sdpa
from retouch.runtime.maskaware.context import ForwardContext, Mode
from retouch.runtime.maskaware.tokens import TokenBatch


@dataclass
class Stream:
    """Image rows ``[T, D]`` in one token batch's packed order, plus their RoPE tables."""

    tokens: TokenBatch
    rows: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]  # per image row
    text_rope: tuple[torch.Tensor, torch.Tensor]  # per text position (shared by requests)
    _joint: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _joint_rows: dict[int, torch.Tensor] = field(default_factory=dict)

    def joint_rope(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of the joint rows ``[B*L text ; T image]`` (one rotation per Q or K)."""
        if batch not in self._joint:
            self._joint[batch] = tuple(
                torch.cat([text.repeat(batch, 1), image])
                for text, image in zip(self.text_rope, self.rope, strict=True)
            )
        return self._joint[batch]

    @property
    def single_request(self) -> bool:
        """One model row: per-row tensors broadcast over every token, no gather needed."""
        return self.tokens.rows == 1


@dataclass(frozen=True)
class PackedInputs:
    """The batched transformer inputs of one step."""

    latents: torch.Tensor  # [B, N, C_in]
    timestep: torch.Tensor  # [B], already divided by 1000 as the pipeline does
    guidance: torch.Tensor | None  # [B]
    pooled: torch.Tensor | None  # [B, P] (FLUX.2: None)
    prompt_embeds: torch.Tensor  # [B, L, D_text]
    text_ids: torch.Tensor  # [L, 3]
    image_ids: torch.Tensor  # [N, 3]


def forward(
    model: FluxTransformer2DModel,
    ctx: ForwardContext,
    blocks: list[str],
    sparse: TokenBatch,
    inputs: PackedInputs,
) -> torch.Tensor:
    """``FluxTransformer2DModel.forward`` on packed tokens; returns ``[B, N, C_out]``.

    Rows of unmasked tokens are zero: the inpaint blend discards them.
    """
    latents = inputs.latents
    batch, n_tokens, _ = latents.shape
    whole = TokenBatch.everything(n_tokens, batch, 1, latents.device)
    timestep = inputs.timestep.to(latents.dtype) * 1000
    if inputs.guidance is None:
        temb = model.time_text_embed(timestep, inputs.pooled)
    else:
        temb = model.time_text_embed(
            timestep, inputs.guidance.to(latents.dtype) * 1000, inputs.pooled
        )
    text = model.context_embedder(inputs.prompt_embeds)
    rope = model.pos_embed(torch.cat([inputs.text_ids, inputs.image_ids]))
    text_len = text.shape[1]
    ctx.text_len = text_len
    first = sparse if ctx.mode(blocks[0]) is Mode.SPARSE else whole
    stream = _stream(first, model.x_embedder(first.gather(latents).squeeze(0)), rope, text_len)
    previous = None
    for name in blocks:
        ctx.enter_block(name)
        tokens = sparse if ctx.mode(name) is Mode.SPARSE else whole
        stream = _relayout(ctx, stream, tokens, previous, rope, text_len)
        block = model.get_submodule(name)
        if isinstance(block, FluxTransformerBlock):
            text, stream.rows = _dual(ctx, name, block, stream, text, temb)
        else:
            text, stream.rows = _single(ctx, name, block, stream, text, temb)
        ctx.exit_block(name)
        previous = name
    rows = stream.rows
    scale, shift = _modulation(
        model.norm_out.linear, model.norm_out.silu(temb).to(rows.dtype), stream.tokens, 2
    )
    rows = model.proj_out(model.norm_out.norm(rows) * (1 + scale) + shift)
    return stream.tokens.scatter_rows(rows, latents.new_zeros(batch, n_tokens, rows.shape[-1]))


def _stream(tokens: TokenBatch, rows: torch.Tensor, rope: tuple, text_len: int) -> Stream:
    index = tokens.positions + text_len
    text = (rope[0][:text_len], rope[1][:text_len])
    return Stream(tokens, rows, (rope[0][index], rope[1][index]), text)


def _relayout(
    ctx: ForwardContext,
    stream: Stream,
    tokens: TokenBatch,
    previous: str | None,
    rope: tuple,
    text_len: int,
) -> Stream:
    """Move the image rows to ``tokens``' layout (sparse → full starts from cached Y)."""
    if tokens is stream.tokens:
        return stream
    if tokens.total > stream.tokens.total:  # sparse → full
        full = assemble(ctx, stream.tokens, previous, "y", stream.rows)
        return _stream(tokens, full.reshape(-1, full.shape[-1]), rope, text_len)
    full = stream.rows.view(tokens.rows, tokens.n_tokens, -1)  # full → sparse
    return _stream(tokens, tokens.gather(full).squeeze(0), rope, text_len)


def _modulation(
    linear: torch.nn.Linear, activated: torch.Tensor, tokens: TokenBatch, chunks: int
) -> tuple[torch.Tensor, ...]:
    """adaLN parameters of every packed token: each row's ``linear(silu(temb))``, expanded
    (one row: broadcast as is)."""
    emb = linear(activated)
    if tokens.rows == 1:
        return emb.chunk(chunks, dim=1)
    return emb[tokens.row_of_token].chunk(chunks, dim=1)


def _dual(
    ctx: ForwardContext,
    name: str,
    block: FluxTransformerBlock,
    stream: Stream,
    text: torch.Tensor,
    temb: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``FluxTransformerBlock.forward`` with packed image rows and batched text."""
    x = stream.rows
    norm1 = block.norm1
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _modulation(
        norm1.linear, norm1.silu(temb), stream.tokens, 6
    )
    normed = norm1.norm(x) * (1 + scale_msa) + shift_msa
    normed_text, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
        text, emb=temb
    )
    attn = block.attn
    q, k, v = _dual_qkv(attn, normed, normed_text)
    joint = _attention(ctx, name, stream, q, k, v, text.shape)
    split = text.shape[0] * text.shape[1]
    image_out, text_out = joint[split:], joint[:split].view(*text.shape[:2], -1)
    image_out = attn.to_out[1](attn.to_out[0](image_out))
    text_out = attn.to_add_out(text_out)

    x = x + gate_msa * image_out
    normed = block.norm2(x) * (1 + scale_mlp) + shift_mlp
    x = x + gate_mlp * block.ff(normed)

    text = text + c_gate_msa.unsqueeze(1) * text_out
    normed_text = block.norm2_context(text) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    text = text + c_gate_mlp.unsqueeze(1) * block.ff_context(normed_text)
    if text.dtype == torch.float16:
        text = text.clip(-65504, 65504)
    return text, x


def _single(
    ctx: ForwardContext,
    name: str,
    block: FluxSingleTransformerBlock,
    stream: Stream,
    text: torch.Tensor,
    temb: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``FluxSingleTransformerBlock.forward``: text rows ``[B*L]`` then packed image rows,
    one stream (one projection, norm and rotation for both)."""
    batch, text_len, dim = text.shape
    x = torch.cat([text.reshape(-1, dim), stream.rows])
    emb = block.norm.linear(block.norm.silu(temb))
    if not stream.single_request:
        emb = emb[_joint_rows(stream, batch, text_len)]
    shift, scale, gate = emb.chunk(3, dim=1)
    normed = block.norm.norm(x) * (1 + scale) + shift
    mlp = block.act_mlp(block.proj_mlp(normed))
    attn = block.attn
    head = (-1, attn.head_dim)
    q = attn.norm_q(attn.to_q(normed).unflatten(-1, head))
    k = attn.norm_k(attn.to_k(normed).unflatten(-1, head))
    v = attn.to_v(normed).unflatten(-1, head)
    attn_out = _attention(ctx, name, stream, q, k, v, text.shape)
    split = batch * text_len
    x = x + gate * block.proj_out(torch.cat([attn_out, mlp], dim=1))
    if x.dtype == torch.float16:
        x = x.clip(-65504, 65504)
    return x[:split].view(batch, text_len, dim), x[split:]


def _joint_rows(stream: Stream, batch: int, text_len: int) -> torch.Tensor:
    """The model row of every joint row ``[B*L text ; T image]`` (memoised per stream)."""
    if batch not in stream._joint_rows:
        text = torch.arange(batch, device=stream.rows.device).repeat_interleave(text_len)
        stream._joint_rows[batch] = torch.cat([text, stream.tokens.row_of_token])
    return stream._joint_rows[batch]


def _dual_qkv(
    attn: FluxAttention, image: torch.Tensor, text: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V of the joint rows ``[B*L text ; T image]``, ``[S, H, D]`` after qk-norm: text
    through the ``add_*`` projections, image through the others."""
    head = (-1, attn.head_dim)
    text = text.flatten(0, 1)
    q = torch.cat(
        [
            attn.norm_added_q(attn.add_q_proj(text).unflatten(-1, head)),
            attn.norm_q(attn.to_q(image).unflatten(-1, head)),
        ]
    )
    k = torch.cat(
        [
            attn.norm_added_k(attn.add_k_proj(text).unflatten(-1, head)),
            attn.norm_k(attn.to_k(image).unflatten(-1, head)),
        ]
    )
    v = torch.cat([attn.add_v_proj(text), attn.to_v(image)]).unflatten(-1, head)
    return q, k, v


def _attention(
    ctx: ForwardContext,
    name: str,
    stream: Stream,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    text_shape: torch.Size,
) -> torch.Tensor:
    """Attention of the joint rows ``[B*L text ; T image]`` (``[S, H, D]``): its output
    ``[S, H*D]`` in the same joint order (before out-projections).

    Each request's [text ; masked tokens] queries attend to its [text ; all image] keys,
    the unmasked image keys and values from the cache.
    """
    batch, text_len = text_shape[0], text_shape[1]
    split = batch * text_len
    rope = stream.joint_rope(batch)
    q = apply_rotary_emb(q[None], rope, sequence_dim=1)[0]
    k = apply_rotary_emb(k[None], rope, sequence_dim=1)[0]
    keys = _keys(ctx, stream.tokens, name, "k", k, split, text_len)
    values = _keys(ctx, stream.tokens, name, "v", v, split, text_len)
    if stream.single_request:  # [text ; image] already in the request's order
        return sdpa(q[None], keys, values)[0]
    tokens = stream.tokens
    if len(set(tokens.counts)) == 1:  # equal masks (and every bucketed batch): one call
        order, inverse = _request_order(batch, text_len, tokens.counts[0], q.device)
        query = q.index_select(0, order).view(batch, -1, *q.shape[1:])
        out = sdpa(query, keys, values)
        return out.view(-1, out.shape[-1]).index_select(0, inverse)
    joint = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for row, (start, count) in enumerate(tokens.segments):
        text_rows = slice(row * text_len, (row + 1) * text_len)
        image_rows = slice(split + start, split + start + count)
        query = torch.cat([q[text_rows], q[image_rows]])[None]
        out = sdpa(query, keys[row : row + 1], values[row : row + 1])[0]
        joint[text_rows], joint[image_rows] = out[:text_len], out[text_len:]
    return joint


@functools.lru_cache(maxsize=64)
def _request_order(
    batch: int, text_len: int, count: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint rows ``[B*L text ; B*count image]`` reordered request by request (each
    request's text, then its image rows), and the inverse: one gather each way instead of
    slicing, viewing and concatenating per request."""
    split = batch * text_len
    order = torch.cat(
        [
            torch.cat(
                [
                    torch.arange(r * text_len, (r + 1) * text_len),
                    torch.arange(split + r * count, split + (r + 1) * count),
                ]
            )
            for r in range(batch)
        ]
    )
    return order.to(device), torch.argsort(order).to(device)


def _keys(
    ctx: ForwardContext,
    tokens: TokenBatch,
    block: str,
    name: str,
    joint: torch.Tensor,
    split: int,
    text_len: int,
) -> torch.Tensor:
    """``[rows, L + N, H, D]`` keys or values: each row's text rows, then its N image rows
    (cached unmasked rows, fresh masked ones). Resident templates: one concatenation of
    text and image rows; else written in place into one buffer."""
    heads = joint.shape[1:]
    flat = joint.flatten(1)
    channels = flat.shape[1]
    text = flat[:split].view(tokens.rows, text_len, channels)
    fresh = flat[split:]
    image = resident_with_fresh(ctx, tokens, block, name, fresh)
    if image is not None:
        return torch.cat([text, image], dim=1).unflatten(-1, heads)
    out = flat.new_empty(tokens.rows, text_len + tokens.n_tokens, channels)
    out[:, :text_len] = text
    fill_cached(ctx, tokens, block, name, out[:, text_len:])
    out.view(-1, channels).index_copy_(0, tokens.joint_index(text_len), tokens.dedupe(fresh))
    return out.unflatten(-1, heads)
