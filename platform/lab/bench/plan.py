"""``retouch bench plan``: the bubble-free plan against naive sequential loading, same run.

One template is baked once, into a real ``ActivationStore`` (host tier, under a temporary
folder) and into a plain ``MemoryActivations``; the per-block cost model is profiled on this
machine first. Then whole mask-aware edits of one batch run in four configurations:

* ``plan``: the bubble-free plan of the cost model, rows loaded ahead (overlapped);
* ``sequential``: every block sparse, each block's rows loaded right before it computes
  (naive load-then-compute, FlashPS's +102 % baseline);
* ``overlapped``: every block sparse, rows loaded ahead;
* ``sync``: every block sparse, rows gathered inside the blocks (no loader at all).

Each round runs one whole edit per configuration (pre-processing, every step, VAE decode),
interleaved at step granularity with rotating order so that drift on a shared machine hits
all alike: every configuration's pre-processing, then step 1 of each, step 2 of each, ...,
then the decodes. Reported per reader: median whole-edit and steps-only seconds, the median
of the per-step paired ratios, the mean load wait per step, the plan and the cost model's
predictions.

``link_gbps`` puts the readers behind an emulated host→device link of that bandwidth (each
row read then sleeps ``bytes / bandwidth``, leaving the CPU free as a DMA copy would) and
re-measures the cost model's load line through it: on a CPU, where loads are memcpy-speed
gathers, this is how the regime of a GPU (loads comparable to sparse compute) is shown.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from retouch.cachestore.store import ActivationStore, StoreConfig
from retouch.functions.demo.images import mask_of_ratio, template_image
from retouch.functions.families import family_spec
from retouch.platform.lab.bench.engine import (
    EDIT_PROMPT,
    TEMPLATE_PROMPT,
    device_name,
    load_demo,
)
from retouch.runtime.costmodel import CostModel
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor, RequestState
from retouch.runtime.maskaware.loader import LoadMode, RowLoader, attach, family_rows
from retouch.runtime.maskaware.store import ActivationReader, MemoryActivations, fetch_rows
from retouch.runtime.models import pick_device, synchronize
from retouch.runtime.plan import BlockCost, evaluate
from retouch.runtime.plan import sequential_latency as predicted_sequential
from retouch.runtime.planner import Planner, batch_tokens, make_planner
from retouch.runtime.profiling import ProfileConfig, measure_load_line, profile_editor

log = logging.getLogger(__name__)

TEMPLATE_KEY = "bench-plan-template"
READERS = ("store", "memory")


@dataclass
class _Variant:
    """One configuration: its plan, its loader, and what it measured."""

    plan: Callable[[list, list[str]], dict[str, Mode]]
    loader: RowLoader | None
    edits: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # every step, in run order


class LinkReader:
    """A reader behind an emulated link: every row read also waits ``bytes / bandwidth``."""

    def __init__(self, inner: ActivationReader, gbps: float) -> None:
        self.inner, self.bytes_per_s = inner, gbps * 1e9

    def get(self, step: int, block: str, name: str) -> torch.Tensor:
        return self.inner.get(step, block, name)

    def read_rows(
        self, step: int, block: str, name: str, rows: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        fetch_rows(self.inner, step, block, name, rows, out)
        time.sleep(out.nbytes / self.bytes_per_s)
        return out


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
    readers: tuple[str, ...] = READERS,
    link_gbps: float | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """Plan vs sequential vs overlapped whole edits. The first of ``readers`` ("store":
    an ``ActivationStore`` host tier, "memory": a ``MemoryActivations``) reports at the top
    level, the others under their names."""
    if repeats < 1 or batch < 1 or steps < 1 or not readers:
        raise ValueError("repeats, batch and steps must be at least 1, readers not empty")
    if unknown := set(readers) - set(READERS):
        raise ValueError(f"unknown readers {sorted(unknown)}; choose from {READERS}")
    where = pick_device(device)
    family, pipe, size = load_demo(model, models_dir, "plan", where)
    editor = MaskAwareEditor(pipe, family, where)
    template = template_image((size, size), seed=1)
    memory = MemoryActivations()
    editor.bake(template, TEMPLATE_PROMPT, 1, steps, guidance, memory)
    log.info("baked %s: %.1f MB of activations", model, memory.nbytes / 2**20)
    cost_model = profile_editor(editor, size, profile or ProfileConfig(batches=(batch,)))
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
            halo=family_spec(family).halo,
        )
        for i in range(batch)
    ]
    results: dict[str, dict[str, Any]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="retouch-bench-plan-") as tmp,
        ActivationStore(StoreConfig(path=Path(tmp) / "cache")) as store,
    ):
        _copy_into(store, memory)
        with store.acquire(TEMPLATE_KEY) as handle:
            for label in readers:
                reader: ActivationReader = handle if label == "store" else memory
                if link_gbps:
                    reader = LinkReader(reader, link_gbps)
                model_here = _with_link(editor, cost_model, requests[0], reader, link_gbps)
                results[label] = _bench_reader(editor, model_here, requests, reader, repeats, label)
    first, *others = readers
    out = {**results[first], **{label: results[label] for label in others}}
    out.update(
        model=model,
        mask_ratio=mask_ratio,
        batch=batch,
        steps=steps,
        size=size,
        threads=torch.get_num_threads(),
        device=device_name(editor.device),
        link_gbps=link_gbps,
        cost_model_min_r2=round(cost_model.min_r2(), 4),
        cost_model=cost_model.to_dict(),
    )
    return out


def _copy_into(store: ActivationStore, memory: MemoryActivations) -> None:
    """The bake's tensors as a store template (host-resident after the commit)."""
    with store.bake(TEMPLATE_KEY, {"function": "bench-plan"}) as writer:
        for (step, block, name), tensor in memory.tensors.items():
            writer.put(step, block, name, tensor)


