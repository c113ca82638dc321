"""The ``flux-kontext`` family: FluxKontextInpaintPipeline (FLUX.1 Kontext) split into
encode / assemble / step / decode.

FLUX.1 Kontext is a Flux DiT that reads a reference image as more image tokens: its
packed latents follow the edited latents in the image sequence, with positions whose first
coordinate is 1 (``FluxKontextInpaintPipeline.prepare_latents``), and the prediction of
the edited tokens is the first part of the model's output. Inpainting blends the unmasked
latents back to the template after every step, as ``flux-inpaint`` does (this module
subclasses it: blocks, text encoding, scheduler, blend and decode are Flux's).

The reference is the template itself (what the pipeline reads when no ``image_reference``
is given), its latents the VAE posterior's mode (``sample_mode="argmax"``, no noise): a
constant of the template, part of what the bake stores. Mask-aware, the reference tokens
are unmasked tokens like the template's own: the token grid is the edited latents' with the
reference's stacked below it, nothing of the reference masked (:meth:`FluxKontext.tokens`),
so their K/V and Y rows come from the bake and only the masked tokens of the edited image
are computed. The reference tokens' activations depend on the masked tokens through the
attention, as the unmasked tokens' do: with the bake's own mask, prompt and seed the edit is
the stock pipeline's.

The stock pipeline resizes its image to one of Kontext's preferred resolutions
(``_auto_resize``); retouch edits templates at their own size, and its stock reference is
called with ``_auto_resize=False`` (deploy templates at a Kontext resolution to get its
behaviour).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import FluxKontextInpaintPipeline
from PIL import Image

from retouch.runtime.families.base import Encoding
from retouch.runtime.families.flux_inpaint import (
    FluxConditioning,
    FluxInpaint,
    FluxInpaintFamily,
    FluxInputs,
    flux_sequence_flops,
)
from retouch.runtime.maskaware import inpaint
from retouch.runtime.maskaware.context import ForwardContext
from retouch.runtime.maskaware.flops import Flops
from retouch.runtime.maskaware.noise import SeedNoise
from retouch.runtime.maskaware.request import EditRequest, RequestState, token_sets
from retouch.runtime.maskaware.tokens import TokenSet

REFERENCE_AXIS = 1.0  # the first position coordinate of the reference's tokens


@dataclass
class KontextInputs(FluxInputs):
    """Flux's inputs and the reference's packed latents (the template's, or the edit's own
    ``image_reference``)."""

    reference: torch.Tensor  # [1, N, 64]


class FluxKontext(FluxInpaint):
    """Glue between the editor and a FluxKontextInpaintPipeline."""

    packs = False  # the reference tokens ride in the image sequence: the padded layout
    image_sequences = 2  # the edited latents' tokens, then the reference's

    def image_latents(self, image: Image.Image, vae_noise: torch.Tensor) -> torch.Tensor:
        """``[1, C, h, w]``: the template's latents as the Kontext pipeline encodes them
        (the posterior's mode, shifted and scaled); ``vae_noise`` is not drawn."""
        return inpaint.mode_latents(self.pipe, image, self.device, self.dtype)

    def encode_image(self, job: Encoding) -> dict[str, torch.Tensor]:
        """The template's latents; with the edit's own reference image, its latents too
        (encoded as the pipeline encodes ``image_reference``: the same mode)."""
        out = super().encode_image(job)
        reference = job.request.reference
        if reference is not None:
            out["reference_latents"] = self.image_latents(reference, job.template_noise.vae).cpu()
        return out

    def inputs(
        self, request: EditRequest, tensors: dict[str, torch.Tensor], noise: torch.Tensor
    ) -> KontextInputs:
        """Flux's, and the reference's packed latents: the edit's own, else the template's."""
        flux = super().inputs(request, tensors, noise)
        own = tensors.get("reference_latents")
        reference = (
            flux.image_latents if own is None else self._pack(own.to(self.device, self.dtype))
        )
        return KontextInputs(**vars(flux), reference=reference)

    def tokens(self, hard: torch.Tensor, *, every: bool) -> dict[tuple[int, int], TokenSet]:
        """The edited latents' token grid with the reference's stacked below it: 2×2-packed
        tokens of a ``[2h, w]`` grid, row-major, are the edited image's then the
        reference's, in the order the pipeline concatenates them; none of the reference's
        is masked."""
        h, w = hard.shape
        stacked = torch.cat([hard, torch.zeros_like(hard)])
        return token_sets(stacked, [(h, w // 2)], every=every)

    def conditioning(
        self, request: EditRequest, tensors: dict[str, torch.Tensor]
    ) -> FluxConditioning:
        """Flux's, with the reference's positions after the edited latents'."""
        conditioning = super().conditioning(request, tensors)
        reference = conditioning.image_ids.clone()
        reference[..., 0] = REFERENCE_AXIS
        conditioning.image_ids = torch.cat([conditioning.image_ids, reference])
        return conditioning

    def transformer_input(self, state: RequestState) -> torch.Tensor:
        """[latents ; reference latents]."""
        return torch.cat((state.latents, state.inputs.reference), dim=1)

    def forward(self, states: list[RequestState], ctx: ForwardContext) -> list[torch.Tensor]:
        """Flux's batched call; each request's prediction of its edited tokens only."""
        edited = states[0].latents.shape[1]
        return [out[:, :edited] for out in super().forward(states, ctx)]

    def stock_options(self) -> dict[str, Any]:
        """The template's own size, not Kontext's preferred resolutions."""
        return {**super().stock_options(), "_auto_resize": False}

    def stock_batch(
        self, requests: list[EditRequest], noises: list[tuple[SeedNoise, SeedNoise]]
    ) -> dict[str, Any]:
        """The template images (the pipeline encodes them itself, to the latents above:
        it takes no latents for ``image``) and each request's composed initial noise."""
        pairs = zip(requests, noises, strict=True)
        composed = [self.composed_noise(r, t, own) for r, (t, own) in pairs]
        size = requests[0].image.size
        return {
            "image": [r.image for r in requests],
            "max_area": size[0] * size[1],  # its own size: no resize warning
            **self.stock_noise(requests, composed, [own for _, own in noises]),
            **self.stock_reference(requests),
        }

    @staticmethod
    def stock_reference(requests: list[EditRequest]) -> dict[str, Any]:
        """``image_reference`` where a request brings its own (the others' is their
        template, which the pipeline also reads when given none)."""
        if all(r.reference is None for r in requests):
            return {}
        return {
            "image_reference": [r.image if r.reference is None else r.reference for r in requests]
        }


def kontext_flops(
    config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
) -> Flops:
    """One row of a Kontext ``FluxTransformer2DModel``: Flux's over a sequence of twice the
    edited image's tokens (the reference's follow). At ``ratio`` 1 every token of it, the
    reference's too (the stock step, and a step without a cache); below it the masked
    share of the edited image's tokens, every image token a key."""
    n_tokens = (latent_size[0] // 2) * (latent_size[1] // 2)
    sequence = 2 * n_tokens
    computed = sequence if ratio >= 1.0 else ratio * n_tokens
    return flux_sequence_flops(config, sequence, computed, text_len)


class FluxKontextFamily(FluxInpaintFamily):
    """``flux-kontext``: FLUX.1 Kontext (a Flux DiT reading the template as reference
    tokens)."""

    name = "flux-kontext"
    model = FluxKontext
    pipeline = FluxKontextInpaintPipeline
    flops = kontext_flops


FAMILY = FluxKontextFamily()
