"""The ``flux-kontext`` family against the stock FluxKontextInpaintPipeline.

The other families' checks (``test_flux_fill.py`` beside it): an exact cache (baked with
the edit's own mask, prompt and seed) reproduces the stock pipeline run with the same
composed noise, also at mask 1.0; plans mixing full and sparse blocks and the row loader
change nothing; a request inside a batch gives its solo result; a worker's pipeline without
the transformer encodes and decodes the same; the analytic FLOPs equal what torch counts.
Kontext's own: the reference tokens follow the edited ones in the sequence and come from the
bake (their rows are stored with the template's); a Kontext folder is told apart from
Flux inpainting; a LoRA of its transformer serves what diffusers' ``load_lora_weights``
gives.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.errors import InvalidSpec
from retouch.functions.modelcheck import check_model, model_family
from retouch.functions.modelsource import ModelSource
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.editor import MaskAwareEditor
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.maskaware.templatelayout import recorded_tensors
from retouch.runtime.models import load_pipeline
from tests.runtime.families.cases import CPU, Case
from tests.runtime.families.cases import close as _close

FAMILY = "flux-kontext"
CASE = Case(FAMILY, guidance=3.5)
SIZE, STEPS, GUIDANCE = CASE.size, CASE.steps, CASE.guidance
_rect, _request, _exact = CASE.rect, CASE.request, CASE.exact
# 128 px, factor-4 VAE, 2x2 packing: 16 x 16 edited tokens, then as many of the reference
TOKENS = (SIZE // 8) ** 2


@pytest.fixture(scope="module")
def folder(models_dir: Path) -> Path:
    return ensure_demo_model("retouch:tiny-flux-kontext", models_dir)


@pytest.fixture(scope="module")
def pipe(folder: Path):
    return load_pipeline(folder, FAMILY, CPU)


@pytest.fixture(scope="module")
def baked(pipe) -> MemoryActivations:
    return CASE.baked(MaskAwareEditor(pipe, FAMILY, CPU))


@pytest.mark.parametrize(
    "mask",
    [_rect(12, 20, 40, 50), _rect(70, 8, 30, 100), np.ones((SIZE, SIZE), bool)],
    ids=["door", "band", "everything"],
)
def test_exact_cache_reproduces_the_stock_pipeline(pipe, mask: np.ndarray) -> None:
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request, store = _exact(editor, mask)
    ours, stock = editor.edit(request, store, "np"), editor.stock_edit(request, "np")
    _close(ours, stock)
    assert np.abs(ours - stock).max() <= 1e-5  # the acceptance bound, fp32


def test_the_reference_tokens_follow_the_edited_ones_and_come_from_the_bake(pipe, baked) -> None:
    """The grid holds the edited tokens then the reference's, none of those masked; the
    bake stores K/V/Y rows of both, as the template layout (capacity planning) says."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request = _request(_rect(32, 32, 48, 48), "a red door", 9, ("a quiet street", 3))
    state = editor.prepare(request, baked)
    (tokens,) = state.tokens.values()
    assert tokens.n_tokens == 2 * TOKENS
    assert tokens.count == 36 and int(tokens.masked.max()) < TOKENS  # 6 x 6 packed tokens
    assert state.inputs.image_ids.shape[0] == 2 * TOKENS
    assert (state.inputs.image_ids[TOKENS:, 0] == 1).all()
    assert (state.inputs.image_ids[:TOKENS, 0] == 0).all()
    first = editor.blocks[0]
    assert baked.get(0, first, "k").shape[1] == 2 * TOKENS
    layout = {
        (step, block, name): shape
        for step, block, name, _, shape in recorded_tensors(editor, SIZE, SIZE, STEPS)
    }
    assert layout[0, first, "k"] == tuple(baked.get(0, first, "k").shape)


def test_an_edit_with_its_own_reference_is_the_stock_pipelines_with_that_reference(
    pipe, baked
) -> None:
    """Another reference image than the template: every token computed (nothing read from
    the bake, whose reference tokens are the template's), and the edit is the stock
    pipeline's given that ``image_reference``; the reference reaches the model."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request = _request(_rect(12, 20, 40, 50), "a red door", 5, ("a quiet street", 3))
    request = dataclasses.replace(request, reference=template_image((SIZE, SIZE), 3))
    state = editor.prepare(request, baked)
    (tokens,) = state.tokens.values()
    assert state.reader is None and tokens.count == tokens.n_tokens == 2 * TOKENS
    ours, stock = editor.edit(request, baked, "np"), editor.stock_edit(request, "np")
    assert np.abs(ours - stock).max() <= 1e-5
    own_template = editor.stock_edit(dataclasses.replace(request, reference=None), "np")
    assert np.abs(ours - own_template).max() > 1e-3


def test_mixed_plans_and_the_row_loader_change_nothing(pipe) -> None:
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request, store = _exact(editor, _rect(12, 20, 40, 50))
    last = editor.blocks[-1]
    plans = [
        {b: Mode.FULL if b == last else Mode.SPARSE for b in editor.blocks},
        {b: Mode.SPARSE if b == last else Mode.FULL for b in editor.blocks},
    ]
    CASE.assert_plans_and_the_loader_change_nothing(editor, request, store, plans)


def test_a_request_in_a_batch_gives_its_solo_result(pipe, baked) -> None:
    CASE.assert_batch_gives_solo(MaskAwareEditor(pipe, FAMILY, CPU), baked)


def test_a_worker_pipeline_without_the_transformer_encodes_and_decodes_the_same(
    pipe, folder: Path
) -> None:
    packed = torch.randn(1, TOKENS, 64)
    CASE.assert_worker_encodes_and_decodes_alike(pipe, folder, packed)


def test_analytic_flops_equal_the_counted_step(pipe, baked) -> None:
    mask = _rect(16, 32, 64, 32)  # aligned to the 2x2-packed tokens: ratio 0.125
    requests = [_request(mask, "xyz", 2 + i, ("a quiet street", 3)) for i in range(2)]
    assert 0.05 < CASE.counted_flops_ratio(pipe, requests, baked) < 0.5


def test_a_kontext_folder_is_told_apart_from_flux_inpainting(folder: Path) -> None:
    """A folder saved from FluxKontextInpaintPipeline is a flux-kontext model; deploying
    it as flux-fill is refused before anything loads."""
    assert model_family(str(folder)) == FAMILY
    check_model(ModelSource(str(folder)), FAMILY)
    with pytest.raises(InvalidSpec, match="cannot serve flux-fill"):
        check_model(ModelSource(str(folder)), "flux-fill")


def test_a_lora_on_the_kontext_transformer_serves_what_diffusers_loads(
    folder: Path, models_dir: Path, tmp_path: Path
) -> None:
    """A LoRA of the transformer's attention (diffusers' layout), attached as an executor
    attaches adapters: the mask-aware edit after a bake under it is the stock pipeline's
    with ``load_lora_weights`` (exact cache), and the LoRA changes the image."""
    ours, stock, bare = CASE.lora_edit_and_stock(
        "retouch:tiny-flux-kontext", folder, models_dir, tmp_path
    )
    _close(ours, stock)
    assert np.abs(ours - bare).max() > 0.05  # the LoRA reached the transformer
