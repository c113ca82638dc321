"""The ``sd3-inpaint`` family: StableDiffusion3InpaintPipeline split into encode / assemble /
step / decode, with mask-aware MMDiT blocks.

Each piece does what ``StableDiffusion3InpaintPipeline.__call__`` does for a 16-channel
transformer, calling the pipeline's own helpers (below strength 1: the schedule without its
first steps, the latents starting from the template's latents noised to the first kept
timestep). Like Flux, the pipeline blends
the unmasked latents back to the template re-noised to the next timestep after every step,
so the unmasked tokens' inputs are exactly the bake's and their transformer output is
discarded; only the masked tokens need computing. Every op of an SD3
``JointTransformerBlock`` is token-wise except the joint attention, so a run of sparse
blocks carries only the masked image tokens, padded per model row (``[rows, n_max, D]``,
rows = 2 per request: classifier-free guidance halves), through diffusers' own block
forwards; the text stream is small and always computed in full. The attention processor is
declared on each block (``set_processor``): it attends the masked queries and the text to
[image K,V with the unmasked rows from the bake ; text K,V]. Forward hooks switch layouts
when a plan mixes modes (shared with Flux) and scatter the last block's output back to the
whole grid, where the model's own ``norm_out``/``proj_out``/unpatchify finish.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import SD3Transformer2DModel, StableDiffusion3InpaintPipeline
from diffusers.models.attention import JointTransformerBlock
from diffusers.models.attention_processor import Attention
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3_inpaint import (
    calculate_shift,
    retrieve_timesteps,
)

from retouch.runtime.families.base import Family, FamilyModel, guided, truncate
from retouch.runtime.maskaware import flowstep, inpaint
from retouch.runtime.maskaware.attention import Call, Processor, assemble, sdpa
from retouch.runtime.maskaware.context import ForwardContext, current
from retouch.runtime.maskaware.flops import Flops, conv_flops, linear_flops
from retouch.runtime.maskaware.flux_blocks import (
    INSTALLED,
    SPARSE_CARRY,
    record_output,
    switch_layout,
)
from retouch.runtime.maskaware.request import (
    EditRequest,
    RequestState,
    batch_timesteps,
    token_sets,
)


@dataclass
class SD3Inputs:
    """Per-request transformer inputs besides the latents."""

    prompt_embeds: torch.Tensor  # [2, L, D]: negative prompt ("" if none), then the prompt
    pooled: torch.Tensor  # [2, P]
    mask: torch.Tensor  # [1, 1, h, w] latent mask (the blend weight)
    image_latents: torch.Tensor  # [1, 16, h, w] template latents
    noise: torch.Tensor  # [1, 16, h, w] initial noise (re-noises the template)


class SD3Inpaint(FamilyModel):
    """Glue between the editor and a StableDiffusion3InpaintPipeline."""

    rows_per_request = 2  # classifier-free guidance halves
    packs = False  # adaLN modulates per model row: the blocks run the padded layout
    template_tensors = ("image_latents",)  # the blend needs them every step
    patch = 2
    _blend: flowstep.BlendInputs | None = None  # the running batch's, stacked once

    def install(self, transformer: torch.nn.Module) -> list[str]:
        if transformer.config.in_channels != 16:
            raise ValueError("mask-aware SD3 inpainting needs a 16-channel transformer")
        self.patch = transformer.config.patch_size
        return install(transformer)

    @staticmethod
    def text_length(pipe: StableDiffusion3InpaintPipeline) -> int:
        return pipe.tokenizer_max_length + pipe.tokenizer_3.model_max_length  # CLIP ; T5

    def max_sequence_length(self) -> int:
        return self.pipe.tokenizer_3.model_max_length

    def _scheduler(self, request: EditRequest) -> tuple[object, torch.Tensor]:
        scheduler = self.new_scheduler()
        config, kwargs = scheduler.config, {}
        if config.get("use_dynamic_shifting", None):
            h, w = self.latent_size(request.height, request.width)
            kwargs["mu"] = calculate_shift(
                (h // self.patch) * (w // self.patch),
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.16),
            )
        timesteps, _ = retrieve_timesteps(scheduler, request.steps, self.device, **kwargs)
        return scheduler, truncate(self.spec, scheduler, timesteps, request)

    def encode_prompt(self, prompt: str, negative_prompt: str) -> dict[str, torch.Tensor]:
        """The three text encoders, the negative prompt ("" if none) first."""
        positive, negative, pooled, negative_pooled = self.pipe.encode_prompt(
            prompt=prompt,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=True,
            negative_prompt=negative_prompt or None,
            max_sequence_length=self.max_sequence_length(),
        )
        return {
            "prompt_embeds": torch.cat([negative, positive]).cpu(),  # [2, L, D]
            "pooled": torch.cat([negative_pooled, pooled]).cpu(),  # [2, P]
        }

    def assemble(
        self, request: EditRequest, tensors: dict[str, torch.Tensor], *, every: bool
    ) -> RequestState:
        """The light part: scheduler, token set, inputs on the device (``every``: compute
        every token, there is no cache to read)."""
        hard = tensors["mask"][0, 0] > 0.5
        noise = tensors["noise"].to(self.device, self.dtype)
        scheduler, timesteps = self._scheduler(request)
        inputs = SD3Inputs(
            prompt_embeds=tensors["prompt_embeds"].to(self.device, self.dtype),
            pooled=tensors["pooled"].to(self.device, self.dtype),
            mask=tensors["mask"].to(self.device, self.dtype),
            image_latents=tensors["image_latents"].to(self.device, self.dtype),
            noise=noise,
        )
        h, w = hard.shape
        tokens = token_sets(hard, [(h // self.patch, w // self.patch)], every=every)
        latents = inpaint.initial_latents(
            request, scheduler, timesteps, noise, inputs.image_latents
        )
        return RequestState(request, latents, scheduler, timesteps, inputs, tokens)

    def forward(self, states: list[RequestState], ctx: ForwardContext) -> list[torch.Tensor]:
        """One batched transformer call; returns each request's ``[2, 16, h, w]`` prediction.

        The model embeds every patch; the first block's pre-hook gathers the masked ones.
        """
        ctx.grid = next(iter(ctx.grids.values()), None)  # one token grid; none in a bake
        ctx.text_len = states[0].inputs.prompt_embeds.shape[1]
        transformer = self.pipe.transformer

        def run(**inputs: torch.Tensor) -> torch.Tensor:
            current().scratch[SPARSE_CARRY] = False  # every run enters in the whole layout
            return transformer(**inputs, return_dict=False)[0]

        out = ctx.call(
            run,
            hidden_states=torch.cat([torch.cat([s.latents] * 2) for s in states]),
            timestep=batch_timesteps(states, self.device, repeat=2),
            encoder_hidden_states=torch.cat([s.inputs.prompt_embeds for s in states]),
            pooled_projections=torch.cat([s.inputs.pooled for s in states]),
        )
        return list(out.split(2))

    def advance(self, state: RequestState, prediction: torch.Tensor) -> None:
        """Guidance, the request's scheduler step, then the pipeline's inpaint blend."""
        step = state.scheduler.step(
            guided(state, prediction), state.timestep, state.latents, return_dict=False
        )
        latents = step[0]
        state.latents = inpaint.blend(state, latents)

    def advance_all(self, states: list[RequestState], predictions: list[torch.Tensor]) -> None:
        """The batch's guidance, scheduler step and blend in one set of ops
        (``maskaware.flowstep``) where every request steps with the flow-matching Euler
        scheduler."""
        if not flowstep.batchable(states):
            return super().advance_all(states, predictions)
        velocity = flowstep.guide(states, torch.stack(predictions))
        self._blend = flowstep.advance(states, velocity, self._blend)
        return None


# -- blocks -------------------------------------------------------------------------------


def install(transformer: SD3Transformer2DModel) -> list[str]:
    """Declare the mask-aware processor and hooks on every block once; the block names."""
    names = [f"transformer_blocks.{i}" for i in range(len(transformer.transformer_blocks))]
    previous: str | None = None
    for name in names:
        block = transformer.get_submodule(name)
        if not isinstance(block, JointTransformerBlock) or block.use_dual_attention:
            raise ValueError(f"{name}: unsupported SD3 block (dual attention: SD3.5)")
        if getattr(block, INSTALLED, None) is None:
            block.attn.set_processor(JointAttention(name, block.attn.processor))
            block.register_forward_pre_hook(switch_layout(name, previous), with_kwargs=True)
            block.register_forward_hook(record_output(name))
            if name == names[-1]:
                block.register_forward_hook(_to_whole_grid)
            setattr(block, INSTALLED, name)
        previous = name
    return names


def _to_whole_grid(block: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
    """Last block: sparse image rows back onto the whole grid (unmasked rows zero: the
    blend discards them), so the model's own output layers and unpatchify run unchanged."""
    ctx = current()
    if ctx is None or ctx.grid is None or not ctx.scratch.get(SPARSE_CARRY):
        return None
    text, image = output
    rows = ctx.grid
    whole = image.new_zeros(rows.rows, rows.n_tokens, image.shape[-1])
    ctx.scratch[SPARSE_CARRY] = False
    return text, rows.scatter(image, whole)


