"""``retouch bench production``: stock vs mask-aware edits on production-shaped models.

The question this answers is the one retouch exists for: on a GPU, at the shapes users
serve (FLUX.1-dev, SD3-medium, SD2-inpainting; ``functions/demo/production.py``), is a
mask-aware edit cheaper than the stock diffusers pipeline, and by how much, with the
template's activations

* ``device``: resident in GPU memory (the device tier: a block copies the cached K/V whole
  and overwrites the masked rows; nothing crosses PCIe), or
* ``graphs``: resident in GPU memory, masked tokens padded to a bucket as a served step
  runs them (``runtime/maskaware/buckets.py``), and the step's denoiser call replayed from
  a CUDA graph captured once per bucket and batch size (``runtime/maskaware/graphs.py``), or
* ``host``: in pinned host memory, streamed every step by the row loader (each block's
  contiguous slab crosses by DMA on a side stream and is gathered on the GPU, overlapped
  with the blocks before it; on a CPU the loader gathers rows itself), or
* ``host-fp8``: the same with the rows resting in fp8 with per-channel scales (half the
  bytes over the link; decoded on the GPU before the gather),
* ``host-graphs`` / ``host-fp8-graphs``: pinned host rows copied whole into a graph's
  static buffers a step ahead (on a copy stream, while the step before replays);
  both host tiers are measured at the ``host_masks`` only, to keep a run short.

For every shape, batch and mask ratio it reports whole edits (text encoding, steps, VAE) and
the denoising steps alone, each the median of ``repeats`` runs timed with CUDA events,
stock and mask-aware interleaved. Stock work does not depend on the mask, so stock is timed
once per batch, eagerly and (on a GPU) with its denoiser call replayed from a CUDA graph
(``stock-graphs``, ``runtime/stockgraphs.py``), and at the batch sizes asked for with its
repeated blocks under ``torch.compile`` (``stock-compiled``, regional compilation); every
ratio divides by the fastest stock, the eager one is kept as a second column. A profiled step of each (torch.profiler) gives the host CPU time and the
kernels launched per step. Steps are fewer than in production (8 by default) so that a
Flux template's activations fit the GPU beside the model; per-step figures do not depend on
that.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from retouch.functions.demo.images import template_image
from retouch.functions.demo.production import SHAPES, build_shape
from retouch.functions.families import family_spec
from retouch.platform.lab.bench.engine import aligned_mask
from retouch.platform.lab.bench.steptiming import StepProfile, StepTimer, profile_steps, timed
from retouch.runtime.families.stepflops import pipeline_step_flops
from retouch.runtime.maskaware.buckets import Buckets
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.loader import LoadMode, RowLoader
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.models import pick_device, synchronize
from retouch.runtime.stockgraphs import StockGraphs

log = logging.getLogger(__name__)

TEMPLATE_PROMPT = "a quiet street"
EDIT_PROMPT = "a red bicycle"
TIERS = ("device", "graphs", "host", "host-fp8", "host-graphs", "host-fp8-graphs")


@dataclass
class Case:
    """One measured configuration of one shape."""

    shape: str
    tier: str  # "stock", "stock-graphs", "stock-compiled", "device", "graphs", "host", ...
    batch: int
    mask_ratio: float
    edit_s: float  # whole edit, median
    step_ms: float  # one denoising step of the whole batch, median over steps and repeats
    flop_ratio: float = 1.0
    edit_ratio: float = 1.0  # against the fastest stock (eager, graphs, compiled), same batch
    step_ratio: float = 1.0
    step_ratio_eager: float = 1.0  # against the eager stock step
    loaded_gb_per_step: float = 0.0  # host → device bytes per step (host tier)
    host_gathered_bytes: int = 0  # rows the CPU gathered (0 on the GPU data path)
    compile_s: float = 0.0  # stock-compiled: the first (compiling) edit's seconds


@dataclass
class ShapeReport:
    shape: str
    stands_for: str
    family: str
    resolution: int
    dtype: str
    parameters_m: float
    build_s: float
    bake_s: float
    template_gb: float
    link_gbps: float = 0.0  # pinned host → device copies on this machine
    cases: list[Case] = field(default_factory=list)
    profiles: list[StepProfile] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def run_production_bench(
    shapes: list[str],
    masks: list[float],
    batches: list[int],
    *,
    steps: int = 8,
    repeats: int = 3,
    tiers: tuple[str, ...] = TIERS,
    device: str = "auto",
    scale: float = 1.0,
    resolution: int | None = None,
    profile: bool = True,
    host_masks: tuple[float, ...] | None = None,
    compile_batches: tuple[int, ...] = (),
    on_shape: Callable[[ShapeReport], None] | None = None,
) -> list[ShapeReport]:
    """Measure every shape (see the module docstring); ``on_shape`` gets each report as soon
    as it is done (a long run keeps what it measured if a later shape fails)."""
    for name in shapes:
        if name not in SHAPES:
            raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    for tier in tiers:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
    if repeats < 1 or steps < 1:
        raise ValueError("steps and repeats must be at least 1")
    where = pick_device(device)
    link = host_to_device_gbps(where) if where.type == "cuda" else 0.0
    reports = []
    for name in shapes:
        report = _bench_shape(
            name, where, masks, batches, steps, repeats, tiers, scale, resolution, profile,
            tuple(masks) if host_masks is None else host_masks, compile_batches,
        )  # fmt: skip
        report.link_gbps = round(link, 1)
        reports.append(report)
        if on_shape is not None:
            on_shape(report)
        gc.collect()
        if where.type == "cuda":
            torch.cuda.empty_cache()
    return reports


def host_to_device_gbps(where: torch.device, nbytes: int = 1 << 30) -> float:
    """The link's speed as the host tier sees it: the best of 3 pinned 1 GiB copies."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device=where)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(where)
        start = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize(where)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _bench_shape(
    name: str,
    where: torch.device,
    masks: list[float],
    batches: list[int],
    steps: int,
    repeats: int,
    tiers: tuple[str, ...],
    scale: float,
    resolution: int | None,
    profile: bool,
    host_masks: tuple[float, ...],
    compile_batches: tuple[int, ...] = (),
) -> ShapeReport:
    dtype = None if where.type == "cuda" else torch.float32
    start = time.perf_counter()
    shape, pipe = build_shape(name, where, scale=scale, dtype=dtype)
    synchronize(where)
    built = time.perf_counter() - start
    size = resolution or shape.resolution
    editor = MaskAwareEditor(pipe, shape.family, where)
    denoiser = getattr(pipe, editor.impl.denoiser)
    template = template_image((size, size), seed=1)
    guidance = family_spec(shape.family).guidance
    baked = MemoryActivations()
    start = time.perf_counter()
    editor.bake(template, TEMPLATE_PROMPT, 1, steps, guidance, baked)
    bake_s = time.perf_counter() - start
    report = ShapeReport(
        shape=name,
        stands_for=shape.stands_for,
        family=shape.family,
        resolution=size,
        dtype=str(editor.impl.dtype).removeprefix("torch."),
        parameters_m=round(sum(p.numel() for p in denoiser.parameters()) / 1e6, 1),
        build_s=round(built, 2),
        bake_s=round(bake_s, 2),
        template_gb=round(baked.nbytes / 1e9, 3),
    )
    log.info(
        "%s: built in %.1f s, baked %.2f GB in %.1f s", name, built, baked.nbytes / 1e9, bake_s
    )
    stores = _tiers(baked, tiers, where, report)
    del baked
    timer = StepTimer(where)
    handles = timer.hook(denoiser)
    cell = editor.model_family.token_cell(pipe)
    halo = family_spec(shape.family).halo
    total = len(batches) * (1 + len(masks) * len(stores)) * repeats  # an upper bound
    try:
        with tqdm(total=total, desc=f"bench production {name}", unit="run") as bar:
            for batch in batches:
                _bench_batch(
                    editor, report, stores, timer, template, size, cell, halo, batch, masks,
                    steps, guidance, repeats, bar, host_masks, compile_batches,
                )  # fmt: skip
    finally:
        for handle in handles:
            handle.remove()
    tier = "device" if "device" in stores else "host"
    if profile and tier in stores:
        request = _requests(template, aligned_mask(size, 0.2, cell), 1, steps, guidance, halo)
        report.profiles = profile_steps(editor, request, stores[tier], tier, where, name)
    return report


