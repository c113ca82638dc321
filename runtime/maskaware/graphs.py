"""CUDA graphs of mask-aware denoiser calls: one capture per batch layout, replayed.

On a GPU a sparse step issues thousands of small kernels from Python (norms, gathers, the
K/V assembly of 57 Flux blocks), and at production shapes the host takes longer to issue
them than the GPU to run them (docs/benchmarks.md, "Production shapes on a GPU"). A CUDA
graph replays the whole call with one launch.

What a capture bakes in, and how it stays valid:

* **the layout**: token batches (``ctx.grids``), per-block modes, tensor shapes. A graph is
  keyed by them (``layout_key``: an exact ``TokenBatch`` by its sets' content, so edits
  with the same masks share it; a bucketed ``BucketBatch`` by its buffers, so every mask
  of its bucket shares it); a new layout runs eagerly once (lazy device copies and kernel
  choices happen there), is captured on its second use and replayed from then on.
* **the weights**: a capture replays the denoiser's LoRA layers as they were (the active
  adapters, their scales, their tensors' addresses). The layout key holds ``weights()``,
  the active adapter set and its injections (``runtime/adapters``), so another set, or the
  same set injected again after an eviction, captures its own graph.
* **the inputs**: every tensor argument of the call is copied into a static buffer before
  each replay, and the output lives in a static buffer overwritten by the next replay
  (callers use it within the step).
* **the cached rows**: a step reads another step's K/V, so blocks read them through
  :class:`StaticRows`, one static buffer per (request, block, name) filled from the
  request's device tier before each replay (device-to-device copies). Graphs are only
  used when every cached row is resident on the device: rows streamed from the host must
  overlap the blocks, which a graph cannot wait for.

On a CPU (tests) the same bookkeeping runs with the "replay" an eager call on the static
buffers, so the substitution logic is checked without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from retouch.cachestore.devicetier import same_device
from retouch.runtime.maskaware.context import ForwardContext
from retouch.runtime.maskaware.rowformat import decode_into
from retouch.runtime.maskaware.store import ActivationReader, all_resident, copy_resident

log = logging.getLogger(__name__)

MAX_GRAPHS = 4  # captured layouts kept (each holds its own memory pool)
EAGER = "eager"  # a parity whose capture failed: it runs eagerly from then on

Weights = Callable[[], Hashable]  # what the denoiser computes with now (its LoRA adapters)


def no_adapters() -> Hashable:
    """The weights of a denoiser that never has adapters: always the same."""
    return ""


class StaticRows:
    """One request's cached rows as the captured blocks see them: fixed buffers on the
    device, filled for a given step from the request's reader (resident rows by a device
    copy, pinned host rows by DMA, fp8 rows decoded on the way)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[tuple[str, str], torch.Tensor] = {}
        self.source: ActivationReader | None = None
        self.step = 0

    def point(self, reader: ActivationReader, step: int) -> None:
        self.source, self.step = reader, step

    def fill_all(self) -> None:
        """Refill every buffer a capture reads from the step pointed at."""
        for (block, name), buffer in self.buffers.items():
            self._fill(block, name, buffer)

    def _fill(self, block: str, name: str, buffer: torch.Tensor) -> None:
        if copy_resident(self.source, self.step, block, name, buffer):
            return
        codes, scale = self.source.encoded(self.step, block, name)  # pinned host rows
        if scale is None:
            buffer.copy_(codes, non_blocking=True)
            return
        scale = self.source.scale(self.step, block, name, self.device)
        decode_into(buffer, codes.to(self.device, non_blocking=True), scale)

    def resident(
        self, step: int, block: str, name: str, device: torch.device
    ) -> torch.Tensor | None:
        """The buffer of ``(block, name)`` (made on the first, eager run of a layout)."""
        key = (block, name)
        if key not in self.buffers:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{block!r}/{name!r} first read during a capture")
            shape, dtype = self.source.describe(self.step, block, name)
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            self._fill(block, name, buffer)
            self.buffers[key] = buffer
        return self.buffers[key]

    def get(self, step: int, block: str, name: str) -> torch.Tensor:
        return self.resident(step, block, name, self.device)

    def holds_on(self, device: torch.device) -> bool:
        return same_device(self.device, device)

    def has_step(self, step: int) -> bool:
        """Whether the source holds ``step`` (a step past the last has nothing to load)."""
        block, name = next(iter(self.buffers), ("", ""))
        try:
            self.source.describe(step, block, name)
        except KeyError:
            return False
        return True


