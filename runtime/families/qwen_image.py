"""The ``qwen-image`` family: QwenImageInpaintPipeline (Qwen-Image, an MMDiT) split into
encode / assemble / step / decode, with mask-aware blocks (``maskaware.qwen_blocks``).

Qwen-Image's inpainting prepares its latents, schedule and blend as Flux's does: 2x2-packed
latents (``_pack_latents``), shifted sigmas with ``mu`` from the image's token count, the
strength rule of SD3 and Flux, and after every step the unmasked latents blended back to the
template re-noised to the next timestep. Those pieces come from ``flux_inpaint`` (this
module subclasses it); what differs is Qwen's:

* text: a Qwen2.5-VL's last hidden states of the prompt in a chat template whose system
  prefix is dropped (``encode_prompt``): as many tokens as the prompt has, with a mask
  when prompts of a batch pad to the longest;
* true classifier-free guidance (``true_cfg_scale``, the request's ``guidance``): two rows
  per request, [negative ; prompt], combined as ``neg + g (pos - neg)`` and rescaled per
  token to the conditional prediction's norm; the pipeline guides whenever a negative
  prompt is given (``""`` too) and ``g > 1``, so a served edit always computes both rows
  (one bake serves every guidance) and at ``g <= 1`` takes the prompt's row alone, as the
  pipeline does;
* the VAE (``AutoencoderKLQwenImage``, a frame axis): latents normalised with its
  ``latents_mean`` / ``latents_std``, not a scaling factor.

Mask-aware, the unmasked tokens' inputs are exactly the bake's at every step (the blend),
so only the masked image tokens are computed: their K/V against the bake's unmasked K/V
(with each row's own text). Their output is discarded by the blend (left at zero).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers import QwenImageInpaintPipeline
from PIL import Image

from retouch.runtime.families.base import Family
from retouch.runtime.families.flux_inpaint import FluxInpaint
from retouch.runtime.maskaware import flowstep, inpaint, qwen_blocks
from retouch.runtime.maskaware.context import ForwardContext, Mode, current
from retouch.runtime.maskaware.flops import Flops, linear_flops
from retouch.runtime.maskaware.flux_blocks import SPARSE_CARRY
from retouch.runtime.maskaware.noise import SeedNoise, vae_sample
from retouch.runtime.maskaware.request import (
    EditRequest,
    ImageSize,
    RequestState,
    batch_timesteps,
)

MAX_SEQUENCE_LENGTH = 512  # the pipeline's default: prompt tokens kept after the template's
NOMINAL_PROMPT_TOKENS = 64  # the prompt length FLOP estimates assume (prompts vary)


@dataclass
class QwenInputs:
    """Per-request transformer inputs besides the latents, and the blend's."""

    prompt_embeds: torch.Tensor  # [2, L, D]: negative prompt, then the prompt
    prompt_mask: torch.Tensor  # [2, L] bool: the real tokens of each (the shorter is padded)
    unpadded: bool  # no padding in either row (known on the host: no device sync per step)
    mask: torch.Tensor  # [1, N, 64] packed latent mask (the blend weight)
    image_latents: torch.Tensor  # [1, N, 64] packed template latents
    noise: torch.Tensor  # [1, N, 64] packed initial noise (re-noises the template)


