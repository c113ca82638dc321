"""``retouch demo``: the trained model's edits, served and by the stock pipeline, on a
labelled sheet; the random-weight tour only when asked for."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

from retouch.functions.demo.shapes import make_scene
from retouch.platform.api.client import read_spec_file
from retouch.platform.cli.main import build_parser
from retouch.platform.lab.demo import (
    LABEL_H,
    LABEL_W,
    SHAPE_EDITS,
    SHAPES_EXAMPLE,
    row_label,
    run_demo,
)


def test_shapes_templates_are_the_scenes_their_ids_name(examples: Path) -> None:
    spec, images = read_spec_file(examples / SHAPES_EXAMPLE)
    assert spec.composite and spec.model == "retouch:shapes-sd"
    for template, data in images.items():
        scene = make_scene(int(template.rsplit("-", 1)[1]))
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), scene.image)
        assert spec.templates[template].prompt == scene.caption()


def test_the_tour_is_behind_a_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["demo"]).tour is False
    assert parser.parse_args(["demo", "--tour"]).tour is True


def test_demo_edits_on_the_trained_model_onto_a_labelled_sheet(
    examples: Path, tmp_path: Path
) -> None:
    """The demo as ``make demo`` runs it, on a copy of the examples whose trained function
    takes 10 steps, not 25: its bakes and each edit's two paths (served and stock) are most
    of the suite's longest test, and what it checks holds at any count."""
    folder = Path(shutil.copytree(examples, tmp_path / "examples"))
    spec = folder / SHAPES_EXAMPLE
    spec.write_text(spec.read_text().replace("\nsteps = 25\n", "\nsteps = 10\n", 1))
    assert read_spec_file(spec)[0].steps == 10
    out = tmp_path / "demo"
    result = run_demo(out, folder, executors=1)
    assert result.tour == []  # no random-weight model unless asked for
    assert sorted(p.name for p in out.iterdir()) == ["data", "shapes-sheet.png"]
    assert [e.template for e in result.edits] == [t for t, _, _ in SHAPE_EDITS]
    for e in result.edits:
        assert e.path == "maskaware"  # the demo waits for the bakes
        grown = Image.fromarray(e.mask.astype(np.uint8) * 255).filter(ImageFilter.MaxFilter(9))
        far = np.asarray(grown) == 0
        # composite: outside the edited region both are the template's own pixels
        assert np.array_equal(e.retouch[far], e.image[far])
        assert np.array_equal(e.stock[far], e.image[far])
        assert not np.array_equal(e.retouch[e.mask], e.image[e.mask])  # something was painted
        assert np.isfinite(e.ssim) and 0 < e.ssim <= 1
        assert row_label(e)[0] == f'"{e.prompt}"'

    assert result.sheet == out / "shapes-sheet.png"
    sheet = np.asarray(Image.open(result.sheet).convert("L"))
    tile = 128 * 2
    assert sheet.shape == (LABEL_H + 4 * tile, LABEL_W + 5 * tile)
    assert (sheet[:LABEL_H] < 128).any()  # the column headers
    for r in range(4):  # each row's prompt and figures, left of its images
        label = sheet[LABEL_H + r * tile + 2 : LABEL_H + (r + 1) * tile, :LABEL_W]
        assert (label < 128).sum() > 200
