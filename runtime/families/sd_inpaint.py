"""The ``sd-inpaint`` family: StableDiffusionInpaintPipeline split into encode / assemble /
step / decode.

Each piece does what ``StableDiffusionInpaintPipeline.__call__`` does for strength 1.0 and a
9-channel UNet, calling the pipeline's own helpers, so that with an exact cache the
mask-aware edit reproduces the stock pipeline. ``encode`` (text encoder, masked-image VAE
encode) and ``decode`` (VAE decode) need no UNet, so they also run on a pipeline loaded
without one (a pre/post worker's). The UNet forward is batched across requests
(request-major rows ``[uncond, cond]`` per request, per-row timesteps); guidance and the
scheduler step stay per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import StableDiffusionInpaintPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint import (
    retrieve_timesteps,
)
from PIL import Image

from retouch.functions.families import family_spec
from retouch.runtime.maskaware import inpaint, unet_blocks
from retouch.runtime.maskaware.context import ForwardContext
from retouch.runtime.maskaware.flops import Flops, conv_flops, linear_flops
from retouch.runtime.maskaware.loader import FamilyRows
from retouch.runtime.maskaware.noise import SeedNoise, vae_sample
from retouch.runtime.maskaware.request import (
    EditRequest,
    ImageSize,
    RequestState,
    check_batchable,
    token_sets,
)
from retouch.runtime.maskaware.tokens import level_sizes


@dataclass
class SDInputs:
    """Per-request UNet inputs besides the latents."""

    prompt_embeds: torch.Tensor  # [2, L, D]: negative (empty) prompt, then the prompt
    mask: torch.Tensor  # [1, 1, h, w] latent mask, the UNet's mask channel
    masked_image_latents: torch.Tensor  # [1, 4, h, w]
    extra_step_kwargs: dict[str, Any]


class SDInpaint:
    """Glue between the editor and a StableDiffusionInpaintPipeline."""

    rows_per_request = 2  # classifier-free guidance halves
    packs = True
    template_tensors: tuple[str, ...] = ()  # the masked-image latents depend on the mask

    def __init__(self, pipe: StableDiffusionInpaintPipeline, device: torch.device) -> None:
        self.pipe, self.device = pipe, device
        self.has_denoiser = pipe.unet is not None
        self.blocks: list[str] = []
        self.levels = 0
        if self.has_denoiser:
            if pipe.unet.config.in_channels != 9:
                raise ValueError("mask-aware inference needs a 9-channel inpainting UNet")
            self.blocks = unet_blocks.install(pipe.unet)
            self.levels = len(pipe.unet.config.block_out_channels)
        self.dtype = (pipe.unet if self.has_denoiser else pipe.vae).dtype

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        factor = self.pipe.vae_scale_factor
        return height // factor, width // factor

    def noise_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (1, self.pipe.vae.config.latent_channels, *self.latent_size(height, width))

    def _mask_condition(self, request: EditRequest) -> torch.Tensor:
        image = request.image
        return self.pipe.mask_processor.preprocess(
            request.mask_image(), height=image.height, width=image.width
        )

    def latent_mask(self, mask_condition: torch.Tensor) -> torch.Tensor:
        """The UNet's mask channel: ``prepare_mask_latents``' nearest resize to latent size."""
        size = self.latent_size(mask_condition.shape[-2], mask_condition.shape[-1])
        return F.interpolate(mask_condition, size=size)

    def _masked_image_latents(
        self, request: EditRequest, mask_condition: torch.Tensor, vae_noise: torch.Tensor
    ) -> torch.Tensor:
        image = request.image
        init = self.pipe.image_processor.preprocess(image, height=image.height, width=image.width)
        masked = (init.to(torch.float32) * (mask_condition < 0.5)).to(self.device, self.dtype)
        return self.pipe.vae.config.scaling_factor * vae_sample(self.pipe.vae, masked, vae_noise)

    def encode(
        self,
        request: EditRequest,
        template_noise: SeedNoise,
        request_noise: SeedNoise,
        template_latents: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The heavy, cache-independent part: latent mask, composed noise, masked-image VAE
        encode and text encoding, as host tensors (``template_latents`` is Flux's; unused)."""
        condition = self._mask_condition(request)
        mask = self.latent_mask(condition)
        noise = template_noise.compose(request_noise, mask[0, 0] > 0.5)
        masked_latents = self._masked_image_latents(request, condition, noise.vae)
        positive, negative = self.pipe.encode_prompt(request.prompt, self.device, 1, True)
        return {
            "prompt_embeds": torch.cat([negative, positive]).cpu(),  # [2, L, D]
            "mask": mask,  # [1, 1, h, w] float32
            "noise": noise.latents,  # [1, 4, h, w] float32
            "masked_image_latents": masked_latents.cpu(),  # [1, 4, h, w]
        }

    def assemble(
        self, request: EditRequest, tensors: dict[str, torch.Tensor], *, every: bool
    ) -> RequestState:
        """The light part: scheduler, timesteps, token sets per level, inputs on the device.

        ``every``: compute every token (no cache to read).
        """
        mask = tensors["mask"].to(self.device, self.dtype)
        hard = tensors["mask"][0, 0] > 0.5
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        timesteps, _ = retrieve_timesteps(scheduler, request.steps, self.device)
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        latents = tensors["noise"].to(self.device, self.dtype) * scheduler.init_noise_sigma
        inputs = SDInputs(
            prompt_embeds=tensors["prompt_embeds"].to(self.device),
            mask=mask,
            masked_image_latents=tensors["masked_image_latents"].to(self.device, self.dtype),
            extra_step_kwargs=self.pipe.prepare_extra_step_kwargs(None, 0.0),  # eta 0
        )
        tokens = token_sets(hard, level_sizes(*hard.shape, self.levels), every=every)
        return RequestState(request, latents, scheduler, timesteps, inputs, tokens)

    def forward(self, states: list[RequestState], ctx: ForwardContext) -> list[torch.Tensor]:
        """One batched UNet call; returns each request's ``[2, 4, h, w]`` noise prediction."""
        rows, times, texts = [], [], []
        for state in states:
            t = state.timestep
            latent_in = state.scheduler.scale_model_input(torch.cat([state.latents] * 2), t)
            extra = [state.inputs.mask, state.inputs.masked_image_latents]
            rows.append(torch.cat([latent_in, *(torch.cat([x] * 2) for x in extra)], dim=1))
            times.append(t.reshape(1).expand(2))
            texts.append(state.inputs.prompt_embeds)
        out = self.pipe.unet(
            torch.cat(rows),
            torch.cat(times).to(self.device),
            encoder_hidden_states=torch.cat(texts),
            return_dict=False,
        )[0]
        return list(out.split(2))

    def advance(self, state: RequestState, prediction: torch.Tensor) -> None:
        """Guidance and the request's own scheduler step."""
        uncond, text = prediction.chunk(2)
        guided = uncond + state.request.guidance * (text - uncond)
        step = state.scheduler.step(
            guided,
            state.timestep,
            state.latents,
            **state.inputs.extra_step_kwargs,
            return_dict=False,
        )
        state.latents = step[0]

    def decode(
        self, latents: torch.Tensor, size: ImageSize, output_type: str = "pil"
    ) -> Image.Image | np.ndarray:
        """VAE decode of ``[1, 4, h, w]`` final latents and the pipeline's postprocess."""
        return inpaint.scaled_decode(self.pipe, latents, self.device, output_type)

    def stock(
        self,
        requests: list[EditRequest],
        noises: list[tuple[SeedNoise, SeedNoise]],
        output_type: str = "pil",
    ) -> list[Image.Image] | np.ndarray:
        """One stock pipeline call for ``requests`` (same size, steps and guidance).

        Each request gets its composed noise and masked-image latents; ``noises`` holds the
        (template, request) noise of each.
        """
        first = check_batchable(requests)
        latents, masked = [], []
        for request, (template_noise, request_noise) in zip(requests, noises, strict=True):
            condition = self._mask_condition(request)
            noise = template_noise.compose(request_noise, self.latent_mask(condition)[0, 0] > 0.5)
            latents.append(noise.latents.to(self.device, self.dtype))
            masked.append(self._masked_image_latents(request, condition, noise.vae))
        return self.pipe(
            prompt=[r.prompt for r in requests],
            image=[r.image for r in requests],
            mask_image=[r.mask_image() for r in requests],
            masked_image_latents=torch.cat(masked),
            height=first.image.height,
            width=first.image.width,
            strength=1.0,
            num_inference_steps=first.steps,
            guidance_scale=first.guidance,
            latents=torch.cat(latents),
            output_type=output_type,
        ).images


