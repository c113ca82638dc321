"""Steps of diffusers' inpaint pipelines that several families share, written once.

Flux and SD3 inpainting (16-channel denoisers) blend the unmasked latents back to the
template re-noised to the next timestep after every step and take the template's latents
as ``image`` (then skip their VAE encode: the stock call of ``families/base.py``); SD and SD3
decode with ``latents / scaling``, Flux and Z-Image with ``latents / scaling + shift``.
Each function does exactly what those pipelines do, so a family built on them stays equal
to its stock pipeline.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from retouch.runtime.maskaware.noise import vae_sample
from retouch.runtime.maskaware.request import EditRequest, RequestState


def mask_condition(pipe: Any, request: EditRequest) -> torch.Tensor:
    """``[1, 1, H, W]``: the pipeline's ``mask_processor`` on the request's mask."""
    image = request.image
    return pipe.mask_processor.preprocess(
        request.mask_image(), height=image.height, width=image.width
    )


def latent_mask(condition: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``[1, 1, h, w]``: ``prepare_mask_latents``' nearest resize of the binarised mask."""
    return F.interpolate(condition, size=size)


def template_latents(
    pipe: Any, image: Image.Image, vae_noise: torch.Tensor, device: torch.device, dtype: Any
) -> torch.Tensor:
    """``[1, C, h, w]`` template latents, as ``_encode_vae_image`` computes them."""
    vae = pipe.vae
    init = pipe.image_processor.preprocess(image, height=image.height, width=image.width)
    sample = vae_sample(vae, init.to(device, dtype), vae_noise)
    return (sample - vae.config.shift_factor) * vae.config.scaling_factor


def initial_latents(
    request: EditRequest,
    scheduler: Any,
    timesteps: torch.Tensor,
    noise: torch.Tensor,
    image_latents: torch.Tensor | None,
) -> torch.Tensor:
    """The flow pipelines' ``prepare_latents``: the noise, or below strength 1 the image's
    latents noised to the first kept timestep (``scale_noise`` is element-wise, so packed
    latents take it alike; the scheduler is begun there)."""
    if request.strength == 1.0:
        return noise.clone()
    if image_latents is None:
        raise ValueError("an edit at strength < 1 starts from the image's latents: none given")
    return scheduler.scale_noise(image_latents, timesteps[:1], noise)


def blend(state: RequestState, latents: torch.Tensor) -> torch.Tensor:
    """The inpaint blend after a scheduler step: unmasked latents from the template,
    re-noised to the next timestep (``inputs``: ``mask``, ``image_latents``, ``noise``)."""
    inputs = state.inputs
    template = inputs.image_latents
    if not state.last:
        following = state.timesteps[state.index + 1]
        template = state.scheduler.scale_noise(template, torch.tensor([following]), inputs.noise)
    return (1 - inputs.mask) * template + inputs.mask * latents


def scaled_decode(
    pipe: Any, latents: torch.Tensor, device: torch.device, output_type: str
) -> Image.Image | np.ndarray:
    """VAE decode of ``latents / scaling_factor`` and the pipeline's postprocess."""
    vae = pipe.vae
    image = vae.decode(latents.to(device, vae.dtype) / vae.config.scaling_factor, return_dict=False)
    return pipe.image_processor.postprocess(
        image[0], output_type=output_type, do_denormalize=[True]
    )[0]


def shifted_decode(
    pipe: Any, latents: torch.Tensor, device: torch.device, output_type: str
) -> Image.Image | np.ndarray:
    """VAE decode of ``latents / scaling_factor + shift_factor`` ``[1, C, h, w]`` (the
    FLUX.1 VAE's) and the pipeline's postprocess."""
    vae = pipe.vae
    latents = latents.to(device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
    decoded = vae.decode(latents, return_dict=False)[0]
    return pipe.image_processor.postprocess(decoded, output_type=output_type)[0]