def _with_link(
    editor: MaskAwareEditor,
    cost_model: CostModel,
    request: EditRequest,
    reader: ActivationReader,
    link_gbps: float | None,
) -> CostModel:
    """The cost model with its load line measured through the emulated link, if any."""
    if not link_gbps:
        return cost_model
    load = measure_load_line(editor, editor.prepare(request, reader))
    log.info("load line through a %.2f GB/s link: %s", link_gbps, load)
    return dataclasses.replace(cost_model, load=load)


def _bench_reader(
    editor: MaskAwareEditor,
    cost_model: CostModel,
    requests: list[EditRequest],
    reader: ActivationReader,
    repeats: int,
    label: str,
) -> dict[str, Any]:
    planner = make_planner(cost_model, editor.device)
    variants = {
        "plan": _Variant(planner, RowLoader.for_editor(editor, LoadMode.OVERLAPPED)),
        "sequential": _Variant(_all_sparse, RowLoader.for_editor(editor, LoadMode.SEQUENTIAL)),
        "overlapped": _Variant(_all_sparse, RowLoader.for_editor(editor, LoadMode.OVERLAPPED)),
        "sync": _Variant(_all_sparse, None),
    }
    try:
        _round(editor, variants, requests, reader, 0, record=False)  # warm-up
        with tqdm(total=repeats, desc=f"bench plan ({label})", unit="round") as bar:
            for repeat in range(repeats):
                _round(editor, variants, requests, reader, repeat, record=True)
                bar.update()
    finally:
        attach(editor, None)
        for variant in variants.values():
            if variant.loader is not None:
                variant.loader.close()
    return {"reader": label, **_summary(editor, cost_model, planner, requests, reader, variants)}


