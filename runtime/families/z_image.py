"""The ``z-image`` family: ZImageInpaintPipeline (Z-Image's single-stream DiT, a Qwen3
text encoder) split into encode / assemble / step / decode.

Each piece does what ``ZImageInpaintPipeline.__call__`` does: the prompt in Qwen's chat
template, encoded to the penultimate hidden states with the padding stripped (a caption
of its own length per prompt); a flow-matching schedule from ``torch.linspace`` sigmas;
the transformer given the reversed time ``(1000 - t) / 1000``; classifier-free guidance
``pos + g · (pos − neg)`` in float32, on whenever ``g > 0``; the negative of that as the
velocity; float32 latents; after every step the unmasked latents blended back to the
template re-noised to the next timestep, so that only the masked tokens need computing
(``maskaware/zimage_blocks.py``, the model's forward from its submodules).

Every request runs two model rows, its prompt's then its negative prompt's ("" without
one), also at ``g = 0`` (Z-Image-Turbo's setting), where the pipeline runs one and the
prediction is the prompt row's alone: the guided result is the same, the negative row
is computed for nothing. ``cfg_normalization`` and ``cfg_truncation`` (the pipeline's
defaults off) are not served: an edit has no field for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers import ZImageInpaintPipeline
from diffusers.pipelines.z_image.pipeline_z_image_inpaint import (
    calculate_shift,
    get_default_z_image_sigmas,
    retrieve_timesteps,
)
from PIL import Image

from retouch.runtime.families.base import Family, FamilyModel, truncate
from retouch.runtime.maskaware import flowstep, inpaint, zimage_blocks
from retouch.runtime.maskaware.context import ForwardContext, Mode, current
from retouch.runtime.maskaware.flops import Flops, linear_flops
from retouch.runtime.maskaware.noise import SeedNoise
from retouch.runtime.maskaware.request import (
    EditRequest,
    ImageSize,
    RequestState,
    batch_timesteps,
    every_token,
)
from retouch.runtime.maskaware.tokens import TokenSet, pool_mask
from retouch.runtime.maskaware.zimage_blocks import SEQ_MULTI_OF, ZImageBatch, padded_length

MAX_SEQUENCE = 512  # the pipeline's max_sequence_length


@dataclass
class ZImageInputs:
    """Per-request transformer inputs besides the latents, and the blend's."""

    captions: tuple[torch.Tensor, torch.Tensor]  # [L, D] of the prompt, of the negative
    shifts: tuple[int, int]  # padded caption length less the bake's, per row
    mask: torch.Tensor  # [1, 1, h, w] latent mask (the blend weight)
    image_latents: torch.Tensor  # [1, 16, h, w] template latents
    noise: torch.Tensor  # [1, 16, h, w] initial noise (re-noises the template)


