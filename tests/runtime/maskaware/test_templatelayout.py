"""The template layout a capacity plan predicts is the one a bake stores: every entry of a
real bake of each family's tiny model (native and fp8 rows), and a real store's disk and
host bytes for it, equal the prediction from the model's shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from retouch.cachestore.footprint import template_bytes
from retouch.cachestore.store import ActivationStore, StoreConfig
from retouch.functions.demo.images import template_image
from retouch.functions.demo.production import build_shape
from retouch.platform.bench.engine import load_demo
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


def test_a_real_store_holds_the_predicted_bytes(models_dir: Path, tmp_path: Path) -> None:
    editor, size = _editor("tiny-sd", models_dir)
    predicted = template_bytes(template_entries(editor, size, size, STEPS, RowFormat.FP8))
    with ActivationStore(StoreConfig(path=tmp_path / "cache")) as store:
        with store.bake("street", {}) as writer:
            image = template_image((size, size), seed=1)
            editor.bake(
                image, "a quiet street", 1, STEPS, 4.0, EncodingWriter(writer, RowFormat.FP8)
            )
        assert store.nbytes("street") == predicted.disk
        store.evict("street")
        store.acquire("street").release()  # loaded from disk into one host buffer
        assert store.stats()["host_bytes"] == predicted.host
    assert predicted.device < predicted.disk  # the per-template tensors stay on the host


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
