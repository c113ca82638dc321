"""diffusers' ``ZImageTransformer2DModel`` (the ``z-image`` family) run from its own
submodules, mask-aware.

Z-Image's DiT patchifies, pads and positions its tokens inside its forward, so no hook on a
block can hand it a subset of the image tokens. This module is that forward (basic mode:
one image per row), written as the model writes it and run in full (the stock step, and a
bake that records) or sparse:

* the image stream: 2×2 latent patches (channels last), embedded, padded to a multiple of
  32 tokens with ``x_pad_token`` at position (0, 0, 0); its real tokens sit at
  ``(Lc + 1, y, x)``, ``Lc`` the row's caption length padded to 32;
* ``noise_refiner`` blocks (modulated, image only), then the caption stream (``cap_embedder``
  and the unmodulated ``context_refiner``: computed in full, it has no image token), then
  the main ``layers`` on ``[image ; caption]`` per row, the final layer and unpatchify.

Every op of a block is token-wise except the attention. A sparse block carries only the
masked image tokens (``[rows, n_max, D]``, padded per row); its queries are those and the
caption's, its keys and values the whole image's (the unmasked rows and the pads from the
bake, recorded after qk-norm and RoPE) and the caption's, a boolean key mask hiding the
batch's caption padding when rows' captions differ in length (a prompt and its negative).

RoPE: a cached key was rotated at the bake's ``Lc + 1`` on the first axis. When an edit's
padded caption length differs from the bake's (another prompt), the cached real image keys
of that row are turned by the difference on that axis, so that image tokens keep their
relative positions (pads stay at 0; values carry no position). The same length leaves
them as they are, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_z_image import (
    SEQ_MULTI_OF,
    ZImageTransformer2DModel,
    ZImageTransformerBlock,
)

from retouch.runtime.maskaware.attention import assemble
from retouch.runtime.maskaware.context import ForwardContext, Mode
from retouch.runtime.maskaware.tokens import TokenBatch

PATCH = 2  # Z-Image's 2x2 patches (all_patch_size (2,), all_f_patch_size (1,))
REFINER = "noise_refiner."  # the image-only blocks' names start so


def padded_length(tokens: int) -> int:
    """Tokens after Z-Image's padding of a sequence to a multiple of 32."""
    return math.ceil(tokens / SEQ_MULTI_OF) * SEQ_MULTI_OF


def block_names(model: ZImageTransformer2DModel) -> list[str]:
    """The blocks of the image stream in execution order (the context refiner is the
    caption's and is never sparse)."""
    refiner = [f"noise_refiner.{i}" for i in range(len(model.noise_refiner))]
    return refiner + [f"layers.{i}" for i in range(len(model.layers))]


def check(model: ZImageTransformer2DModel) -> None:
    """Refuse what this forward does not run: other patch sizes, the Omni variant."""
    config = model.config
    if tuple(config.all_patch_size) != (PATCH,) or tuple(config.all_f_patch_size) != (1,):
        raise ValueError("mask-aware Z-Image needs 2x2 patches of one frame")
    if model.siglip_embedder is not None:
        raise ValueError("Z-Image Omni (SigLIP conditioning) is not supported")


@dataclass(frozen=True)
class ZImageBatch:
    """The batched transformer inputs of one step: model rows, a request's prompt row
    then its negative prompt's."""

    latents: torch.Tensor  # [R, C, H, W] in the model's dtype
    timestep: torch.Tensor  # [R]: (1000 - t) / 1000, as the pipeline gives it
    captions: torch.Tensor  # [R, L, D] text features, zero after each row's length
    lengths: tuple[int, ...]  # each row's caption tokens (padding stripped)
    shifts: tuple[int, ...]  # each row's padded caption length less its bake's


@dataclass
class Tables:
    """What every block of one forward shares: RoPE tables, key masks, lengths."""

    image: torch.Tensor  # [R, P, hd/2] complex: the image stream's (P padded tokens)
    caption: torch.Tensor  # [R, Lc, hd/2] complex: the caption stream's
    caption_valid: torch.Tensor  # [R, Lc] bool: real (or 32-padding) caption tokens
    ragged: bool  # rows' captions differ in length: keys need a mask
    n_real: int  # the image's tokens before padding
    realign: torch.Tensor | None  # [R, P, 1, hd/2] complex turn of the cached keys


