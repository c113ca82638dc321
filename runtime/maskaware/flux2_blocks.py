"""Sparse blocks for diffusers' ``Flux2Transformer2DModel`` (the ``flux2-klein`` family),
padded layout.

FLUX.2's blocks are Flux's in another arrangement, so this reuses ``flux_blocks``: a
double-stream block's attention (``Flux2Attention``) has Flux's projections, norms and
order (project, qk-norm, [text ; image], RoPE, attend, split), and its processor is
``flux_blocks.JointAttention`` as is. What differs is the single-stream block:

* the model hands it the joint sequence ``[text ; image]`` and it returns one tensor, so
  its layout hooks switch and record only the image part (``text_first``);
* its attention (``Flux2ParallelSelfAttention``) projects Q, K, V and the MLP input in one
  fused linear, attends, and projects ``[attention ; MLP]`` back in one more: every op but
  the attention is token-wise, so :class:`ParallelAttention` runs it on [text ; masked
  tokens] with the unmasked image rows of K/V from the bake;
* diffusers calls its processor as ``(attn, hidden_states, attention_mask,
  image_rotary_emb)``, without an encoder slot.

The shared modulations are computed once per row outside the blocks and broadcast over the
tokens, so a block runs on any subset of them; the model's concatenation of the two streams
and its final slice of the text tokens take the sparse layout as they take the full one.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_flux2 import (
    Flux2AttnProcessor,
    Flux2KVAttnProcessor,
    Flux2KVParallelSelfAttnProcessor,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
    Flux2SingleTransformerBlock,
    Flux2TransformerBlock,
)
from torch import nn

from retouch.runtime.maskaware.attention import Call
from retouch.runtime.maskaware.context import ForwardContext, current
from retouch.runtime.maskaware.flux_blocks import (
    INSTALLED,
    JointAttention,
    block_names,
    record_output,
    switch_layout,
)

# The processors diffusers gives each block kind: the plain ones, or the KV-cache ones that
# behave alike when the call passes no KV arguments (the inpaint pipeline passes none).
DOUBLE_PROCESSORS = (Flux2AttnProcessor, Flux2KVAttnProcessor)
SINGLE_PROCESSORS = (Flux2ParallelSelfAttnProcessor, Flux2KVParallelSelfAttnProcessor)


def install(transformer: nn.Module) -> list[str]:
    """Wrap every block of ``transformer`` once; returns the block names in order."""
    names = block_names(transformer)
    previous: str | None = None
    for name in names:
        block = transformer.get_submodule(name)
        if getattr(block, INSTALLED, None) is None:
            single = _check(name, block)
            wrapper = ParallelAttention if single else JointAttention
            block.attn.set_processor(wrapper(name, block.attn.processor))
            hook = switch_layout(name, previous, text_first=single)
            block.register_forward_pre_hook(hook, with_kwargs=True)
            block.register_forward_hook(record_output(name, text_first=single))
            setattr(block, INSTALLED, name)
        previous = name
    return names


def _check(name: str, block: nn.Module) -> bool:
    """Whether ``block`` is a single-stream block, once it is seen to be one this module
    wraps (a FLUX.2 block with diffusers' own processor, projections not fused)."""
    if isinstance(block, Flux2TransformerBlock):
        single, accepted = False, DOUBLE_PROCESSORS
    elif isinstance(block, Flux2SingleTransformerBlock):
        single, accepted = True, SINGLE_PROCESSORS
    else:
        raise ValueError(f"{name}: unsupported FLUX.2 block {type(block).__name__}")
    if getattr(block.attn, "fused_projections", False):
        raise ValueError(f"{name}: fused QKV projections are not supported")
    if not isinstance(block.attn.processor, accepted):
        raise ValueError(
            f"{name}: unsupported attention processor {type(block.attn.processor).__name__}"
        )
    return single


class ParallelAttention(JointAttention):
    """``Flux2ParallelSelfAttnProcessor``, sparse- and record-aware: the single-stream
    block's fused QKV + MLP projection, attention over [text ; image] (Flux's,
    :meth:`JointAttention.attend`) and fused output projection, on [text ; masked tokens]
    when the block runs sparse."""

    def __call__(  # type: ignore[override]  # diffusers' single-stream call has no encoder slot
        self,
        attn: Flux2ParallelSelfAttention,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        ctx = current()
        call = Call(attn, hidden_states, None, (image_rotary_emb,))
        if ctx is None or not self.active(ctx, call):
            return self.inner(attn, hidden_states, attention_mask, image_rotary_emb, **kwargs)
        if attention_mask is not None:
            raise ValueError(f"{type(self).__name__} (mask-aware) takes no attention mask")
        return self.run(ctx, call)

    def run(self, ctx: ForwardContext, call: Call) -> torch.Tensor:
        attn = call.attn
        fused = attn.to_qkv_mlp_proj(call.hidden_states)
        qkv, mlp = fused.split([3 * attn.inner_dim, fused.shape[-1] - 3 * attn.inner_dim], -1)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
        normed = (attn.norm_q(query), attn.norm_k(key), value)
        out = self.attend(ctx, normed, call.rest[0], ctx.text_len)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))