class QwenImageInpaint(FluxInpaint):
    """Glue between the editor and a QwenImageInpaintPipeline."""

    rows_per_request = 2  # true classifier-free guidance: [negative ; prompt]
    packs = False  # adaLN modulates per model row: the blocks run the padded layout
    template_tensors = ("image_latents",)  # the blend needs them every step

    @staticmethod
    def vae_channels(vae: torch.nn.Module) -> int:
        return vae.config.z_dim

    def install(self, transformer: torch.nn.Module) -> list[str]:
        self.channels = transformer.config.in_channels // 4
        if transformer.config.guidance_embeds:
            raise ValueError("a guidance-embedding Qwen-Image transformer is not supported")
        return qwen_blocks.install(transformer)

    @staticmethod
    def text_length(pipe: QwenImageInpaintPipeline) -> int:
        """The template's tokens after its dropped prefix, and a nominal prompt."""
        template = pipe.prompt_template_encode.format("")
        kept = len(pipe.tokenizer(template).input_ids) - pipe.prompt_template_encode_start_idx
        return kept + NOMINAL_PROMPT_TOKENS

    def max_sequence_length(self) -> int:
        return MAX_SEQUENCE_LENGTH

    # -- encode ---------------------------------------------------------------------------

    def stock_negative(self, request: EditRequest, batch: int) -> dict[str, Any]:
        """The negative prompt ("" too: the pipeline then guides, as edits do) and the
        guidance as ``true_cfg_scale``."""
        return {
            "negative_prompt": [request.negative_prompt] * batch,
            "true_cfg_scale": request.guidance,
        }

    def encode_prompt(self, prompt: str, negative_prompt: str) -> dict[str, torch.Tensor]:
        """Each prompt encoded alone, as the pipeline encodes them (its CFG calls are two),
        padded to the longer with their masks: ``[2, L, D]``, negative first."""
        return self.encoded_pair(negative_prompt, prompt)

    def encoded_pair(
        self, negative_prompt: str, prompt: str, **image: Any
    ) -> dict[str, torch.Tensor]:
        """:meth:`encode_prompt`'s tensors (``image``: what else the pipeline's
        ``encode_prompt`` reads, Qwen-Image-Edit's image)."""
        encoded = [self._encode_text(text, **image) for text in (negative_prompt, prompt)]
        embeds, masks = padded([e for e, _ in encoded], [m for _, m in encoded])
        return {"prompt_embeds": embeds.cpu(), "prompt_mask": masks.cpu()}

    def _encode_text(self, text: str, **image: Any) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = self.pipe.encode_prompt(
            prompt=text,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length(),
            **image,
        )
        if mask is None:  # every token real (the pipeline's None)
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask.bool()

    def image_latents(self, image: Image.Image, vae_noise: torch.Tensor) -> torch.Tensor:
        """``[1, C, h, w]``: ``_encode_vae_image`` of the template with ``vae_noise`` as the
        posterior's noise (the frame axis dropped), normalised with the VAE's statistics."""
        pipe, vae = self.pipe, self.pipe.vae
        init = pipe.image_processor.preprocess(image, height=image.height, width=image.width)
        init = init.to(self.device, self.dtype).unsqueeze(2)  # one frame
        sample = vae_sample(vae, init, vae_noise.unsqueeze(2))
        mean, inverse_std = latents_statistics(vae, sample)
        return ((sample - mean) * inverse_std)[:, :, 0]

    # -- steps ----------------------------------------------------------------------------

    def inputs(
        self, request: EditRequest, tensors: dict[str, torch.Tensor], noise: torch.Tensor
    ) -> QwenInputs:
        mask = tensors["mask"].to(self.device, self.dtype)
        return QwenInputs(
            prompt_embeds=tensors["prompt_embeds"].to(self.device, self.dtype),
            prompt_mask=tensors["prompt_mask"].to(self.device),
            unpadded=bool(tensors["prompt_mask"].all()),
            mask=self._pack(mask.repeat(1, self.channels, 1, 1)),
            image_latents=self._pack(tensors["image_latents"].to(self.device, self.dtype)),
            noise=noise,
        )

    def forward(self, states: list[RequestState], ctx: ForwardContext) -> list[torch.Tensor]:
        """One batched transformer call; each request's ``[2, N, 64]`` prediction pair."""
        ctx.grid = grid = next(iter(ctx.grids.values()), None)  # one token grid; none in a bake
        text, text_mask = padded(
            [s.inputs.prompt_embeds for s in states], [s.inputs.prompt_mask for s in states]
        )
        ctx.text_len = text.shape[1]
        unpadded = all(
            s.inputs.unpadded and s.inputs.prompt_embeds.shape[1] == text.shape[1] for s in states
        )
        sparse = (
            grid is not None
            and any(s.step_reader is not None for s in states)
            and any(ctx.mode(b) is Mode.SPARSE for b in self.blocks)
        )
        if not sparse:
            ctx.grid = grid = None  # the blocks' processors stay inert: the stock forward
        # the first block sparse: only the masked tokens enter the model (img_in is token-wise)
        first = sparse and ctx.mode(self.blocks[0]) is Mode.SPARSE
        img_shapes = self.img_shapes(states[0])
        transformer = self.pipe.transformer

        def run(**t: torch.Tensor) -> torch.Tensor:
            scratch = current().scratch  # the running step's: a graph runner replays this
            scratch[SPARSE_CARRY] = first
            latents = t["latents"]
            out = transformer(
                hidden_states=grid.gather(latents) if first else latents,
                timestep=t["timestep"],
                encoder_hidden_states=t["text"],
                encoder_hidden_states_mask=t["text_mask"],
                img_shapes=[img_shapes] * latents.shape[0],
                attention_kwargs={},
                return_dict=False,
            )[0]
            if scratch[SPARSE_CARRY]:  # unmasked rows zero: the blend discards them
                out = grid.scatter(out, torch.zeros_like(latents))
            return out

        dtype = states[0].latents.dtype
        out = ctx.call(
            run,
            latents=torch.cat([torch.cat([self.transformer_input(s)] * 2) for s in states]),
            timestep=batch_timesteps(states, self.device, repeat=2).to(dtype) / 1000,
            text=text,
            text_mask=None if unpadded else text_mask,  # as the pipeline: none when unpadded
        )
        return list(out.split(2))

    def img_shapes(self, state: RequestState) -> list[tuple[int, int, int]]:
        """The transformer's ``img_shapes`` of one row: (frames, token rows, token columns)
        of each image in its image sequence (RoPE's frame index is the image's place)."""
        h, w = self.latent_size(state.request.height, state.request.width)
        return [(1, h // 2, w // 2)]

    def advance(self, state: RequestState, prediction: torch.Tensor) -> None:
        """True CFG with the norm rescale, the scheduler step, the inpaint blend."""
        velocity = true_cfg(prediction[None], [state.request.guidance])[0]
        latents = state.scheduler.step(velocity, state.timestep, state.latents, return_dict=False)
        state.latents = inpaint.blend(state, latents[0])

    def advance_all(self, states: list[RequestState], predictions: list[torch.Tensor]) -> None:
        """The batch's guidance, scheduler step and blend in one set of ops where every
        request steps with the flow-matching Euler scheduler."""
        if not flowstep.batchable(states):
            for state, prediction in zip(states, predictions, strict=True):
                self.advance(state, prediction)
            return
        velocity = true_cfg(torch.stack(predictions), [s.request.guidance for s in states])
        latents = flowstep.step(states, velocity)
        self._blend = flowstep.BlendInputs.of(states, self._blend)
        latents = flowstep.blend(states, latents, self._blend)
        for state, row in zip(states, latents.split(1), strict=True):
            state.latents = row

    # -- decode and the stock reference ---------------------------------------------------

    def decode(
        self, latents: torch.Tensor, size: ImageSize, output_type: str = "pil"
    ) -> Image.Image | np.ndarray:
        """Unpack ``[1, N, 4C]`` final latents to one frame, undo the VAE normalisation,
        decode, postprocess (the pipeline's last lines)."""
        pipe, vae = self.pipe, self.pipe.vae
        latents = pipe._unpack_latents(
            latents.to(self.device, vae.dtype), size.height, size.width, pipe.vae_scale_factor
        )
        mean, inverse_std = latents_statistics(vae, latents)
        decoded = vae.decode(latents / inverse_std + mean, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(decoded, output_type=output_type)[0]

    def stock_noise(
        self, requests: list[EditRequest], composed: list[torch.Tensor], own: list[SeedNoise]
    ) -> dict[str, Any]:
        """The composed noise as the stock call takes it. ``prepare_latents`` of this
        pipeline returns given ``latents`` alone, which its caller cannot unpack; so the
        call draws from the requests' seeds (exact where the composed noise is the seed's,
        :meth:`FamilyModel.stock_noise`), or, at strength 1 with a template's noise in it,
        from :func:`given_noise`."""
        if all(torch.equal(c, o.latents) for c, o in zip(composed, own, strict=True)):
            return {"generator": [torch.Generator().manual_seed(r.seed) for r in requests]}
        return super().stock_noise(requests, composed, own)

    def stock(
        self,
        requests: list[EditRequest],
        noises: list[tuple[SeedNoise, SeedNoise]],
        output_type: str = "pil",
    ) -> list[Image.Image] | np.ndarray:
        with given_noise(self.pipe):
            return super().stock(requests, noises, output_type)


@contextlib.contextmanager
def given_noise(pipe: QwenImageInpaintPipeline) -> Iterator[None]:
    """Within: the pipeline's ``prepare_latents`` takes given ``latents`` as its initial
    noise (the template's image latents noised with it, as it does with a drawn one) and
    returns the three tensors its caller unpacks."""
    original = pipe.prepare_latents

    def prepare(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        *args, given = args  # the pipeline passes its ten arguments by position
        if given is None:
            return original(*args, None)
        _, _, image_latents = original(*args, None)
        noise = pipe._pack_latents(given, given.shape[0], given.shape[1], *given.shape[-2:])
        return pipe.scheduler.scale_noise(image_latents, args[1], noise), noise, image_latents

    pipe.prepare_latents = prepare
    try:
        yield
    finally:
        del pipe.prepare_latents


def latents_statistics(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's ``latents_mean`` and ``1 / latents_std`` as ``[1, C, 1, 1, 1]`` tensors on
    ``like``'s device and dtype (as the pipeline computes them)."""
    config = vae.config
    view = (1, config.z_dim, 1, 1, 1)
    mean = torch.tensor(config.latents_mean).view(view).to(like.device, like.dtype)
    inverse_std = 1.0 / torch.tensor(config.latents_std).view(view).to(like.device, like.dtype)
    return mean, inverse_std


def padded(
    embeds: list[torch.Tensor], masks: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, L, D]`` embeddings and ``[rows, L]`` bool masks of several row groups of
    different text lengths, each padded with zeros (masked off) to the longest."""
    longest = max(e.shape[1] for e in embeds)
    out_e, out_m = [], []
    for e, m in zip(embeds, masks, strict=True):
        pad = longest - e.shape[1]
        out_e.append(torch.nn.functional.pad(e, (0, 0, 0, pad)))
        out_m.append(torch.nn.functional.pad(m, (0, pad), value=False))
    return torch.cat(out_e), torch.cat(out_m)


def true_cfg(pairs: torch.Tensor, scales: list[float]) -> torch.Tensor:
    """The pipeline's true CFG of ``[B, 2, N, C]`` ``[negative ; prompt]`` predictions:
    ``neg + g (pos - neg)``, rescaled per token to the prompt's prediction's norm; a request
    at ``g <= 1`` takes its prompt's prediction (the pipeline does not guide). Tokens left
    at zero (not computed: the blend discards them) stay zero."""
    negative, positive = pairs[:, 0], pairs[:, 1]
    out = []
    for neg, pos, scale in zip(negative, positive, scales, strict=True):
        if scale <= 1.0:
            out.append(pos)
            continue
        combined = neg + scale * (pos - neg)
        norm = torch.norm(combined, dim=-1, keepdim=True)
        ratio = torch.norm(pos, dim=-1, keepdim=True) / norm
        out.append(torch.where(norm > 0, combined * ratio, combined))
    return torch.stack(out)


# -- FLOPs --------------------------------------------------------------------------------


def qwen_image_flops(
    config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
) -> Flops:
    """One row of a ``QwenImageTransformer2DModel`` at mask ratio ``ratio`` (2×2-packed
    tokens): the masked tokens' image stream, the whole text stream, their joint attention
    against every image key."""
    n_tokens = (latent_size[0] // 2) * (latent_size[1] // 2)
    return qwen_sequence_flops(config, n_tokens, ratio * n_tokens, text_len)


def qwen_sequence_flops(
    config: Mapping[str, Any], n_tokens: int, masked: float, text_len: int
) -> Flops:
    """One row of a ``QwenImageTransformer2DModel`` whose image sequence has ``n_tokens``
    tokens (every one a key) of which ``masked`` are computed."""
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    cout = (config.get("out_channels") or config["in_channels"]) * config["patch_size"] ** 2
    queries, keys = text_len + masked, text_len + n_tokens
    dense = linear_flops(1, 256, dim) + linear_flops(1, dim, dim)  # timestep embedding
    dense += linear_flops(masked, config["in_channels"], dim)  # img_in
    dense += linear_flops(text_len, config["joint_attention_dim"], dim)  # txt_in
    attention = 0.0
    for _ in range(config["num_layers"]):
        dense += 2 * linear_flops(1, dim, 6 * dim)  # img_mod, txt_mod
        for tokens in (masked, text_len):  # Q, K, V, out; the GELU MLP (4x)
            dense += 4 * linear_flops(tokens, dim, dim) + 2 * linear_flops(tokens, dim, 4 * dim)
        attention += 2 * 2.0 * queries * keys * dim
    dense += linear_flops(1, dim, 2 * dim) + linear_flops(masked, dim, cout)  # norm_out, proj_out
    return Flops(dense, attention)


class QwenImageFamily(Family):
    """``qwen-image``: Qwen-Image (an MMDiT over 2x2-packed latents of a frame-axis VAE,
    Qwen2.5-VL text, true classifier-free guidance)."""

    name = "qwen-image"
    model = QwenImageInpaint
    pipeline = QwenImageInpaintPipeline
    text_components = ("text_encoder", "tokenizer")
    flops = qwen_image_flops

    def token_cell(self, pipe: QwenImageInpaintPipeline) -> int:
        return pipe.vae_scale_factor * 2


FAMILY = QwenImageFamily()
