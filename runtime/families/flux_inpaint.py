"""The ``flux-inpaint`` family: FluxInpaintPipeline split into encode / assemble / step /
decode.

Each piece does what ``FluxInpaintPipeline.__call__`` does, calling the pipeline's own
helpers (below strength 1: the schedule without its first steps, the latents starting from
the template's latents noised to the first kept timestep). Flux is guidance-distilled: no
unconditional branch, so no negative prompt. ``encode`` (text encoders, template VAE encode) and ``decode`` (VAE
decode) need no transformer, so they also run on a pipeline loaded without one. After every step the pipeline blends the unmasked latents back to
the template re-noised to the next timestep, so the unmasked tokens' inputs are exactly the
bake's at every step and only the masked tokens need computing; the transformer output of
unmasked tokens is discarded by that blend (it is left at zero).

The template's image latents are a per-template tensor: the bake stores them with the
template (the VAE posterior sample drawn with the template seed), which also saves every
edit a VAE encode; the stock reference is given the same latents. A request whose template
has no cache yet gets them from ``encode`` (the same VAE encode with the template's seed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers import FluxInpaintPipeline
from diffusers.pipelines.flux.pipeline_flux_inpaint import calculate_shift, retrieve_timesteps
from PIL import Image

from retouch.runtime.families.base import Family, FamilyModel, truncate
from retouch.runtime.maskaware import flowstep, flux_blocks, flux_packed, inpaint
from retouch.runtime.maskaware.context import ForwardContext, Mode, current
from retouch.runtime.maskaware.flops import Flops, linear_flops
from retouch.runtime.maskaware.flux_packed import PackedInputs
from retouch.runtime.maskaware.request import (
    EditRequest,
    ImageSize,
    RequestState,
    batch_timesteps,
    token_sets,
)
from retouch.runtime.maskaware.tokens import TokenSet


@dataclass
class FluxConditioning:
    """What every Flux pipeline hands its transformer besides the image tokens."""

    prompt_embeds: torch.Tensor  # [1, L, D]
    pooled: torch.Tensor | None  # [1, P] (FLUX.2 reads no pooled text: None)
    text_ids: torch.Tensor  # [L, 3] (FLUX.2: [L, 4])
    image_ids: torch.Tensor  # [N, 3] (FLUX.2: [N, 4])
    guidance: torch.Tensor | None  # [1] (guidance-distilled models) or None


@dataclass
class FluxInputs(FluxConditioning):
    """Per-request transformer inputs besides the latents, and the blend's."""

    mask: torch.Tensor  # [1, N, 64] packed latent mask (the blend weight)
    image_latents: torch.Tensor  # [1, N, 64] packed template latents
    noise: torch.Tensor  # [1, N, 64] packed initial noise (re-noises the template)


