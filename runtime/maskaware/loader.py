"""Cached rows loaded while blocks compute: the load side of the bubble-free plan.

At the start of a mask-aware step the :class:`RowLoader` turns the step's plan into *jobs*,
one per block that reads cached rows, in block execution order: a sparse block's own rows
(K/V, and Y for UNet blocks) and, for a full block right after a sparse one, that sparse
block's Y. How the jobs run is the loader's :class:`LoadMode`:

* ``overlapped``: a loader thread fills them ahead of the blocks, so loading block *i+1*
  overlaps computing block *i*. On CUDA the thread gathers into pinned staging buffers and
  copies them on a dedicated stream; an event per job makes the compute stream wait only
  for that job's copy. The thread stays at most ``depth`` jobs ahead (bounded memory).
* ``sequential``: each job is loaded on the compute thread when its block starts, then the
  block computes (naive load-then-compute: the baseline the plan is measured against).
* ``preload``: every job before the forward (profiling: block times without loads).
* ``sync``: no loader; the blocks gather their rows themselves, synchronously.

Blocks take their rows with :meth:`StepLoads.rows` (through ``ForwardContext.loader``),
waiting only when that job is not ready yet; the time they wait is the step's *load wait*.
:func:`attach` declares a loader on an editor (``set_row_loader``), whose steps then run
inside :meth:`RowLoader.session`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from retouch.cachestore.handle import TemplateHandle
from retouch.cachestore.rows import RowSelection
from retouch.runtime.maskaware.context import BlockHook, ForwardContext, Mode
from retouch.runtime.maskaware.rowformat import decode
from retouch.runtime.maskaware.store import device_resident, fetch_rows

log = logging.getLogger(__name__)

ALIGN = 256  # byte alignment of the tensors packed into one job buffer
POOL_BYTES = 1 << 30  # host job buffers kept for re-use across steps (CPU)


class LoadMode(StrEnum):
    SYNC = "sync"
    SEQUENTIAL = "sequential"
    OVERLAPPED = "overlapped"
    PRELOAD = "preload"


@dataclass(frozen=True)
class RowNeed:
    """Rows ``names`` cached for block ``source``, read while block ``consumer`` runs."""

    consumer: str
    source: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class FamilyRows:
    """Which cached rows a model family's blocks read, by plan.

    ``sparse[b]``: what block ``b`` reads when it runs sparse; ``exit[b]``: what the next
    block reads of ``b`` when it runs full right after ``b`` ran sparse.
    """

    order: tuple[str, ...]  # blocks in execution order
    sparse: dict[str, tuple[str, ...]]
    exit: dict[str, tuple[str, ...]]

    def needs(self, mode: Callable[[str], Mode]) -> list[RowNeed]:
        """The step's jobs in execution order (at most one per consumer block)."""
        out: list[RowNeed] = []
        previous_sparse: str | None = None
        for block in self.order:
            if mode(block) is Mode.SPARSE:
                out.append(RowNeed(block, block, self.sparse[block]))
                previous_sparse = block
                continue
            if previous_sparse is not None and self.exit[previous_sparse]:
                out.append(RowNeed(block, previous_sparse, self.exit[previous_sparse]))
            previous_sparse = None
        return out


def family_rows(editor: Any) -> FamilyRows:
    """The :class:`FamilyRows` of a ``MaskAwareEditor``'s model (its family's layout)."""
    return editor.model_family.rows(editor.impl)


@dataclass
class LoadStats:
    """One step's loading: ``wait_s`` is the time blocks spent waiting on rows."""

    mode: str
    wait_s: float = 0.0
    load_s: float = 0.0  # loader busy time (host side; with the copy where it was timed)
    bytes: int = 0
    jobs: int = 0
    host_gathered: int = 0  # bytes of rows the CPU gathered (none where slabs cross by DMA)
    job_times: list[tuple[int, float]] = field(default_factory=list)  # (bytes, s) per job

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "wait_s": self.wait_s,
            "load_s": self.load_s,
            "bytes": self.bytes,
            "jobs": self.jobs,
        }