def _graphed(tier: str) -> bool:
    return tier.endswith("graphs")


def _tiers(
    baked: MemoryActivations, tiers: tuple[str, ...], where: torch.device, report: ShapeReport
) -> dict[str, MemoryActivations]:
    """The template in each tier asked for that this machine can hold."""
    stores: dict[str, MemoryActivations] = {}
    if where.type != "cuda":
        stores["host"] = baked  # a CPU has one memory: the loader gathers on the CPU
        if "host-fp8" in tiers:
            stores["host-fp8"] = baked.placed("cpu", fmt="fp8")
        if any(t not in ("host", "host-fp8") for t in tiers):
            report.skipped.append("device tiers and graphs: no GPU")
        return stores
    if {"host", "host-graphs"} & set(tiers):
        pinned = baked.placed("cpu", pin=True)
        stores.update({t: pinned for t in ("host", "host-graphs") if t in tiers})
    if {"host-fp8", "host-fp8-graphs"} & set(tiers):
        fp8 = baked.placed("cpu", pin=True, fmt="fp8", encode_on=where)
        stores.update({t: fp8 for t in ("host-fp8", "host-fp8-graphs") if t in tiers})
    if "device" in tiers or "graphs" in tiers:
        free = _free_bytes(where)
        if baked.nbytes * 1.15 + 6e9 < free:
            device = baked.placed(where)
            stores.update({t: device for t in ("device", "graphs") if t in tiers})
        else:
            report.skipped.append(
                f"device tier: {baked.nbytes / 1e9:.1f} GB of activations, {free / 1e9:.1f} GB free"
            )
    return stores