class ZImage(FamilyModel):
    """Glue between the editor and a ZImageInpaintPipeline."""

    rows_per_request = 2  # the prompt's row, then the negative prompt's
    packs = False  # adaLN modulates per model row: the blocks run the padded layout
    template_tensors = ("image_latents",)  # the blend needs them every step
    _blend: flowstep.BlendInputs | None = None  # the running batch's, stacked once

    def install(self, transformer: torch.nn.Module) -> list[str]:
        zimage_blocks.check(transformer)
        self.channels = transformer.config.in_channels
        return zimage_blocks.block_names(transformer)

    @staticmethod
    def latent_grid(pipe: ZImageInpaintPipeline, height: int, width: int) -> tuple[int, int]:
        factor = pipe.vae_scale_factor * 2  # 2x2 patches on top of the VAE factor
        return 2 * (height // factor), 2 * (width // factor)

    @staticmethod
    def text_length(pipe: ZImageInpaintPipeline) -> int:
        """The most caption tokens a row attends to: Z-Image strips a prompt's padding, so
        a prompt has fewer (its own length, padded to 32)."""
        return padded_length(_max_sequence(pipe))

    def max_sequence_length(self) -> int:
        return _max_sequence(self.pipe)

    def grid_tokens(self, lh: int, lw: int) -> int:
        """The image tokens padded to a multiple of 32, as the model pads them."""
        return padded_length((lh // 2) * (lw // 2))

    def row_channels(self, block: str, name: str) -> int:
        transformer = self.pipe.transformer
        if name == "y":
            return transformer.config.dim
        return transformer.get_submodule(block).attention.to_k.out_features

    def _scheduler(self, request: EditRequest) -> tuple[object, torch.Tensor]:
        scheduler = self.new_scheduler()
        h, w = self.latent_size(request.height, request.width)
        config = scheduler.config
        mu = calculate_shift(
            (h // 2) * (w // 2),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = get_default_z_image_sigmas(request.steps)
        timesteps, _ = retrieve_timesteps(
            scheduler, request.steps, self.device, sigmas=sigmas, mu=mu
        )
        return scheduler, truncate(self.spec, scheduler, timesteps, request)

    # -- encode -------------------------------------------------------------------------------

    def encode(
        self,
        request: EditRequest,
        template_noise: SeedNoise,
        request_noise: SeedNoise,
        template_latents: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The base encode, and the caption lengths of the bake the edit reads (its
        template prompt's and the empty negative's, from the tokenizer alone)."""
        tensors = super().encode(request, template_noise, request_noise, template_latents)
        baked = [self.caption_length(request.template_prompt), self.caption_length("")]
        tensors["bake_lengths"] = torch.tensor(baked)
        return tensors

    def caption_length(self, prompt: str) -> int:
        """The tokens of ``prompt``'s caption (the pipeline's chat template, truncated)."""
        tokenizer = self.pipe.tokenizer
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=True,
        )
        ids = tokenizer(text, max_length=self.max_sequence_length(), truncation=True).input_ids
        return len(ids)

    def encode_prompt(self, prompt: str, negative_prompt: str) -> dict[str, torch.Tensor]:
        """The prompt's caption and the negative prompt's ("" if none), each its own length."""
        positive, negative = self.pipe.encode_prompt(
            prompt=prompt,
            device=self.device,
            do_classifier_free_guidance=True,
            negative_prompt=negative_prompt or None,
            max_sequence_length=self.max_sequence_length(),
        )
        return {"caption": positive[0].cpu(), "negative_caption": negative[0].cpu()}

    # -- steps --------------------------------------------------------------------------------

    def assemble(
        self, request: EditRequest, tensors: dict[str, torch.Tensor], *, every: bool
    ) -> RequestState:
        """Scheduler, captions and their shifts from the bake's, token set, inputs on the
        device (``every``: compute every token, there is no cache to read)."""
        hard = tensors["mask"][0, 0] > 0.5
        noise = tensors["noise"].to(self.device, self.dtype)
        scheduler, timesteps = self._scheduler(request)
        captions = (tensors["caption"], tensors["negative_caption"])
        baked = [int(n) for n in tensors["bake_lengths"]]
        shifts = tuple(
            padded_length(c.shape[0]) - padded_length(b)
            for c, b in zip(captions, baked, strict=True)
        )
        inputs = ZImageInputs(
            captions=tuple(c.to(self.device, self.dtype) for c in captions),
            shifts=shifts,
            mask=tensors["mask"].to(self.device, self.dtype),
            image_latents=tensors["image_latents"].to(self.device, self.dtype),
            noise=noise,
        )
        latents = inpaint.initial_latents(
            request, scheduler, timesteps, noise, inputs.image_latents
        )
        tokens = self.tokens(hard, every=every)
        return RequestState(request, latents, scheduler, timesteps, inputs, tokens)

    def tokens(self, hard: torch.Tensor, *, every: bool) -> dict[tuple[int, int], TokenSet]:
        """The token set of a boolean ``[h, w]`` latent mask on the model's padded image
        sequence: 2×2 patches row-major, then the pads to a multiple of 32 (never masked:
        their rows come from the bake). Its grid is that sequence, 32 tokens a row."""
        h, w = hard.shape
        real = (h // 2) * (w // 2)
        total = padded_length(real)
        size = (total // SEQ_MULTI_OF, SEQ_MULTI_OF)
        if every:
            return every_token([size])
        grid = pool_mask(hard.cpu(), (h // 2, w // 2)).reshape(-1)
        positions = torch.arange(total)
        unmasked = torch.cat([positions[:real][~grid], positions[real:]])
        return {size: TokenSet(positions[:real][grid], unmasked, total)}

    def forward(self, states: list[RequestState], ctx: ForwardContext) -> list[torch.Tensor]:
        """One batched transformer call; each request's ``[2, 16, h, w]`` prediction (its
        prompt's row, then its negative's)."""
        grid = next(iter(ctx.grids.values()), None)  # one token grid; none in a bake
        sparse = (
            grid is not None
            and any(s.step_reader is not None for s in states)
            and any(ctx.mode(b) is Mode.SPARSE for b in self.blocks)
        )
        ctx.grid = grid if sparse else None  # no sparse block: the stock step
        transformer, blocks = self.pipe.transformer, self.blocks
        out = ctx.call(  # the running step's context: a graph runner replays this
            lambda **t: zimage_blocks.forward(transformer, current(), blocks, ZImageBatch(**t)),
            **vars(self._batched(states)),
        )
        return list(out.split(2))

    def _batched(self, states: list[RequestState]) -> ZImageBatch:
        """The rows of every request: its latents twice, its two captions."""
        captions = [c for s in states for c in s.inputs.captions]
        longest = max(c.shape[0] for c in captions)
        padded = captions[0].new_zeros(len(captions), longest, captions[0].shape[-1])
        for row, caption in enumerate(captions):
            padded[row, : caption.shape[0]] = caption
        latents = torch.cat([s.latents for s in states for _ in range(2)])
        timestep = batch_timesteps(states, self.device, repeat=2)
        return ZImageBatch(
            latents=latents.to(self.dtype),
            timestep=(1000 - timestep) / 1000,
            captions=padded,
            lengths=tuple(c.shape[0] for c in captions),
            shifts=tuple(shift for s in states for shift in s.inputs.shifts),
        )

    def advance(self, state: RequestState, prediction: torch.Tensor) -> None:
        """Guidance, the velocity's sign, the request's scheduler step, the inpaint blend."""
        velocity = guided_velocity([state], prediction[None])
        latents = state.scheduler.step(velocity, state.timestep, state.latents, return_dict=False)
        state.latents = inpaint.blend(state, latents[0])

    def advance_all(self, states: list[RequestState], predictions: list[torch.Tensor]) -> None:
        """The batch's guidance, scheduler step and blend in one set of ops
        (``maskaware.flowstep``) where every request steps with the flow-matching Euler
        scheduler."""
        if not flowstep.batchable(states):
            return super().advance_all(states, predictions)
        velocity = guided_velocity(states, torch.stack(predictions))
        self._blend = flowstep.advance(states, velocity, self._blend)
        return None

    def decode(
        self, latents: torch.Tensor, size: ImageSize, output_type: str = "pil"
    ) -> Image.Image | np.ndarray:
        """VAE decode of ``latents / scaling + shift``, the pipeline's postprocess."""
        return inpaint.shifted_decode(self.pipe, latents, self.device, output_type)

    # -- the stock reference --------------------------------------------------------------------

    def stock_options(self) -> dict[str, Any]:
        """Guidance as served: no renormalisation, no truncation (the pipeline's defaults)."""
        return {**super().stock_options(), "cfg_normalization": False, "cfg_truncation": 1.0}

    def stock_batch(
        self, requests: list[EditRequest], noises: list[tuple[SeedNoise, SeedNoise]]
    ) -> dict[str, Any]:
        """The template images, each request's start and a generator on its template's
        seed. Given ``latents``, the pipeline draws its blend noise, then the VAE sample of
        the template, from the generator: the template's noise and latents, exactly what
        the blend reads outside the mask (at any strength and seed)."""
        starts = []
        for request, (template, own) in zip(requests, noises, strict=True):
            composed = template.compose(own, self.masks(request)[1][0, 0] > 0.5).latents
            composed = composed.to(self.device, self.dtype)
            if request.strength < 1.0:
                scheduler, timesteps = self._scheduler(request)
                latents = self.image_latents(request.image, template.vae)
                composed = scheduler.scale_noise(latents, timesteps[:1], composed)
            starts.append(composed)
        return {
            "image": [r.image for r in requests],
            "latents": torch.cat(starts),
            "generator": [torch.Generator().manual_seed(r.template_seed) for r in requests],
        }


def _max_sequence(pipe: ZImageInpaintPipeline) -> int:
    return min(MAX_SEQUENCE, pipe.tokenizer.model_max_length)


def guided_velocity(states: Sequence[RequestState], pairs: torch.Tensor) -> torch.Tensor:
    """The velocity of ``[B, 2, ...]`` ``[prompt ; negative]`` predictions, in float32:
    Z-Image's guidance ``pos + g · (pos − neg)`` (off at ``g = 0``), negated (the model
    predicts the negative velocity)."""
    positive, negative = pairs[:, 0].float(), pairs[:, 1].float()
    scale = flowstep.per_request([np.float32(s.request.guidance) for s in states], positive)
    return -(positive + scale * (positive - negative))


# -- FLOPs --------------------------------------------------------------------------------


def z_image_flops(
    config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
) -> Flops:
    """One row of a ``ZImageTransformer2DModel`` at mask ratio ``ratio`` with a caption of
    ``text_len`` tokens (padded to 32).

    The image sequence is padded to 32 tokens (every one a key). At ``ratio`` 1 every
    token of it is computed, pads too (the stock step); below it the masked share of the
    image's own tokens, in the noise refiner and the main layers, and the final layer
    only on those. The caption stream (embedding, context refiner) is computed in full.
    """
    dim, cin = config["dim"], config["in_channels"]
    adaln = min(dim, 256)
    hidden = int(dim / 3 * 8)
    real = (latent_size[0] // 2) * (latent_size[1] // 2)
    keys = padded_length(real)
    image = keys if ratio >= 1.0 else ratio * real
    text = padded_length(text_len)

    def block(queries: float, keys: float, modulated: bool) -> Flops:
        dense = 4 * linear_flops(queries, dim, dim) + 3 * linear_flops(queries, dim, hidden)
        if modulated:
            dense += linear_flops(1, adaln, 4 * dim)
        return Flops(dense, 2 * 2.0 * queries * keys * dim)

    total = Flops(linear_flops(1, 256, 1024) + linear_flops(1, 1024, adaln))  # timestep
    total += Flops(
        linear_flops(image, 4 * cin, dim) + linear_flops(text, config["cap_feat_dim"], dim)
    )
    for _ in range(config["n_refiner_layers"]):
        total += block(image, keys, True) + block(text, text, False)
    for _ in range(config["n_layers"]):
        total += block(image + text, keys + text, True)
    final = image + text if ratio >= 1.0 else image
    return total + Flops(linear_flops(1, adaln, dim) + linear_flops(final, dim, 4 * cin))


class ZImageFamily(Family):
    """``z-image``: Z-Image's single-stream DiT (noise and context refiners, 2x2 patches,
    a Qwen3 text encoder)."""

    name = "z-image"
    model = ZImage
    pipeline = ZImageInpaintPipeline
    text_components = ("text_encoder", "tokenizer")
    flops = z_image_flops

    def token_cell(self, pipe: ZImageInpaintPipeline) -> int:
        return pipe.vae_scale_factor * 2


FAMILY = ZImageFamily()