# -- UNet ---------------------------------------------------------------------------------


def unet_flops(
    config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
) -> Flops:
    """One row of a ``UNet2DConditionModel`` with cross-attention blocks at mask ratio ``ratio``."""
    channels = list(config["block_out_channels"])
    levels = len(channels)
    sizes = [latent_size]
    for _ in range(levels - 1):
        h, w = sizes[-1]
        sizes.append(((h + 1) // 2, (w + 1) // 2))
    pixels = [h * w for h, w in sizes]
    per_block = _per_level(config.get("transformer_layers_per_block", 1), levels)
    temb = channels[0] * 4
    layers = config["layers_per_block"]
    text_dim = config["cross_attention_dim"]

    def resnet(level: int, cin: int, cout: int) -> Flops:
        n = pixels[level]
        dense = conv_flops(n, cin, cout) + conv_flops(n, cout, cout) + linear_flops(1, temb, cout)
        if cin != cout:
            dense += conv_flops(n, cin, cout, kernel=1)
        return Flops(dense)

    def transformer(level: int, width: int) -> Flops:
        return _unet_transformer(pixels[level], width, per_block[level], text_len, text_dim, ratio)

    total = Flops(conv_flops(pixels[0], config["in_channels"], channels[0]))
    total += Flops(linear_flops(1, channels[0], temb) + linear_flops(1, temb, temb))  # timestep MLP
    for i, out in enumerate(channels):  # down path
        for j in range(layers):
            total += resnet(i, channels[max(i - 1, 0)] if j == 0 else out, out)
            total += transformer(i, out)
        if i < levels - 1:
            total += Flops(conv_flops(pixels[i + 1], out, out))  # stride-2 downsampler
    deepest = channels[-1]
    total += resnet(levels - 1, deepest, deepest) + transformer(levels - 1, deepest)
    total += resnet(levels - 1, deepest, deepest)
    reversed_channels = channels[::-1]
    output = reversed_channels[0]
    for i in range(levels):  # up path
        level = levels - 1 - i
        previous, output = output, reversed_channels[i]
        skip_in = reversed_channels[min(i + 1, levels - 1)]
        for j in range(layers + 1):
            skip = skip_in if j == layers else output
            total += resnet(level, (previous if j == 0 else output) + skip, output)
            total += transformer(level, output)
        if level > 0:
            total += Flops(conv_flops(pixels[level - 1], output, output))  # upsampler conv
    return total + Flops(conv_flops(pixels[0], channels[0], config["out_channels"]))


def _per_level(value: int | list[int] | tuple[int, ...], levels: int) -> list[int]:
    return [value] * levels if isinstance(value, int) else list(value)


def _unet_transformer(
    n_tokens: int, width: int, depth: int, text_len: int, text_dim: int, ratio: float
) -> Flops:
    """A Transformer2DModel: proj_in/out, then ``depth`` BasicTransformerBlocks (GEGLU FFN)."""
    masked = ratio * n_tokens
    dense = 2 * linear_flops(masked, width, width)  # proj_in, proj_out
    attention = 0.0
    for _ in range(depth):
        dense += 4 * linear_flops(masked, width, width)  # attn1 q, k, v, out
        # attn2 (q and out on image tokens, k and v on text), then the GEGLU FFN
        dense += 2 * linear_flops(masked, width, width) + 2 * linear_flops(
            text_len, text_dim, width
        )
        dense += linear_flops(masked, width, 8 * width) + linear_flops(masked, 4 * width, width)
        attention += 2 * 2.0 * masked * n_tokens * width  # self-attention QKᵀ, AV
        attention += 2 * 2.0 * masked * text_len * width  # cross-attention
    return Flops(dense, attention)


class SDInpaintFamily:
    """``sd-inpaint``: a 9-channel inpainting UNet (Stable Diffusion 1.x/2.x inpainting)."""

    name = "sd-inpaint"
    spec = family_spec(name)
    pipeline = StableDiffusionInpaintPipeline
    load_kwargs: Mapping[str, Any] = {"safety_checker": None, "requires_safety_checker": False}
    denoisers = ("unet",)
    text_components = ("text_encoder", "tokenizer")
    rows_per_request = SDInpaint.rows_per_request

    def bind(self, pipe: StableDiffusionInpaintPipeline, device: torch.device) -> SDInpaint:
        return SDInpaint(pipe, device)

    def rows(self, model: SDInpaint) -> FamilyRows:
        """A sparse block reads its attn1 K/V and its Y; a full block reads nothing (the
        convolutions between blocks see whole maps, so no Y carries over)."""
        unet, blocks = model.pipe.unet, list(model.blocks)
        sparse = {b: unet_blocks.sparse_rows(unet.get_submodule(b)) for b in blocks}
        order = tuple(unet_blocks.execution_order(blocks))
        return FamilyRows(order, sparse, dict.fromkeys(blocks, ()))

    def step_flops(
        self, config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
    ) -> Flops:
        return unet_flops(config, latent_size, text_len, ratio)

    def flop_shape(
        self, pipe: StableDiffusionInpaintPipeline, height: int, width: int
    ) -> tuple[Mapping[str, Any], tuple[int, int], int]:
        factor = pipe.vae_scale_factor
        return (
            pipe.unet.config,
            (height // factor, width // factor),
            pipe.tokenizer.model_max_length,
        )

    def token_cell(self, pipe: StableDiffusionInpaintPipeline) -> int:
        return pipe.vae_scale_factor * 2 ** (len(pipe.unet.config.block_out_channels) - 1)


FAMILY = SDInpaintFamily()