@dataclass(eq=False)
class _Piece:
    """One request's rows of one cached tensor inside a job buffer."""

    request: int
    block: str
    name: str
    reader: Any
    step: int
    rows: torch.Tensor | RowSelection
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    device_rows: torch.Tensor | None = None  # the unmasked positions on the loader's device

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(eq=False)
class _Job:
    index: int
    need: RowNeed
    ready: threading.Event = field(default_factory=threading.Event)
    tensors: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    flat: torch.Tensor | None = None
    event: Any = None  # torch.cuda.Event of the job's copy
    error: BaseException | None = None
    released: bool = False
    synced: bool = False  # the compute stream already waits for ``event``


class RowLoader:
    """Loads the cached rows of each mask-aware step (see the module docstring)."""

    def __init__(
        self,
        rows: FamilyRows,
        device: torch.device | str,
        mode: LoadMode | str = LoadMode.OVERLAPPED,
        *,
        depth: int = 4,
        hooks: list[BlockHook] | None = None,
        time_copies: bool = False,
    ) -> None:
        if depth < 1:
            raise ValueError("depth must be at least 1")
        self.family = rows
        self.device = _indexed(torch.device(device))
        self.mode = LoadMode(mode)
        self.depth = depth
        self.hooks = list(hooks or [])
        self.time_copies = time_copies  # wait for each CUDA copy to time jobs (profiling)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.last: LoadStats | None = None
        self.totals = LoadStats(self.mode.value)
        self.steps = 0
        self._pool = _HostPool()
        self._staging = _PinnedStaging(2) if self.cuda else None
        self._fill_lock = threading.Lock()
        self._queue: queue.SimpleQueue[StepLoads | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_editor(
        cls, editor: Any, mode: LoadMode | str = LoadMode.OVERLAPPED, **kw: Any
    ) -> RowLoader:
        """A loader for a ``MaskAwareEditor``'s model on its device."""
        return cls(family_rows(editor), editor.device, mode, **kw)

    # -- steps ----------------------------------------------------------------------------

    @contextmanager
    def session(self, ctx: ForwardContext) -> Iterator[StepLoads | None]:
        """Load ``ctx``'s rows while the forward inside the ``with`` runs."""
        if self.mode is LoadMode.SYNC:
            self._record(LoadStats(self.mode.value))
            yield None
            return
        loads = StepLoads(self, ctx, self.family.needs(ctx.mode))
        ctx.loader = loads
        ctx.hooks = [*ctx.hooks, loads, *self.hooks]
        try:
            loads.start()
            yield loads
        finally:
            loads.close()
            ctx.loader = None
            self._record(loads.stats)

    def measure(self, ctx: ForwardContext, mode: Callable[[str], Mode]) -> LoadStats:
        """Load (and drop) every row a step with plan ``mode`` would read, job by job, each
        timed with its copy to the device: the load side of profiling, without compute."""
        loads = StepLoads(self, ctx, self.family.needs(mode))
        loads._finished.set()
        try:
            for job in loads.jobs:
                self.fill(loads, job, self.stream, timed=True)
                self.release(job)
        finally:
            loads.close()
        return loads.stats

    def _record(self, stats: LoadStats) -> None:
        self.last = stats
        self.steps += 1
        for name in ("wait_s", "load_s", "bytes", "jobs", "host_gathered"):
            setattr(self.totals, name, getattr(self.totals, name) + getattr(stats, name))

    def close(self) -> None:
        """Stop the loader thread (a later overlapped step starts it again)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _submit(self, loads: StepLoads) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="row-loader", daemon=True)
            self._thread.start()
        self._queue.put(loads)

    def _run(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        while (loads := self._queue.get()) is not None:
            with torch.inference_mode():
                loads.load_ahead()

    # -- filling one job ------------------------------------------------------------------

    def fill(self, loads: StepLoads, job: _Job, stream: Any, *, timed: bool = False) -> None:
        """Gather a job's rows into one buffer (pinned + a copy on ``stream`` on CUDA)."""
        start = time.perf_counter()
        with self._fill_lock:
            pieces, nbytes = loads.layout(job)
            if self.cuda and pieces and all(_slab(p)[0] is not None for p in pieces):
                moved = self._fill_from_slabs(job, pieces, nbytes, stream, timed)
                loads.account(moved, time.perf_counter() - start)
                return
            host = self._staging.take(nbytes) if self._staging else self._pool.take(nbytes)
            for piece in pieces:
                _gather(piece, piece.view(host))
            flat = host
            if self.cuda:
                with torch.cuda.stream(stream):
                    flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                    flat.copy_(host[:nbytes], non_blocking=True)
                    job.event = torch.cuda.Event()
                    job.event.record(stream)
                self._staging.done(job.event)
                if self.time_copies or timed:
                    job.event.synchronize()
        job.flat = flat
        job.tensors = {(p.request, p.name): p.view(flat) for p in pieces}
        loads.account(nbytes, time.perf_counter() - start, gathered=nbytes)

    def _fill_from_slabs(
        self, job: _Job, pieces: list[_Piece], nbytes: int, stream: Any, timed: bool
    ) -> int:
        """CUDA, whole tensors in pinned host memory: each contiguous slab crosses by DMA on
        ``stream`` and its unmasked rows are gathered there, on the GPU (the CPU touches no
        row). Returns the bytes moved host → device."""
        moved = 0
        with torch.cuda.stream(stream):
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            for piece in pieces:
                slab, scale = _slab(piece)
                on_device = slab.to(self.device, non_blocking=True)
                moved += slab.numel() * slab.element_size() if slab.device.type == "cpu" else 0
                if scale is not None:  # fp8 rows: decoded here, on the GPU
                    scale = piece.reader.scale(piece.step, piece.block, piece.name, self.device)
                    on_device = decode(on_device, scale, piece.dtype)
                torch.index_select(on_device, -2, piece.device_rows, out=piece.view(flat))
            job.event = torch.cuda.Event()
            job.event.record(stream)
        if self.time_copies or timed:
            job.event.synchronize()
        job.flat = flat
        job.tensors = {(p.request, p.name): p.view(flat) for p in pieces}
        return moved

    def release(self, job: _Job) -> None:
        """The job's block is done: its host buffer goes back to the pool (idempotent)."""
        if job.flat is not None and not self.cuda:
            self._pool.give(job.flat)
        job.flat, job.tensors = None, {}


class StepLoads:
    """The loads of one step: what ``ForwardContext.loader`` points to during a forward."""

    def __init__(self, loader: RowLoader, ctx: ForwardContext, needs: list[RowNeed]) -> None:
        self.loader = loader
        self.ctx = ctx
        self.jobs = [_Job(i, need) for i, need in enumerate(needs)]
        self.by_consumer = {job.need.consumer: job for job in self.jobs}
        self.by_source = {(j.need.source, n): j for j in self.jobs for n in j.need.names}
        self.stats = LoadStats(loader.mode.value, jobs=len(self.jobs))
        self._grids = {batch.n_tokens: batch for batch in ctx.grids.values()}
        self._selections: dict[tuple[int, int], RowSelection] = {}
        self._cond = threading.Condition()
        self._progress = -1  # the latest job the blocks have reached
        self._cancelled = False
        self._finished = threading.Event()
        self._gpu_waits: list[tuple[Any, Any]] = []

    # -- the compute side -----------------------------------------------------------------

    def start(self) -> None:
        mode = self.loader.mode
        if mode is LoadMode.PRELOAD:
            for job in self.jobs:
                self._fill_safely(job, self.loader.stream)
        if mode is LoadMode.OVERLAPPED and self.jobs:
            self.loader._submit(self)
        else:
            self._finished.set()

    def enter(self, block: str) -> None:
        """A block starts: earlier jobs are done with; a sequential loader loads now."""
        job = self.by_consumer.get(block)
        if job is None:
            return
        self._advance(job.index)
        if self.loader.mode is LoadMode.SEQUENTIAL and not job.ready.is_set():
            start = time.perf_counter()
            self._fill_safely(job, _current_stream(self.loader))
            self.stats.wait_s += time.perf_counter() - start

    def exit(self, block: str) -> None:
        return None

    def rows(self, request: int, block: str, name: str) -> torch.Tensor:
        """Request ``request``'s cached unmasked rows of ``(block, name)``, once loaded."""
        job = self.by_source.get((block, name))
        if job is None:
            raise RuntimeError(f"the plan loads no rows of {block!r}/{name!r} in this step")
        self._advance(job.index)
        if job.released:
            raise RuntimeError(f"rows of {block!r} taken after a later block started")
        if not job.ready.is_set():
            if self.loader.mode is LoadMode.SEQUENTIAL:
                self.enter(job.need.consumer)
            start = time.perf_counter()
            job.ready.wait()
            self.stats.wait_s += time.perf_counter() - start
        if job.error is not None:
            raise RuntimeError(f"loading the cached rows of {block!r} failed") from job.error
        self._sync(job)
        try:
            return job.tensors[(request, name)]
        except KeyError:
            raise RuntimeError(f"request {request} has no cached rows of {block!r}") from None

    def close(self) -> None:
        """End of the forward: stop loading, free the buffers, settle the statistics."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()
        self._finished.wait()
        for job in self.jobs:
            self.loader.release(job)
            job.released = True
        if self._gpu_waits:
            self._gpu_waits[-1][1].synchronize()
            self.stats.wait_s += sum(a.elapsed_time(b) for a, b in self._gpu_waits) / 1e3

    def _advance(self, index: int) -> None:
        """The blocks reached job ``index``: release the jobs before it, let the thread on."""
        with self._cond:
            if index <= self._progress:
                return
            done = self.jobs[max(self._progress, 0) : index]
            self._progress = index
            for job in done:
                job.released = True
                if job.ready.is_set():
                    self.loader.release(job)
            self._cond.notify_all()

    def _sync(self, job: _Job) -> None:
        """CUDA: order the compute stream after the job's copy (timing the stall)."""
        if job.event is None or job.synced:
            return
        stream = torch.cuda.current_stream(self.loader.device)
        if stream != self.loader.stream:
            before, after = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            before.record(stream)
            stream.wait_event(job.event)
            after.record(stream)
            self._gpu_waits.append((before, after))
            job.flat.record_stream(stream)
        job.synced = True

    # -- the loading side -----------------------------------------------------------------

    def load_ahead(self) -> None:
        """Loader thread: every job in order, at most ``depth`` ahead of the blocks."""
        try:
            for job in self.jobs:
                with self._cond:
                    while job.index > self._progress + self.loader.depth and not self._cancelled:
                        self._cond.wait()
                    if self._cancelled or job.released:
                        job.ready.set()
                        continue
                self._fill_safely(job, self.loader.stream)
                with self._cond:
                    if job.released:
                        self.loader.release(job)
        finally:
            self._finished.set()

    def _fill_safely(self, job: _Job, stream: Any) -> None:
        try:
            self.loader.fill(self, job, stream)
        except BaseException as exc:  # handed to the block that needs these rows
            log.exception("loading rows of %s failed", job.need.source)
            job.error = exc
        finally:
            job.ready.set()

    def account(self, nbytes: int, seconds: float, *, gathered: int = 0) -> None:
        with self._cond:
            self.stats.bytes += nbytes
            self.stats.host_gathered += gathered
            self.stats.load_s += seconds
            self.stats.job_times.append((nbytes, seconds))

    def layout(self, job: _Job) -> tuple[list[_Piece], int]:
        """Every (request, name) piece of a job and their offsets in one buffer."""
        pieces, offset, source = [], 0, job.need.source
        for request, slot in enumerate(self.ctx.slots):
            if slot.reader is None:
                continue
            for name in job.need.names:
                resident = device_resident(slot.reader, slot.step, source, name, self.loader.device)
                if resident is not None:
                    continue  # the device tier: the block copies it whole, nothing to load
                shape, dtype = _describe(slot.reader, slot.step, source, name)
                grid = self._grids[shape[-2]]
                tokens = grid.sets[request]
                count = tokens.unmasked.numel()
                if count == 0:
                    continue
                shape = (*shape[:-2], count, shape[-1])
                rows = self._rows(slot.reader, request, tokens.n_tokens, tokens.unmasked)
                piece = _Piece(
                    request, source, name, slot.reader, slot.step, rows, shape, dtype, offset
                )
                if self.loader.cuda:
                    piece.device_rows = grid.unmasked_index(request)
                pieces.append(piece)
                offset += -(-piece.nbytes // ALIGN) * ALIGN
        return pieces, offset

    def _rows(
        self, reader: Any, request: int, n_tokens: int, unmasked: torch.Tensor
    ) -> torch.Tensor | RowSelection:
        """The rows argument for ``read_rows``: a cached ``RowSelection`` for the cachestore."""
        if not isinstance(reader, TemplateHandle):
            return unmasked
        key = (request, n_tokens)
        if key not in self._selections:
            self._selections[key] = RowSelection(unmasked)
        return self._selections[key]


def _slab(piece: _Piece) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[None, None]:
    """The piece's whole cached tensor as stored (and its fp8 scales) when its reader holds
    it in pinned host memory or on a GPU: it then crosses by DMA and is gathered (and
    decoded) on the device. ``(None, None)`` otherwise."""
    encoded = getattr(piece.reader, "encoded", None)
    if piece.device_rows is None or encoded is None:
        return None, None
    tensor, scale = encoded(piece.step, piece.block, piece.name)
    if tensor.device.type == "cuda" or tensor.is_pinned():
        return tensor, scale
    return None, None


def _describe(reader: Any, step: int, block: str, name: str) -> tuple[torch.Size, torch.dtype]:
    """Shape and compute dtype of a cached tensor (without decoding it where it can)."""
    describe = getattr(reader, "describe", None)
    if describe is not None:
        return describe(step, block, name)
    cached = reader.get(step, block, name)
    return cached.shape, cached.dtype


def _gather(piece: _Piece, out: torch.Tensor) -> None:
    if isinstance(piece.rows, RowSelection):  # the cachestore takes prepared selections
        piece.reader.read_rows(piece.step, piece.block, piece.name, piece.rows, out)
        return
    fetch_rows(piece.reader, piece.step, piece.block, piece.name, piece.rows, out)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` → ``cuda:<current>`` (the loader thread must select the same device)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _current_stream(loader: RowLoader) -> Any:
    return torch.cuda.current_stream(loader.device) if loader.cuda else None


class _HostPool:
    """Host job buffers by size class, re-used across steps (no page faults each step)."""

    def __init__(self, limit: int = POOL_BYTES) -> None:
        self.limit = limit
        self.kept = 0
        self.free: dict[int, list[torch.Tensor]] = {}
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        size = _size_class(nbytes)
        with self.lock:
            found = self.free.get(size)
            if found:
                self.kept -= size
                return found.pop()
        return torch.empty(size, dtype=torch.uint8)

    def give(self, flat: torch.Tensor) -> None:
        size = flat.numel()
        with self.lock:
            if self.kept + size <= self.limit:
                self.free.setdefault(size, []).append(flat)
                self.kept += size


class _PinnedStaging:
    """A ring of pinned host buffers; one is re-used once its last copy has finished."""

    def __init__(self, slots: int) -> None:
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.events: list[Any] = [None] * slots
        self.turn = 0

    def take(self, nbytes: int) -> torch.Tensor:
        slot = self.turn % len(self.buffers)
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        buffer = self.buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(_size_class(nbytes), dtype=torch.uint8, pin_memory=True)
            self.buffers[slot] = buffer
        return buffer

    def done(self, event: Any) -> None:
        self.events[self.turn % len(self.buffers)] = event
        self.turn += 1


def _size_class(nbytes: int) -> int:
    """Round up to 4 classes per power of two (at most ~19 % slack), at least 4 KiB."""
    nbytes = max(nbytes, 4096)
    step = 1 << max(nbytes.bit_length() - 3, 0)
    return -(-nbytes // step) * step


def attach(editor: Any, loader: RowLoader | None) -> None:
    """Run every mask-aware step of ``editor`` through ``loader`` (``None``: synchronous).

    The editor holds it as a declared attachment (``editor.set_row_loader``); bakes and
    stock calls never use it.
    """
    editor.set_row_loader(loader)


def attached(editor: Any) -> RowLoader | None:
    return editor.row_loader
