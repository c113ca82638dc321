"""The stock diffusers inpainting path: the reference every faster path is held against."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from retouch.runtime.models import LoadedModel


def stock_edit(
    loaded: LoadedModel,
    scheduler: str,
    image: Image.Image,
    mask: np.ndarray,
    prompt: str,
    seed: int,
    steps: int,
    guidance: float,
) -> Image.Image:
    """Run the family's diffusers inpainting pipeline on the whole image."""
    pipe = loaded.pipeline_for(scheduler)
    kwargs: dict = {}
    if loaded.family == "flux-inpaint":
        # Inpainting repaints the masked region from pure noise; FluxInpaintPipeline's
        # default strength (0.6) would keep a trace of the template there.
        kwargs = {"strength": 1.0, "max_sequence_length": pipe.tokenizer_2.model_max_length}
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.inference_mode():
        out = pipe(
            prompt=prompt,
            image=image.convert("RGB"),
            mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
            height=image.height,
            width=image.width,
            num_inference_steps=steps,
            guidance_scale=guidance,
            generator=generator,
            **kwargs,
        )
    return out.images[0]
