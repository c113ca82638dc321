"""The ``sdxl-inpaint`` family against the stock StableDiffusionXLInpaintPipeline.

Same checks as the other families (``test_sd3_inpaint.py`` beside it): an exact cache
reproduces the stock pipeline, a full mask equals it whatever was baked, plans mixing full
and sparse blocks and the row loader change nothing, a request inside a batch gives its
solo result, a worker's pipeline without the UNet encodes and decodes the same, and the
analytic FLOPs equal what torch counts. ``retouch:tiny-sdxl`` has SDXL's layout: no
transformer blocks on its first level, two layers per block on its deepest, two text
encoders, pooled embeddings and time ids as ``added_cond_kwargs``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.models import LoadedModel, load_pipeline
from tests.runtime.families.cases import CPU, Case
from tests.runtime.families.cases import close as _close

FAMILY = "sdxl-inpaint"
CASE = Case(FAMILY)
SIZE, STEPS, GUIDANCE = CASE.size, CASE.steps, CASE.guidance
_rect, _request, _exact = CASE.rect, CASE.request, CASE.exact


@pytest.fixture(scope="module")
def folder(models_dir: Path) -> Path:
    return ensure_demo_model("retouch:tiny-sdxl", models_dir)


@pytest.fixture(scope="module")
def pipe(folder: Path):
    return load_pipeline(folder, FAMILY, CPU)


@pytest.fixture(scope="module")
def exact(pipe) -> tuple[EditRequest, MemoryActivations]:
    """A request and a cache baked with its own mask, prompt and seed."""
    mask = _rect(12, 20, 40, 50)
    request = _request(mask, "a red door", 11, ("a red door", 11))
    store = MemoryActivations()
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    editor.bake(request.image, "a red door", 11, STEPS, GUIDANCE, store, mask=mask)
    return request, store


@pytest.fixture(scope="module")
def street(pipe) -> MemoryActivations:
    """The cache of a template edits are made against ("a quiet street", seed 3)."""
    store = MemoryActivations()
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    editor.bake(template_image((SIZE, SIZE), 7), "a quiet street", 3, STEPS, GUIDANCE, store)
    return store


def test_the_unet_has_sdxl_layout(pipe) -> None:
    """What the family must handle: attention-free first level, several layers per block,
    the text-time added embedding, two text encoders side by side."""
    config = pipe.unet.config
    assert config.down_block_types[0] == "DownBlock2D"
    assert max(config.transformer_layers_per_block) > 1
    assert config.addition_embed_type == "text_time"
    width = pipe.text_encoder.config.hidden_size + pipe.text_encoder_2.config.hidden_size
    assert config.cross_attention_dim == width
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    assert not any(block.startswith("down_blocks.0.") for block in editor.blocks)


def test_exact_cache_reproduces_the_stock_pipeline(pipe, exact) -> None:
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request, store = exact
    _close(editor.edit(request, store, "np"), editor.stock_edit(request, "np"))


def test_full_mask_equals_the_pipeline_called_directly(pipe, street) -> None:
    """Mask 1.0: the mask-aware edit against another template's cache equals the stock
    StableDiffusionXLInpaintPipeline called as a user calls it, with the request's noise:
    its initial latents, then (same generator) the masked image's VAE posterior sample."""
    request = _request(np.ones((SIZE, SIZE), bool), "a red door", 5, ("a quiet street", 3))
    generator = torch.Generator().manual_seed(request.seed)
    direct = pipe(
        prompt=request.prompt,
        image=request.image,
        mask_image=Image.fromarray(request.mask.astype(np.uint8) * 255),
        height=SIZE,
        width=SIZE,
        strength=1.0,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        latents=torch.randn((1, 4, SIZE // 4, SIZE // 4), generator=generator),
        generator=generator,
        output_type="np",
    ).images[0]
    _close(MaskAwareEditor(pipe, FAMILY, CPU).edit(request, street, "np"), direct)


def test_mixed_plans_and_the_row_loader_change_nothing(pipe, exact) -> None:
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request, store = exact
    plans = [
        {b: Mode.FULL if i % 2 == parity else Mode.SPARSE for i, b in enumerate(editor.blocks)}
        for parity in (0, 1)
    ]
    CASE.assert_plans_and_the_loader_change_nothing(editor, request, store, plans)


def test_a_request_in_a_batch_gives_its_solo_result(pipe, street) -> None:
    editor, store = MaskAwareEditor(pipe, FAMILY, CPU), street
    CASE.assert_batch_gives_solo(editor, store)


def test_a_worker_pipeline_without_the_unet_encodes_and_decodes_the_same(
    pipe, folder: Path
) -> None:
    latents = torch.randn(1, 4, SIZE // 4, SIZE // 4)
    names = CASE.assert_worker_encodes_and_decodes_alike(pipe, folder, latents)
    assert names >= {"prompt_embeds", "text_embeds"}


def test_analytic_flops_equal_the_counted_step(pipe) -> None:
    image = template_image((SIZE, SIZE), 2)
    mask = _rect(16, 32, 64, 32)  # aligned to every token grid: ratio 0.125 on each
    store = MemoryActivations()
    MaskAwareEditor(pipe, FAMILY, CPU).bake(image, "abc", 1, 1, GUIDANCE, store)
    requests = [EditRequest(image, mask, "xyz", 2 + i, 1, GUIDANCE, "abc", 1) for i in range(2)]
    assert 0.1 < CASE.counted_flops_ratio(pipe, requests, store) < 1.0


def test_a_function_pipeline_keeps_the_model_options(pipe, folder: Path) -> None:
    """An executor's pipeline with the function's scheduler keeps what the model folder
    says, e.g. a refiner-style model's aesthetic-score time ids."""
    options = {"requires_aesthetics_score": True, "force_zeros_for_empty_prompt": False}
    model = type(pipe)(**pipe.components, **options)
    loaded = LoadedModel("m", FAMILY, model, CPU, folder, dict(pipe.scheduler.config))
    view = loaded.pipeline_for("ddim")
    assert type(view.scheduler).__name__ == "DDIMScheduler"
    assert {k: view.config[k] for k in options} == options
