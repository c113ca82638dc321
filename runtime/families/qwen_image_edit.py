"""The ``qwen-image-edit`` family: QwenImageEditInpaintPipeline (Qwen-Image-Edit) split into
encode / assemble / step / decode, mask-aware with Qwen-Image's blocks
(``maskaware.qwen_blocks``).

Qwen-Image-Edit is Qwen-Image's MMDiT reading the image twice: its latents (the VAE
posterior's sample, drawn with the pipeline's generator) follow the edited latents in the
image sequence, with RoPE frame index 1 (``img_shapes`` ``[(1, h, w), (1, h, w)]``), and the
prediction of the edited tokens is the first part of the output; and its Qwen2.5-VL reads
the image with the prompt (the edit template's ``<|image_pad|>`` expanded to the image's
merged vision tokens, ``functions/qwenvl``), so the text depends on the template. The latents,
schedule, true classifier-free guidance (two rows: [negative ; prompt]), blend and decode are
Qwen-Image's (this module subclasses ``qwen_image``). The pipeline's reference latents are
the very latents its blend restores: one per-template tensor of the bake. Mask-aware, the
reference tokens are unmasked tokens as in ``flux-kontext``: the token grid is the edited
latents' with the reference's stacked below it, nothing of the reference masked, their K/V
and Y rows from the bake; only the masked tokens of the edited image are computed. The
pipeline samples its VAE before it draws the noise, so a seed's VAE noise is its first draw
here (``vae_noise_first``).

Size. The pipeline takes no size: it resizes its image to ``calculate_dimensions(1024 *
1024, aspect)`` (multiples of 32 near one megapixel) and edits and returns that. A served
edit runs at the template's own size, as every family does (the mask, the bake's rows and
the output are the template's): a template deployed at the pipeline's size (1024x1024,
1184x896, ... for its aspect) gets exactly the pipeline's edit, unmodified; a template of
another size is edited by the same model at its own size, with no resize in or out (the
same model's ``QwenImageEditPipeline`` takes an output ``height`` and ``width``;
``flux-kontext`` serves other sizes than Kontext's alike). Resizing every edit to one megapixel would make a 512 px template cost
four times its tokens, twice over with the reference, for an output the user did not ask
for. The stock reference (:meth:`QwenImageEditInpaint.stock`) is the pipeline; at another
size its size rule alone answers the template's size (:func:`edit_size`), everything else
unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import QwenImageEditInpaintPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_inpaint as edit_pipeline
from PIL import Image

from retouch.functions.qwenvl import ImageTextProcessor, image_tokens, new_image_processor
from retouch.runtime.families.qwen_image import (
    NOMINAL_PROMPT_TOKENS,
    QwenImageFamily,
    QwenImageInpaint,
    qwen_sequence_flops,
)
from retouch.runtime.maskaware.context import ForwardContext
from retouch.runtime.maskaware.flops import Flops
from retouch.runtime.maskaware.noise import SeedNoise
from retouch.runtime.maskaware.request import EditRequest, RequestState, token_sets
from retouch.runtime.maskaware.tokens import TokenSet

EDIT_AREA = 1024 * 1024  # the area the pipeline resizes every image to
_SIZE_RULE = threading.Lock()  # edit_size may replace a module function: one stock call at a time


class QwenImageEditInpaint(QwenImageInpaint):
    """Glue between the editor and a QwenImageEditInpaintPipeline."""

    image_sequences = 2  # the edited latents' tokens, then the reference's
    vae_noise_first = True  # the pipeline samples its VAE with the generator, then draws

    @staticmethod
    def text_length(pipe: QwenImageEditInpaintPipeline) -> int:
        """The text tokens of a nominal prompt with an image at the pipeline's own size."""
        return edit_text_length(pipe, 1024, 1024)

    def encode_text(self, request: EditRequest) -> dict[str, torch.Tensor]:
        """Each prompt encoded alone with the template image, as the pipeline encodes them."""
        return self.encoded_pair(request.negative_prompt, request.prompt, image=request.image)

    def tokens(self, hard: torch.Tensor, *, every: bool) -> dict[tuple[int, int], TokenSet]:
        """The edited latents' 2x2-packed token grid with the reference's stacked below it
        (the order of the image sequence); none of the reference's is masked."""
        h, w = hard.shape
        stacked = torch.cat([hard, torch.zeros_like(hard)])
        return token_sets(stacked, [(h, w // 2)], every=every)

    def transformer_input(self, state: RequestState) -> torch.Tensor:
        """[latents ; reference latents] (the template's packed latents)."""
        return torch.cat((state.latents, state.inputs.image_latents), dim=1)

    def img_shapes(self, state: RequestState) -> list[tuple[int, int, int]]:
        """The edited image, then the reference (RoPE frame index 1), of one size."""
        return super().img_shapes(state) * 2

    def forward(self, states: list[RequestState], ctx: ForwardContext) -> list[torch.Tensor]:
        """Qwen-Image's batched call; each request's prediction pair of its edited tokens."""
        edited = states[0].latents.shape[1]
        return [out[:, :edited] for out in super().forward(states, ctx)]

    # -- the stock reference --------------------------------------------------------------

    def stock(
        self,
        requests: list[EditRequest],
        noises: list[tuple[SeedNoise, SeedNoise]],
        output_type: str = "pil",
    ) -> list[Image.Image] | np.ndarray:
        """One pipeline call per request (the pipeline reads one image per call), at the
        template's size (:func:`edit_size`)."""
        out = []
        for request, noise in zip(requests, noises, strict=True):
            with edit_size(request.width, request.height):
                out.append(super().stock([request], [noise], output_type))
        if output_type == "np":
            return np.concatenate(out)
        return [image for images in out for image in images]

    def stock_batch(
        self, requests: list[EditRequest], noises: list[tuple[SeedNoise, SeedNoise]]
    ) -> dict[str, Any]:
        """The template image (the pipeline encodes it itself, with a generator on the
        template's seed: its first draw is the template's VAE noise), the composed noise
        where it is not the template seed's own (the pipeline's ``latents``,
        :func:`~retouch.runtime.families.qwen_image.given_noise`), and zero
        ``masked_image_latents``: nothing in the 16-channel model's loop reads them, and
        given they spare a VAE encode that changes nothing."""
        (request,), ((template, own),) = requests, noises
        composed = self.composed_noise(request, template, own)
        inputs: dict[str, Any] = {
            "image": request.image,
            "generator": torch.Generator().manual_seed(request.template_seed),
            "masked_image_latents": torch.zeros_like(composed).to(self.device, self.dtype),
        }
        if not torch.equal(composed, template.latents):
            inputs["latents"] = composed.to(self.device, self.dtype)
        return inputs


@contextlib.contextmanager
def edit_size(width: int, height: int) -> Iterator[None]:
    """Within: the edit pipeline's size rule answers ``width`` x ``height`` (the template's
    size), unless that is its own size for the aspect already (then nothing is replaced)."""
    with _SIZE_RULE:  # another thread's stock call must not see this one's rule
        original = edit_pipeline.calculate_dimensions
        if original(EDIT_AREA, width / height)[:2] == (width, height):
            yield
            return
        edit_pipeline.calculate_dimensions = lambda area, ratio: (width, height, None)
        try:
            yield
        finally:
            edit_pipeline.calculate_dimensions = original


def edit_text_length(pipe: QwenImageEditInpaintPipeline, height: int, width: int) -> int:
    """The text tokens the MMDiT reads for an image of ``height`` x ``width``: the edit
    template's after its dropped prefix, with its one ``<|image_pad|>`` expanded to the
    image's merged vision tokens, and a nominal prompt."""
    template = pipe.prompt_template_encode.format("")
    kept = len(pipe.tokenizer(template).input_ids) - pipe.prompt_template_encode_start_idx
    images = new_image_processor() if pipe.processor is None else pipe.processor.image_processor
    return kept - 1 + image_tokens(images, height, width) + NOMINAL_PROMPT_TOKENS


def qwen_edit_flops(
    config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
) -> Flops:
    """One row of Qwen-Image-Edit's MMDiT: Qwen-Image's over a sequence of twice the edited
    image's tokens (the reference's follow). At ``ratio`` 1 every token of it (the stock
    step, and a step without a cache); below it the masked share of the edited image's
    tokens, every image token a key."""
    n_tokens = (latent_size[0] // 2) * (latent_size[1] // 2)
    sequence = 2 * n_tokens
    computed = sequence if ratio >= 1.0 else ratio * n_tokens
    return qwen_sequence_flops(config, sequence, computed, text_len)


class QwenImageEditFamily(QwenImageFamily):
    """``qwen-image-edit``: Qwen-Image-Edit (Qwen-Image's MMDiT reading the template as
    reference tokens, its Qwen2.5-VL reading it with the prompt)."""

    name = "qwen-image-edit"
    model = QwenImageEditInpaint
    pipeline = QwenImageEditInpaintPipeline
    text_components = ("text_encoder", "tokenizer", "processor")
    flops = qwen_edit_flops

    def own_components(self, folder: Path, without: tuple[str, ...]) -> dict[str, Any]:
        """The processor, read without transformers' video processor (``functions/qwenvl``:
        it needs torchvision, which the edit never uses)."""
        if "processor" in without:
            return {}
        return {"processor": ImageTextProcessor.from_folder(folder / "processor")}

    def flop_shape(
        self, pipe: QwenImageEditInpaintPipeline, height: int, width: int
    ) -> tuple[Mapping[str, Any], tuple[int, int], int]:
        """Qwen-Image's, with the text of an image of that size."""
        config, latent, _ = super().flop_shape(pipe, height, width)
        return config, latent, edit_text_length(pipe, height, width)


FAMILY = QwenImageEditFamily()