def _requests(
    template: Any, mask: Any, batch: int, steps: int, guidance: float, halo: int
) -> list[EditRequest]:
    return [
        EditRequest(
            template, mask, EDIT_PROMPT, 100 + i, steps, guidance, TEMPLATE_PROMPT, 1, 0, halo
        )
        for i in range(batch)
    ]


def _bench_batch(
    editor: MaskAwareEditor,
    report: ShapeReport,
    stores: dict[str, MemoryActivations],
    timer: StepTimer,
    template: Any,
    size: int,
    cell: int,
    halo: int,
    batch: int,
    masks: list[float],
    steps: int,
    guidance: float,
    repeats: int,
    bar: tqdm,
    host_masks: tuple[float, ...],
    compile_batches: tuple[int, ...] = (),
) -> None:
    where = editor.device
    loaders = {
        tier: RowLoader.for_editor(
            editor,
            LoadMode.OVERLAPPED if tier.startswith("host") and not _graphed(tier) else "sync",
        )
        for tier in stores
    }
    reference = _requests(template, aligned_mask(size, 0.2, cell), batch, steps, guidance, halo)
    stock = timed(lambda: editor.stock_edits(reference), timer, where, repeats, bar, warm=True)
    steps_timer = StepTimer(where)
    report.cases.append(Case(report.shape, "stock", batch, 0.0, *stock))
    best = _stock_graphs(editor, report, reference, timer, batch, repeats, bar, stock)
    if batch in compile_batches:
        best = _stock_compiled(editor, report, reference, timer, batch, repeats, bar, stock, best)
    warmed: set[str] = set()
    for ratio in masks:
        mask = aligned_mask(size, ratio, cell)
        requests = _requests(template, mask, batch, steps, guidance, halo)
        flops = pipeline_step_flops(
            editor.impl.pipe, editor.family, size, size, float(mask.mean()), batch
        )
        for tier, store in stores.items():
            if tier.startswith("host") and ratio not in host_masks:
                continue
            if _graphed(tier) and not _room_for_graphs(store, batch, where):
                report.skipped.append(f"graphs at batch {batch}, mask {ratio}: GPU memory")
                continue
            loader = loaders[tier]
            editor.set_row_loader(loader)
            editor.set_graphs(_graphed(tier))
            # graphs run the served layout: masked tokens padded to a bucket
            editor.set_buckets(Buckets() if _graphed(tier) else None)
            before = (loader.totals.bytes, loader.steps, loader.totals.host_gathered)
            try:
                edit_s, step_ms = timed(
                    lambda reqs=requests, s=store: _maskaware(editor, reqs, s, steps_timer),
                    steps_timer,
                    where,
                    repeats,
                    bar,
                    warm=tier not in warmed or _graphed(tier),  # graphs: captures untimed
                    others=(timer,),
                )
            except Exception as exc:  # one failed case must not lose the run's other figures
                log.exception(
                    "%s: %s at batch %d, mask %s failed", report.shape, tier, batch, ratio
                )
                report.skipped.append(f"{tier} at batch {batch}, mask {ratio}: {exc!r}"[:300])
                synchronize(where)
                continue
            finally:
                editor.set_row_loader(None)
                editor.set_graphs(False)
                editor.set_buckets(None)
            warmed.add(tier)
            moved = loader.totals.bytes - before[0]
            taken = max(loader.steps - before[1], 1)
            report.cases.append(
                Case(
                    report.shape,
                    tier,
                    batch,
                    round(float(mask.mean()), 4),
                    edit_s,
                    step_ms,
                    flop_ratio=round(flops.ratio, 4),
                    edit_ratio=round(edit_s / best[0], 4),
                    step_ratio=round(step_ms / best[1], 4),
                    step_ratio_eager=round(step_ms / stock[1], 4),
                    loaded_gb_per_step=round(moved / taken / 1e9, 4),
                    host_gathered_bytes=loader.totals.host_gathered - before[2],
                )
            )
    for loader in loaders.values():
        loader.close()