def _round(
    editor: MaskAwareEditor,
    variants: dict[str, _Variant],
    requests: list[EditRequest],
    reader: ActivationReader,
    repeat: int,
    *,
    record: bool,
) -> None:
    """One whole edit per configuration, interleaved step by step in a rotating order."""
    names = list(variants)
    order = names[repeat % len(names) :] + names[: repeat % len(names)]
    states: dict[str, list[RequestState]] = {}
    spent = dict.fromkeys(names, 0.0)
    stepping = dict.fromkeys(names, 0.0)
    for name in order:
        start = time.perf_counter()
        states[name] = [editor.prepare(r, reader) for r in requests]
        synchronize(editor.device)
        spent[name] += time.perf_counter() - start
    while not states[names[0]][0].done:
        for name in order:
            variant = variants[name]
            attach(editor, variant.loader)
            start = time.perf_counter()
            editor.step(states[name], variant.plan(states[name], editor.blocks))
            synchronize(editor.device)
            seconds = time.perf_counter() - start
            stepping[name] += seconds
            if record:
                variant.step_times.append(seconds)
    for name in order:
        start = time.perf_counter()
        for state in states[name]:
            editor.finish(state)
        synchronize(editor.device)
        spent[name] += time.perf_counter() - start
    if record:
        for name, variant in variants.items():
            variant.edits.append(spent[name] + stepping[name])
            variant.steps.append(stepping[name])


def _all_sparse(states: list, blocks: list[str]) -> dict[str, Mode]:
    return dict.fromkeys(blocks, Mode.SPARSE)


def _summary(
    editor: MaskAwareEditor,
    cost_model: CostModel,
    planner: Planner,
    requests: list[EditRequest],
    reader: ActivationReader,
    variants: dict[str, _Variant],
) -> dict[str, Any]:
    edit = {name: statistics.median(v.edits) for name, v in variants.items()}
    steps = {name: statistics.median(v.steps) for name, v in variants.items()}
    states = [editor.prepare(r, reader) for r in requests]
    modes = planner(states, editor.blocks)
    costs = cost_model.block_costs(batch_tokens(cost_model, states, editor.device))
    sequential = variants["sequential"].loader
    paired = [
        s / p
        for s, p in zip(variants["sequential"].step_times, variants["plan"].step_times, strict=True)
    ]
    out = {
        **{f"{name}_s": round(seconds, 4) for name, seconds in edit.items()},
        "ratio_sequential_over_plan": round(edit["sequential"] / edit["plan"], 4),
        "ratio_sequential_over_overlapped": round(edit["sequential"] / edit["overlapped"], 4),
        "steps_s": {name: round(seconds, 4) for name, seconds in steps.items()},
        "step_ratio_sequential_over_plan_paired": round(statistics.median(paired), 4),
        "load_wait_per_step_s": {
            name: round(v.loader.totals.wait_s / max(v.loader.steps, 1), 5)
            for name, v in variants.items()
            if v.loader is not None
        },
        "rows_mb_per_step": round(sequential.totals.bytes / max(sequential.steps, 1) / 1e6, 2),
        "plan_sparse_blocks": sum(m is Mode.SPARSE for m in modes.values()),
        "blocks": len(editor.blocks),
        "plan_modes": "".join(  # in execution order
            "S" if modes[b] is Mode.SPARSE else "F" for b in family_rows(editor).order
        ),
        "predicted_s": _predicted(costs, planner, requests[0].steps),
        "load_line": dataclasses.asdict(cost_model.load),
    }
    log.info("%s", out)
    return out


def _predicted(costs: list[BlockCost], planner: Planner, steps: int) -> dict[str, float]:
    """The cost model's step latencies times the steps (no pre/post-processing)."""
    every = tuple(Mode.SPARSE for _ in costs)
    return {
        "plan": round(planner.last.latency * steps, 4) if planner.last else 0.0,
        "sequential": round(predicted_sequential(costs) * steps, 4),
        "overlapped": round(evaluate(costs, every) * steps, 4),
        "full": round(sum(c.full for c in costs) * steps, 4),
    }
