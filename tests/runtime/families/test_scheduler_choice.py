"""A request's own scheduler (one its function allows) against diffusers' pipeline with it.

The executor runs an edit that chose another scheduler on the model's pipeline view with
that scheduler (``LoadedModel.pipeline_for``, as it makes the spec's own). Without a cache,
at mask 1.0, that must be diffusers' pipeline whose ``scheduler`` was replaced by the
class made ``from_config`` of the model's; and a bake with that scheduler (another
trajectory) makes the mask-aware edit reproduce the stock one, as for the spec's own.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from diffusers import (
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    StableDiffusionInpaintPipeline,
)

from retouch.functions.demo.models import ensure_demo_model
from retouch.runtime.maskaware.editor import MaskAwareEditor
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.models import LoadedModel, ModelCache
from tests.runtime.families.cases import CPU, close
from tests.runtime.families.test_strength import (
    GUIDANCE,
    SIZE,
    STEPS,
    STRENGTH,
    _diffusers,
    _request,
    _served,
)

MODEL, FAMILY = "retouch:tiny-sd", "sd-inpaint"  # its spec's scheduler: ddim
# The deterministic choices besides DDIM (euler-a's step draws noise; pndm's warm-up runs
# more timesteps than steps).
CHOSEN = {"euler": EulerDiscreteScheduler, "dpm++": DPMSolverMultistepScheduler}


@pytest.fixture(scope="module")
def loaded(models_dir: Path) -> LoadedModel:
    ensure_demo_model(MODEL, models_dir)
    return ModelCache(models_dir, CPU).get(MODEL, FAMILY)


def _reference(loaded: LoadedModel, name: str) -> MaskAwareEditor:
    """diffusers' pipeline of the model with its scheduler replaced by hand."""
    pipe = StableDiffusionInpaintPipeline(**loaded.pipe.components)
    pipe.scheduler = CHOSEN[name].from_config(loaded.pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return MaskAwareEditor(pipe, FAMILY, CPU)


@pytest.mark.parametrize(("name", "strength"), [("euler", STRENGTH), ("dpm++", 1.0)])
def test_the_stock_path_with_a_chosen_scheduler_equals_diffusers(
    loaded: LoadedModel, name: str, strength: float
) -> None:
    served = MaskAwareEditor(loaded.pipeline_for(name), FAMILY, CPU)
    request = _request(served, np.ones((SIZE, SIZE), bool), seed=21, strength=strength)
    out = _served(served, request)
    close(out, _diffusers(_reference(loaded, name), request))
    spec_own = MaskAwareEditor(loaded.pipeline_for("ddim"), FAMILY, CPU)
    assert np.abs(out - _served(spec_own, request)).max() > 1e-3  # 10x close(): it ran


def test_an_exact_bake_with_a_chosen_scheduler_reproduces_stock(loaded: LoadedModel) -> None:
    """DPM++ (a multistep solver: its state is the last steps' outputs) baked with the
    edit's own mask, prompt and seed: the mask-aware edit is the stock one."""
    editor = MaskAwareEditor(loaded.pipeline_for("dpm++"), FAMILY, CPU)
    mask = np.zeros((SIZE, SIZE), bool)
    mask[8:40, 12:44] = True
    request = _request(editor, mask, seed=3, negative_prompt="", prompt="a quiet street")
    request = dataclasses.replace(request, strength=1.0)
    store = MemoryActivations()
    editor.bake(request.image, "a quiet street", 3, STEPS, GUIDANCE, store, mask=mask)
    close(editor.edit(request, store, "np"), editor.stock_edit(request, "np"))
