"""Steps of diffusers' inpaint pipelines that several families share, written once.

Flux and SD3 inpainting (16-channel denoisers) blend the unmasked latents back to the
template re-noised to the next timestep after every step and take the template's latents
as ``image`` (then skip their VAE encode); SD and SD3 decode with ``latents / scaling``.
Each function does exactly what those pipelines do, so a family built on them stays equal
to its stock pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from retouch.runtime.maskaware.noise import SeedNoise, vae_sample
from retouch.runtime.maskaware.request import EditRequest, RequestState, check_batchable


def latent_mask(pipe: Any, request: EditRequest, size: tuple[int, int]) -> torch.Tensor:
    """``[1, 1, h, w]``: ``prepare_mask_latents``' nearest resize of the binarised mask."""
    image = request.image
    condition = pipe.mask_processor.preprocess(
        request.mask_image(), height=image.height, width=image.width
    )
    return F.interpolate(condition, size=size)


def template_latents(
    pipe: Any, image: Image.Image, vae_noise: torch.Tensor, device: torch.device, dtype: Any
) -> torch.Tensor:
    """``[1, C, h, w]`` template latents, as ``_encode_vae_image`` computes them."""
    vae = pipe.vae
    init = pipe.image_processor.preprocess(image, height=image.height, width=image.width)
    sample = vae_sample(vae, init.to(device, dtype), vae_noise)
    return (sample - vae.config.shift_factor) * vae.config.scaling_factor


def blend(state: RequestState, latents: torch.Tensor) -> torch.Tensor:
    """The inpaint blend after a scheduler step: unmasked latents from the template,
    re-noised to the next timestep (``inputs``: ``mask``, ``image_latents``, ``noise``)."""
    inputs = state.inputs
    template = inputs.image_latents
    if not state.last:
        following = state.timesteps[state.index + 1]
        template = state.scheduler.scale_noise(template, torch.tensor([following]), inputs.noise)
    return (1 - inputs.mask) * template + inputs.mask * latents


def stock_with_template(
    pipe: Any,
    requests: list[EditRequest],
    noises: list[tuple[SeedNoise, SeedNoise]],
    mask_of: Callable[[EditRequest], torch.Tensor],
    latents_of: Callable[[Image.Image, torch.Tensor], torch.Tensor],
    output_type: str,
    **options: Any,
) -> list[Image.Image] | np.ndarray:
    """One stock call of a blending pipeline for ``requests`` (same size, steps, guidance):
    each with its composed noise and its template's latents, passed as ``image`` (which
    the pipeline then uses without encoding) and as ``masked_image_latents`` (unused by
    the blend; skips an encode). ``mask_of`` gives a request's latent mask, ``latents_of``
    an image's latents from its VAE noise."""
    first = check_batchable(requests)
    pairs = list(zip(requests, noises, strict=True))
    noise = [t.compose(own, mask_of(r)[0, 0] > 0.5).latents for r, (t, own) in pairs]
    latents = torch.cat([latents_of(r.image, t.vae) for r, (t, _) in pairs])
    denoiser = pipe.transformer
    return pipe(
        prompt=[r.prompt for r in requests],
        image=latents,
        mask_image=[r.mask_image() for r in requests],
        masked_image_latents=latents,
        height=first.image.height,
        width=first.image.width,
        strength=1.0,
        num_inference_steps=first.steps,
        guidance_scale=first.guidance,
        latents=torch.cat(noise).to(denoiser.device, denoiser.dtype),
        output_type=output_type,
        **options,
    ).images


def scaled_decode(
    pipe: Any, latents: torch.Tensor, device: torch.device, output_type: str
) -> Image.Image | np.ndarray:
    """VAE decode of ``latents / scaling_factor`` and the pipeline's postprocess."""
    vae = pipe.vae
    image = vae.decode(latents.to(device, vae.dtype) / vae.config.scaling_factor, return_dict=False)
    return pipe.image_processor.postprocess(
        image[0], output_type=output_type, do_denormalize=[True]
    )[0]
