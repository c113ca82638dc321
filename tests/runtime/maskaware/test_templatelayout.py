"""The template layout a capacity plan predicts is the one a bake stores: every entry of a
real bake of each family's tiny model (native and fp8 rows) equals the prediction from the
model's shapes (a real store's bytes for it: ``tests/platform/lab/test_plan_capacity.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from retouch.functions.demo.images import template_image
from retouch.functions.demo.production import build_shape
from retouch.platform.lab.bench.engine import load_demo
from retouch.runtime.maskaware.editor import MaskAwareEditor
from retouch.runtime.maskaware.rowformat import RowFormat
from retouch.runtime.maskaware.storedrows import EncodingWriter
from retouch.runtime.maskaware.templatelayout import EntryList, template_entries

STEPS = 2
MODELS = ["tiny-sd", "tiny-sdxl", "tiny-flux", "tiny-flux-fill", "tiny-sd3"]


def _editor(model: str, models_dir: Path) -> tuple[MaskAwareEditor, int]:
    family, pipe, size = load_demo(f"retouch:{model}", models_dir, "test", torch.device("cpu"))
    return MaskAwareEditor(pipe, family, "cpu"), size


@pytest.mark.parametrize("model", MODELS)
def test_predicted_entries_are_the_baked_ones(model: str, models_dir: Path) -> None:
    editor, size = _editor(model, models_dir)
    for storage in RowFormat:
        baked = EntryList()
        image = template_image((size, size), seed=1)
        editor.bake(image, "a quiet street", 1, STEPS, 4.0, EncodingWriter(baked, storage))
        predicted = template_entries(editor, size, size, STEPS, storage)
        assert sorted(predicted, key=str) == sorted(baked.entries, key=str)


def test_production_shapes_are_planned_on_the_meta_device() -> None:
    """SD2-inpainting at 512², 50 steps, bf16: 16 blocks of K, V and Y rows; the UNet's
    first level holds 4096 tokens of 320 channels, two CFG rows each."""
    shape, pipe = build_shape("sd2-inpaint", "meta")
    editor = MaskAwareEditor(pipe, shape.family, "meta")
    entries = template_entries(editor, 512, 512, 50, RowFormat.NATIVE)
    first = next(e for e in entries if e.step == 0)
    assert (first.block, first.name, first.shape) == (
        "down_blocks.0.attentions.0",
        "k0",
        (2, 4096, 320),
    )
    assert first.dtype == torch.bfloat16
    assert len({e.block for e in entries if e.step >= 0}) == 16
    assert len([e for e in entries if e.step == 49]) == 16 * 3