@dataclass(eq=False)
class _Layout:
    """One batch layout. Its runs alternate between two sets of static rows (parity), so
    the rows of the next step are copied in (on a copy stream) while this step runs; each
    parity has its own graph and output."""

    rows: tuple[list[StaticRows], list[StaticRows]]
    runs: int = 0
    graphs: list[Any] = field(default_factory=lambda: [None, None])  # CUDAGraph or True (CPU)
    outputs: list[Any] = field(default_factory=lambda: [None, None])
    fns: list[Any] = field(default_factory=lambda: [None, None])
    inputs: dict[str, Any] = field(default_factory=dict)
    filled_for: list[Any] = field(default_factory=lambda: [None, None])  # (reader ref, step)s
    ready: list[Any] = field(default_factory=lambda: [None, None])  # rows copied in (event)
    read_done: list[Any] = field(default_factory=lambda: [None, None])  # last reader finished


class StepGraphs:
    """The captured layouts of one editor (LRU, at most ``limit``)."""

    def __init__(
        self, device: torch.device, limit: int = MAX_GRAPHS, weights: Weights = no_adapters
    ) -> None:
        self.device = device
        self.weights = weights
        self.cuda = device.type == "cuda"
        self.limit = limit
        self.layouts: OrderedDict[Hashable, _Layout] = OrderedDict()
        self.captures = 0
        self.replays = 0
        self.eager = 0  # steps run eagerly by the runner: a parity's first run, a failed capture
        self.prefetched = 0  # runs whose rows had been copied in during the run before
        self._copies = torch.cuda.Stream(device) if self.cuda else None

    def close(self) -> None:
        """Drop every layout, once the copies into their buffers have finished."""
        if self._copies is not None:
            self._copies.synchronize()
        self.layouts.clear()

    @staticmethod
    def usable(ctx: ForwardContext, device: torch.device) -> bool:
        """Whether a step can run from a graph: nothing recorded, no loader or block hooks
        (they run Python per block), and every request's rows resident on ``device`` or
        in pinned host memory (copied in a step ahead)."""
        if ctx.recording or ctx.loader is not None or ctx.hooks or not ctx.grids:
            return False
        return all(
            slot.reader is None
            or all_resident(slot.reader, device)
            or streams_to(slot.reader, device)
            for slot in ctx.slots
        )

    def run(self, ctx: ForwardContext, fn: Callable[..., Any], tensors: dict[str, Any]) -> Any:
        """``fn(**tensors)`` for this step, eagerly, by a capture or by a replay; then the
        next step's rows start copying into the other parity's buffers."""
        key = (self.weights(), _layout_key(ctx, tensors))
        layout = self.layouts.get(key)
        if layout is None:
            requests = len(ctx.slots)
            layout = _Layout(
                tuple([StaticRows(self.device) for _ in range(requests)] for _ in "pq")
            )
            self.layouts[key] = layout
            while len(self.layouts) > self.limit:
                if self._copies is not None:  # its buffers may still be being copied into
                    self._copies.synchronize()
                self.layouts.popitem(last=False)
        self.layouts.move_to_end(key)
        parity = layout.runs % 2
        layout.runs += 1
        slots = list(ctx.slots)
        self._rows_for(layout, parity, slots)
        ctx.slots = [
            slot if slot.reader is None else replace(slot, reader=rows)
            for slot, rows in zip(slots, layout.rows[parity], strict=True)
        ]
        if layout.fns[parity] is None or layout.graphs[parity] is EAGER:
            # first run of this parity (its static rows are made), or a capture failed
            layout.fns[parity] = fn
            self.eager += 1
            out = fn(**tensors)
        else:
            if layout.graphs[parity] is None:
                self._capture(layout, parity, fn, tensors)
            else:
                _copy_inputs(layout.inputs, tensors)
            if layout.graphs[parity] is EAGER:
                self.eager += 1
                out = fn(**tensors)
            else:
                self._replay(layout, parity)
                out = layout.outputs[parity]
        layout.read_done[parity] = self._event()
        self._prefetch(layout, 1 - parity, slots)
        for rows in (*layout.rows[0], *layout.rows[1]):
            rows.source = None  # the buffers are filled: keep no edit's handle alive
        return out

    def _rows_for(self, layout: _Layout, parity: int, slots: list) -> None:
        """Make this parity's rows hold the slots' steps: wait for their prefetch, or copy
        them now."""
        ready = layout.ready[parity]
        if self.cuda and ready is not None:  # a prefetch into these buffers may be running
            torch.cuda.current_stream(self.device).wait_event(ready)
        if ready is not None and _holds(layout.filled_for[parity], slots, 0):
            self.prefetched += 1
            return
        for rows, slot in zip(layout.rows[parity], slots, strict=True):
            if slot.reader is not None:
                rows.point(slot.reader, slot.step)
                rows.fill_all()
        layout.filled_for[parity], layout.ready[parity] = _wanted(slots, 0), None

    def _prefetch(self, layout: _Layout, parity: int, slots: list) -> None:
        """Copy every request's next step into ``parity``'s rows (once its last reader has
        finished), on the copy stream: it overlaps the run just launched."""
        rows = layout.rows[parity]
        active = [(r, s) for r, s in zip(rows, slots, strict=True) if s.reader is not None]
        if not active or any(not r.buffers for r, _ in active):
            return  # this parity has not run yet: its buffers are made by its eager run
        for r, s in active:
            r.point(s.reader, s.step + 1)
        if not all(r.has_step(s.step + 1) for r, s in active):
            layout.filled_for[parity] = None
            return
        with self._on_copy_stream(layout.read_done[parity]):
            for r, _ in active:
                r.fill_all()
            layout.ready[parity] = self._event()
        layout.filled_for[parity] = _wanted(slots, 1)

    def _on_copy_stream(self, after: Any) -> Any:
        if not self.cuda:
            return contextlib.nullcontext()
        if after is not None:
            self._copies.wait_event(after)
        return torch.cuda.stream(self._copies)

    def _event(self) -> Any:
        if not self.cuda:
            return True
        event = torch.cuda.Event()
        event.record()
        return event

    def _capture(
        self, layout: _Layout, parity: int, fn: Callable[..., Any], tensors: dict[str, Any]
    ) -> None:
        if not layout.inputs:
            layout.inputs = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()
            }
        else:
            _copy_inputs(layout.inputs, tensors)
        layout.fns[parity] = fn
        if not self.cuda:
            layout.graphs[parity] = True
            return
        graph = torch.cuda.CUDAGraph()
        try:
            layout.outputs[parity] = capture(graph, lambda: fn(**layout.inputs), self.device)
        except RuntimeError:
            log.exception("capturing a mask-aware step failed: this layout runs eagerly")
            layout.graphs[parity] = EAGER
            return
        layout.graphs[parity] = graph
        self.captures += 1
        log.debug("captured a mask-aware step (%d layouts)", len(self.layouts))

    def _replay(self, layout: _Layout, parity: int) -> None:
        self.replays += 1
        if self.cuda:
            layout.graphs[parity].replay()
        else:
            layout.outputs[parity] = layout.fns[parity](**layout.inputs)


