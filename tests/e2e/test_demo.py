"""The trained-model part of ``retouch demo``: real edits served and by the stock pipeline."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

from retouch.functions.demo.shapes import make_scene
from retouch.platform.client import Client, read_spec_file
from retouch.platform.demo import SHAPES_EXAMPLE, run_shape_edits, write_shape_sheet


def test_shapes_templates_are_the_scenes_their_ids_name(examples: Path) -> None:
    spec, images = read_spec_file(examples / SHAPES_EXAMPLE)
    assert spec.composite and spec.model == "retouch:shapes-sd"
    for template, data in images.items():
        scene = make_scene(int(template.rsplit("-", 1)[1]))
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), scene.image)
        assert spec.templates[template].prompt == scene.caption()


def test_demo_edits_on_the_trained_model(
    admin: Client, examples: Path, models_dir: Path, tmp_path: Path
) -> None:
    edits = run_shape_edits(admin, examples / SHAPES_EXAMPLE, models_dir)
    assert len(edits) == 4
    for e in edits:
        assert e.path == "maskaware"  # the demo waits for the bakes
        grown = Image.fromarray(e.mask.astype(np.uint8) * 255).filter(ImageFilter.MaxFilter(9))
        far = np.asarray(grown) == 0
        # composite: outside the edited region both are the template's own pixels
        assert np.array_equal(e.retouch[far], e.image[far])
        assert np.array_equal(e.stock[far], e.image[far])
        assert not np.array_equal(e.retouch[e.mask], e.image[e.mask])  # something was painted
        assert np.isfinite(e.psnr) and 0 < e.ssim <= 1
    sheet = Image.open(write_shape_sheet(edits, tmp_path / "sheet.png"))
    assert sheet.size == (5 * 128 * 2, 4 * 128 * 2 + 16)
