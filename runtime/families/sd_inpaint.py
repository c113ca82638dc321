"""The ``sd-inpaint`` family: StableDiffusionInpaintPipeline split into encode / assemble /
step / decode.

Each piece does what ``StableDiffusionInpaintPipeline.__call__`` does for a 9-channel UNet,
calling the pipeline's own helpers, so that with an exact cache the mask-aware edit
reproduces the stock pipeline. Below strength 1 the schedule loses its first steps and the
latents start from the image's VAE encode noised to the first kept timestep. ``encode`` (text encoder, masked-image VAE
encode) and ``decode`` (VAE decode) need no UNet, so they also run on a pipeline loaded
without one (a pre/post worker's). The UNet forward is batched across requests
(request-major rows ``[uncond, cond]`` per request, per-row timesteps); guidance and the
scheduler step stay per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import StableDiffusionInpaintPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint import (
    retrieve_timesteps,
)
from PIL import Image

from retouch.runtime.families.base import Encoding, Family, FamilyModel, guided, truncate
from retouch.runtime.maskaware import ddimstep, flowstep, unet_blocks
from retouch.runtime.maskaware.context import ForwardContext
from retouch.runtime.maskaware.flops import Flops, conv_flops, linear_flops
from retouch.runtime.maskaware.loader import FamilyRows
from retouch.runtime.maskaware.noise import SeedNoise, vae_sample
from retouch.runtime.maskaware.request import (
    EditRequest,
    RequestState,
    batch_timesteps,
    token_sets,
)
from retouch.runtime.maskaware.tokens import level_sizes


@dataclass
class SDInputs:
    """Per-request UNet inputs besides the latents."""

    prompt_embeds: torch.Tensor  # [2, L, D]: negative prompt ("" if none), then the prompt
    mask: torch.Tensor  # [1, 1, h, w] latent mask, the UNet's mask channel
    masked_image_latents: torch.Tensor  # [1, 4, h, w]
    extra_step_kwargs: dict[str, Any]


class SDInpaint(FamilyModel):
    """Glue between the editor and a StableDiffusionInpaintPipeline."""

    denoiser = "unet"
    rows_per_request = 2  # classifier-free guidance halves
    packs = True
    mixes_packed = True  # the sparse transformer's layers see [1, T, C] under ctx.grid
    template_tensors = ()  # the masked-image latents depend on the mask
    levels = 0  # UNet levels (resolutions); known once the UNet is installed
    _extra: ExtraRows | None = None  # the running batch's extra input channels, stacked once

    def install(self, unet: torch.nn.Module) -> list[str]:
        if unet.config.in_channels != 9:
            raise ValueError("mask-aware inference needs a 9-channel inpainting UNet")
        self.levels = len(unet.config.block_out_channels)
        return unet_blocks.install(unet)

    @staticmethod
    def text_length(pipe: StableDiffusionInpaintPipeline) -> int:
        return pipe.tokenizer.model_max_length

    def _masked_image_latents(
        self, request: EditRequest, mask_condition: torch.Tensor, vae_noise: torch.Tensor
    ) -> torch.Tensor:
        return self._vae_latents(request.image, mask_condition < 0.5, vae_noise)

    def _image_latents(self, request: EditRequest, vae_noise: torch.Tensor) -> torch.Tensor:
        """The whole image's VAE encode (``_encode_vae_image``): where strength < 1 starts."""
        return self._vae_latents(request.image, None, vae_noise)

    def _vae_latents(
        self, image: Image.Image, keep: torch.Tensor | None, vae_noise: torch.Tensor
    ) -> torch.Tensor:
        """``scaling_factor`` times the VAE sample of ``image`` (only where ``keep``)."""
        vae = self.pipe.vae
        init = self.pipe.image_processor.preprocess(image, height=image.height, width=image.width)
        pixels = init.to(torch.float32) if keep is None else init.to(torch.float32) * keep
        return vae.config.scaling_factor * vae_sample(
            vae, pixels.to(self.device, vae.dtype), vae_noise
        )

    def encode_prompt(self, prompt: str, negative_prompt: str) -> dict[str, torch.Tensor]:
        positive, negative = self.pipe.encode_prompt(
            prompt, self.device, 1, True, negative_prompt=negative_prompt or None
        )
        return {"prompt_embeds": torch.cat([negative, positive]).cpu()}  # [2, L, D]

    def encode_image(self, job: Encoding) -> dict[str, torch.Tensor]:
        """The masked image's VAE encode; below strength 1 also the whole image's (both
        with the composed VAE noise: the unmasked region's is the bake's)."""
        latents = self._masked_image_latents(job.request, job.condition, job.noise.vae)
        out = {"masked_image_latents": latents.cpu()}  # [1, 4, h, w]
        if job.request.strength < 1.0:
            out["image_latents"] = self._image_latents(job.request, job.noise.vae).cpu()
        return out

    def assemble(
        self, request: EditRequest, tensors: dict[str, torch.Tensor], *, every: bool
    ) -> RequestState:
        """The light part: scheduler, timesteps, token sets per level, inputs on the device.

        ``every``: compute every token (no cache to read).
        """
        hard = tensors["mask"][0, 0] > 0.5
        scheduler = self.new_scheduler()
        timesteps, _ = retrieve_timesteps(scheduler, request.steps, self.device)
        timesteps = truncate(self.spec, scheduler, timesteps, request)
        latents = self.initial_latents(request, tensors, scheduler, timesteps)
        inputs = self.model_inputs(request, tensors)
        tokens = token_sets(
            hard, level_sizes(*hard.shape, self.levels), every=every, halo=request.halo
        )
        return RequestState(request, latents, scheduler, timesteps, inputs, tokens)

    def initial_latents(
        self,
        request: EditRequest,
        tensors: dict[str, torch.Tensor],
        scheduler: Any,
        timesteps: torch.Tensor,
    ) -> torch.Tensor:
        """``prepare_latents``: the noise scaled to the scheduler's first sigma, or below
        strength 1 the image latents noised to the first kept timestep."""
        noise = tensors["noise"].to(self.device, self.dtype)
        if request.strength == 1.0:
            return noise * scheduler.init_noise_sigma
        image = tensors["image_latents"].to(self.device, self.dtype)
        return scheduler.add_noise(image, noise, timesteps[:1])

    def model_inputs(self, request: EditRequest, tensors: dict[str, torch.Tensor]) -> SDInputs:
        """The request's UNet inputs besides the latents, on the device."""
        return SDInputs(
            prompt_embeds=tensors["prompt_embeds"].to(self.device),
            mask=tensors["mask"].to(self.device, self.dtype),
            masked_image_latents=tensors["masked_image_latents"].to(self.device, self.dtype),
            extra_step_kwargs=self.pipe.prepare_extra_step_kwargs(None, 0.0),  # eta 0
        )

    def forward(self, states: list[RequestState], ctx: ForwardContext) -> list[torch.Tensor]:
        """One batched UNet call; returns each request's ``[2, 4, h, w]`` noise prediction."""
        if ddimstep.batchable(states):  # DDIM scales no model input: the batch at once
            self._extra = ExtraRows.of(states, self._extra)
            latents = torch.cat([x for s in states for x in (s.latents, s.latents)])
            sample = torch.cat([latents, self._extra.rows], dim=1)
            timestep = batch_timesteps(states, self.device, repeat=2)
        else:
            rows, times = [], []
            for state in states:
                t = state.timestep
                latent_in = state.scheduler.scale_model_input(torch.cat([state.latents] * 2), t)
                extra = [state.inputs.mask, state.inputs.masked_image_latents]
                rows.append(torch.cat([latent_in, *(torch.cat([x] * 2) for x in extra)], dim=1))
                times.append(t.reshape(1).expand(2))
            sample, timestep = torch.cat(rows), torch.cat(times).to(self.device)
        out = ctx.call(self.denoise, sample=sample, timestep=timestep, **self.conditions(states))
        return list(out.split(2))

    def conditions(self, states: list[RequestState]) -> dict[str, torch.Tensor]:
        """The batch's conditioning rows besides sample and timestep (arguments of
        :meth:`denoise`, so that a step-graph runner captures them)."""
        return {"text": torch.cat([s.inputs.prompt_embeds for s in states])}

    def denoise(
        self, sample: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor
    ) -> torch.Tensor:
        """One UNet call on the batch's rows."""
        return self.pipe.unet(sample, timestep, encoder_hidden_states=text, return_dict=False)[0]

    def advance(self, state: RequestState, prediction: torch.Tensor) -> None:
        """Guidance and the request's own scheduler step."""
        step = state.scheduler.step(
            guided(state, prediction),
            state.timestep,
            state.latents,
            **state.inputs.extra_step_kwargs,
            return_dict=False,
        )
        state.latents = step[0]

    def advance_all(self, states: list[RequestState], predictions: list[torch.Tensor]) -> None:
        """The batch's guidance and DDIM step in one set of ops (``maskaware.ddimstep``)
        where every request steps with a deterministic DDIM scheduler; else one by one."""
        if not ddimstep.batchable(states):
            return super().advance_all(states, predictions)
        latents = ddimstep.step(states, flowstep.guide(states, torch.stack(predictions)))
        for state, row in zip(states, latents.split(1), strict=True):
            state.latents = row
        return None

    def stock_options(self) -> dict[str, Any]:
        return {}

    def stock_inputs(
        self, request: EditRequest, template_noise: SeedNoise, request_noise: SeedNoise
    ) -> tuple[torch.Tensor, Image.Image | torch.Tensor, torch.Tensor]:
        """The composed noise, the image (below strength 1 its latents, which the pipeline
        takes as they are: the served path's VAE sample) and its masked-image latents."""
        condition, mask = self.masks(request)
        noise = template_noise.compose(request_noise, mask[0, 0] > 0.5)
        image = request.image
        if request.strength < 1.0:
            image = self._image_latents(request, noise.vae)
        return noise.latents, image, self._masked_image_latents(request, condition, noise.vae)


