"""Per-block costs measured on the executor's own device: the inputs of the bubble-free plan.

At executor start a loaded editor bakes a synthetic template in memory, then runs a few
denoising steps with synthetic masks of several ratios and batch sizes, all blocks sparse
and all blocks full, with every cached row loaded *before* the forward (``preload``) so
that block times are compute alone. Each block's time (timed between its enter and exit
hooks, synchronising the device on CUDA) is fitted as a line in the tokens it processed
(summed over the batch). The row loads of those steps, plus a sweep of loads alone (1 to 8
copies of a request, each job timed with its copy to the device) give the load line in bytes.
The result is a :class:`CostModel` with R² per fit, cached as JSON under
``<data-dir>/profiles/<model fingerprint>-<device>.json`` so a restart does not re-profile
(the fingerprint of the model as loaded: its files, variant and dtype).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import multiprocessing
import os
import re
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from retouch.functions.demo.images import mask_of_ratio, template_image
from retouch.runtime.costmodel import BlockProfile, CostModel, LinearFit
from retouch.runtime.maskaware.context import ForwardContext, Mode, Slot
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor, RequestState
from retouch.runtime.maskaware.loader import FamilyRows, LoadMode, RowLoader, attach, attached
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.maskaware.tokens import TokenBatch
from retouch.runtime.parentwatch import watch_pipe

log = logging.getLogger(__name__)
HEX64 = re.compile(r"[0-9a-f]{64}")  # a folder's fingerprint (runtime/fingerprint.py)

PROFILE_NICE = 10  # the profiling child yields most of the CPU to the engine beside it
PROFILE_VERSION = 2  # bump when what is measured changes: cached profiles are redone
PROMPT = "a quiet street"  # the demo tokenizers take 14 characters
SWEEP_COPIES = (1, 2, 4, 8)  # requests per timed load job in the load sweep


@dataclass(frozen=True)
class ProfileConfig:
    """What to run: ``repeats`` timed steps per (mask ratio, batch, all-sparse/all-full)."""

    ratios: tuple[float, ...] = (0.15, 0.4, 0.7)
    batches: tuple[int, ...] = (1, 2)
    repeats: int = 2
    guidance: float = 4.0
    # A deploy waits for its model's profile: when the bake's steps say the runs above
    # would take longer than this, the profile keeps the smallest and largest ratio at
    # batch 1 (a line per block still has three points: two sparse, one full).
    budget_s: float = 20.0

    def __post_init__(self) -> None:
        if self.repeats < 1 or not self.ratios or not self.batches:
            raise ValueError("profiling needs repeats >= 1, mask ratios and batch sizes")

    def steps(self) -> int:
        """Denoising steps the measurement runs (each run's first step is a warm-up)."""
        return (len(self.ratios) + 1) * sum(self.batches) * (self.repeats + 1)

    def within(self, step_s: float) -> ProfileConfig:
        """This config, or its smallest when its steps of ``step_s`` (a batch of one)
        would take longer than ``budget_s``."""
        if step_s * self.steps() <= self.budget_s or (
            self.batches == (1,) and len(self.ratios) <= 2
        ):
            return self
        return replace(self, ratios=(min(self.ratios), max(self.ratios)), batches=(1,))


@dataclass
class BlockTimer:
    """A block hook recording how long each block of one forward took."""

    cuda: bool
    times: dict[str, float] = field(default_factory=dict)
    _started: dict[str, float] = field(default_factory=dict)

    def enter(self, block: str) -> None:
        self._sync()
        self._started[block] = time.perf_counter()

    def exit(self, block: str) -> None:
        self._sync()
        self.times[block] = time.perf_counter() - self._started.pop(block)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@dataclass
class _Samples:
    compute: dict[str, list[tuple[float, float]]]
    load: list[tuple[int, float]] = field(default_factory=list)
    grids: list[int] = field(default_factory=list)  # a request's token grids, finest first


def device_label(device: torch.device | str) -> str:
    """``cpu`` or ``cuda-<GPU name>``: a file-name-safe name of the hardware profiled."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)
    return "cuda-" + re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")


def profile_path(data_dir: Path, fingerprint: str, device: torch.device | str) -> Path:
    """Where the profile of a loaded model (``LoadedModel.fingerprint``: its files, and
    the variant and dtype it was loaded in, so a bf16 copy is not timed as its fp32 one) on
    ``device`` is cached. A plain folder's fingerprint is its folder hash, used as it is."""
    name = fingerprint
    if not HEX64.fullmatch(fingerprint):  # files + variant + dtype: one hash for a file name
        name = hashlib.sha256(fingerprint.encode()).hexdigest()
    return data_dir / "profiles" / f"{name}-{device_label(device)}.json"


def load_or_profile(
    editor: MaskAwareEditor,
    fingerprint: str,
    data_dir: Path,
    size: int,
    config: ProfileConfig | None = None,
) -> CostModel:
    """The cached profile of this model on this device at ``size``, profiling on a miss."""
    config = config or ProfileConfig()
    path = profile_path(data_dir, fingerprint, editor.device)
    cached = _read_cached(path, editor.family, size)
    if cached is not None:
        log.info("cost model of %s from %s (min R² %.3f)", editor.family, path, cached.min_r2())
        return cached
    model = profile_editor(editor, size, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(model.to_dict(), indent=1))
    os.replace(tmp, path)
    return model


def cached_profile(
    fingerprint: str, data_dir: Path, device: torch.device | str, family: str, size: int
) -> CostModel | None:
    """The cached profile of this model on this device at ``size``, or None."""
    return _read_cached(profile_path(data_dir, fingerprint, device), family, size)


def profile_in_subprocess(
    model: str,
    family: str,
    scheduler: str,
    size: int,
    data_dir: Path,
    device: torch.device | str,
    threads: int = 0,
) -> bool:
    """Profile in a child process at the lowest CPU priority and wait for it.

    An executor deploying a second model must not slow the invocations it is serving much:
    in a child at ``nice 10`` the profile gets about a tenth of a core the engine wants (at
    ``nice 19`` it starved: 1.6 % of a CPU under steady load, so the deploy never ended), and
    it shares no GIL with the executor's event loop (a low-priority *thread* holding the GIL
    would stall it). On a CPU the child forks from the workers' fork server, which holds
    torch and diffusers already (``runtime/forkserver.py``); on CUDA it is spawned. The
    child writes the profile cache; the caller then reads it. Returns False (the caller
    profiles in-process) when the child failed; its error is in the executor's log."""
    argv = [
        "--model", model, "--family", family, "--scheduler", scheduler,
        "--size", str(size), "--data-dir", str(data_dir), "--device", str(device),
        "--threads", str(threads),
    ]  # fmt: skip
    log.info("profiling %s on %s in a background process", model, device)
    how = "forkserver" if torch.device(device).type == "cpu" else "spawn"
    context = multiprocessing.get_context(how)
    lifeline, kept = context.Pipe(duplex=False)  # the child reads; this process never writes
    # daemon: an executor that exits terminates it (a non-daemon child is waited for, and
    # a profile can take minutes); the lifeline ends it if the executor is killed instead
    child = context.Process(
        target=_profile_child, args=(argv, lifeline), name="retouch-profile", daemon=True
    )
    child.start()
    lifeline.close()
    try:
        child.join()
    finally:
        kept.close()
    if child.exitcode != 0:
        log.error("profiling %s failed (exit %s)", model, child.exitcode)
        return False
    return True


def _profile_child(argv: list[str], lifeline: Connection) -> None:
    watch_pipe(lifeline, lambda: os._exit(1))  # forked from the fork server: not our parent
    _nice()
    main(argv)


def _nice() -> None:
    os.nice(PROFILE_NICE)


def _read_cached(path: Path, family: str, size: int) -> CostModel | None:
    """A usable cached profile, or None (absent, unreadable, other size or version)."""
    if not path.exists():
        return None
    try:
        model = CostModel.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable profile %s: %s", path, exc)
        return None
    extra = model.extra
    if (extra.get("version"), extra.get("family"), extra.get("size")) != (
        PROFILE_VERSION,
        family,
        size,
    ):
        return None
    return model


def profile_editor(
    editor: MaskAwareEditor, size: int, config: ProfileConfig | None = None
) -> CostModel:
    """Measure every block's compute line and the row-load line on ``editor``'s device."""
    config = config or ProfileConfig()
    started = time.perf_counter()
    timer = BlockTimer(editor.device.type == "cuda")
    loader = RowLoader.for_editor(editor, LoadMode.PRELOAD, hooks=[timer], time_copies=True)
    store = MemoryActivations()
    image = template_image((size, size), seed=0)
    steps = config.repeats + 1  # the first step of every run is a warm-up
    baking = time.perf_counter()
    editor.bake(image, PROMPT, 0, steps, config.guidance, store)
    config = config.within((time.perf_counter() - baking) / steps)
    previous = attached(editor)
    attach(editor, loader)
    try:
        samples = _measure(editor, loader, timer, store, image, steps, config)
    finally:
        attach(editor, previous)
        loader.close()
    model = _fit(editor, loader.family, store, samples, size)
    seconds = time.perf_counter() - started
    model.extra.update(
        version=PROFILE_VERSION,
        family=editor.family,
        size=size,
        ratios=list(config.ratios),
        batches=list(config.batches),
        repeats=config.repeats,
        seconds=round(seconds, 3),
        torch=torch.__version__,
    )
    log.info(
        "profiled %s on %s in %.1f s (min R² %.3f)",
        editor.family,
        model.device,
        seconds,
        model.min_r2(),
    )
    return model


def _measure(
    editor: MaskAwareEditor,
    loader: RowLoader,
    timer: BlockTimer,
    store: MemoryActivations,
    image: Any,
    steps: int,
    config: ProfileConfig,
) -> _Samples:
    samples = _Samples({b: [] for b in loader.family.order})
    sparse = dict.fromkeys(editor.blocks, Mode.SPARSE)
    full = dict.fromkeys(editor.blocks, Mode.FULL)
    _run(editor, _states(editor, store, image, config.ratios[0], 1, steps, config), sparse, 1)
    for batch in config.batches:
        runs = [(ratio, sparse) for ratio in config.ratios] + [(1.0, full)]
        for ratio, modes in runs:
            states = _states(editor, store, image, ratio, batch, steps, config)
            samples.grids = sorted({t.n_tokens for t in states[0].tokens.values()}, reverse=True)
            for index in range(steps):
                timer.times.clear()
                editor.step(states, modes)
                if index == 0:
                    continue
                for block, seconds in timer.times.items():
                    tokens = _block_tokens(states, store, loader.family, block, modes[block])
                    samples.compute[block].append((tokens, seconds))
                samples.load.extend(loader.last.job_times if loader.last else [])
            if modes is sparse and batch == config.batches[0]:
                samples.load.extend(_load_sweep(editor, loader, states[0], config.repeats))
    return samples


def measure_load_line(editor: MaskAwareEditor, state: RequestState, repeats: int = 2) -> LinearFit:
    """The row-load line through ``state``'s reader alone (another reader than the bake
    profiled, e.g. behind a slower link): loads of 1 to 8 copies of the request."""
    loader = RowLoader.for_editor(editor, LoadMode.PRELOAD, time_copies=True)
    try:
        sizes, seconds = zip(*_load_sweep(editor, loader, state, repeats), strict=True)
    finally:
        loader.close()
    return LinearFit.fit_medians([float(b) for b in sizes], list(seconds))


def _load_sweep(
    editor: MaskAwareEditor, loader: RowLoader, state: RequestState, repeats: int
) -> list[tuple[int, float]]:
    """Row loads alone, of 1 to 8 copies of one request: job sizes over a decade of bytes."""
    per = editor.impl.rows_per_request
    out: list[tuple[int, float]] = []
    for copies in SWEEP_COPIES:
        grids = {
            size: TokenBatch((tokens,) * copies, per, editor.packed, editor.device)
            for size, tokens in state.tokens.items()
        }
        ctx = ForwardContext([Slot(0, reader=state.reader)] * copies, per, {}, grids)
        for _ in range(repeats):
            out.extend(loader.measure(ctx, lambda block: Mode.SPARSE).job_times)
    return out


def _states(
    editor: MaskAwareEditor,
    store: MemoryActivations,
    image: Any,
    ratio: float,
    batch: int,
    steps: int,
    config: ProfileConfig,
) -> list[RequestState]:
    """``batch`` requests against the synthetic template, masks of about ``ratio``."""
    size = (image.width, image.height)
    return [
        editor.prepare(
            EditRequest(
                image,
                mask_of_ratio(size, ratio, "rect", seed=i),
                PROMPT,
                i + 1,
                steps,
                config.guidance,
                PROMPT,
                0,
            ),
            store,
        )
        for i in range(batch)
    ]


def _run(editor: MaskAwareEditor, states: list[RequestState], modes: dict, steps: int) -> None:
    for _ in range(steps):
        editor.step(states, modes)


def _grid_tokens(store: MemoryActivations, rows: FamilyRows, block: str) -> int:
    """Tokens of the block's own token grid (from what the bake recorded for it)."""
    return store.get(0, block, rows.sparse[block][0]).shape[-2]


def _block_tokens(
    states: list[RequestState], store: MemoryActivations, rows: FamilyRows, block: str, mode: Mode
) -> int:
    """Tokens the block processed, summed over the batch: masked (sparse) or all (full)."""
    n_tokens = _grid_tokens(store, rows, block)
    total = 0
    for state in states:
        tokens = next(t for t in state.tokens.values() if t.n_tokens == n_tokens)
        total += tokens.count if mode is Mode.SPARSE else n_tokens
    return total


def _bytes_per_token(store: MemoryActivations, block: str, names: tuple[str, ...]) -> int:
    """Bytes of the named cached tensors per token of one request (every model row)."""
    total = 0
    for name in names:
        tensor = store.get(0, block, name)
        total += math.prod(tensor.shape[:-2]) * tensor.shape[-1] * tensor.element_size()
    return total


def _fit(
    editor: MaskAwareEditor,
    rows: FamilyRows,
    store: MemoryActivations,
    samples: _Samples,
    size: int,
) -> CostModel:
    blocks = []
    for block in rows.order:
        if not samples.compute[block]:
            raise RuntimeError(f"block {block!r} was never timed: its enter/exit hooks did not run")
        xs, ys = zip(*samples.compute[block], strict=True)
        blocks.append(
            BlockProfile(
                name=block,
                compute=LinearFit.fit_medians(list(xs), list(ys)),
                bytes_per_token_sparse=_bytes_per_token(store, block, rows.sparse[block]),
                bytes_per_token_exit=_bytes_per_token(store, block, rows.exit[block]),
                level=samples.grids.index(_grid_tokens(store, rows, block)),
            )
        )
    sizes, seconds = zip(*samples.load, strict=True) if samples.load else ((), ())
    load = LinearFit.fit_medians([float(b) for b in sizes], list(seconds))
    device = str(editor.device) if editor.device.type != "cuda" else device_label(editor.device)
    # A request's tokens per grid level: the gateway's prediction sums masks on them.
    return CostModel(device, blocks, load, {"grids": list(samples.grids)})


def main(argv: list[str] | None = None) -> None:
    """``python -m retouch.runtime.profiling``: profile one model into the profile cache
    (the child of :func:`profile_in_subprocess`)."""
    import argparse

    from retouch.runtime.models import ModelCache

    parser = argparse.ArgumentParser(prog="retouch-profile")
    parser.add_argument("--model", required=True, help="retouch:<name> or a diffusers folder")
    parser.add_argument("--family", required=True, help="the model's family")
    parser.add_argument("--scheduler", required=True, help="the function's scheduler")
    parser.add_argument("--size", type=int, required=True, help="the function's width")
    parser.add_argument("--data-dir", type=Path, required=True, help="holds models/, profiles/")
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("RETOUCH_LOG_LEVEL", "INFO"))
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    loaded = ModelCache(args.data_dir / "models", device).get(args.model, args.family)
    editor = MaskAwareEditor(loaded.pipeline_for(args.scheduler), args.family, device)
    attach(editor, RowLoader.for_editor(editor, LoadMode.OVERLAPPED))
    load_or_profile(editor, loaded.fingerprint, args.data_dir, args.size)


if __name__ == "__main__":
    main()