class FluxInpaint(FamilyModel):
    """Glue between the editor and a FluxInpaintPipeline."""

    rows_per_request = 1  # guidance is an embedding: no CFG halves
    packs = True
    template_tensors = ("image_latents",)  # the blend needs them every step
    _blend: flowstep.BlendInputs | None = None  # the running batch's, stacked once

    def install(self, transformer: torch.nn.Module) -> list[str]:
        self.channels = transformer.config.in_channels // 4
        return flux_blocks.install(transformer)

    @staticmethod
    def latent_grid(pipe: FluxInpaintPipeline, height: int, width: int) -> tuple[int, int]:
        factor = pipe.vae_scale_factor * 2  # 2x2 packing on top of the VAE factor
        return 2 * (height // factor), 2 * (width // factor)

    @staticmethod
    def text_length(pipe: FluxInpaintPipeline) -> int:
        return pipe.tokenizer_2.model_max_length

    def max_sequence_length(self) -> int:
        return self.text_length(self.pipe)

    def _pack(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipe._pack_latents(latents, latents.shape[0], self.channels, *latents.shape[2:])

    def _scheduler(self, request: EditRequest) -> tuple[object, torch.Tensor]:
        scheduler = self.new_scheduler()
        steps, factor = request.steps, self.pipe.vae_scale_factor
        sigmas = np.linspace(1.0, 1 / steps, steps)
        seq_len = (request.image.height // factor // 2) * (request.image.width // factor // 2)
        mu = self.shift(scheduler.config, seq_len, steps)
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        return scheduler, truncate(self.spec, scheduler, timesteps, request)

    @staticmethod
    def shift(config: Mapping[str, Any], seq_len: int, steps: int) -> float:
        """The schedule's ``mu`` for ``seq_len`` image tokens (Flux's ``calculate_shift``)."""
        return calculate_shift(
            seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )

    def refuse_negative(self, negative_prompt: str) -> None:
        """Flux has no unconditional branch: a negative prompt would be silently ignored."""
        if negative_prompt:
            raise ValueError(f"{self.spec.name} takes no negative prompt (guidance-distilled)")

    def stock_negative(self, request: EditRequest, batch: int) -> dict[str, Any]:
        self.refuse_negative(request.negative_prompt)
        return {}

    def encode_prompt(self, prompt: str, negative_prompt: str) -> dict[str, torch.Tensor]:
        """The prompt's encoding (no negative prompt)."""
        self.refuse_negative(negative_prompt)
        prompt_embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=prompt,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length(),
        )
        return {
            "prompt_embeds": prompt_embeds.cpu(),  # [1, L, D]
            "pooled": pooled.cpu(),  # [1, P]
            "text_ids": text_ids.cpu(),  # [L, 3]
        }

    def assemble(
        self, request: EditRequest, tensors: dict[str, torch.Tensor], *, every: bool
    ) -> RequestState:
        """The light part: packing, scheduler, token set, inputs on the device.

        ``every``: compute every token (no cache to read).
        """
        hard = tensors["mask"][0, 0] > 0.5
        noise = self._pack(tensors["noise"].to(self.device, self.dtype))
        scheduler, timesteps = self._scheduler(request)
        inputs = self.inputs(request, tensors, noise)
        tokens = self.tokens(hard, every=every)
        start = tensors.get("image_latents")  # Fill's only below strength 1
        image = None if start is None else self._pack(start.to(self.device, self.dtype))
        latents = inpaint.initial_latents(request, scheduler, timesteps, noise, image)
        return RequestState(request, latents, scheduler, timesteps, inputs, tokens)

    def tokens(self, hard: torch.Tensor, *, every: bool) -> dict[tuple[int, int], TokenSet]:
        """The token set of a boolean ``[h, w]`` latent mask: 2×2-packed latents."""
        h, w = hard.shape
        return token_sets(hard, [(h // 2, w // 2)], every=every)

    def inputs(
        self, request: EditRequest, tensors: dict[str, torch.Tensor], noise: torch.Tensor
    ) -> FluxInputs:
        """The request's transformer inputs besides the latents, and what the blend needs."""
        mask = tensors["mask"].to(self.device, self.dtype)
        return FluxInputs(
            **vars(self.conditioning(request, tensors)),
            mask=self._pack(mask.repeat(1, self.channels, 1, 1)),
            image_latents=self._pack(tensors["image_latents"].to(self.device, self.dtype)),
            noise=noise,
        )

    def conditioning(
        self, request: EditRequest, tensors: dict[str, torch.Tensor]
    ) -> FluxConditioning:
        """Text, positions and guidance on the device, as the Flux pipelines prepare them."""
        h, w = tensors["mask"].shape[-2:]
        guidance = None
        if self.pipe.transformer.config.guidance_embeds:
            guidance = torch.full([1], request.guidance, device=self.device, dtype=torch.float32)
        return FluxConditioning(
            prompt_embeds=tensors["prompt_embeds"].to(self.device),
            pooled=tensors["pooled"].to(self.device),
            text_ids=tensors["text_ids"].to(self.device),
            image_ids=self.pipe._prepare_latent_image_ids(
                1, h // 2, w // 2, self.device, self.dtype
            ),
            guidance=guidance,
        )

    def transformer_input(self, state: RequestState) -> torch.Tensor:
        """A request's image tokens as the transformer takes them: its packed latents."""
        return state.latents

    def forward(self, states: list[RequestState], ctx: ForwardContext) -> list[torch.Tensor]:
        """One batched transformer call; returns each request's ``[1, N, 64]`` prediction."""
        ctx.grid = next(iter(ctx.grids.values()), None)  # one token grid; none in a bake
        ctx.text_len = states[0].inputs.prompt_embeds.shape[1]
        inputs = _batched(states, torch.cat([self.transformer_input(s) for s in states]))
        transformer, grid = self.pipe.transformer, ctx.grid
        sparse = (
            grid is not None
            and any(s.step_reader is not None for s in states)
            and any(ctx.mode(b) is Mode.SPARSE for b in self.blocks)
        )
        if not sparse:
            ctx.grid = grid = None  # the blocks' wrappers stay inert: the stock forward
        elif grid.packed:
            out = ctx.call(  # the running step's context: a graph runner replays this
                lambda **t: flux_packed.forward(
                    transformer, current(), self.blocks, grid, PackedInputs(**t)
                ),
                **vars(inputs),
            )
            return list(out.split(1))
        # A step with nothing cached, or a plan with no sparse block (sparse does not pay),
        # runs the model's own forward: the stock step, at the stock step's host cost.
        first = sparse and ctx.mode(self.blocks[0]) is Mode.SPARSE

        def padded(**t: torch.Tensor) -> torch.Tensor:
            scratch = current().scratch  # the running step's: a graph runner replays this
            scratch[flux_blocks.SPARSE_CARRY] = first
            latents = t["latents"]
            out = transformer(
                hidden_states=grid.gather(latents) if first else latents,
                **self.denoiser_kwargs(t),
                joint_attention_kwargs={},
                return_dict=False,
            )[0]
            if scratch[flux_blocks.SPARSE_CARRY]:
                out = grid.scatter(out, torch.zeros_like(latents))
            return out

        return list(ctx.call(padded, **vars(inputs)).split(1))

    @staticmethod
    def denoiser_kwargs(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        """The transformer's arguments besides the image tokens, from ``_batched``'s."""
        return {
            "timestep": t["timestep"],
            "guidance": t["guidance"],
            "pooled_projections": t["pooled"],
            "encoder_hidden_states": t["prompt_embeds"],
            "txt_ids": t["text_ids"],
            "img_ids": t["image_ids"],
        }

    def advance(self, state: RequestState, prediction: torch.Tensor) -> None:
        """The request's scheduler step, then the pipeline's inpaint blend."""
        latents = state.scheduler.step(
            prediction, state.timestep, state.latents, return_dict=False
        )[0]
        state.latents = inpaint.blend(state, latents)

    def advance_all(self, states: list[RequestState], predictions: list[torch.Tensor]) -> None:
        """The batch's scheduler step and blend in one set of ops (``maskaware.flowstep``)
        where every request steps with the flow-matching Euler scheduler."""
        if not flowstep.batchable(states):
            return super().advance_all(states, predictions)
        self._blend = flowstep.advance(states, torch.cat(predictions), self._blend)
        return None

    def decode(
        self, latents: torch.Tensor, size: ImageSize, output_type: str = "pil"
    ) -> Image.Image | np.ndarray:
        """Unpack ``[1, N, 4C]`` final latents to ``size``, VAE decode, postprocess."""
        pipe = self.pipe
        latents = pipe._unpack_latents(
            latents.to(self.device, pipe.vae.dtype), size.height, size.width, pipe.vae_scale_factor
        )
        return inpaint.shifted_decode(pipe, latents, self.device, output_type)


def _batched(states: list[RequestState], latents: torch.Tensor) -> PackedInputs:
    """The transformer inputs of all requests (``latents``: their image tokens), as the
    pipeline prepares them for one."""
    inputs = [s.inputs for s in states]
    timestep = batch_timesteps(states, latents.device).to(latents.dtype) / 1000
    return PackedInputs(
        latents=latents,
        timestep=timestep,
        guidance=None if inputs[0].guidance is None else torch.cat([i.guidance for i in inputs]),
        pooled=None if inputs[0].pooled is None else torch.cat([i.pooled for i in inputs]),
        prompt_embeds=torch.cat([i.prompt_embeds for i in inputs]),
        text_ids=inputs[0].text_ids,
        image_ids=inputs[0].image_ids,
    )


# -- Flux ---------------------------------------------------------------------------------


def flux_flops(
    config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
) -> Flops:
    """One row of a ``FluxTransformer2DModel`` at mask ratio ``ratio`` (2×2-packed tokens)."""
    n_tokens = (latent_size[0] // 2) * (latent_size[1] // 2)
    return flux_sequence_flops(config, n_tokens, ratio * n_tokens, text_len)


def flux_sequence_flops(
    config: Mapping[str, Any], n_tokens: int, masked: float, text_len: int
) -> Flops:
    """One row of a ``FluxTransformer2DModel`` whose image sequence has ``n_tokens`` tokens
    (every one a key) of which ``masked`` are computed."""
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    cin = config["in_channels"]
    cout = config.get("out_channels") or cin
    queries, keys = text_len + masked, text_len + n_tokens
    embed = 2 * (linear_flops(1, 256, dim) + linear_flops(1, dim, dim))  # timestep, guidance
    embed += linear_flops(1, config["pooled_projection_dim"], dim) + linear_flops(1, dim, dim)
    if not config.get("guidance_embeds", False):
        embed -= linear_flops(1, 256, dim) + linear_flops(1, dim, dim)
    dense = (
        embed
        + linear_flops(masked, cin, dim)
        + linear_flops(text_len, config["joint_attention_dim"], dim)
    )
    attention = 0.0
    for _ in range(config["num_layers"]):  # dual-stream blocks
        dense += 2 * linear_flops(1, dim, 6 * dim)  # adaLN of both streams
        for tokens in (masked, text_len):
            dense += 4 * linear_flops(tokens, dim, dim) + 2 * linear_flops(tokens, dim, 4 * dim)
        attention += 2 * 2.0 * queries * keys * dim
    for _ in range(config["num_single_layers"]):  # single-stream blocks
        dense += linear_flops(1, dim, 3 * dim)
        dense += 3 * linear_flops(queries, dim, dim) + linear_flops(queries, dim, 4 * dim)
        dense += linear_flops(queries, 5 * dim, dim)
        attention += 2 * 2.0 * queries * keys * dim
    dense += linear_flops(1, dim, 2 * dim) + linear_flops(masked, dim, cout)  # norm_out, proj_out
    return Flops(dense, attention)


class FluxInpaintFamily(Family):
    """``flux-inpaint``: a Flux DiT (dual- and single-stream blocks, 2x2-packed latents)."""

    name = "flux-inpaint"
    model = FluxInpaint
    pipeline = FluxInpaintPipeline
    text_components = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
    flops = flux_flops

    def token_cell(self, pipe: FluxInpaintPipeline) -> int:
        return pipe.vae_scale_factor * 2


FAMILY = FluxInpaintFamily()