def forward(
    model: ZImageTransformer2DModel,
    ctx: ForwardContext,
    blocks: list[str],
    batch: ZImageBatch,
) -> torch.Tensor:
    """``ZImageTransformer2DModel.forward`` on a batch of rows; ``[R, C, H, W]``.

    ``ctx.grid`` set: the blocks planned sparse compute the masked tokens only; the
    prediction of the others is zero (the inpaint blend discards it)."""
    latents = batch.latents
    rows, channels, height, width = latents.shape
    grid = ctx.grid
    adaln = model.t_embedder(batch.timestep * model.t_scale).type_as(latents)
    patches = _patchify(latents)
    n_real = patches.shape[1]
    tables = _tables(model, batch, n_real, grid)
    first = grid is not None and ctx.mode(blocks[0]) is Mode.SPARSE
    image = _embed(model, patches, grid if first else None)
    caption = _caption(model, batch.captions, batch.lengths, tables)
    sparse_now, previous = first, None
    for name in blocks:
        ctx.enter_block(name)
        sparse = grid is not None and ctx.mode(name) is Mode.SPARSE
        image = _relayout(ctx, image, sparse_now, sparse, previous)
        block = model.get_submodule(name)
        joint = None if name.startswith(REFINER) else caption
        image, rest = _block(ctx, name, block, image, joint, adaln, tables, sparse)
        if joint is not None:
            caption = rest
        if ctx.recording and not sparse:
            ctx.record(name, "y", image)
        ctx.exit_block(name)
        sparse_now, previous = sparse, name
    final = model.all_final_layer[f"{PATCH}-1"]
    if sparse_now:
        out = final(image, c=adaln)
        whole = out.new_zeros(rows, grid.n_tokens, out.shape[-1])
        out = grid.scatter(out, whole)
    else:
        out = final(torch.cat([image, caption], dim=1), c=adaln)  # as the model: all rows
    return _unpatchify(out[:, :n_real], channels, height, width)


def _patchify(latents: torch.Tensor) -> torch.Tensor:
    """``[R, C, H, W]`` → ``[R, N, 4C]``: row-major 2×2 patches, features (ph, pw, C)."""
    rows, channels, height, width = latents.shape
    h, w = height // PATCH, width // PATCH
    patches = latents.view(rows, channels, h, PATCH, w, PATCH).permute(0, 2, 4, 3, 5, 1)
    return patches.reshape(rows, h * w, PATCH * PATCH * channels)


def _unpatchify(out: torch.Tensor, channels: int, height: int, width: int) -> torch.Tensor:
    rows = out.shape[0]
    h, w = height // PATCH, width // PATCH
    out = out.view(rows, h, w, PATCH, PATCH, channels).permute(0, 5, 1, 3, 2, 4)
    return out.reshape(rows, channels, height, width)


def _embed(
    model: ZImageTransformer2DModel, patches: torch.Tensor, grid: TokenBatch | None
) -> torch.Tensor:
    """The image stream's first hidden states: every padded token (the model pads with
    the last patch, embeds, then puts ``x_pad_token`` in the pads), or ``grid``'s
    masked tokens (a pad among them, of a request computing every token, is the pad
    token alike)."""
    rows, n_real, _ = patches.shape
    total = padded_length(n_real)
    padded = torch.cat([patches, patches[:, -1:].expand(rows, total - n_real, -1)], dim=1)
    pad = model.x_pad_token
    if grid is None:
        embedded = model.all_x_embedder[f"{PATCH}-1"](padded)
        is_pad = torch.arange(total, device=patches.device) >= n_real
        return torch.where(is_pad[None, :, None], pad, embedded)
    embedded = model.all_x_embedder[f"{PATCH}-1"](grid.gather(padded))
    return torch.where((grid.positions >= n_real)[..., None], pad, embedded)