@dataclass
class ExtraRows:
    """The batch's mask and masked-image latents, each request's twice (CFG halves), as
    the UNet's extra input channels: concatenated once while the batch stays the same."""

    sources: tuple[torch.Tensor, ...]  # every request's (mask, masked image latents)
    rows: torch.Tensor  # [2B, C_mask + C_image, h, w]

    @classmethod
    def of(cls, states: list[RequestState], memo: ExtraRows | None) -> ExtraRows:
        sources = tuple(t for s in states for t in (s.inputs.mask, s.inputs.masked_image_latents))
        if (
            memo is not None
            and len(memo.sources) == len(sources)
            and all(a is b for a, b in zip(memo.sources, sources, strict=True))
        ):
            return memo
        pairs = [
            torch.cat([m, x], dim=1) for m, x in zip(sources[0::2], sources[1::2], strict=True)
        ]
        return cls(sources, torch.cat([p for p in pairs for _ in range(2)]))


# -- UNet ---------------------------------------------------------------------------------


def unet_flops(
    config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
) -> Flops:
    """One row of a ``UNet2DConditionModel`` at mask ratio ``ratio``.

    Transformer blocks are counted where the UNet has them: in its ``CrossAttn*`` down and
    up blocks (SDXL's first level and SD2's deepest have none) and a cross-attention mid
    block, each with its ``transformer_layers_per_block`` layers.
    """
    channels = list(config["block_out_channels"])
    levels = len(channels)
    sizes = [latent_size]
    for _ in range(levels - 1):
        h, w = sizes[-1]
        sizes.append(((h + 1) // 2, (w + 1) // 2))
    pixels = [h * w for h, w in sizes]
    per_block = _per_level(config.get("transformer_layers_per_block", 1), levels)
    down_attends = _attends(config, "down_block_types", levels)
    up_attends = _attends(config, "up_block_types", levels)[::-1]  # per level, as down
    temb = channels[0] * 4
    layers = config["layers_per_block"]
    text_dim = config["cross_attention_dim"]

    def resnet(level: int, cin: int, cout: int) -> Flops:
        n = pixels[level]
        dense = conv_flops(n, cin, cout) + conv_flops(n, cout, cout) + linear_flops(1, temb, cout)
        if cin != cout:
            dense += conv_flops(n, cin, cout, kernel=1)
        return Flops(dense)

    def transformer(level: int, width: int, attends: bool = True) -> Flops:
        if not attends:
            return Flops()
        return _unet_transformer(pixels[level], width, per_block[level], text_len, text_dim, ratio)

    total = Flops(conv_flops(pixels[0], config["in_channels"], channels[0]))
    total += Flops(linear_flops(1, channels[0], temb) + linear_flops(1, temb, temb))  # timestep MLP
    for i, out in enumerate(channels):  # down path
        for j in range(layers):
            total += resnet(i, channels[max(i - 1, 0)] if j == 0 else out, out)
            total += transformer(i, out, down_attends[i])
        if i < levels - 1:
            total += Flops(conv_flops(pixels[i + 1], out, out))  # stride-2 downsampler
    deepest = channels[-1]
    total += _mid_block(
        config, resnet(levels - 1, deepest, deepest), transformer(levels - 1, deepest)
    )
    reversed_channels = channels[::-1]
    output = reversed_channels[0]
    for i in range(levels):  # up path
        level = levels - 1 - i
        previous, output = output, reversed_channels[i]
        skip_in = reversed_channels[min(i + 1, levels - 1)]
        for j in range(layers + 1):
            skip = skip_in if j == layers else output
            total += resnet(level, (previous if j == 0 else output) + skip, output)
            total += transformer(level, output, up_attends[level])
        if level > 0:
            total += Flops(conv_flops(pixels[level - 1], output, output))  # upsampler conv
    return total + Flops(conv_flops(pixels[0], channels[0], config["out_channels"]))


def _attends(config: Mapping[str, Any], key: str, levels: int) -> list[bool]:
    """Per block of ``config[key]``: whether it has transformer blocks (``CrossAttn*``)."""
    types = config.get(key) or ("CrossAttn",) * levels
    return ["CrossAttn" in t for t in types]


def _mid_block(config: Mapping[str, Any], resnet: Flops, transformer: Flops) -> Flops:
    """The mid block: resnet, transformer, resnet (``UNetMidBlock2DCrossAttn``) or none."""
    kind = config.get("mid_block_type", "UNetMidBlock2DCrossAttn")
    if kind is None:
        return Flops()
    if kind != "UNetMidBlock2DCrossAttn":
        raise ValueError(f"no FLOP formula for a UNet mid block {kind!r}")
    return resnet + transformer + resnet


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


class SDInpaintFamily(Family):
    """``sd-inpaint``: a 9-channel inpainting UNet (Stable Diffusion 1.x/2.x inpainting)."""

    name = "sd-inpaint"
    model = SDInpaint
    pipeline = StableDiffusionInpaintPipeline
    load_kwargs: Mapping[str, Any] = {"safety_checker": None, "requires_safety_checker": False}
    text_components = ("text_encoder", "tokenizer")
    flops = unet_flops

    def rows(self, model: SDInpaint) -> FamilyRows:
        """A sparse block reads its attn1 K/V and its Y; a full block reads nothing (the
        convolutions between blocks see whole maps, so no Y carries over)."""
        unet, blocks = model.pipe.unet, list(model.blocks)
        sparse = {b: unet_blocks.sparse_rows(unet.get_submodule(b)) for b in blocks}
        order = tuple(unet_blocks.execution_order(blocks))
        return FamilyRows(order, sparse, dict.fromkeys(blocks, ()))

    def token_cell(self, pipe: StableDiffusionInpaintPipeline) -> int:
        return pipe.vae_scale_factor * 2 ** (len(pipe.unet.config.block_out_channels) - 1)


FAMILY = SDInpaintFamily()
