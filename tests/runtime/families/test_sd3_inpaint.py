"""The ``sd3-inpaint`` family against the stock StableDiffusion3InpaintPipeline.

Same checks as the other families (``tests/runtime/maskaware/test_exactness.py`` and
``test_flops.py`` beside it): an exact cache reproduces the stock pipeline, a full mask
equals it whatever was baked, plans mixing full and sparse blocks and the row loader change
nothing, a request inside a batch gives its solo result, a worker's pipeline without the
transformer encodes and decodes the same, and the analytic FLOPs equal what torch counts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.models import load_pipeline
from tests.runtime.families.cases import CPU, Case
from tests.runtime.families.cases import close as _close

FAMILY = "sd3-inpaint"
CASE = Case(FAMILY)
SIZE, STEPS, GUIDANCE = CASE.size, CASE.steps, CASE.guidance
_rect, _request, _exact = CASE.rect, CASE.request, CASE.exact


@pytest.fixture(scope="module")
def folder(models_dir: Path) -> Path:
    return ensure_demo_model("retouch:tiny-sd3", models_dir)


@pytest.fixture(scope="module")
def pipe(folder: Path):
    return load_pipeline(folder, FAMILY, CPU)


@pytest.mark.parametrize("mask", [_rect(12, 20, 40, 50), _rect(70, 8, 30, 100)])
def test_exact_cache_reproduces_the_stock_pipeline(pipe, mask: np.ndarray) -> None:
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request, store = _exact(editor, mask)
    _close(editor.edit(request, store, "np"), editor.stock_edit(request, "np"))


def test_full_mask_equals_stock_whatever_was_baked(pipe) -> None:
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    store = MemoryActivations()
    editor.bake(template_image((SIZE, SIZE), 7), "a quiet street", 3, STEPS, GUIDANCE, store)
    request = _request(np.ones((SIZE, SIZE), bool), "a red door", 5, ("a quiet street", 3))
    _close(editor.edit(request, store, "np"), editor.stock_edit(request, "np"))


def test_mixed_plans_and_the_row_loader_change_nothing(pipe) -> None:
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request, store = _exact(editor, _rect(12, 20, 40, 50))
    first, second = editor.blocks
    plans = [{first: Mode.SPARSE, second: Mode.FULL}, {first: Mode.FULL, second: Mode.SPARSE}]
    CASE.assert_plans_and_the_loader_change_nothing(editor, request, store, plans)


def test_a_request_in_a_batch_gives_its_solo_result(pipe) -> None:
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    store = MemoryActivations()
    editor.bake(template_image((SIZE, SIZE), 7), "a quiet street", 3, STEPS, GUIDANCE, store)
    CASE.assert_batch_gives_solo(editor, store)


def test_a_worker_pipeline_without_the_transformer_encodes_and_decodes_the_same(
    pipe, folder: Path
) -> None:
    CASE.assert_worker_encodes_and_decodes_alike(
        pipe, folder, torch.randn(1, 16, SIZE // 4, SIZE // 4)
    )


def test_analytic_flops_equal_the_counted_step(pipe) -> None:
    image = template_image((SIZE, SIZE), 2)
    mask = _rect(16, 32, 64, 32)  # aligned to the 2x2 patches: ratio 0.125
    store = MemoryActivations()
    MaskAwareEditor(pipe, FAMILY, CPU).bake(image, "abc", 1, 1, GUIDANCE, store)
    requests = [EditRequest(image, mask, "xyz", 2 + i, 1, GUIDANCE, "abc", 1) for i in range(2)]
    assert 0.1 < CASE.counted_flops_ratio(pipe, requests, store) < 0.5
