"""The ``flux-fill`` family against the stock FluxFillPipeline.

The other families' checks (``test_sd3_inpaint.py`` beside it): an exact cache reproduces
the stock pipeline (run with the same composed noise), a full mask equals it whatever was
baked, plans mixing full and sparse blocks and the row loader change nothing, a request inside a batch gives its solo result, a worker's
pipeline without the transformer encodes and decodes the same, and the analytic FLOPs
equal what torch counts. Fill keeps no unmasked latents of its own: the unmasked tokens'
output comes from the last block's cached Y, which these checks cover.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxFillPipeline

from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.errors import InvalidSpec
from retouch.functions.modelcheck import check_model, model_family
from retouch.functions.modelsource import ModelSource
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor, RequestState
from retouch.runtime.maskaware.quality import psnr
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.models import load_pipeline
from tests.runtime.families.cases import CPU, EQUAL_DB, Case
from tests.runtime.families.cases import close as _close

FAMILY = "flux-fill"
CASE = Case(FAMILY, guidance=30.0)
SIZE, STEPS, GUIDANCE = CASE.size, CASE.steps, CASE.guidance
_rect, _request, _exact = CASE.rect, CASE.request, CASE.exact


@pytest.fixture(scope="module")
def folder(models_dir: Path) -> Path:
    return ensure_demo_model("retouch:tiny-flux-fill", models_dir)


@pytest.fixture(scope="module")
def pipe(folder: Path):
    return load_pipeline(folder, FAMILY, CPU)


@pytest.fixture(scope="module")
def baked(pipe) -> MemoryActivations:
    return CASE.baked(MaskAwareEditor(pipe, FAMILY, CPU))


@pytest.mark.parametrize("mask", [_rect(12, 20, 40, 50), _rect(70, 8, 30, 100)])
def test_exact_cache_reproduces_the_stock_pipeline(pipe, mask: np.ndarray) -> None:
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request, store = _exact(editor, mask)
    _close(editor.edit(request, store, "np"), editor.stock_edit(request, "np"))


def test_full_mask_equals_stock_whatever_was_baked(pipe, baked) -> None:
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request = _request(np.ones((SIZE, SIZE), bool), "a red door", 5, ("a quiet street", 3))
    _close(editor.edit(request, baked, "np"), editor.stock_edit(request, "np"))


def _final_latents(editor: MaskAwareEditor, request: EditRequest, store) -> RequestState:
    state = editor.prepare(request, store)
    while not state.done:
        editor.step([state])
    return state


def test_the_unmasked_tokens_follow_the_bake(pipe, baked) -> None:
    """Fill blends nothing back: with the template's prompt and another seed, every
    unmasked token's latents are the bake's own at the end (the template's noise, then the
    cached output each step), while the masked ones differ."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    template = _request(np.zeros((SIZE, SIZE), bool), "a quiet street", 3, ("a quiet street", 3))
    generated = _final_latents(editor, template, None).latents  # what the bake computed
    edit = _final_latents(
        editor, _request(_rect(32, 32, 48, 48), "a quiet street", 9, ("a quiet street", 3)), baked
    )
    (tokens,) = edit.tokens.values()
    assert torch.equal(edit.latents[0, tokens.unmasked], generated[0, tokens.unmasked])
    assert not torch.allclose(edit.latents[0, tokens.masked], generated[0, tokens.masked])


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
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    CASE.assert_batch_gives_solo(editor, baked)


def test_a_worker_pipeline_without_the_transformer_encodes_and_decodes_the_same(
    pipe, folder: Path
) -> None:
    packed = torch.randn(1, (SIZE // 8) ** 2, 64)  # packed: 2x2 tokens of the factor-4 VAE
    CASE.assert_worker_encodes_and_decodes_alike(pipe, folder, packed)


def test_a_transformer_without_the_fill_inputs_is_refused(pipe, models_dir: Path) -> None:
    inpaint = load_pipeline(ensure_demo_model("retouch:tiny-flux", models_dir), "flux-inpaint", CPU)
    wrong = FluxFillPipeline(**{**pipe.components, "transformer": inpaint.transformer})
    with pytest.raises(ValueError, match="192 input channels"):
        MaskAwareEditor(wrong, FAMILY, CPU)


def test_analytic_flops_equal_the_counted_step(pipe, baked) -> None:
    mask = _rect(16, 32, 64, 32)  # aligned to the 2x2-packed tokens: ratio 0.125
    requests = [_request(mask, "xyz", 2 + i, ("a quiet street", 3)) for i in range(2)]
    assert 0.1 < CASE.counted_flops_ratio(pipe, requests, baked) < 0.5


def test_a_fill_folder_is_told_apart_from_flux_inpainting(folder: Path) -> None:
    """A folder saved from FluxFillPipeline (as FLUX.1-Fill-dev ships) is a flux-fill
    model; deploying it as flux-inpaint is refused before anything loads."""
    assert model_family(str(folder)) == FAMILY
    check_model(ModelSource(str(folder)), FAMILY)
    with pytest.raises(InvalidSpec, match="cannot serve flux-inpaint"):
        check_model(ModelSource(str(folder)), "flux-inpaint")


def test_a_batched_stock_call_gives_each_request_its_reference(pipe) -> None:
    """The bench's batched baseline: each request keeps its own noise and VAE generator."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    requests = [
        _request(_rect(12, 20, 40, 50), "a red door", 5, ("a quiet street", 3)),
        _request(_rect(60, 60, 20, 30), "a blue car", 6, ("a quiet street", 4)),
    ]
    batched = editor.stock_edits(requests, "np")
    for request, together in zip(requests, batched, strict=True):
        alone = editor.stock_edit(request, "np")  # a batch of one rounds differently
        assert psnr(alone, together) >= EQUAL_DB and np.abs(alone - together).max() <= 1e-3
