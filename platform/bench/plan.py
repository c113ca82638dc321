"""``retouch bench plan``: the bubble-free plan against naive sequential loading, same run.

One template is baked once, into a real ``ActivationStore`` (host tier, under a temporary
folder) and into a plain ``MemoryActivations``; the per-block cost model is profiled on this
machine first. Then whole mask-aware edits (pre-processing, every step, VAE decode) of one
batch run, interleaved repeat by repeat with rotating order, in four configurations:

* ``plan``: the bubble-free plan of the cost model, rows loaded ahead (overlapped);
* ``sequential``: every block sparse, each block's rows loaded right before it computes
  (naive load-then-compute, FlashPS's +102 % baseline);
* ``overlapped``: every block sparse, rows loaded ahead;
* ``sync``: every block sparse, rows gathered inside the blocks (no loader at all).

Reported per reader: the median whole-edit seconds, the median seconds of the steps alone,
the mean load wait per step, the plan's choice and the cost model's predictions.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import DiffusionPipeline
from tqdm import tqdm

from retouch.cachestore.store import ActivationStore, StoreConfig
from retouch.functions.demo.images import mask_of_ratio, template_image
from retouch.functions.demo.models import demo_model, ensure_demo_model, is_demo
from retouch.runtime.costmodel import CostModel
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.loader import LoadMode, RowLoader, attach
from retouch.runtime.maskaware.store import ActivationReader, MemoryActivations
from retouch.runtime.models import PIPELINES
from retouch.runtime.plan import BlockCost, batch_tokens, evaluate, make_planner
from retouch.runtime.plan import sequential_latency as predicted_sequential
from retouch.runtime.profiling import ProfileConfig, profile_editor

log = logging.getLogger(__name__)

TEMPLATE_PROMPT = "a quiet street"  # the demo tokenizers take 14 characters
EDIT_PROMPT = "a red bicycle"
TEMPLATE_KEY = "bench-plan-template"


@dataclass(frozen=True)
class _Variant:
    """How one configuration runs: which plan and which loader."""

    plan: Callable[[list, list[str]], dict[str, Mode]]
    loader: RowLoader | None


def run_plan_bench(
    model: str,
    mask_ratio: float,
    batch: int,
    steps: int,
    repeats: int,
    models_dir: Path,
    *,
    guidance: float = 4.0,
    profile: ProfileConfig | None = None,
) -> dict[str, Any]:
    """Plan vs sequential vs overlapped whole edits; figures of the store reader at the top
    level, those of a plain ``MemoryActivations`` reader under ``"memory"``."""
    if repeats < 1 or batch < 1 or steps < 1:
        raise ValueError("repeats, batch and steps must be at least 1")
    family, pipe, size = _load(model, models_dir)
    editor = MaskAwareEditor(pipe, family, torch.device("cpu"))
    template = template_image((size, size), seed=1)
    memory = MemoryActivations()
    editor.bake(template, TEMPLATE_PROMPT, 1, steps, guidance, memory)
    log.info("baked %s: %.1f MB of activations", model, memory.nbytes / 2**20)
    cost_model = profile_editor(editor, size, profile)
    requests = [
        EditRequest(
            template,
            mask_of_ratio((size, size), mask_ratio, "rect", seed=i),
            EDIT_PROMPT,
            100 + i,
            steps,
            guidance,
            TEMPLATE_PROMPT,
            1,
        )
        for i in range(batch)
    ]
    with tempfile.TemporaryDirectory(prefix="retouch-bench-plan-") as tmp:
        with ActivationStore(StoreConfig(path=Path(tmp) / "cache")) as store:
            _copy_into(store, memory)
            with store.acquire(TEMPLATE_KEY) as handle:
                result = _bench_reader(editor, cost_model, requests, handle, repeats, "store")
        result["memory"] = _bench_reader(editor, cost_model, requests, memory, repeats, "memory")
    result.update(
        model=model,
        mask_ratio=mask_ratio,
        batch=batch,
        steps=steps,
        size=size,
        threads=torch.get_num_threads(),
        cost_model_min_r2=round(cost_model.min_r2(), 4),
        cost_model=cost_model.to_dict(),
    )
    return result


def _copy_into(store: ActivationStore, memory: MemoryActivations) -> None:
    """The bake's tensors as a store template (host-resident after the commit)."""
    with store.bake(TEMPLATE_KEY, {"function": "bench-plan"}) as writer:
        for (step, block, name), tensor in memory.tensors.items():
            writer.put(step, block, name, tensor)


