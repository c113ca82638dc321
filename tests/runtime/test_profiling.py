"""Profiling at executor start: per-block fits with R², levels, bytes, cached on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import FluxInpaintPipeline, StableDiffusionInpaintPipeline

from retouch.functions.demo.images import mask_of_ratio, template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.platform.lab.bench.plan import LinkReader
from retouch.runtime import profiling
from retouch.runtime.costmodel import CostModel
from retouch.runtime.fingerprint import model_fingerprint
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.loader import attached, family_rows
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.planner import make_planner
from retouch.runtime.profiling import (
    ProfileConfig,
    load_or_profile,
    measure_load_line,
    profile_editor,
    profile_path,
)

SIZE = 128
QUICK = ProfileConfig(ratios=(0.2, 0.6), batches=(1, 2), repeats=1)


def _editor(model: str, models_dir: Path) -> tuple[MaskAwareEditor, Path]:
    torch.set_num_threads(1)
    folder = ensure_demo_model(model, models_dir)
    cls = StableDiffusionInpaintPipeline if "sd" in model else FluxInpaintPipeline
    pipe = cls.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    family = "sd-inpaint" if "sd" in model else "flux-inpaint"
    return MaskAwareEditor(pipe, family, torch.device("cpu")), folder


def test_flux_profile_is_cached_per_model_and_device(
    models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    editor, folder = _editor("retouch:tiny-flux", models_dir)
    model = load_or_profile(editor, model_fingerprint(folder), tmp_path, SIZE, QUICK)
    path = tmp_path / "profiles" / f"{model_fingerprint(folder)}-cpu.json"
    assert path.exists() and CostModel.from_dict(json.loads(path.read_text())) == model
    assert [b.name for b in model.blocks] == list(family_rows(editor).order)
    for block in model.blocks:
        assert block.compute.r2 <= 1.0  # values: noise on tiny blocks and a busy machine
        assert block.bytes_per_token_sparse > 0 and block.bytes_per_token_exit > 0
    assert model.load.r2 <= 1.0 and model.min_r2() <= 1.0
    assert model.extra["size"] == SIZE and attached(editor) is None

    def refuse(*args, **kwargs):
        raise AssertionError("profiled again")

    monkeypatch.setattr(profiling, "profile_editor", refuse)
    assert load_or_profile(editor, model_fingerprint(folder), tmp_path, SIZE, QUICK) == model
    with pytest.raises(AssertionError, match="profiled again"):  # another size: re-profile
        load_or_profile(editor, model_fingerprint(folder), tmp_path, 2 * SIZE, QUICK)
    path.write_text("{not json")
    with pytest.raises(AssertionError, match="profiled again"):  # unreadable: re-profile
        load_or_profile(editor, model_fingerprint(folder), tmp_path, SIZE, QUICK)


@pytest.mark.slow
def test_sd_profile_levels_and_planner(models_dir: Path) -> None:
    editor, _ = _editor("retouch:tiny-sd", models_dir)
    model = profile_editor(editor, SIZE, QUICK)
    levels = {b.name: b.level for b in model.blocks}
    assert levels["down_blocks.0.attentions.0"] == 0 and levels["mid_block.attentions.0"] == 1
    coarse = next(b for b in model.blocks if b.level == 1)
    fine = next(b for b in model.blocks if b.level == 0)
    assert coarse.bytes_per_token_sparse == 2 * fine.bytes_per_token_sparse  # 2x channels
    assert fine.bytes_per_token_exit == 0  # UNet blocks read their Y inside the block
    assert all(b.compute.r2 <= 1.0 for b in model.blocks)
    image = template_image((SIZE, SIZE), 1)
    store = MemoryActivations()
    editor.bake(image, "a door", 1, 2, 4.0, store)
    mask = mask_of_ratio((SIZE, SIZE), 0.3, "rect", seed=2)
    state = editor.prepare(EditRequest(image, mask, "red", 3, 2, 4.0, "a door", 1), store)
    planner = make_planner(model, editor.device)
    modes = planner([state], editor.blocks)
    assert set(modes) == set(editor.blocks) and planner.last is not None


def test_load_line_through_an_emulated_link(models_dir: Path) -> None:
    """The load line recovers a link's bandwidth (the bench's GPU-regime emulation)."""
    editor, _ = _editor("retouch:tiny-flux", models_dir)
    image = template_image((SIZE, SIZE), 1)
    store = MemoryActivations()
    editor.bake(image, "a door", 1, 2, 4.0, store)
    mask = mask_of_ratio((SIZE, SIZE), 0.2, "rect", seed=2)
    request = EditRequest(image, mask, "red", 3, 2, 4.0, "a door", 1)
    state = editor.prepare(request, LinkReader(store, gbps=0.005))
    line = measure_load_line(editor, state, repeats=1)
    assert 0.7 / 0.005e9 < line.slope < 2.0 / 0.005e9 and line.r2 > 0.8, line


def test_a_copy_loaded_in_another_dtype_has_its_own_profile(models_dir: Path) -> None:
    """Profiles are keyed by the model as loaded (``LoadedModel.fingerprint``): a plain
    folder keeps its folder hash as the key, a bf16 copy of it gets another file."""
    folder = ensure_demo_model("retouch:tiny-sd", models_dir)
    plain = model_fingerprint(folder)
    bf16 = f"{plain}-None-torch.bfloat16"  # as runtime/models.py's source_fingerprint
    data = Path("/data")
    assert profile_path(data, plain, "cpu").name == f"{plain}-cpu.json"
    assert profile_path(data, bf16, "cpu") != profile_path(data, plain, "cpu")
    assert profile_path(data, bf16, "cpu").parent == data / "profiles"


def test_a_profile_of_slow_steps_keeps_to_its_budget() -> None:
    """A deploy waits for its profile: steps that would overrun the budget are measured
    at the smallest and largest ratio at batch 1 only; fast ones at every point."""
    config = ProfileConfig()
    assert config.steps() == 4 * 3 * 3  # 3 ratios and full, batches 1 + 2, 3 steps a run
    assert config.within(0.01) is config  # 0.36 s of steps
    small = config.within(1.0)  # 36 s of steps against 20
    assert small.ratios == (0.15, 0.7) and small.batches == (1,) and small.steps() == 9
    assert small.within(10.0) is small  # nothing smaller to go to


def test_a_budgeted_profile_still_fits_every_block(models_dir: Path) -> None:
    editor, _ = _editor("retouch:tiny-sd", models_dir)
    model = profile_editor(editor, SIZE, ProfileConfig(budget_s=0.0))  # every step "slow"
    assert model.extra["batches"] == [1] and model.extra["ratios"] == [0.15, 0.7]
    assert all(b.compute.slope > 0 or b.compute.intercept > 0 for b in model.blocks)