def _stock_graphs(
    editor: MaskAwareEditor,
    report: ShapeReport,
    reference: list[EditRequest],
    timer: StepTimer,
    batch: int,
    repeats: int,
    bar: tqdm,
    stock: tuple[float, float],
) -> tuple[float, float]:
    """On a GPU, the stock edits again with the denoiser call replayed from CUDA graphs
    (``runtime/stockgraphs``: what a user serving the stock pipeline well would run); the
    faster stock edit seconds and step milliseconds, eager or graphed."""
    where = editor.device
    if where.type != "cuda":
        return stock
    denoiser = getattr(editor.impl.pipe, editor.impl.denoiser)
    try:
        with StockGraphs(denoiser, where) as graphs:
            graphed = timed(
                lambda: editor.stock_edits(reference), timer, where, repeats, bar, warm=True
            )
            captured = graphs.captures
    except Exception as exc:  # the eager stock stays the baseline; the run goes on
        log.exception("%s: stock graphs at batch %d failed", report.shape, batch)
        report.skipped.append(f"stock-graphs at batch {batch}: {exc!r}"[:300])
        return stock
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    if not captured:
        report.skipped.append(f"stock-graphs at batch {batch}: no capture (ran eagerly)")
    _add_stock_case(report, "stock-graphs", batch, graphed, stock)
    return min(stock[0], graphed[0]), min(stock[1], graphed[1])


def _add_stock_case(
    report: ShapeReport,
    tier: str,
    batch: int,
    timed: tuple[float, float],
    stock: tuple[float, float],
    **extra: float,
) -> None:
    """A row of another way to run stock (edit seconds, step ms), its ratios to eager."""
    edit_ratio, step_ratio = round(timed[0] / stock[0], 4), round(timed[1] / stock[1], 4)
    ratios = {"edit_ratio": edit_ratio, "step_ratio": step_ratio, "step_ratio_eager": step_ratio}
    report.cases.append(Case(report.shape, tier, batch, 0.0, *timed, **ratios, **extra))


@contextlib.contextmanager
def _compiled_blocks(denoiser: torch.nn.Module) -> Iterator[int]:
    """The denoiser's repeated blocks under ``torch.compile`` while active (regional
    compilation, as diffusers' ``compile_repeated_blocks``; the whole denoiser when it
    declares no repeated blocks), uncompiled again on exit, so the mask-aware steps after
    it run the blocks as written. Yields the number of compiled modules."""
    names = set(getattr(denoiser, "_repeated_blocks", None) or ())
    modules = [m for m in denoiser.modules() if type(m).__name__ in names] or [denoiser]
    for module in modules:
        module.compile(dynamic=False)
    try:
        yield len(modules)
    finally:
        for module in modules:
            module._compiled_call_impl = None  # what ``nn.Module.compile`` set
        torch._dynamo.reset()


