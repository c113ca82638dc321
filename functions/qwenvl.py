"""Qwen2.5-VL's processor for images and text alone: what Qwen-Image-Edit's pipeline reads
its condition image with (``QwenImageEditInpaintPipeline.processor``).

transformers' ``Qwen2VLProcessor`` also holds a video processor, whose class needs
torchvision; without it the processor cannot even be built, and a Qwen-Image-Edit folder
does not load. The edit pipeline hands the processor images only, so
:class:`ImageTextProcessor` is ``Qwen2VLProcessor`` without the video processor: the same
``__call__`` (the image's patches and the ``<|image_pad|>`` run expanded to the image's
merged tokens), with the PIL backend of Qwen2-VL's image processor, which is what
transformers itself falls back to without torchvision. It reads the ``processor`` folder of
a Qwen-Image-Edit checkpoint as published (``preprocessor_config.json`` and the tokenizer's
files); a folder saved by transformers' own processor (``processor_config.json``) reads
alike. Imported by the model builders and the runtime only (it imports transformers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import Qwen2Tokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor

# The Qwen2.5-VL vision tower's patch geometry the image processor must share
# (``vision_config``: ``patch_size``, ``spatial_merge_size``, ``temporal_patch_size``).
PATCH, MERGE, TEMPORAL_PATCH = 14, 2, 2
# Qwen2.5-VL's pixel bounds (``min_pixels``, ``max_pixels``): 4 to 16384 merged tokens.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16384
# The class a Qwen-Image-Edit ``model_index.json`` names for its processor.
INDEX_ENTRY = ["transformers", "Qwen2VLProcessor"]


class ImageTextProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with no video processor (see the module docstring)."""

    def __init__(
        self,
        image_processor: Qwen2VLImageProcessorPil | None = None,
        tokenizer: Qwen2Tokenizer | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template, **kwargs)

    @classmethod
    def from_folder(cls, folder: Path) -> ImageTextProcessor:
        """The processor of a ``processor`` folder: its image processor's config (the
        published ``preprocessor_config.json``, or transformers' ``processor_config.json``)
        and its tokenizer."""
        return cls(
            image_processor=image_processor(folder),
            tokenizer=Qwen2Tokenizer.from_pretrained(folder),
        )

    def save(self, folder: Path) -> None:
        """The layout of a published Qwen-Image-Edit ``processor`` folder: the image
        processor's ``preprocessor_config.json`` and the tokenizer's files."""
        self.image_processor.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)


def image_processor(folder: Path) -> Qwen2VLImageProcessorPil:
    """Qwen2-VL's image processor (PIL backend) of a ``processor`` folder."""
    published = folder / "preprocessor_config.json"
    if published.is_file():
        return Qwen2VLImageProcessorPil.from_pretrained(folder)
    saved = json.loads((folder / "processor_config.json").read_text())["image_processor"]
    saved.pop("image_processor_type", None)
    return Qwen2VLImageProcessorPil(**saved)


def new_image_processor(max_pixels: int = MAX_PIXELS) -> Qwen2VLImageProcessorPil:
    """Qwen2.5-VL's image processor (patch 14, merge 2, temporal patch 2, CLIP's
    normalisation); ``max_pixels`` bounds the merged tokens an image becomes."""
    return Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=TEMPORAL_PATCH,
        min_pixels=MIN_PIXELS,
        max_pixels=max_pixels,
    )


def image_tokens(images: Qwen2VLImageProcessorPil, height: int, width: int) -> int:
    """The merged vision tokens an image of ``height`` x ``width`` becomes in the text."""
    patches = images.get_number_of_image_patches(height, width, {})
    return patches // images.merge_size**2
