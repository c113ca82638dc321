"""``retouch bench fidelity``: how close mask-aware edits stay to the stock pipeline.

One template is baked with its own prompt and seed; one edit with another prompt and seed
and a rectangle of ``mask_ratio`` runs through the stock diffusers pipeline once and through
the mask-aware path once per ``full_steps`` value. Reported per value: PSNR and SSIM over
the whole image and PSNR over the unmasked region (the acceptance thresholds are 35 dB,
0.98 and 40 dB), and the stock pipeline's own sensitivity to the masked noise alone.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np

from retouch.functions.demo.images import template_image
from retouch.platform.bench.engine import (
    EDIT_PROMPT,
    TEMPLATE_PROMPT,
    device_name,
    load_demo,
)
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.quality import psnr, ssim
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.models import pick_device

log = logging.getLogger(__name__)


def rectangle(size: int, ratio: float) -> np.ndarray:
    """A square of about ``ratio`` of the image, off the centre (the fidelity tests' mask)."""
    side = round(size * np.sqrt(ratio))
    top, left = size // 8, size // 8 + size // 16
    mask = np.zeros((size, size), dtype=bool)
    mask[top : top + side, left : left + side] = True
    return mask


def run_fidelity_bench(
    model: str,
    steps: int,
    full_steps: list[int],
    models_dir: Path,
    *,
    mask_ratio: float = 0.2,
    guidance: float = 5.0,
    device: str = "auto",
) -> list[dict[str, Any]]:
    """One row per ``full_steps`` value: ``psnr``, ``ssim``, ``psnr_unmasked`` against the
    stock output, and ``stock_vs_stock_psnr`` (stock with only the masked noise changed)."""
    if any(not 0 <= k <= steps for k in full_steps):
        raise ValueError(f"every full_steps value must be in [0, steps={steps}]")
    where = pick_device(device)
    family, pipe, size = load_demo(model, models_dir, "fidelity", where)
    editor = MaskAwareEditor(pipe, family, where)
    image, mask = template_image((size, size), 3), rectangle(size, mask_ratio)
    store = MemoryActivations()
    editor.bake(image, TEMPLATE_PROMPT, 1, steps, guidance, store)
    request = EditRequest(image, mask, EDIT_PROMPT, 2, steps, guidance, TEMPLATE_PROMPT, 1)
    stock = editor.stock_edit(request, "np")
    other_noise = editor.stock_edit(dataclasses.replace(request, seed=1), "np")
    rows = []
    for k in full_steps:
        edited = editor.edit(dataclasses.replace(request, full_steps=k), store, "np")
        rows.append(
            {
                "model": model,
                "steps": steps,
                "full_steps": k,
                "mask_ratio": round(float(mask.mean()), 4),
                "device": device_name(editor.device),
                "psnr": round(psnr(edited, stock), 2),
                "ssim": round(ssim(edited, stock), 4),
                "psnr_unmasked": round(psnr(edited, stock, ~mask), 2),
                "stock_vs_stock_psnr": round(psnr(stock, other_noise), 2),
            }
        )
        log.info("%s", rows[-1])
    return rows
