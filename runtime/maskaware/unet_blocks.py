"""Sparse transformer blocks for diffusers' ``UNet2DConditionModel`` (the ``sd-inpaint`` family).

A block is one ``Transformer2DModel``, put behind a :class:`MaskAwareTransformer2D` in its
parent's module list (names and ``state_dict`` keys unchanged). Convolutions stay full, so a block always receives
its whole input map; in sparse mode it runs the GroupNorm over every token (it needs them
all) and everything after it on the masked tokens of its level only:

    proj_in → BasicTransformerBlock(s) → proj_out → + residual   (masked rows)
    unmasked output rows ← the bake's Y of this block and step

The ``BasicTransformerBlock`` forwards are diffusers' own; only their attention processors
are wrapped: ``attn1`` attends with masked queries to [fresh masked K,V ; cached unmasked
K,V], ``attn2`` (cross-attention) gets a per-row loop in the packed layout. In record mode
(the bake) the same wrappers write K, V and Y. Outside a mask-aware forward every wrapper
hands straight to diffusers' code, so the stock pipeline runs unchanged on the same model.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from torch import nn

from retouch.runtime.maskaware.attention import (
    Call,
    Processor,
    assemble,
    sdpa,
    sdpa_segments,
)
from retouch.runtime.maskaware.context import ForwardContext, Mode, current


def install(unet: nn.Module) -> list[str]:
    """Put a :class:`MaskAwareTransformer2D` in place of every ``Transformer2DModel`` of
    ``unet`` (once: an installed wrapper is kept); returns the block names in order."""
    names, found = [], []
    for name, module in unet.named_modules():
        if isinstance(module, MaskAwareTransformer2D):
            names.append(name)
        elif isinstance(module, Transformer2DModel):
            _check_supported(name, module)
            found.append((name, module))
            names.append(name)
    for name, module in found:
        parent, _, key = name.rpartition(".")
        unet.get_submodule(parent).add_module(key, MaskAwareTransformer2D(name, module))
    return names


def execution_order(names: list[str]) -> list[str]:
    """Block names in the order a UNet forward runs them: down, mid, up.

    ``named_modules`` lists ``up_blocks`` before ``mid_block`` (the UNet registers the empty
    ``up_blocks`` list first), so ``install``'s order is not the execution order.
    """
    stage = {"down_blocks": 0, "mid_block": 1, "up_blocks": 2}
    return sorted(names, key=lambda name: stage.get(name.split(".", 1)[0], 1))


def sparse_rows(module: nn.Module) -> tuple[str, ...]:
    """What a sparse block reads from the cache: K and V of each attn1, then its output Y."""
    count = len(module.transformer_blocks)
    return (*(n for i in range(count) for n in (f"k{i}", f"v{i}")), "y")


def _check_supported(name: str, module: Transformer2DModel) -> None:
    if not module.is_input_continuous:
        raise ValueError(f"{name}: only continuous-input Transformer2DModel blocks can run sparse")
    if next(module.parameters(recurse=False), None) is not None or module._buffers:
        raise ValueError(f"{name}: a Transformer2DModel with weights of its own")
    for block in module.transformer_blocks:
        if block.norm_type != "layer_norm" or block.pos_embed is not None:
            raise ValueError(f"{name}: unsupported BasicTransformerBlock ({block.norm_type})")
        for attn in (block.attn1, block.attn2):
            if attn is None:
                continue
            if (
                attn.spatial_norm is not None
                or attn.group_norm is not None
                or attn.norm_q is not None
                or attn.residual_connection
                or attn.rescale_output_factor != 1.0
            ):
                raise ValueError(f"{name}: unsupported attention configuration")


class MaskAwareTransformer2D(nn.Module):
    """A ``Transformer2DModel`` that runs sparse when the active plan says so.

    It takes the block's place in its parent and adopts the block's children (``norm``,
    ``proj_in``, ``transformer_blocks``, ``proj_out``) under their own names, so module
    names and ``state_dict`` keys are those of the unwrapped UNet and ``.to()`` reaches
    every weight; the block itself is kept (outside the module tree) for its configuration
    and diffusers' own forward, which runs unchanged outside a mask-aware call and for full
    blocks. Its attention processors are declared with ``set_processor``.
    """

    def __init__(self, name: str, block: Transformer2DModel) -> None:
        super().__init__()
        self.block_name = name
        self._inner = (block,)  # a tuple: not registered, its children are ours
        for child, module in block.named_children():
            self.add_module(child, module)
        for index, layer in enumerate(block.transformer_blocks):
            layer.attn1.set_processor(SelfAttention(name, index, layer.attn1.processor))
            if layer.attn2 is not None:
                layer.attn2.set_processor(CrossAttention(name, layer.attn2.processor))

    @property
    def inner(self) -> Transformer2DModel:
        return self._inner[0]

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Transformer2DModelOutput | tuple[torch.Tensor]:
        ctx = current()
        if ctx is None:
            return self.inner(
                hidden_states, encoder_hidden_states, return_dict=return_dict, **kwargs
            )
        name = self.block_name
        ctx.enter_block(name)
        if ctx.mode(name) is Mode.FULL:
            out = self.inner(
                hidden_states, encoder_hidden_states, return_dict=return_dict, **kwargs
            )
            if ctx.recording:
                sample = out.sample if return_dict else out[0]
                ctx.record(name, "y", sample.flatten(2).transpose(1, 2))
        else:
            if (
                kwargs.get("attention_mask") is not None
                or kwargs.get("encoder_attention_mask") is not None
            ):
                raise ValueError("sparse blocks do not support attention masks")
            sample = _sparse_forward(
                ctx, self.inner, name, hidden_states, encoder_hidden_states, kwargs
            )
            out = Transformer2DModelOutput(sample=sample) if return_dict else (sample,)
        ctx.exit_block(name)
        return out


def _sparse_forward(
    ctx: ForwardContext,
    module: Transformer2DModel,
    name: str,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Masked rows through norm/proj/blocks; unmasked rows from the cached block output."""
    batch, channels, height, width = hidden_states.shape
    tokens = ctx.grids[(height, width)]
    residual = tokens.gather_map(hidden_states)
    x = tokens.gather_map(module.norm(hidden_states))
    ctx.grid = tokens  # from proj_in to proj_out: a mixed-adapter step's packed layers
    try:
        x = _project(module.proj_in, x)
        for block in module.transformer_blocks:
            x = block(
                x,
                encoder_hidden_states=encoder_hidden_states,
                cross_attention_kwargs=kwargs.get("cross_attention_kwargs"),
            )
        x = _project(module.proj_out, x) + residual
    finally:
        ctx.grid = None
    full = assemble(ctx, tokens, name, "y", tokens.real_rows(x))
    return full.view(batch, height, width, channels).permute(0, 3, 1, 2).contiguous()