def _bench_reader(
    editor: MaskAwareEditor,
    cost_model: CostModel,
    requests: list[EditRequest],
    reader: ActivationReader,
    repeats: int,
    label: str,
) -> dict[str, Any]:
    planner = make_planner(cost_model)
    sparse = _all_sparse
    variants = {
        "plan": _Variant(planner, RowLoader.for_editor(editor, LoadMode.OVERLAPPED)),
        "sequential": _Variant(sparse, RowLoader.for_editor(editor, LoadMode.SEQUENTIAL)),
        "overlapped": _Variant(sparse, RowLoader.for_editor(editor, LoadMode.OVERLAPPED)),
        "sync": _Variant(sparse, None),
    }
    wall: dict[str, list[float]] = {name: [] for name in variants}
    stepping: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for variant in variants.values():  # warm-up: first-call allocations, thread start
            _edit(editor, variant, requests, reader)
        order = list(variants)
        with tqdm(total=repeats, desc=f"bench plan ({label})", unit="round") as bar:
            for repeat in range(repeats):
                for name in order[repeat % len(order) :] + order[: repeat % len(order)]:
                    total, steps_s = _edit(editor, variants[name], requests, reader)
                    wall[name].append(total)
                    stepping[name].append(steps_s)
                bar.update()
    finally:
        attach(editor, None)
        for variant in variants.values():
            if variant.loader is not None:
                variant.loader.close()
    out = _summary(editor, cost_model, planner, requests, reader, variants, wall, stepping)
    return {"reader": label, **out}


def _edit(
    editor: MaskAwareEditor,
    variant: _Variant,
    requests: list[EditRequest],
    reader: ActivationReader,
) -> tuple[float, float]:
    """One whole batched edit; returns (seconds of the edit, seconds of its steps)."""
    attach(editor, variant.loader)
    start = time.perf_counter()
    states = [editor.prepare(r, reader) for r in requests]
    stepping = 0.0
    while not states[0].done:
        modes = variant.plan(states, editor.blocks)
        t0 = time.perf_counter()
        editor.step(states, modes)
        stepping += time.perf_counter() - t0
    for state in states:
        editor.finish(state)
    return time.perf_counter() - start, stepping


def _all_sparse(states: list, blocks: list[str]) -> dict[str, Mode]:
    return dict.fromkeys(blocks, Mode.SPARSE)


def _summary(
    editor: MaskAwareEditor,
    cost_model: CostModel,
    planner: Any,
    requests: list[EditRequest],
    reader: ActivationReader,
    variants: dict[str, _Variant],
    wall: dict[str, list[float]],
    stepping: dict[str, list[float]],
) -> dict[str, Any]:
    median = {name: statistics.median(times) for name, times in wall.items()}
    steps_median = {name: statistics.median(times) for name, times in stepping.items()}
    states = [editor.prepare(r, reader) for r in requests]
    modes = planner(states, editor.blocks)
    costs = cost_model.block_costs(batch_tokens(cost_model, states))
    waits = {
        name: round(v.loader.totals.wait_s / max(v.loader.steps, 1), 6)
        for name, v in variants.items()
        if v.loader is not None
    }
    steps = requests[0].steps
    out = {
        **{f"{name}_s": round(seconds, 4) for name, seconds in median.items()},
        "ratio_sequential_over_plan": round(median["sequential"] / median["plan"], 4),
        "ratio_sequential_over_overlapped": round(median["sequential"] / median["overlapped"], 4),
        "steps_s": {name: round(s, 4) for name, s in steps_median.items()},
        "steps_ratio_sequential_over_plan": round(
            steps_median["sequential"] / steps_median["plan"], 4
        ),
        "load_wait_per_step_s": waits,
        "rows_bytes_per_step": variants["sequential"].loader.totals.bytes
        // max(variants["sequential"].loader.steps, 1),
        "plan_sparse_blocks": sum(m is Mode.SPARSE for m in modes.values()),
        "blocks": len(editor.blocks),
        "predicted_s": _predicted(costs, planner, steps),
    }
    log.info("%s", out)
    return out


def _predicted(costs: list[BlockCost], planner: Any, steps: int) -> dict[str, float]:
    """The cost model's step latencies times the steps (no pre/post-processing)."""
    every = tuple(Mode.SPARSE for _ in costs)
    return {
        "plan": round(planner.last.latency * steps, 4) if planner.last else 0.0,
        "sequential": round(predicted_sequential(costs) * steps, 4),
        "overlapped": round(evaluate(costs, every) * steps, 4),
        "full": round(sum(c.full for c in costs) * steps, 4),
    }


def _load(model: str, models_dir: Path) -> tuple[str, DiffusionPipeline, int]:
    """Family, loaded pipeline and square image size of a built-in model."""
    if not is_demo(model):
        raise ValueError("bench plan runs the built-in retouch: models")
    spec = demo_model(model)
    pipe = PIPELINES[spec.family].from_pretrained(ensure_demo_model(model, models_dir))
    pipe.set_progress_bar_config(disable=True)
    return spec.family, pipe, spec.resolution