def _stock_compiled(
    editor: MaskAwareEditor,
    report: ShapeReport,
    reference: list[EditRequest],
    timer: StepTimer,
    batch: int,
    repeats: int,
    bar: tqdm,
    stock: tuple[float, float],
    best: tuple[float, float],
) -> tuple[float, float]:
    """The stock edits again with the denoiser's repeated blocks compiled (``stock-compiled``:
    the other way a user would serve the stock pipeline well); the faster of ``best`` and
    it. The compile itself (the warm run) is not timed; its seconds are in the case."""
    denoiser = getattr(editor.impl.pipe, editor.impl.denoiser)
    started = time.perf_counter()
    try:
        with _compiled_blocks(denoiser):
            editor.stock_edits(reference)  # compiles
            compile_s = time.perf_counter() - started
            compiled = timed(
                lambda: editor.stock_edits(reference),
                timer,
                editor.device,
                repeats,
                bar,
                warm=False,
            )
    except Exception as exc:  # the eager and graphed stock stay the baseline; the run goes on
        log.exception("%s: compiled stock at batch %d failed", report.shape, batch)
        report.skipped.append(f"stock-compiled at batch {batch}: {exc!r}"[:300])
        return best
    finally:
        gc.collect()
        if editor.device.type == "cuda":
            torch.cuda.empty_cache()
    _add_stock_case(report, "stock-compiled", batch, compiled, stock, compile_s=round(compile_s, 1))
    return min(best[0], compiled[0]), min(best[1], compiled[1])


def _room_for_graphs(store: MemoryActivations, batch: int, where: torch.device) -> bool:
    """A captured layout holds one step's rows per request in static buffers, twice (the
    next step's are copied in while one runs)."""
    if where.type != "cuda":
        return True
    step = sum(t.nbytes for (s, _, _), t in store.tensors.items() if s == 0)
    if store.format.value == "fp8":
        step *= 2  # decoded into the compute dtype
    return 2 * step * batch * 1.3 + 4e9 < _free_bytes(where)


def _free_bytes(where: torch.device) -> int:
    """Free GPU memory, counting what torch's allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(where)
    return free + torch.cuda.memory_reserved(where) - torch.cuda.memory_allocated(where)


def _maskaware(
    editor: MaskAwareEditor,
    requests: list[EditRequest],
    store: MemoryActivations,
    timer: StepTimer,
) -> None:
    """A whole batch through the step-level API, as the engine runs it, steps timed."""
    states = [editor.prepare(r, store) for r in requests]
    while not states[0].done:
        timer.start()
        editor.step(states)
        timer.stop()
    for state in states:
        editor.finish(state)


def markdown(reports: list[ShapeReport], device: str, command: str) -> str:
    """The tables docs/benchmarks.md takes."""
    lines = [f"Device: {device}. Command: `{command}`.", ""]
    lines += [
        "| shape | params | batch | mask | tier | edit s | step ms | step ratio (best stock) | step ratio (eager stock) | edit ratio | FLOP ratio | GB/step loaded |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        for c in r.cases:
            lines.append(
                f"| {r.shape} | {r.parameters_m:.0f} M | {c.batch} | "
                f"{c.mask_ratio if not c.tier.startswith('stock') else '-'} | {c.tier} | {c.edit_s:.3f} | "
                f"{c.step_ms:.1f} | {c.step_ratio:.3f} | {c.step_ratio_eager:.3f} | "
                f"{c.edit_ratio:.3f} | {c.flop_ratio:.3f} | "
                f"{c.loaded_gb_per_step:.3f} |"
            )
    lines += [
        "",
        "| shape | step | host ms to issue | CPU ms | kernels | GPU ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in reports:
        for p in r.profiles:
            lines.append(
                f"| {r.shape} | {p.path} | {p.host_ms} | {p.cpu_ms} | {p.kernels} | {p.gpu_ms} |"
            )
    lines.append("")
    for r in reports:
        lines.append(
            f"* {r.shape} ({r.stands_for}, {r.dtype}, {r.resolution}²): built in {r.build_s} s, "
            f"template {r.template_gb} GB baked in {r.bake_s} s, "
            f"pinned host→device {r.link_gbps} GB/s"
            + (f"; skipped: {'; '.join(r.skipped)}" if r.skipped else "")
        )
    return "\n".join(lines) + "\n"


def as_json(reports: list[ShapeReport]) -> str:
    return json.dumps([asdict(r) for r in reports], indent=1)


def write_outputs(reports: list[ShapeReport], out: Path, device: str, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-bench.json").write_text(as_json(reports))
    (out / "gpu-bench.md").write_text(markdown(reports, device, command))
