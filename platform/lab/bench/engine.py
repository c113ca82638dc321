"""``retouch bench engine``: mask-aware edits against the stock diffusers pipeline, same model, same run.

For every (batch, mask ratio) case the stock pipeline (one batched call, with the same
composed noise) and the mask-aware path (``prepare`` / ``step`` / ``finish`` on the whole
batch) edit the same requests, interleaved repeat by repeat with alternating order so that
drift on a shared machine hits both alike; the median of the repeats is reported. Times
cover whole edits (pre-processing, every step, VAE decode); the template's bake happens
once before and is excluded. ``flop_ratio`` is the analytic ideal from the model config.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import DiffusionPipeline
from tqdm import tqdm

from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import demo_model, ensure_demo_model, is_demo
from retouch.functions.families import family_spec
from retouch.platform.api.config import default_data_dir
from retouch.runtime.families.stepflops import pipeline_step_flops
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.models import load_pipeline, pick_device, synchronize
from retouch.runtime.stockgraphs import StockGraphs

log = logging.getLogger(__name__)

TEMPLATE_PROMPT = "a quiet street"  # the demo tokenizers take 14 characters
EDIT_PROMPT = "a red bicycle"
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def run_engine_bench(
    model: str,
    mask_ratios: list[float],
    batches: list[int],
    steps: int,
    repeats: int = 3,
    models_dir: Path | None = None,
    *,
    guidance: float = 4.0,
    clock: str = "wall",
    full_steps: int = 0,
    device: str = "auto",
    dtype: str = "auto",
) -> list[dict[str, Any]]:
    """Stock vs mask-aware whole edits for every batch size and mask ratio.

    Returns one row per case: ``model, mask_ratio, batch, stock_s, maskaware_s, ratio
    (maskaware_s / the faster stock), flop_ratio``; on CUDA also ``stock_graphs_s`` (stock
    with its denoiser call replayed from CUDA graphs) and ``ratio_eager`` (against the
    eager stock). Models are built into ``models_dir`` (default
    ``$RETOUCH_DATA_DIR/models``) on first use. ``clock="cpu"`` times process CPU time instead
    of wall time (steadier on a machine shared with other work). ``full_steps``: the
    mask-aware edits' warm-up steps over every token (rows then carry ``full_steps``).
    ``device``: ``auto`` (CUDA when there is one), ``cpu`` or ``cuda``; rows name it.
    ``dtype``: the compute dtype as a spec names it (``auto``: the family's on the device).
    """
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, not {clock!r}")
    if not 0 <= full_steps <= steps:
        raise ValueError(f"full_steps must be in [0, steps={steps}], not {full_steps}")
    where = pick_device(device)
    family, pipe, size = load_demo(
        model, models_dir or default_data_dir() / "models", "engine", where, dtype
    )
    editor = MaskAwareEditor(pipe, family, where)
    template = template_image((size, size), seed=1)
    store = MemoryActivations()
    editor.bake(template, TEMPLATE_PROMPT, 1, steps, guidance, store)
    log.info("baked %s: %.1f MB of activations", model, store.nbytes / 2**20)
    cell = _token_cell(editor, size)
    cases = [(batch, ratio) for batch in batches for ratio in mask_ratios]
    results = []
    graphed: dict[int, float] = {}  # batch -> the stock edit with its denoiser call graphed
    with tqdm(total=len(cases) * repeats, desc=f"bench engine {model}", unit="run") as bar:
        for index, (batch, ratio) in enumerate(cases):
            mask = aligned_mask(size, ratio, cell)
            requests = [
                EditRequest(
                    template,
                    mask,
                    EDIT_PROMPT,
                    100 + i,
                    steps,
                    guidance,
                    TEMPLATE_PROMPT,
                    1,
                    full_steps,
                    family_spec(family).halo,
                )
                for i in range(batch)
            ]
            runs = {
                "stock": lambda reqs=requests: editor.stock_edits(reqs),
                "maskaware": lambda reqs=requests: _maskaware(editor, reqs, store),
            }
            if index == 0 or cases[index - 1][0] != batch:
                for run in runs.values():  # warm-up: first-call allocations, kernel choices
                    run()
            times = _interleaved(runs, repeats, CLOCKS[clock], bar, where)
            if where.type == "cuda" and batch not in graphed:  # stock does not depend on the mask
                graphed[batch] = _graphed_stock_s(editor, requests, repeats, CLOCKS[clock], where)
            flops = pipeline_step_flops(pipe, family, size, size, float(mask.mean()), batch)
            stock, sparse = statistics.median(times["stock"]), statistics.median(times["maskaware"])
            best = min(stock, graphed.get(batch, stock))
            results.append(
                {
                    "model": model,
                    "mask_ratio": ratio,
                    "batch": batch,
                    "stock_s": round(stock, 4),
                    "maskaware_s": round(sparse, 4),
                    "ratio": round(sparse / best, 4),  # against the faster stock
                    "flop_ratio": round(flops.ratio, 4),
                    "device": device_name(where),
                    "dtype": str(pipe.dtype).removeprefix("torch."),
                }
            )
            if batch in graphed:
                results[-1].update(
                    stock_graphs_s=round(graphed[batch], 4), ratio_eager=round(sparse / stock, 4)
                )
            if full_steps:
                results[-1]["full_steps"] = full_steps
            log.info("%s", results[-1])
    return results


def latency_fit(results: list[dict[str, Any]], batch: int) -> tuple[float, float, float]:
    """Least-squares line of mask-aware latency against mask ratio: (slope, intercept, R²)."""
    rows = [r for r in results if r["batch"] == batch]
    x = np.array([r["mask_ratio"] for r in rows], dtype=float)
    y = np.array([r["maskaware_s"] for r in rows], dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (slope * x + intercept)
    total = ((y - y.mean()) ** 2).sum()
    r2 = 1.0 - (residual**2).sum() / total if total > 0 else 1.0
    return float(slope), float(intercept), float(r2)


def aligned_mask(size: int, ratio: float, cell: int) -> np.ndarray:
    """A centred rectangle of about ``ratio`` of the image, its sides multiples of ``cell``
    pixels, so every token grid sees the same masked fraction."""
    cells = size // cell
    if ratio >= 1.0:
        return np.ones((size, size), dtype=bool)
    target = ratio * cells * cells
    height = max(1, min(cells, round(np.sqrt(target))))
    width = max(1, min(cells, round(target / height)))
    top, left = (cells - height) // 2 * cell, (cells - width) // 2 * cell
    mask = np.zeros((size, size), dtype=bool)
    mask[top : top + height * cell, left : left + width * cell] = True
    return mask


def load_demo(
    model: str, models_dir: Path, bench: str, device: torch.device, dtype: str = "auto"
) -> tuple[str, DiffusionPipeline, int]:
    """Family, pipeline loaded on ``device`` in ``dtype`` and square image size of a
    built-in model (the benchmarks need its known resolution; ``bench`` names the caller in
    the error)."""
    if not is_demo(model):
        raise ValueError(f"bench {bench} runs the built-in retouch: models")
    spec = demo_model(model)
    folder = ensure_demo_model(model, models_dir)
    return spec.family, load_pipeline(folder, spec.family, device, dtype=dtype), spec.resolution


def device_name(device: torch.device) -> str:
    """What a benchmark row records as its device: the GPU's name, or ``cpu``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def _token_cell(editor: MaskAwareEditor, size: int) -> int:
    """Pixels per token of the coarsest token grid."""
    return editor.model_family.token_cell(editor.impl.pipe)


def _maskaware(
    editor: MaskAwareEditor, requests: list[EditRequest], store: MemoryActivations
) -> list:
    """A whole batch through the step-level API, as the engine runs it."""
    states = [editor.prepare(r, store) for r in requests]
    while not states[0].done:
        editor.step(states)
    return [editor.finish(s) for s in states]


def _graphed_stock_s(
    editor: MaskAwareEditor,
    requests: list[EditRequest],
    repeats: int,
    clock: Callable[[], float],
    device: torch.device,
) -> float:
    """The stock edits with the denoiser call replayed from CUDA graphs
    (``runtime/stockgraphs``: the stock pipeline served well), median seconds; the first
    two runs (eager, capture) untimed."""
    denoiser = getattr(editor.impl.pipe, editor.impl.denoiser)
    times = []
    with StockGraphs(denoiser, device):
        for run in range(2 + repeats):
            synchronize(device)
            start = clock()
            editor.stock_edits(requests)
            synchronize(device)
            if run >= 2:
                times.append(clock() - start)
    return statistics.median(times)


def _interleaved(
    runs: dict[str, Callable[[], object]],
    repeats: int,
    clock: Callable[[], float],
    bar: tqdm,
    device: torch.device,
) -> dict[str, list[float]]:
    """Time every run ``repeats`` times, alternating which goes first (the device's queued
    kernels are waited for on both sides of each run)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for repeat in range(repeats):
        for name in order if repeat % 2 == 0 else order[::-1]:
            synchronize(device)
            start = clock()
            runs[name]()
            synchronize(device)
            times[name].append(clock() - start)
        bar.update()
    return times