def _project(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``proj_in``/``proj_out`` on token rows: a 1×1 convolution is a linear map per token."""
    if isinstance(layer, nn.Conv2d):
        return F.linear(x, _matrix(layer), layer.bias)
    return layer(x)


_MATRICES: weakref.WeakKeyDictionary[nn.Conv2d, tuple[torch.Tensor, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def _matrix(conv: nn.Conv2d) -> torch.Tensor:
    """A 1×1 convolution's weight as a ``[out, in]`` matrix: a view made once per weight
    (it shares the weight's memory, so an in-place weight update shows through)."""
    weight = conv.weight
    made = _MATRICES.get(conv)
    if made is None or made[0] is not weight:
        made = _MATRICES[conv] = (weight, weight.detach().flatten(1))
    return made[1]


def _heads(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (attn.heads, -1))


class SelfAttention(Processor):
    """``attn1`` of a BasicTransformerBlock: records K/V in a bake, reads them in an edit."""

    def __init__(self, block: str, index: int, inner: Any) -> None:
        super().__init__(block, inner)
        self.k_name, self.v_name = f"k{index}", f"v{index}"

    def sparse(self, ctx: ForwardContext) -> bool:
        return ctx.grid is not None  # set by the block's wrapper while it runs sparse

    def run(self, ctx: ForwardContext, call: Call) -> torch.Tensor:
        attn, hidden_states = call.attn, call.hidden_states
        query, key, value = (
            attn.to_q(hidden_states),
            attn.to_k(hidden_states),
            attn.to_v(hidden_states),
        )
        if self.sparse(ctx):
            out = self._sparse(ctx, attn, query, key, value)
        else:
            ctx.record(self.block, self.k_name, key)
            ctx.record(self.block, self.v_name, value)
            out = sdpa(_heads(attn, query), _heads(attn, key), _heads(attn, value))
        return attn.to_out[1](attn.to_out[0](out))

    def _sparse(
        self,
        ctx: ForwardContext,
        attn: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> torch.Tensor:
        tokens = ctx.grid
        keys = _heads(attn, assemble(ctx, tokens, self.block, self.k_name, tokens.real_rows(key)))
        values = _heads(
            attn, assemble(ctx, tokens, self.block, self.v_name, tokens.real_rows(value))
        )
        if tokens.packed:
            return sdpa_segments(_heads(attn, query), keys, values, tokens.segments)
        return sdpa(_heads(attn, query), keys, values)


class CrossAttention(Processor):
    """``attn2``: in the packed layout each row's tokens attend to that row's text."""

    def active(self, ctx: ForwardContext, call: Call) -> bool:
        return ctx.grid is not None and ctx.grid.packed

    def run(self, ctx: ForwardContext, call: Call) -> torch.Tensor:
        attn, hidden_states = call.attn, call.hidden_states
        context = call.encoder_hidden_states
        if context is None:
            context = hidden_states
        if attn.norm_cross:
            context = attn.norm_encoder_hidden_states(context)
        query = _heads(attn, attn.to_q(hidden_states))
        key, value = _heads(attn, attn.to_k(context)), _heads(attn, attn.to_v(context))
        out = sdpa_segments(query, key, value, ctx.grid.segments)
        return attn.to_out[1](attn.to_out[0](out))
