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
* **the scratch**: blocks memoise per run what they all read (RoPE rows gathered by the
  layout's indices); each run of the call starts with an empty scratch
  (``ForwardContext.call``), so the capture, run after a warm-up, records its own gathers.
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
from collections.abc import Callable, Hashable, Iterable, Iterator
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
class RowBank:
    """The static rows of a resolution's batch slots, shared by every layout of it.

    Steps alternate between two sets of rows (parity), so the rows of the next step are
    copied in (on a copy stream) while this step runs. A slot's rows have the shapes of a
    template's cached rows, not of the mask, so one bank serves every bucket and batch size:
    graph memory grows with the largest batch, not with the layouts (one set of rows per
    layout held a step of every template per layout: 24 layouts of a Flux-dev batch of 4
    would have held hundreds of GB)."""

    device: torch.device
    rows: tuple[list[StaticRows], list[StaticRows]] = field(default_factory=lambda: ([], []))
    turns: int = 0
    filled_for: list[Any] = field(default_factory=lambda: [None, None])  # (reader ref, step)s
    ready: list[Any] = field(default_factory=lambda: [None, None])  # rows copied in (event)
    read_done: list[Any] = field(default_factory=lambda: [None, None])  # last reader finished

    def slots(self, parity: int, n: int) -> list[StaticRows]:
        """The first ``n`` slots' rows of ``parity`` (made as batches grow)."""
        rows = self.rows[parity]
        while len(rows) < n:
            rows.append(StaticRows(self.device))
        return rows[:n]

    @property
    def nbytes(self) -> int:
        return sum(
            b.numel() * b.element_size()
            for r in (*self.rows[0], *self.rows[1])
            for b in r.buffers.values()
        )


@dataclass(eq=False)
class _Layout:
    """One batch layout: per parity, its graph (captured reading that parity's rows of the
    bank), its output, and the static inputs both parities share."""

    bank: RowBank
    graphs: list[Any] = field(default_factory=lambda: [None, None])  # CUDAGraph or True (CPU)
    outputs: list[Any] = field(default_factory=lambda: [None, None])
    fns: list[Any] = field(default_factory=lambda: [None, None])
    inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Its static inputs and outputs (its captures' memory is the shared pool's)."""
        return _tensor_bytes(self.inputs.values()) + _tensor_bytes(self.outputs)


class StepGraphs:
    """The captured layouts of one editor (LRU, at most ``limit``), their row banks and one
    memory pool for all their captures.

    ``budget_bytes`` bounds what graphs hold (row banks, static inputs and outputs, the
    pool's growth): a layout not yet captured when the total has reached it runs eagerly
    (counted in ``over_budget``). Captures made inside :meth:`warming` (the executor's
    warm-up, before it serves) are counted apart from those on the request path."""

    def __init__(
        self,
        device: torch.device,
        limit: int = MAX_GRAPHS,
        weights: Weights = no_adapters,
        budget_bytes: int | None = None,
    ) -> None:
        self.device = device
        self.weights = weights
        self.cuda = device.type == "cuda"
        self.limit = limit
        self.budget_bytes = budget_bytes
        self.layouts: OrderedDict[Hashable, _Layout] = OrderedDict()
        self.banks: dict[Hashable, RowBank] = {}
        self.captures = 0
        self.warm_captures = 0  # of ``captures``, made while warming up (off the request path)
        self.replays = 0
        self.eager = 0  # steps run eagerly by the runner: a parity's first run, a failed capture
        self.over_budget = 0  # of ``eager``, runs of a layout the budget left uncaptured
        self.prefetched = 0  # runs whose rows had been copied in during the run before
        self.pool_bytes = 0  # device memory the captures reserved (CUDA; until closed)
        self._warming = False
        self._pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self._copies = torch.cuda.Stream(device) if self.cuda else None

    def close(self) -> None:
        """Drop every layout, once the copies into their buffers have finished, and the
        captures' pool with them (a new one for the captures after: its bytes count from
        zero again against the budget)."""
        if self._copies is not None:
            self._copies.synchronize()
        self.layouts.clear()
        self.banks.clear()
        self.pool_bytes = 0
        self._pool = torch.cuda.graph_pool_handle() if self.cuda else None

    @property
    def nbytes(self) -> int:
        """What the graphs hold now: row banks, static inputs and outputs, the pool."""
        banks = sum(bank.nbytes for bank in self.banks.values())
        return banks + sum(layout.nbytes for layout in self.layouts.values()) + self.pool_bytes

    @property
    def request_captures(self) -> int:
        """Captures made while serving: each one stalled the step that needed it."""
        return self.captures - self.warm_captures

    @contextlib.contextmanager
    def warming(self) -> Iterator[None]:
        """Count the captures made inside as warm-up (the executor's, before it serves)."""
        self._warming = True
        try:
            yield
        finally:
            self._warming = False

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
        layout = self.layouts.get(key) or self._add(key, tuple(sorted(ctx.grids)))
        self.layouts.move_to_end(key)
        bank = layout.bank
        parity = bank.turns % 2
        bank.turns += 1
        slots = list(ctx.slots)
        rows = bank.slots(parity, len(slots))
        self._rows_for(bank, parity, slots)
        ctx.slots = [
            slot if slot.reader is None else replace(slot, reader=r)
            for slot, r in zip(slots, rows, strict=True)
        ]
        out = self._call(layout, parity, fn, tensors)
        bank.read_done[parity] = self._event()
        self._prefetch(bank, 1 - parity, slots)
        for r in (*bank.rows[0], *bank.rows[1]):
            r.source = None  # the buffers are filled: keep no edit's handle alive
        return out

    def _add(self, key: Hashable, sizes: Hashable) -> _Layout:
        """A new layout on its resolution's bank; the least recently used beyond ``limit``
        is dropped (its captures' memory stays in the pool for the next ones)."""
        bank = self.banks.get(sizes)
        if bank is None:
            bank = self.banks[sizes] = RowBank(self.device)
        layout = self.layouts[key] = _Layout(bank)
        while len(self.layouts) > self.limit:
            if self._copies is not None:  # its buffers may still be being copied into
                self._copies.synchronize()
            self.layouts.popitem(last=False)
        return layout

    def _call(
        self, layout: _Layout, parity: int, fn: Callable[..., Any], tensors: dict[str, Any]
    ) -> Any:
        """A parity's first run is eager (its rows' buffers are made, lazy device state
        settles), the second captures, later ones replay."""
        if layout.fns[parity] is None or layout.graphs[parity] is EAGER:
            layout.fns[parity] = fn
            self.eager += 1
            return fn(**tensors)
        if layout.graphs[parity] is None:
            if self.budget_bytes is not None and self.nbytes >= self.budget_bytes:
                self.eager += 1
                self.over_budget += 1
                return fn(**tensors)
            self._capture(layout, parity, fn, tensors)
        else:
            _copy_inputs(layout.inputs, tensors)
        if layout.graphs[parity] is EAGER:
            self.eager += 1
            return fn(**tensors)
        self._replay(layout, parity)
        return layout.outputs[parity]

    def _rows_for(self, bank: RowBank, parity: int, slots: list) -> None:
        """Make this parity's rows hold the slots' steps: wait for their prefetch, or copy
        them now."""
        ready = bank.ready[parity]
        if self.cuda and ready is not None:  # a prefetch into these buffers may be running
            torch.cuda.current_stream(self.device).wait_event(ready)
        for rows, slot in zip(bank.rows[parity], slots, strict=False):
            if slot.reader is not None:  # a buffer another layout never read is made from it
                rows.point(slot.reader, slot.step)
        if ready is not None and _holds(bank.filled_for[parity], slots, 0):
            self.prefetched += 1
            return
        for rows, slot in zip(bank.rows[parity], slots, strict=False):
            if slot.reader is not None:
                rows.fill_all()
        bank.filled_for[parity], bank.ready[parity] = _wanted(slots, 0), None

    def _prefetch(self, bank: RowBank, parity: int, slots: list) -> None:
        """Copy every request's next step into ``parity``'s rows (once its last reader has
        finished), on the copy stream: it overlaps the run just launched."""
        rows = bank.slots(parity, len(slots))
        active = [(r, s) for r, s in zip(rows, slots, strict=True) if s.reader is not None]
        if not active or any(not r.buffers for r, _ in active):
            return  # this parity has not run yet: its buffers are made by its eager run
        for r, s in active:
            r.point(s.reader, s.step + 1)
        if not all(r.has_step(s.step + 1) for r, s in active):
            bank.filled_for[parity] = None
            return
        with self._on_copy_stream(bank.read_done[parity]):
            for r, _ in active:
                r.fill_all()
            bank.ready[parity] = self._event()
        bank.filled_for[parity] = _wanted(slots, 1)

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
            self._count_capture()
            return
        graph = torch.cuda.CUDAGraph()
        reserved = torch.cuda.memory_reserved(self.device)
        try:
            run = lambda: fn(**layout.inputs)  # noqa: E731
            layout.outputs[parity] = capture(graph, run, self.device, self._pool)
        except RuntimeError:
            log.exception("capturing a mask-aware step failed: this layout runs eagerly")
            layout.graphs[parity] = EAGER
            return
        finally:
            self.pool_bytes += max(0, torch.cuda.memory_reserved(self.device) - reserved)
        layout.graphs[parity] = graph
        self._count_capture()
        log.debug("captured a mask-aware step (%d layouts)", len(self.layouts))

    def _count_capture(self) -> None:
        """One capture (on a CPU: the bookkeeping that stands in for one)."""
        self.captures += 1
        self.warm_captures += self._warming
        if not self._warming:
            log.info(
                "a mask-aware step captured on the request path (%d so far)", self.request_captures
            )

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
    """What a parity's buffers hold: each request's bank slot, reader (weakly: a finished
    edit's handle is not kept alive) and step."""
    return tuple(
        (i, weakref.ref(s.reader), s.step + ahead)
        for i, s in enumerate(slots)
        if s.reader is not None
    )


def _holds(filled: tuple | None, slots: list, ahead: int) -> bool:
    """Whether ``filled`` is exactly the slots' readers (the same objects, in the same bank
    slots) at their steps."""
    wanted = [(i, s.reader, s.step + ahead) for i, s in enumerate(slots) if s.reader is not None]
    return (
        filled is not None
        and len(filled) == len(wanted)
        and all(
            slot == want_slot and ref() is reader and step == want_step
            for (slot, ref, step), (want_slot, reader, want_step) in zip(
                filled, wanted, strict=True
            )
        )
    )


def _tensor_bytes(values: Iterable[Any]) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


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
