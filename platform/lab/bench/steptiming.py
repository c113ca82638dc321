"""Timing and profiling of denoising steps for ``bench production``: CUDA events (or the
wall clock on a CPU) around each step, medians over repeated runs, and torch.profiler's
account of one step (host time to issue it, kernels launched, GPU time).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.models import synchronize

log = logging.getLogger(__name__)


@dataclass
class StepProfile:
    """One profiled step: host time to issue it, kernels it launched, GPU time."""

    shape: str
    path: str  # "stock" or "mask-aware (device tier)"
    host_ms: float
    cpu_ms: float
    kernels: int
    gpu_ms: float


class StepTimer:
    """CUDA events (or the wall clock on a CPU) around each call of a module or function."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pairs: list[tuple[Any, Any]] = []
        self._open: Any = None

    def start(self) -> None:
        self._open = self._mark()

    def stop(self) -> None:
        self.pairs.append((self._open, self._mark()))

    def _mark(self) -> Any:
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return None  # a capture records no timing events
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def take_ms(self) -> list[float]:
        """The recorded durations (ms), and forget them."""
        if self.cuda:
            torch.cuda.synchronize()
            out = [a.elapsed_time(b) for a, b in self.pairs if a is not None and b is not None]
        else:
            out = [(b - a) * 1e3 for a, b in self.pairs]
        self.pairs = []
        return out

    def hook(self, module: torch.nn.Module) -> list[Any]:
        return [
            module.register_forward_pre_hook(lambda *_: self.start()),
            module.register_forward_hook(lambda *_: self.stop()),
        ]


def timed(
    run: Callable[[], object],
    timer: StepTimer,
    where: torch.device,
    repeats: int,
    bar: tqdm,
    *,
    warm: bool,
    others: tuple[StepTimer, ...] = (),
) -> tuple[float, float]:
    """Median whole-run seconds and median step milliseconds (``timer``'s) over ``repeats``
    runs; what ``others`` recorded meanwhile is dropped."""
    if warm:  # first calls: allocator growth, kernel selection, lazy inits
        run()
    for t in (timer, *others):
        t.take_ms()
    edits = []
    for _ in range(repeats):
        synchronize(where)
        start = time.perf_counter()
        run()
        synchronize(where)
        edits.append(time.perf_counter() - start)
        bar.update()
    steps = timer.take_ms()
    for t in others:
        t.take_ms()
    return round(statistics.median(edits), 4), round(statistics.median(steps), 3)


def profile_steps(
    editor: MaskAwareEditor,
    requests: list[EditRequest],
    store: MemoryActivations,
    tier: str,
    where: torch.device,
    name: str,
) -> list[StepProfile]:
    """Under torch.profiler: the stock pipeline's denoiser call (its inputs captured from a
    stock edit and replayed), a step over every token through retouch's step path, and a
    mask-aware step (mask 0.2, batch 1, rows from ``tier``)."""
    denoiser = getattr(editor.impl.pipe, editor.impl.denoiser)
    captured: list[tuple[tuple, dict]] = []
    handle = denoiser.register_forward_pre_hook(
        lambda _m, args, kwargs: captured.append((args, kwargs)) if not captured else None,
        with_kwargs=True,
    )
    try:
        editor.stock_edits(requests[:1])
    finally:
        handle.remove()
    args, kwargs = captured[0]
    state = editor.prepare(requests[0], store)
    editor.step([state])  # warm
    full = editor.prepare(requests[0], None)
    editor.step([full])
    runs = [
        ("stock denoiser call", lambda: denoiser(*args, **kwargs)),
        ("retouch step, every token", lambda: editor.step([full])),
        (f"mask-aware step ({tier} tier)", lambda: editor.step([state])),
    ]
    with torch.inference_mode():
        out = [profile_one(run, where, name, path) for path, run in runs]
        if where.type == "cuda" and tier == "device":
            editor.set_graphs(True)
            try:
                graphed = editor.prepare(requests[0], store)
                editor.step([graphed])  # eager: the layout's static rows
                editor.step([graphed])  # captured, then replayed
                path = "mask-aware step (device tier, CUDA graph)"
                out.append(profile_one(lambda: editor.step([graphed]), where, name, path))
            except Exception:
                log.exception("%s: profiling the graphed step failed", name)
            finally:
                editor.set_graphs(False)
    return out


def profile_one(
    run: Callable[[], object], where: torch.device, name: str, path: str
) -> StepProfile:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if where.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    synchronize(where)
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    host_ms, cpu_ms = (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3
    synchronize(where)
    with profile(activities=activities) as prof:
        run()
        synchronize(where)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kernels) / 1e3
    return StepProfile(
        name, path, round(host_ms, 2), round(cpu_ms, 2), len(kernels), round(gpu_ms, 2)
    )
