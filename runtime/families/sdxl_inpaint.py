"""The ``sdxl-inpaint`` family: StableDiffusionXLInpaintPipeline split into encode / assemble /
step / decode, mask-aware over the UNet's transformer blocks as ``sd-inpaint`` is.

SDXL's inpainting UNet is SD's (9 input channels: latents, mask, masked-image latents; the
same ``Transformer2DModel`` blocks, here with several transformer layers per block and
linear projections), so :class:`SDXLInpaint` is :class:`SDInpaint` with what the SDXL
pipeline adds: two text encoders (CLIP-L and CLIP-G, whose penultimate hidden states are
concatenated; CLIP-G's projection is the pooled embedding), the micro-conditioning
``add_time_ids`` (original size, crop, target size or aesthetic score), both passed to
the UNet as ``added_cond_kwargs``, and a VAE that runs in float32 when it is float16 and
its config says ``force_upcast`` (SDXL's VAE overflows in float16). At 1024² most of an
SDXL step's FLOPs are in its transformer blocks, which is what the mask-aware path saves.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers import StableDiffusionXLInpaintPipeline
from PIL import Image

from retouch.runtime.families.sd_inpaint import SDInpaint, SDInpaintFamily, SDInputs, unet_flops
from retouch.runtime.maskaware.flops import Flops, linear_flops
from retouch.runtime.maskaware.request import EditRequest, ImageSize, RequestState

AESTHETIC_SCORE, NEGATIVE_AESTHETIC_SCORE = 6.0, 2.5  # the pipeline's defaults


@dataclass
class SDXLInputs(SDInputs):
    """SD's UNet inputs and the added conditioning of SDXL's UNet."""

    text_embeds: torch.Tensor  # [2, P] pooled CLIP-G embeddings: negative, then the prompt
    time_ids: torch.Tensor  # [2, 6] (or [2, 5] with an aesthetic score): negative, then own


@contextmanager
def upcast(vae: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The VAE in float32 while inside, when it is float16 and ``force_upcast`` (as the SDXL
    pipelines upcast it around their encodes and decodes); otherwise as it is."""
    if vae.dtype != torch.float16 or not vae.config.force_upcast:
        yield vae
        return
    vae.to(torch.float32)
    try:
        yield vae
    finally:
        vae.to(torch.float16)


class SDXLInpaint(SDInpaint):
    """Glue between the editor and a StableDiffusionXLInpaintPipeline."""

    @staticmethod
    def text_length(pipe: StableDiffusionXLInpaintPipeline) -> int:
        return pipe.tokenizer_2.model_max_length  # both CLIPs pad to it; features concatenate

    def _vae_latents(
        self, image: Image.Image, keep: torch.Tensor | None, vae_noise: torch.Tensor
    ) -> torch.Tensor:
        with upcast(self.pipe.vae):
            latents = super()._vae_latents(image, keep, vae_noise)
        return latents.to(self.pipe.vae.dtype)

    def encode_prompt(self, prompt: str, negative_prompt: str) -> dict[str, torch.Tensor]:
        """Both text encoders; the negative prompt first (without one: zeros when the
        pipeline's ``force_zeros_for_empty_prompt`` says so, as the stock call makes it)."""
        positive, negative, pooled, negative_pooled = self.pipe.encode_prompt(
            prompt,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=True,
            negative_prompt=negative_prompt or None,
        )
        return {
            "prompt_embeds": torch.cat([negative, positive]).cpu(),  # [2, L, D]
            "text_embeds": torch.cat([negative_pooled, pooled]).cpu(),  # [2, P]
        }

    def model_inputs(self, request: EditRequest, tensors: dict[str, torch.Tensor]) -> SDXLInputs:
        """SD's inputs, the pooled embeddings and the time ids of the request's size."""
        sd = super().model_inputs(request, tensors)
        text_embeds = tensors["text_embeds"].to(self.device)
        return SDXLInputs(
            **vars(sd),
            text_embeds=text_embeds,
            time_ids=self._time_ids(request, sd.prompt_embeds.dtype, text_embeds.shape[-1]),
        )

    def _time_ids(self, request: EditRequest, dtype: torch.dtype, pooled: int) -> torch.Tensor:
        """``[negative ; own]`` add_time_ids as the stock call makes them (defaults: original
        and target size the image's, crop (0, 0), aesthetic scores 6.0 and 2.5)."""
        h, w = self.latent_size(request.height, request.width)
        size = (h * self.pipe.vae_scale_factor, w * self.pipe.vae_scale_factor)
        own, negative = self.pipe._get_add_time_ids(
            size,
            (0, 0),
            size,
            AESTHETIC_SCORE,
            NEGATIVE_AESTHETIC_SCORE,
            size,
            (0, 0),
            size,
            dtype=dtype,
            text_encoder_projection_dim=pooled,
        )
        return torch.cat([negative, own]).to(self.device)

    def conditions(self, states: list[RequestState]) -> dict[str, torch.Tensor]:
        return {
            **super().conditions(states),
            "text_embeds": torch.cat([s.inputs.text_embeds for s in states]),
            "time_ids": torch.cat([s.inputs.time_ids for s in states]),
        }

    def denoise(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor,
        text: torch.Tensor,
        text_embeds: torch.Tensor,
        time_ids: torch.Tensor,
    ) -> torch.Tensor:
        """One UNet call on the batch's rows, with SDXL's added conditioning."""
        return self.pipe.unet(
            sample,
            timestep,
            encoder_hidden_states=text,
            added_cond_kwargs={"text_embeds": text_embeds, "time_ids": time_ids},
            return_dict=False,
        )[0]

    def decode(
        self, latents: torch.Tensor, size: ImageSize, output_type: str = "pil"
    ) -> Image.Image | np.ndarray:
        """The SDXL pipeline's decode: upcast VAE, the latents' mean and std when the VAE
        declares them (else ``/ scaling_factor``), the watermark when the pipeline has one."""
        with upcast(self.pipe.vae) as vae:
            latents = latents.to(self.device, vae.dtype)
            config = vae.config
            mean, std = config.get("latents_mean"), config.get("latents_std")
            if mean is not None and std is not None:
                mean, std = (torch.tensor(v).view(1, -1, 1, 1).to(latents) for v in (mean, std))
                latents = latents * std / config.scaling_factor + mean
            else:
                latents = latents / config.scaling_factor
            image = vae.decode(latents, return_dict=False)[0]
        if self.pipe.watermark is not None:
            image = self.pipe.watermark.apply_watermark(image)
        return self.pipe.image_processor.postprocess(image, output_type=output_type)[0]


def sdxl_flops(
    config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
) -> Flops:
    """One row of SDXL's UNet: SD's count and the added embedding of the pooled text and
    the time ids (``addition_embed_type`` ``text_time``: two linear layers, once per row)."""
    temb = config["block_out_channels"][0] * 4
    added = config["projection_class_embeddings_input_dim"]
    extra = linear_flops(1, added, temb) + linear_flops(1, temb, temb)
    return unet_flops(config, latent_size, text_len, ratio) + Flops(extra)


class SDXLInpaintFamily(SDInpaintFamily):
    """``sdxl-inpaint``: SDXL's 9-channel inpainting UNet with CLIP-L and CLIP-G text."""

    name = "sdxl-inpaint"
    model = SDXLInpaint
    pipeline = StableDiffusionXLInpaintPipeline
    load_kwargs: Mapping[str, Any] = {}
    text_components = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
    flops = sdxl_flops


FAMILY = SDXLInpaintFamily()