def _tables(
    model: ZImageTransformer2DModel, batch: ZImageBatch, n_real: int, grid: TokenBatch | None
) -> Tables:
    """RoPE of both streams, as ``patchify_and_embed`` positions them, and the realignment
    of cached keys (``grid`` given and some row's caption length differs from its bake's).
    Built with device ops from the step's static shapes and the layout's device indices
    (no host copy: a CUDA graph of the step may replay it for other masks)."""
    device = batch.latents.device
    rows = len(batch.lengths)
    height, width = (s // PATCH for s in batch.latents.shape[-2:])
    total = padded_length(n_real)
    caption_lengths = [padded_length(n) for n in batch.lengths]
    longest = max(caption_lengths)
    y, x = torch.meshgrid(
        torch.arange(height, device=device), torch.arange(width, device=device), indexing="ij"
    )
    image_ids = torch.zeros(rows, total, 3, dtype=torch.int32, device=device)
    valid = torch.zeros(rows, longest, dtype=torch.bool, device=device)
    for r, lc in enumerate(caption_lengths):
        image_ids[r, :n_real, 0] = lc + 1
        valid[r, :lc] = True
    image_ids[:, :n_real, 1] = y.reshape(-1).to(torch.int32)
    image_ids[:, :n_real, 2] = x.reshape(-1).to(torch.int32)
    caption_ids = torch.zeros(rows, longest, 3, dtype=torch.int32, device=device)
    caption_ids[..., 0] = torch.arange(1, longest + 1, dtype=torch.int32, device=device)
    rope = model.rope_embedder
    image = rope(image_ids.view(-1, 3)).view(rows, total, -1)
    caption = rope(caption_ids.view(-1, 3)).view(rows, longest, -1)
    caption = torch.where(valid[..., None], caption, torch.zeros_like(caption))  # as pad_sequence
    realign = None
    if grid is not None and any(batch.shifts):
        realign = _realign(model, batch.shifts, grid, n_real)
    ragged = len(set(caption_lengths)) > 1
    return Tables(image, caption, valid, ragged, n_real, realign)


def _realign(
    model: ZImageTransformer2DModel, shifts: tuple[int, ...], grid: TokenBatch, n_real: int
) -> torch.Tensor:
    """``[R, P, 1, hd/2]``: per row, the turn by its shift on the first RoPE axis at the
    cached real image keys (the tokens the layout does not compute), 1 elsewhere."""
    axis = model.rope_embedder.freqs_cis[0]  # [len, d0/2] complex64: positions 0, 1, ...
    width = sum(model.config.axes_dims) // 2
    turn = torch.ones(grid.rows, width, dtype=axis.dtype, device=axis.device)
    for r, shift in enumerate(shifts):
        if shift:
            angle = axis[abs(shift)]
            turn[r, : angle.shape[0]] = angle if shift > 0 else angle.conj()
    computed = torch.zeros(grid.rows * grid.n_tokens, dtype=torch.bool, device=axis.device)
    computed[grid.flat_index] = True
    cached = ~computed.view(grid.rows, grid.n_tokens)
    cached[:, n_real:] = False  # the pads sit at position 0 in every row
    out = torch.where(cached[..., None], turn[:, None], torch.ones_like(turn[:, None]))
    return out.unsqueeze(2)


def _caption(
    model: ZImageTransformer2DModel,
    captions: torch.Tensor,
    lengths: tuple[int, ...],
    tables: Tables,
) -> torch.Tensor:
    """The caption stream ``[R, Lc, D]``: embedded, ``cap_pad_token`` up to each row's 32
    multiple, zeros after it (the batch's padding), through the context refiner."""
    longest = tables.caption.shape[1]
    rows, have, features = captions.shape
    if have < longest:
        captions = torch.cat([captions, captions.new_zeros(rows, longest - have, features)], 1)
    embedded = model.cap_embedder(captions[:, :longest])
    real = torch.zeros(rows, longest, dtype=torch.bool, device=captions.device)
    for r, length in enumerate(lengths):
        real[r, :length] = True
    hidden = torch.where(real[..., None], embedded, model.cap_pad_token)
    hidden = torch.where(tables.caption_valid[..., None], hidden, torch.zeros_like(hidden))
    mask = tables.caption_valid if tables.ragged else None
    for layer in model.context_refiner:
        hidden = layer(hidden, mask, tables.caption)
    return hidden


def _relayout(
    ctx: ForwardContext,
    image: torch.Tensor,
    sparse_now: bool,
    sparse: bool,
    previous: str | None,
) -> torch.Tensor:
    """The image stream in the block's layout: a full block after a sparse one starts from
    the cached Y of the block before it, a sparse one after a full one gathers."""
    if sparse_now == sparse:
        return image
    grid = ctx.grid
    if sparse:
        return grid.gather(image)
    if previous is None:
        raise RuntimeError("the first block cannot receive sparse input")
    return assemble(ctx, grid, previous, "y", grid.real_rows(image))


def _block(
    ctx: ForwardContext,
    name: str,
    block: ZImageTransformerBlock,
    image: torch.Tensor,
    caption: torch.Tensor | None,
    adaln: torch.Tensor,
    tables: Tables,
    sparse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``ZImageTransformerBlock.forward`` (modulated) on ``[image ; caption]`` rows."""
    n_image = image.shape[1]
    x = image if caption is None else torch.cat([image, caption], dim=1)
    mod = block.adaLN_modulation(adaln)
    scale_msa, gate_msa, scale_mlp, gate_mlp = mod.unsqueeze(1).chunk(4, dim=2)
    gate_msa, gate_mlp = gate_msa.tanh(), gate_mlp.tanh()
    scale_msa, scale_mlp = 1.0 + scale_msa, 1.0 + scale_mlp
    normed = block.attention_norm1(x) * scale_msa
    out = _attention(ctx, name, block.attention, normed, n_image, tables, sparse)
    x = x + gate_msa * block.attention_norm2(out)
    x = x + gate_mlp * block.ffn_norm2(block.feed_forward(block.ffn_norm1(x) * scale_mlp))
    return x[:, :n_image], (None if caption is None else x[:, n_image:])


def _attention(
    ctx: ForwardContext,
    name: str,
    attn: torch.nn.Module,
    x: torch.Tensor,
    n_image: int,
    tables: Tables,
    sparse: bool,
) -> torch.Tensor:
    """``ZSingleStreamAttnProcessor``: Q/K/V, qk-norm, RoPE, attention, out-projection;
    sparse, the image keys and values are the whole grid's with the cached rows."""
    head = (attn.heads, -1)
    query = attn.norm_q(attn.to_q(x).unflatten(-1, head))
    key = attn.norm_k(attn.to_k(x).unflatten(-1, head))
    value = attn.to_v(x).unflatten(-1, head)
    freqs = _image_freqs(ctx, tables, sparse)
    if x.shape[1] > n_image:
        freqs = torch.cat([freqs, tables.caption], dim=1)
    query, key = rotate(query, freqs), rotate(key, freqs)
    if sparse:
        grid = ctx.grid
        cached_key = assemble(ctx, grid, name, "k", grid.real_rows(key[:, :n_image].flatten(2)))
        cached_key = cached_key.unflatten(-1, head)
        if tables.realign is not None:
            cached_key = _turn(cached_key, tables.realign)
        cached_value = assemble(
            ctx, grid, name, "v", grid.real_rows(value[:, :n_image].flatten(2))
        ).unflatten(-1, head)
        key = torch.cat([cached_key, key[:, n_image:]], dim=1)
        value = torch.cat([cached_value, value[:, n_image:]], dim=1)
    elif ctx.recording:
        ctx.record(name, "k", key[:, :n_image].flatten(2))
        ctx.record(name, "v", value[:, :n_image].flatten(2))
    mask = None
    if tables.ragged and key.shape[1] > tables.image.shape[1]:
        image_keys = key.shape[1] - tables.caption.shape[1]
        every_image = tables.caption_valid.new_ones(key.shape[0], image_keys)
        mask = torch.cat([every_image, tables.caption_valid], dim=1)[:, None, None, :]
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask
    )
    out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
    out = attn.to_out[0](out)
    return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def _image_freqs(ctx: ForwardContext, tables: Tables, sparse: bool) -> torch.Tensor:
    """The image rows' RoPE: every padded token's, or the sparse rows' (memoised)."""
    if not sparse:
        return tables.image
    key = ("zimage_rope", id(tables))
    if key not in ctx.scratch:
        positions = ctx.grid.positions  # [R, n_max]
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        ctx.scratch[key] = tables.image[rows, positions]
    return ctx.scratch[key]


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The processor's complex RoPE of ``[R, S, H, hd]`` by ``[R, S, hd/2]``, in float32."""
    turned = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs.unsqueeze(2)
    return torch.view_as_real(turned).flatten(3).type_as(x)


def _turn(keys: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """Cached keys ``[R, P, H, hd]`` turned by ``[R, P, 1, hd/2]`` (1: left as they are)."""
    turned = torch.view_as_complex(keys.float().reshape(*keys.shape[:-1], -1, 2)) * turn
    return torch.view_as_real(turned).flatten(3).type_as(keys)
