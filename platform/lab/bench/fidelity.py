"""``retouch bench fidelity``: how close mask-aware edits stay to the stock pipeline.

Two forms, one command:

* ``run_fidelity_bench`` (random-weight models): one template is baked with its own prompt
  and seed; one edit with another prompt and seed and a rectangle of ``mask_ratio`` runs
  through the stock diffusers pipeline once and through the mask-aware path once per
  ``full_steps`` value. Reported per value: PSNR and SSIM over the whole image and PSNR over
  the unmasked region, and the stock pipeline's own sensitivity to the masked noise alone.
* ``run_edit_grid`` (trained weights, ``retouch:shapes-sd``): held-out shapes scenes, each
  baked with its caption; an irregular mask around the most visible object at each ratio,
  the prompt asking for that object in another colour. Per (ratio, ``full_steps``): PSNR
  and SSIM of mask-aware vs stock over the whole image and over the unmasked region, the
  same with both outputs composited into the template (the ``composite`` function option),
  the edit-success rate of both, and the time of both edits, measured side by side.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from retouch.functions.demo.images import template_image
from retouch.functions.demo.shapes import edit_succeeded, make_scene, object_phrase
from retouch.functions.families import family_spec
from retouch.functions.imaging import composite
from retouch.platform.lab.bench.edits import EVAL_SEED, TEMPLATE_SEED, recolour_target, to_uint8
from retouch.platform.lab.bench.engine import (
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
    halo: int | None = None,
) -> list[dict[str, Any]]:
    """One row per ``full_steps`` value: ``psnr``, ``ssim``, ``psnr_unmasked`` against the
    stock output, and ``stock_vs_stock_psnr`` (stock with only the masked noise changed)."""
    if any(not 0 <= k <= steps for k in full_steps):
        raise ValueError(f"every full_steps value must be in [0, steps={steps}]")
    where = pick_device(device)
    family, pipe, size = load_demo(model, models_dir, "fidelity", where)
    editor = MaskAwareEditor(pipe, family, where)
    halo = family_spec(family).halo if halo is None else halo
    image, mask = template_image((size, size), 3), rectangle(size, mask_ratio)
    store = MemoryActivations()
    editor.bake(image, TEMPLATE_PROMPT, 1, steps, guidance, store)
    request = EditRequest(
        image, mask, EDIT_PROMPT, 2, steps, guidance, TEMPLATE_PROMPT, 1, halo=halo
    )
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
                "halo": halo,
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


GRID_SEED = EVAL_SEED + 500_000  # held-out scenes apart from ``bench edits``' own
OTHER_SEED = 1_000_000  # the second stock edit's seed offset (another masked noise)


def object_blob(silhouette: np.ndarray, ratio: float, rng: np.random.Generator) -> np.ndarray:
    """An irregular mask of about ``ratio`` of the image around an object: its blurred
    silhouette plus random brush strokes from its centre, thresholded at the quantile that
    covers ``ratio`` (the object is inside whenever it is smaller than that)."""
    size = silhouette.shape[0]
    ys, xs = np.nonzero(silhouette)
    x, y = (float(xs.mean()), float(ys.mean())) if len(xs) else (size / 2, size / 2)
    strokes = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(strokes)
    for _ in range(8):
        nx = float(np.clip(x + rng.normal(0, size / 7), 0, size - 1))
        ny = float(np.clip(y + rng.normal(0, size / 7), 0, size - 1))
        draw.line([x, y, nx, ny], fill=255, width=max(2, size // 12))
        x, y = nx, ny
    body = Image.fromarray(silhouette.astype(np.uint8) * 255)
    field = 2.0 * np.asarray(body.filter(ImageFilter.GaussianBlur(size / 32)), dtype=np.float64)
    field += np.asarray(strokes.filter(ImageFilter.GaussianBlur(size / 16)), dtype=np.float64)
    field += rng.uniform(0, 1e-3, field.shape)  # break ties so the quantile is exact
    return field >= np.quantile(field, 1.0 - ratio)


def run_edit_grid(
    editor: MaskAwareEditor,
    *,
    edits: int,
    ratios: list[float],
    full_steps: list[int],
    steps: int,
    guidance: float,
    halos: list[int] | None = None,
    feather_px: int = 3,
    seed: int = 0,
    storages: tuple[str, ...] = ("native",),
) -> list[dict[str, Any]]:
    """One row per (mask ratio, ``full_steps``, halo, storage), each over ``edits``
    held-out scenes (``halos``: default the family's). ``storages``: how the template's
    rows rest (``runtime/maskaware/rowformat.py``); rows of a storage other than the first
    also give ``ssim_vs_first``, their edits against the first storage's (bf16-equivalent
    bytes of each in ``template_bytes``)."""
    if any(not 0 <= k <= steps for k in full_steps):
        raise ValueError(f"every full_steps value must be in [0, steps={steps}]")
    size = editor.impl.pipe.unet.config.sample_size * editor.impl.pipe.vae_scale_factor
    halos = halos if halos is not None else [family_spec(editor.family).halo]
    cells = [(r, k, h, f) for r in ratios for k in full_steps for h in halos for f in storages]
    samples: dict[tuple, list[dict[str, Any]]] = {cell: [] for cell in cells}
    rng = np.random.default_rng([seed, 11])
    for i in range(edits):
        scene = make_scene(GRID_SEED + seed * 10_000 + i, size)
        index, colour = recolour_target(scene, rng)
        image = Image.fromarray(scene.image)
        baked = MemoryActivations()
        caption = scene.caption()
        editor.bake(image, caption, TEMPLATE_SEED, steps, guidance, baked)
        stores = {f: baked.placed("cpu", fmt=f) for f in storages}
        for ratio in ratios:
            mask = object_blob(scene.silhouettes[index], ratio, rng)
            prompt = object_phrase(colour, scene.objects[index][1])
            request = EditRequest(image, mask, prompt, i + 1, steps, guidance, caption, 0)
            stock, stock_s = _timed(editor.stock_edit, request, "np")
            # The stock pipeline against itself with only the masked noise changed: how
            # far apart two equally valid stock edits are (the floor of any comparison).
            other = np.asarray(
                editor.stock_edit(dataclasses.replace(request, seed=i + 1 + OTHER_SEED), "np")
            )
            target = (colour, scene.unpainted(index))
            reference = _compare(stock, other, scene.image, mask, target, feather_px)
            first: dict[tuple[int, int], np.ndarray] = {}
            for ratio_, k, h, f in cells:
                if ratio_ != ratio:
                    continue
                edit = dataclasses.replace(request, full_steps=k, halo=h)
                edited, edit_s = _timed(editor.edit, edit, stores[f], "np")
                versus = first.setdefault((k, h), edited)
                samples[(ratio, k, h, f)].append(
                    _compare(stock, edited, scene.image, mask, target, feather_px)
                    | {
                        "stock_s": stock_s,
                        "retouch_s": edit_s,
                        "stock_vs_stock_psnr": reference["psnr"],
                        "stock_vs_stock_ssim": reference["ssim"],
                        "stock_vs_stock_ssim_composite": reference["ssim_composite"],
                        "ssim_vs_first": ssim(edited, versus),
                        "template_bytes": _bf16_bytes(stores[f]),
                    }
                )
    rows = [_grid_row(cell, samples[cell], steps, feather_px) for cell in cells]
    for row in rows:
        row["device"] = device_name(editor.device)
        log.info("%s", row)
    return rows


def _bf16_bytes(store: MemoryActivations) -> int:
    """A template's step rows as they would rest beside a bf16 model (CPU bakes are fp32):
    2 bytes per value natively, the codes plus the scales (2 bytes each) in fp8."""
    codes = sum(
        t.numel() * min(t.element_size(), 2) for (s, _, _), t in store.tensors.items() if s >= 0
    )
    return codes + sum(t.numel() * 2 for t in store.scales.values())


def _timed(fn: Any, *args: Any) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    out = fn(*args)
    return np.asarray(out), time.perf_counter() - started


def _compare(
    stock: np.ndarray,
    edited: np.ndarray,
    template: np.ndarray,
    mask: np.ndarray,
    target: tuple[str, np.ndarray],
    feather_px: int,
) -> dict[str, Any]:
    """Agreement of two ``np`` outputs (floats in [0, 1]), raw and composited, and whether
    each painted the requested colour (``target``: the colour and the scene's unpainted
    colours, as ``shapes.edit_succeeded`` takes them)."""
    as8 = [to_uint8(stock), to_uint8(edited)]
    tpl = Image.fromarray(template)
    pasted = [
        np.asarray(composite(Image.fromarray(a), tpl, mask, feather_px), dtype=np.float64) / 255
        for a in as8
    ]
    template_f = template.astype(np.float64) / 255
    return {
        "stock_unmasked_vs_template_psnr": psnr(stock, template_f, ~mask),
        "retouch_unmasked_vs_template_psnr": psnr(edited, template_f, ~mask),
        "psnr": psnr(edited, stock),
        "ssim": ssim(edited, stock),
        "psnr_unmasked": psnr(edited, stock, ~mask),
        "ssim_unmasked": ssim(edited, stock, region=~mask),
        "psnr_composite": psnr(pasted[1], pasted[0]),
        "ssim_composite": ssim(pasted[1], pasted[0]),
        "stock_success": edit_succeeded(as8[0], mask, *target),
        "retouch_success": edit_succeeded(as8[1], mask, *target),
        "mask_ratio": float(mask.mean()),
    }


def _grid_row(
    cell: tuple[float, int, int], samples: list[dict[str, Any]], steps: int, feather_px: int
) -> dict[str, Any]:
    ratio, k, halo, storage = cell

    def mean(key: str) -> float:
        values = [s[key] for s in samples]
        finite = [v for v in values if np.isfinite(v)]
        return float(np.mean(finite)) if len(finite) == len(values) else float("inf")

    stock_s = statistics.median(s["stock_s"] for s in samples)
    retouch_s = statistics.median(s["retouch_s"] for s in samples)
    return {
        "mask_ratio": ratio,
        "mask_ratio_measured": round(mean("mask_ratio"), 3),
        "full_steps": k,
        "halo": halo,
        "storage": storage,
        "template_bytes": int(mean("template_bytes")),
        "ssim_vs_first": round(mean("ssim_vs_first"), 4),
        "ssim_vs_first_min": round(min(s["ssim_vs_first"] for s in samples), 4),
        "steps": steps,
        "edits": len(samples),
        "psnr": round(mean("psnr"), 2),
        "psnr_min": round(min(s["psnr"] for s in samples), 2),
        "ssim": round(mean("ssim"), 4),
        "ssim_min": round(min(s["ssim"] for s in samples), 4),
        "psnr_unmasked": round(mean("psnr_unmasked"), 2),
        "ssim_unmasked": round(mean("ssim_unmasked"), 4),
        "feather_px": feather_px,
        "psnr_composite": round(mean("psnr_composite"), 2),
        "ssim_composite": round(mean("ssim_composite"), 4),
        "ssim_composite_min": round(min(s["ssim_composite"] for s in samples), 4),
        "stock_vs_stock_psnr": round(mean("stock_vs_stock_psnr"), 2),
        "stock_vs_stock_ssim": round(mean("stock_vs_stock_ssim"), 4),
        "stock_vs_stock_ssim_composite": round(mean("stock_vs_stock_ssim_composite"), 4),
        "stock_unmasked_vs_template_psnr": round(mean("stock_unmasked_vs_template_psnr"), 2),
        "retouch_unmasked_vs_template_psnr": round(mean("retouch_unmasked_vs_template_psnr"), 2),
        "stock_success": round(mean("stock_success"), 3),
        "retouch_success": round(mean("retouch_success"), 3),
        "stock_ms_p50": round(stock_s * 1e3, 1),
        "retouch_ms_p50": round(retouch_s * 1e3, 1),
        "retouch_over_stock_time": round(retouch_s / stock_s, 3),
    }
