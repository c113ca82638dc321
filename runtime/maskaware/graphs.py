"""CUDA graphs of mask-aware denoiser calls: one capture per batch layout, replayed.

On a GPU a sparse step issues thousands of small kernels from Python (norms, gathers, the
K/V assembly of 57 Flux blocks), and at production shapes the host takes longer to issue
them than the GPU to run them (docs/benchmarks.md, "Production shapes on a GPU"). A CUDA
graph replays the whole call with one launch.

What a capture bakes in, and how it stays valid:

* **the layout**: token batches (``ctx.grids``), per-block modes, tensor shapes. A graph is
  keyed by them (token sets by content, ``TokenSet.digest``), so edits with the same masks
  share it; a new layout runs eagerly once (lazy device copies and kernel choices happen
  there), is captured on its second use and replayed from then on.
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

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from retouch.runtime.maskaware.context import ForwardContext
from retouch.runtime.maskaware.store import ActivationReader, all_resident, copy_resident

log = logging.getLogger(__name__)

MAX_GRAPHS = 4  # captured layouts kept (each holds its own memory pool)


class StaticRows:
    """A request's cached rows as the captured blocks see them: fixed buffers, refilled
    from the request's real (device-resident) reader before every run."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[tuple[str, str], torch.Tensor] = {}
        self.source: ActivationReader | None = None
        self.step = 0

    def load(self, reader: ActivationReader, step: int) -> None:
        """Point at ``reader``'s step ``step``: refill every buffer a capture reads."""
        self.source, self.step = reader, step
        for (block, name), buffer in self.buffers.items():
            self._fill(block, name, buffer)

    def _fill(self, block: str, name: str, buffer: torch.Tensor) -> None:
        if not copy_resident(self.source, self.step, block, name, buffer):
            raise RuntimeError(f"cached rows of {block!r}/{name!r} are not on {self.device}")

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
        return self.source is not None and all_resident(self.source, device)


@dataclass(eq=False)
class _Layout:
    """One batch layout: its static rows, inputs, output and (once captured) graph."""

    rows: list[StaticRows]
    runs: int = 0
    graph: Any = None  # torch.cuda.CUDAGraph, or True for the CPU stand-in
    inputs: dict[str, Any] = field(default_factory=dict)
    output: Any = None
    fn: Callable[..., Any] | None = None


class StepGraphs:
    """The captured layouts of one editor (LRU, at most ``limit``)."""

    def __init__(self, device: torch.device, limit: int = MAX_GRAPHS) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.limit = limit
        self.layouts: OrderedDict[Hashable, _Layout] = OrderedDict()
        self.captures = 0
        self.replays = 0

    @staticmethod
    def usable(ctx: ForwardContext, device: torch.device) -> bool:
        """Whether a step can run from a graph: nothing recorded, no loader or block hooks
        (they run Python per block), every cached row resident on ``device``."""
        if ctx.recording or ctx.loader is not None or ctx.hooks or not ctx.grids:
            return False
        return all(slot.reader is None or all_resident(slot.reader, device) for slot in ctx.slots)

    def run(self, ctx: ForwardContext, fn: Callable[..., Any], tensors: dict[str, Any]) -> Any:
        """``fn(**tensors)`` for this step, eagerly, by a capture or by a replay."""
        key = _layout_key(ctx, tensors)
        layout = self.layouts.get(key)
        if layout is None:
            layout = _Layout([StaticRows(self.device) for _ in ctx.slots])
            self.layouts[key] = layout
            while len(self.layouts) > self.limit:
                self.layouts.popitem(last=False)
        self.layouts.move_to_end(key)
        for rows, slot in zip(layout.rows, ctx.slots, strict=True):
            if slot.reader is not None:
                rows.load(slot.reader, slot.step)
        ctx.slots = [
            slot if slot.reader is None else replace(slot, reader=rows)
            for slot, rows in zip(ctx.slots, layout.rows, strict=True)
        ]
        layout.runs += 1
        if layout.runs == 1:  # eager: static rows made, lazy device state settled
            return fn(**tensors)
        if layout.graph is None:
            self._capture(layout, fn, tensors)
        else:
            _copy_inputs(layout.inputs, tensors)
        self._replay(layout)
        return layout.output

    def _capture(self, layout: _Layout, fn: Callable[..., Any], tensors: dict[str, Any]) -> None:
        layout.inputs = {
            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()
        }
        layout.fn = fn
        if not self.cuda:
            layout.graph = True
            return
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn(**layout.inputs)  # warm-up on the capture stream, as torch advises
        torch.cuda.current_stream(self.device).wait_stream(stream)
        with torch.cuda.graph(graph, stream=stream):
            layout.output = fn(**layout.inputs)
        layout.graph = graph
        self.captures += 1
        log.debug("captured a mask-aware step (%d layouts)", len(self.layouts))

    def _replay(self, layout: _Layout) -> None:
        self.replays += 1
        if self.cuda:
            layout.graph.replay()
        else:
            layout.output = layout.fn(**layout.inputs)


def _layout_key(ctx: ForwardContext, tensors: dict[str, Any]) -> Hashable:
    grids = tuple(
        (size, batch.rows_per_request, batch.packed, tuple(s.digest for s in batch.sets))
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
