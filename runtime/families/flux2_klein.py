"""The ``flux2-klein`` family: Flux2KleinInpaintPipeline (FLUX.2 [klein], the distilled
checkpoints) split into encode / assemble / step / decode.

FLUX.2 [klein] is a Flux2 DiT (``Flux2Transformer2DModel``, blocks in
``maskaware/flux2_blocks.py``) whose inpaint pipeline works like FLUX.1 Kontext's: the
template's own latents always follow the edited latents in the image sequence as condition
tokens (positions ``(T=10, h, w, 0)``), the prediction of the edited tokens is the first
part of the model's output, and the unmasked latents are blended back to the template
re-noised to the next timestep after every step. The distilled checkpoints read no
guidance: one model row per request, no negative prompt. This module subclasses
``flux-inpaint`` for the step, the blend and the padded forward; what differs is each piece
of the pipeline's own:

* latents: the VAE posterior's mode, 2x2-patchified into channels (``[1, 4C, H/16, W/16]``)
  and normalised with the VAE's BatchNorm statistics; the initial noise is drawn in that
  shape, and packing is a plain reshape to ``[1, N, 4C]``; decoding de-normalises and
  unpatchifies before the VAE;
* the mask: binarised, then resized *bilinearly* straight to the token grid, so a token
  the mask's edge crosses gets a blend weight between 0 and 1. Every token with a weight
  above 0 is computed (its latents depend on the prediction), the others' rows come from
  the bake;
* text: Qwen3's hidden layers 9, 18 and 27 side by side, over a chat-templated prompt
  padded to ``max_sequence_length`` (every token attended, pads too); positions have four
  axes (T, H, W, L);
* the schedule's shift: ``compute_empirical_mu`` of the token count and the step count.

Mask-aware, the condition tokens are unmasked tokens like the template's own: the token
grid is the edited latents' with the template's stacked below it, none of those masked, so
their K/V and Y rows come from the bake (``image_sequences = 2``). With the bake's own
mask, prompt and seed the edit is the stock pipeline's.

The pipeline can also read an ``image_reference`` (more condition tokens, T=20): it changes
every token's activations, so it is left out (the gateway refuses it for this family, and
so does :meth:`Flux2Klein.encode_image`). Templates over 1 MP are downscaled by the stock
pipeline; retouch edits them at their own size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import Flux2KleinInpaintPipeline
from diffusers.pipelines.flux2.pipeline_flux2_klein_inpaint import compute_empirical_mu
from PIL import Image

from retouch.runtime.families.base import Encoding
from retouch.runtime.families.flux_inpaint import FluxInpaint, FluxInpaintFamily, FluxInputs
from retouch.runtime.maskaware import flux2_blocks, inpaint
from retouch.runtime.maskaware.context import ForwardContext
from retouch.runtime.maskaware.flops import Flops, linear_flops
from retouch.runtime.maskaware.noise import SeedNoise
from retouch.runtime.maskaware.request import (
    EditRequest,
    ImageSize,
    RequestState,
    token_sets,
)
from retouch.runtime.maskaware.tokens import TokenSet


class Flux2Klein(FluxInpaint):
    """Glue between the editor and a (distilled) Flux2KleinInpaintPipeline."""

    packs = False  # the condition tokens ride in the image sequence: the padded layout
    image_sequences = 2  # the edited latents' tokens, then the template's

    def install(self, transformer: torch.nn.Module) -> list[str]:
        return flux2_blocks.install(transformer)

    def row_channels(self, block: str, name: str) -> int:
        """K/V as wide as the attention's ``inner_dim`` (the single-stream blocks project K
        fused with Q, V and the MLP input: no ``to_k``); Y the model's width."""
        transformer = self.pipe.transformer
        if name == "y":
            return transformer.inner_dim
        return transformer.get_submodule(block).attn.inner_dim

    @staticmethod
    def text_length(pipe: Flux2KleinInpaintPipeline) -> int:
        return min(pipe.tokenizer_max_length, pipe.tokenizer.model_max_length)

    def noise_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Patchified latents: ``[1, 4C, h/2, w/2]`` (the noise is drawn in that shape)."""
        h, w = self.latent_size(height, width)
        return (1, 4 * self.channels, h // 2, w // 2)

    def masks(self, request: EditRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """The binarised mask and its bilinear resize to the token grid (soft at edges),
        as ``prepare_mask_latents`` makes it."""
        condition = inpaint.mask_condition(self.pipe, request)
        size = self.noise_shape(request.height, request.width)[2:]
        return condition, F.interpolate(condition, size=size, mode="bilinear")

    def image_latents(self, image: Image.Image, vae_noise: torch.Tensor) -> torch.Tensor:
        """``[1, 4C, h/2, w/2]``: the template's latents as the pipeline encodes them (the
        posterior's mode, patchified, normalised); ``vae_noise`` is not drawn."""
        return inpaint.mode_latents(self.pipe, image, self.device, self.dtype)

    def encode_image(self, job: Encoding) -> dict[str, torch.Tensor]:
        if job.request.reference is not None:
            raise ValueError(f"{self.spec.name} reads no image_reference")
        return super().encode_image(job)

    def encode_prompt(self, prompt: str, negative_prompt: str) -> dict[str, torch.Tensor]:
        """The prompt's Qwen3 encoding (distilled: no negative prompt)."""
        self.refuse_negative(negative_prompt)
        prompt_embeds, text_ids = self.pipe.encode_prompt(
            prompt=prompt,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length(),
        )
        return {
            "prompt_embeds": prompt_embeds.cpu(),  # [1, L, D]
            "text_ids": text_ids[0].cpu(),  # [L, 4]
        }

    @staticmethod
    def shift(config: Mapping[str, Any], seq_len: int, steps: int) -> float:
        """FLUX.2's ``compute_empirical_mu`` of the edited tokens and the full step count."""
        return compute_empirical_mu(image_seq_len=seq_len, num_steps=steps)

    def _pack(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipe._pack_latents(latents)

    def assemble(
        self, request: EditRequest, tensors: dict[str, torch.Tensor], *, every: bool
    ) -> RequestState:
        """Scheduler, token set (every token the soft mask touches), inputs on the device,
        and the initial latents (the noise, or the template noised to the first step)."""
        noise = self._pack(tensors["noise"].to(self.device, self.dtype))
        scheduler, timesteps = self._scheduler(request)
        inputs = self.inputs(request, tensors, noise)
        tokens = self.tokens(tensors["mask"][0, 0] > 0, every=every)
        latents = inpaint.initial_latents(
            request, scheduler, timesteps, noise, inputs.image_latents
        )
        return RequestState(request, latents, scheduler, timesteps, inputs, tokens)

    def tokens(self, hard: torch.Tensor, *, every: bool) -> dict[tuple[int, int], TokenSet]:
        """The token grid ``[h, w]`` with the condition tokens' stacked below it, in the
        order the pipeline concatenates them; none of the condition tokens is masked."""
        h, w = hard.shape
        return token_sets(torch.cat([hard, torch.zeros_like(hard)]), [(2 * h, w)], every=every)

    def inputs(
        self, request: EditRequest, tensors: dict[str, torch.Tensor], noise: torch.Tensor
    ) -> FluxInputs:
        """Text, 4-axis positions (the edited latents', then the condition tokens' with
        T=10), the packed soft mask, the template's normalised latents and the noise; no
        pooled text, no guidance."""
        pipe = self.pipe
        grid = tensors["image_latents"].to(self.device, self.dtype)
        image_ids = torch.cat(
            [pipe._prepare_latent_ids(grid)[0], pipe._prepare_image_ids([grid], 1)[0]]
        )
        return FluxInputs(
            prompt_embeds=tensors["prompt_embeds"].to(self.device),
            pooled=None,
            text_ids=tensors["text_ids"].to(self.device),
            image_ids=image_ids.to(self.device),
            guidance=None,
            mask=self._pack(tensors["mask"].to(self.device, self.dtype)),
            image_latents=self._pack(grid),
            noise=noise,
        )

    def transformer_input(self, state: RequestState) -> torch.Tensor:
        """[latents ; condition tokens (the template's latents)]."""
        return torch.cat((state.latents, state.inputs.image_latents), dim=1)

    def forward(self, states: list[RequestState], ctx: ForwardContext) -> list[torch.Tensor]:
        """Flux's batched call; each request's prediction of its edited tokens only."""
        edited = states[0].latents.shape[1]
        return [out[:, :edited] for out in super().forward(states, ctx)]

    @staticmethod
    def denoiser_kwargs(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        """No pooled text, no guidance (the pipeline passes ``guidance=None``)."""
        return {
            "timestep": t["timestep"],
            "guidance": None,
            "encoder_hidden_states": t["prompt_embeds"],
            "txt_ids": t["text_ids"],
            "img_ids": t["image_ids"],
        }

    def decode(
        self, latents: torch.Tensor, size: ImageSize, output_type: str = "pil"
    ) -> Image.Image | np.ndarray:
        """``[1, N, 4C]`` final latents back to the token grid, de-normalised with the
        VAE's BatchNorm statistics, unpatchified, VAE-decoded, postprocessed."""
        pipe, vae = self.pipe, self.pipe.vae
        h, w = self.noise_shape(size.height, size.width)[2:]
        grid = latents.to(self.device, vae.dtype).transpose(1, 2).reshape(1, -1, h, w)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(grid.device, grid.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        grid = grid * std.to(grid.device, grid.dtype) + mean
        decoded = vae.decode(pipe._unpatchify_latents(grid), return_dict=False)[0]
        return pipe.image_processor.postprocess(decoded, output_type=output_type)[0]

    def stock_batch(
        self, requests: list[EditRequest], noises: list[tuple[SeedNoise, SeedNoise]]
    ) -> dict[str, Any]:
        """The template images (the pipeline encodes them itself, to the latents above)
        and each request's composed initial noise."""
        pairs = zip(requests, noises, strict=True)
        composed = [self.composed_noise(r, t, own) for r, (t, own) in pairs]
        return {
            "image": [r.image for r in requests],
            **self.stock_noise(requests, composed, [own for _, own in noises]),
        }


def flux2_flops(
    config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
) -> Flops:
    """One row of a ``Flux2Transformer2DModel`` over an image sequence of twice the edited
    image's tokens (the condition tokens follow). At ``ratio`` 1 every token of it (the
    stock step, and a step without a cache); below it the masked share of the edited
    image's tokens, every image token a key. The modulations are computed once per row."""
    n_tokens = (latent_size[0] // 2) * (latent_size[1] // 2)
    sequence = 2 * n_tokens
    computed = sequence if ratio >= 1.0 else ratio * n_tokens
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    mlp = int(dim * config.get("mlp_ratio", 3.0))
    cin = config["in_channels"]
    cout = config.get("out_channels") or cin
    queries, keys = text_len + computed, text_len + sequence
    embedders = 2 if config.get("guidance_embeds", False) else 1  # timestep (and guidance)
    dense = embedders * (linear_flops(1, config["timestep_guidance_channels"], dim))
    dense += embedders * linear_flops(1, dim, dim)
    dense += linear_flops(1, dim, 2 * 6 * dim) + linear_flops(1, dim, 3 * dim)  # modulations
    dense += linear_flops(computed, cin, dim) + linear_flops(
        text_len, config["joint_attention_dim"], dim
    )
    attention = 0.0
    for _ in range(config["num_layers"]):  # double-stream blocks
        for tokens in (computed, text_len):
            dense += 4 * linear_flops(tokens, dim, dim)  # Q, K, V, out
            dense += linear_flops(tokens, dim, 2 * mlp) + linear_flops(tokens, mlp, dim)
        attention += 2 * 2.0 * queries * keys * dim
    for _ in range(config["num_single_layers"]):  # single-stream blocks
        dense += linear_flops(queries, dim, 3 * dim + 2 * mlp)
        dense += linear_flops(queries, dim + mlp, dim)
        attention += 2 * 2.0 * queries * keys * dim
    dense += linear_flops(1, dim, 2 * dim) + linear_flops(computed, dim, cout)  # norm_out, proj
    return Flops(dense, attention)


class Flux2KleinFamily(FluxInpaintFamily):
    """``flux2-klein``: FLUX.2 [klein] distilled (a Flux2 DiT reading the template as
    condition tokens, one model row per request)."""

    name = "flux2-klein"
    model = Flux2Klein
    pipeline = Flux2KleinInpaintPipeline
    text_components = ("text_encoder", "tokenizer")
    flops = flux2_flops


FAMILY = Flux2KleinFamily()