def capture(graph: Any, run: Callable[[], Any], device: torch.device, pool: Any = None) -> Any:
    """``run()`` warmed up on a side stream, as torch advises, then captured into ``graph``
    on it; the captured call's output. Thread-local capture mode: CUDA calls of other
    threads (a device-tier copy, a pinned registration) neither break the capture nor are
    broken by it. On an error the caller's stream has waited for the side stream."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream(device).wait_stream(stream)
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            return run()
    except RuntimeError:
        torch.cuda.current_stream(device).wait_stream(stream)
        raise


def streams_to(reader: ActivationReader, device: torch.device) -> bool:
    """Whether ``reader`` holds its rows whole in pinned host memory (a graph's rows can
    then be copied in by DMA a step ahead)."""
    check = getattr(reader, "streams_to", None)
    return check is not None and check(device)


def _wanted(slots: list, ahead: int) -> tuple:
    """What a parity's buffers hold: each request's reader (weakly: a finished edit's
    handle is not kept alive) and step."""
    return tuple((weakref.ref(s.reader), s.step + ahead) for s in slots if s.reader is not None)


def _holds(filled: tuple | None, slots: list, ahead: int) -> bool:
    """Whether ``filled`` is exactly the slots' readers (the same objects) at their steps."""
    wanted = [(s.reader, s.step + ahead) for s in slots if s.reader is not None]
    return (
        filled is not None
        and len(filled) == len(wanted)
        and all(
            ref() is reader and step == want_step
            for (ref, step), (reader, want_step) in zip(filled, wanted, strict=True)
        )
    )


def _layout_key(ctx: ForwardContext, tensors: dict[str, Any]) -> Hashable:
    grids = tuple(
        (size, batch.rows_per_request, batch.packed, batch.layout_key)
        for size, batch in sorted(ctx.grids.items())
    )
    modes = tuple(sorted((block, mode.value) for block, mode in ctx.modes.items()))
    readers = tuple(slot.reader is not None for slot in ctx.slots)
    shapes = tuple(
        (k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, v)
        for k, v in sorted(tensors.items())
    )
    return grids, modes, readers, shapes


def _copy_inputs(static: dict[str, Any], tensors: dict[str, Any]) -> None:
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor):
            static[name].copy_(value)