class JointAttention(Processor):
    """``JointAttnProcessor2_0``, sparse- and record-aware (image rows first, then text)."""

    def active(self, ctx: ForwardContext, call: Call) -> bool:
        return call.encoder_hidden_states is not None and super().active(ctx, call)

    def run(self, ctx: ForwardContext, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        attn, hidden_states = call.attn, call.hidden_states
        head = (attn.heads, -1)
        query, key, value = _projected(attn, hidden_states, head, text=False)
        text_q, text_k, text_v = _projected(attn, call.encoder_hidden_states, head, text=True)
        if self.sparse(ctx):
            tokens = ctx.grid
            key = assemble(ctx, tokens, self.block, "k", tokens.real_rows(key, 2))
            value = assemble(ctx, tokens, self.block, "v", tokens.real_rows(value, 2))
            key, value = key.unflatten(-1, head), value.unflatten(-1, head)
        else:
            ctx.record(self.block, "k", key.flatten(2))
            ctx.record(self.block, "v", value.flatten(2))
        out = sdpa(
            torch.cat([query, text_q], 1),
            torch.cat([key, text_k], 1),
            torch.cat([value, text_v], 1),
        )
        split = hidden_states.shape[1]
        image, text = out[:, :split], out[:, split:]
        if not attn.context_pre_only:
            text = attn.to_add_out(text)
        return attn.to_out[1](attn.to_out[0](image)), text


def _projected(
    attn: Attention, states: torch.Tensor, head: tuple[int, int], *, text: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V ``[B, S, H, D]`` after the optional qk-norm (image or ``add_*`` projections)."""
    if text:
        q, k, v = attn.add_q_proj(states), attn.add_k_proj(states), attn.add_v_proj(states)
        norm_q, norm_k = attn.norm_added_q, attn.norm_added_k
    else:
        q, k, v = attn.to_q(states), attn.to_k(states), attn.to_v(states)
        norm_q, norm_k = attn.norm_q, attn.norm_k
    q, k, v = q.unflatten(-1, head), k.unflatten(-1, head), v.unflatten(-1, head)
    if norm_q is not None:
        q = norm_q(q)
    if norm_k is not None:
        k = norm_k(k)
    return q, k, v


# -- FLOPs --------------------------------------------------------------------------------


def sd3_flops(
    config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
) -> Flops:
    """One row of an ``SD3Transformer2DModel`` at mask ratio ``ratio``.

    The patch embedding, ``norm_out`` and ``proj_out`` run on every token either way (the
    mask-aware path embeds the whole grid and scatters the last block back onto it).
    """
    patch = config["patch_size"]
    n_tokens = (latent_size[0] // patch) * (latent_size[1] // patch)
    masked = ratio * n_tokens
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    text, layers = text_len, config["num_layers"]
    dense = conv_flops(n_tokens, config["in_channels"], dim, kernel=patch)
    dense += linear_flops(1, 256, dim) + linear_flops(1, dim, dim)  # timestep embedding
    dense += linear_flops(1, config["pooled_projection_dim"], dim) + linear_flops(1, dim, dim)
    dense += linear_flops(text, config["joint_attention_dim"], config["caption_projection_dim"])
    attention = 0.0
    for index in range(layers):
        pre_only = index == layers - 1  # the last block's text stream ends at its attention
        dense += linear_flops(1, dim, 6 * dim) + linear_flops(1, dim, (2 if pre_only else 6) * dim)
        dense += 4 * linear_flops(masked, dim, dim) + 3 * linear_flops(text, dim, dim)
        dense += linear_flops(masked, dim, 4 * dim) + linear_flops(masked, 4 * dim, dim)
        if not pre_only:
            dense += linear_flops(text, dim, dim)  # to_add_out
            dense += linear_flops(text, dim, 4 * dim) + linear_flops(text, 4 * dim, dim)
        attention += 2 * 2.0 * (masked + text) * (n_tokens + text) * dim
    out_channels = config.get("out_channels") or config["in_channels"]
    dense += linear_flops(1, dim, 2 * dim) + linear_flops(n_tokens, dim, patch**2 * out_channels)
    return Flops(dense, attention)


class SD3InpaintFamily(Family):
    """``sd3-inpaint``: an SD3 MMDiT (joint-attention blocks, CLIP-L + CLIP-G + T5 text)."""

    name = "sd3-inpaint"
    model = SD3Inpaint
    pipeline = StableDiffusion3InpaintPipeline
    text_components = (
        "text_encoder",
        "text_encoder_2",
        "text_encoder_3",
        "tokenizer",
        "tokenizer_2",
        "tokenizer_3",
    )
    flops = sd3_flops

    def token_cell(self, pipe: StableDiffusion3InpaintPipeline) -> int:
        return pipe.vae_scale_factor * pipe.transformer.config.patch_size


FAMILY = SD3InpaintFamily()
