"""The engine: step-level continuous batching on one device (FlashPS §4.3).

One thread runs nothing but denoising steps. Each iteration it (1) lets ready invocations
join the running batch, (2) runs exactly one denoising step for every running invocation
of one batch group (per-sample timesteps; requests of different functions that share a
model and resolution share the group), (3) hands finished invocations to post-processing.
Pre-processing (text encoding, VAE encode) and post-processing (VAE decode, image encoding)
run in worker processes (:class:`Stages`), so a newcomer never stalls the batch; with
``disaggregated=False`` they run on the engine thread instead (naive continuous batching)
and every such call counts as an *interruption* of each running invocation.

``static`` mode keeps the classic behaviour for comparisons: a batch forms from the queue
when the engine is idle and runs to completion before the next one forms.

Background work (template bakes) runs when the engine is idle, or after waiting longer than
``bake_starvation_s`` under sustained load (newer invocations keep arriving), so
insert-on-miss still happens.

Lifecycle: the owner calls :meth:`Engine.start` and :meth:`Engine.stop`. The engine thread
alone touches the running batch; other threads read a snapshot. Every accepted invocation
ends: with its result, with its own error (a failed encode, step or decode fails only the
invocations it concerns), or, when the loop itself dies or the engine stops, with
:class:`EngineUnavailable` — never left waiting. A dead engine refuses new work and reports
``alive = False`` so the executor's health check turns red and the pool restarts it.

Adapters: a work's ``adapters`` (``runtime/adapters``) name the LoRA set its model runs
with; the key keeps one set per group. A work whose adapter files are still being read
waits outside the ready queue (other groups keep stepping); once they are read, while a
batch runs, it stays in the ready queue and each iteration attaches a slice of its set's
layers, for ``adapter_load_share`` of the last step's time, before the step (counted in
the step's overhead); it joins once its set is resident. An idle engine attaches a set in
one piece. Before a group's step the engine activates its set (a swap, counted in the
group's step overhead).

Cancel and progress: :meth:`Engine.cancel` flags an invocation; it leaves the ready queue at
once, or the running batch at the top of the next iteration (before the step runs; the
batch goes on without it), failing with ``Canceled``. A work's ``on_step`` hears each of its
steps on the engine thread (the executor hands it to its event loop, never waiting).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import torch

from retouch.functions.adapters import AdapterSpec
from retouch.functions.errors import Canceled, Unavailable
from retouch.functions.imaging import composite, encode_image
from retouch.runtime.adapters import BARE, AdapterUse
from retouch.runtime.costmodel import LinearFit
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.editor import MaskAwareEditor
from retouch.runtime.maskaware.loader import attached
from retouch.runtime.maskaware.request import EditRequest, RequestState
from retouch.runtime.mixedlora import RowAdapters, rows_with
from retouch.runtime.niceness import renice_this_thread

log = logging.getLogger(__name__)

STEP_HISTORY = 512  # per-step records kept for /state
MIN_LINE_STEPS = 12  # fewer steps give the median ratio, not a line
LINE_STEPS = 96  # the latest steps a line is fitted on (4 560 pairs: ~1 ms per /state)
STOP_JOIN_S = 30.0


class EngineUnavailable(Unavailable):
    """The engine died or is stopping: the invocation did not (and will not) finish here.

    The gateway re-places invocations that fail this way (edits are deterministic)."""

    code = "engine_unavailable"


class InjectedFault(RuntimeError):
    """Raised inside the engine loop by :meth:`Engine.inject_fault` (fault tests)."""


class EngineMode(StrEnum):
    CONTINUOUS = "continuous"
    STATIC = "static"


class WorkStatus(StrEnum):
    """Where an invocation is in the engine (set by the engine as it moves it on)."""

    ACCEPTED = "accepted"  # submitted: pre-processing (or waiting to be encoded inline)
    WAITING_ADAPTERS = "waiting_adapters"  # encoded; its LoRA files are still being read
    READY = "ready"  # in the ready queue, may join the next step
    RUNNING = "running"  # in the running batch, one step per iteration
    POSTPROCESSING = "postprocessing"  # denoised, being decoded
    DONE = "done"
    FAILED = "failed"
    CANCELED = "canceled"

    @property
    def finished(self) -> bool:
        return self in (WorkStatus.DONE, WorkStatus.FAILED, WorkStatus.CANCELED)


@dataclass(frozen=True)
class EngineConfig:
    mode: EngineMode = EngineMode.CONTINUOUS
    max_batch: int = 8  # FlashPS: throughput plateaus around 8 (4 on small GPUs)
    disaggregated: bool = True
    bake_starvation_s: float = 30.0
    # engine-thread time an iteration gives to attaching a waiting adapter set's layers, as
    # a share of the last step's time (at least one layer: a load always progresses)
    adapter_load_share: float = 0.1
    # batches mix adapter sets (each row its own LoRA updates, runtime/mixedlora) instead
    # of one set per batch, the sets taking turns; the executor's keys then omit the set
    mixed_adapters: bool = False
    # added to the engine thread's niceness (Linux, where a thread has its own): on a CPU
    # the steps share cores with request handling, which must not wait behind a step
    nice: int = 0


@dataclass(frozen=True)
class Output:
    """What post-processing returns: the encoded image."""

    image: bytes
    width: int
    height: int


class Stages(Protocol):
    """Where pre- and post-processing run when they are disaggregated (worker processes)."""

    def encode(self, work: Work) -> Future: ...  # -> the editor's Encoded

    def decode(self, work: Work, latents: torch.Tensor) -> Future: ...  # -> (bytes, w, h)


Acquire = Callable[[], tuple[Any, dict[str, Any]]]  # -> (reader or None, cache info)
OnStep = Callable[[int, int], None]  # (steps done, total steps), called on the engine thread


@dataclass
class Work:
    """One invocation's life inside the engine, with its timestamps and counters."""

    key: Hashable  # invocations with the same key can share a denoising step
    model: str
    family: str
    scheduler: str
    editor: MaskAwareEditor
    request: EditRequest
    fmt: str
    acquire: Acquire  # makes the template host-resident (or not) at join time
    future: Future = field(default_factory=Future)
    id: int = 0  # set by the engine at submit
    arrived: float = field(default_factory=time.perf_counter)
    pre_done: float = 0.0
    joined: float = 0.0
    first_step: float = 0.0
    last_step: float = 0.0
    post_done: float = 0.0
    encoded: Any = None
    state: RequestState | None = None
    reader: Any = None
    cache: dict[str, Any] = field(default_factory=dict)
    interruptions: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    reader_released: bool = False
    on_step: OnStep | None = None  # progress: must be cheap and never block
    cancel_requested: bool = False  # set by Engine.cancel; honoured before the next step
    status: WorkStatus = WorkStatus.ACCEPTED
    feather_px: int | None = None  # composite into the template, this soft edge (None: off)
    adapters: AdapterUse | None = None  # the model's adapter set (None: a model without any)
    # The function's LoRA files, whose text-encoder parts encode its prompt (pre workers).
    text_adapters: tuple[AdapterSpec, ...] = ()
    # Pre-processing on the engine thread (no pre workers) when the editor's own encode
    # would miss the function's text-encoder LoRAs; None: ``editor.encode``.
    encode_inline: Callable[[EditRequest], Any] | None = None

    @property
    def path(self) -> str:
        return "maskaware" if self.reader is not None else "stock"

    def report(self, output: Output) -> dict[str, Any]:
        ms = 1e3
        return {
            "output": output,
            "path": self.path,
            "cache": self.cache,
            "timings": {
                "pre_ms": (self.pre_done - self.arrived) * ms,
                "queue_ms": (self.joined - self.pre_done) * ms,
                "run_ms": (self.last_step - self.joined) * ms,
                "post_ms": (self.post_done - self.last_step) * ms,
            },
            "engine": {
                "steps": len(self.batch_sizes),
                "interruptions": self.interruptions,
                "batch_sizes": self.batch_sizes,
            },
        }


@dataclass
class StepRecord:
    batch: int
    overhead_ms: float  # engine-thread time assembling the batch before the forward
    step_ms: float
    load_wait_ms: float  # time blocks waited for cached rows during the step
    sparse_blocks: int
    blocks: int
    predicted_ms: float = 0.0  # the plan's latency of the profiled blocks (0: no planner)
    model: str = ""  # whose group stepped (a step runs one model's group)


@dataclass
class EngineCounters:
    steps: int = 0
    interruptions: int = 0
    bakes: int = 0
    canceled: int = 0
    history: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=STEP_HISTORY))
    # (planned, measured) ms pairs a previous engine left per model (``steprecords``): they
    # fill the step fit's window until this engine's own steps displace them. Replaced
    # whole (never mutated) by the deploy thread; the state path reads a snapshot.
    prior: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)

    def own_pairs(self, model: str) -> list[tuple[float, float]]:
        """This engine's planned steps of ``model`` as (planned, measured) ms pairs."""
        return [
            (r.predicted_ms, r.step_ms)
            for r in list(self.history)
            if r.model == model and r.predicted_ms > 0
        ]

    def summary(self) -> dict[str, Any]:
        recent = list(self.history)
        overhead = [r.overhead_ms for r in recent]
        return {
            "steps": self.steps,
            "interruptions": self.interruptions,
            "bakes": self.bakes,
            "canceled": self.canceled,
            "batch_overhead_ms_p50": statistics.median(overhead) if overhead else 0.0,
            "step_ms_p50": statistics.median(r.step_ms for r in recent) if recent else 0.0,
            "load_wait_ms_p50": statistics.median(r.load_wait_ms for r in recent)
            if recent
            else 0.0,
            "batch_mean": statistics.fmean(r.batch for r in recent) if recent else 0.0,
            "last_plan": {"sparse": recent[-1].sparse_blocks, "blocks": recent[-1].blocks}
            if recent
            else None,
            **step_overhead(recent, [p for pairs in list(self.prior.values()) for p in pairs]),
        }


@dataclass(frozen=True)
class Admission:
    """What :func:`schedule` decided for the next step: who joins the running batch, and
    whose adapter set is attached between steps first."""

    joining: tuple[Work, ...] = ()
    loading: tuple[Work, ...] = ()


def schedule(
    ready: Sequence[Work],
    running: Mapping[Hashable, int],
    config: EngineConfig,
    joined: Sequence[Work] = (),
) -> Admission:
    """Which ready invocations join before the next step (pure: the engine applies it).

    ``running``: the size of every running group; ``joined``: invocations this iteration
    admitted already (they count towards their group's size). Continuous mode: in arrival
    order, each joins its group while the group has room (``max_batch``); while a batch
    runs, one whose adapter set is not resident waits for it to be attached between steps
    instead. Static mode: a batch forms only when nothing runs, from the oldest ready
    invocation's group, and runs to completion."""
    cap = config.max_batch
    if config.mode is EngineMode.STATIC:
        if running or not ready:
            return Admission()
        key = ready[0].key
        return Admission(tuple([w for w in ready if w.key == key][:cap]))
    sizes = dict(running)
    for work in joined:
        sizes[work.key] = sizes.get(work.key, 0) + 1
    joining: list[Work] = []
    loading: list[Work] = []
    for work in ready:
        if running and not (work.adapters is None or work.adapters.resident):
            loading.append(work)  # attached between steps, then it joins
        elif sizes.get(work.key, 0) < cap:
            sizes[work.key] = sizes.get(work.key, 0) + 1
            joining.append(work)
    return Admission(tuple(joining), tuple(loading))


def _mixed_rows(group: list[Work], editor: MaskAwareEditor, mixed: bool) -> RowAdapters | None:
    """The per-row adapter plan of a group's step in mixed batching (None: the group runs
    one set through peft, ``activate``). Every step with an adapter runs the rows' plan,
    even of one set, so that batching never swaps; a batch of the bare model alone turns
    peft's layers off instead (they then compute their base only)."""
    uses = [w.adapters for w in group]
    if any(u is None for u in uses):
        return None
    if not mixed and len({u.set_id for u in uses}) < 2:
        return None
    if all(u.set_id == BARE for u in uses):
        return None
    residency = uses[0].residency
    per = editor.impl.rows_per_request
    return residency.rows([u.set_id for u in uses], per, editor.device)


def step_overhead(
    records: list[StepRecord], prior: list[tuple[float, float]] | None = None
) -> dict[str, float]:
    """How steps really took against what the plan predicted for them: ``step_ms =
    step_intercept_ms + step_slope × planned_ms``, fitted on the recent steps. It absorbs
    the time outside the profiled blocks and a profile taken while the device was busier
    or quieter than now; the gateway's predictions apply it to every planned step. With
    too few steps or too little spread in the planned times for a line, the slope is the
    median ratio. ``prior`` (planned, measured) pairs, a previous engine's, fill the
    window while this engine has fewer than ``LINE_STEPS`` of its own."""
    own = [(r.predicted_ms, r.step_ms) for r in records if r.predicted_ms > 0]
    room = max(0, LINE_STEPS - len(own))
    pairs = (prior[-room:] if prior and room else []) + own
    if not pairs:
        return {}
    counts = {"step_fit_prior": len(pairs) - len(own)}
    xs = [p for p, _ in pairs]
    ys = [m for _, m in pairs]
    mean = sum(xs) / len(xs)
    if len(xs) >= MIN_LINE_STEPS and max(xs) - min(xs) > 0.3 * mean:
        # The intercept may be negative: a profile with too large a fixed cost per block
        # (taken while the device was shared) is corrected by a steeper, shifted line.
        fit = LinearFit.fit_theil_sen(xs[-LINE_STEPS:], ys[-LINE_STEPS:])
        if fit.slope > 0:
            return {"step_intercept_ms": fit.intercept, "step_slope": fit.slope, **counts}
    return {
        "step_intercept_ms": 0.0,
        "step_slope": statistics.median(y / x for x, y in zip(xs, ys, strict=True)),
        **counts,
    }


class Engine:
    """The step loop of one device. Owned by the executor core: ``start()``, ``stop()``."""

    def __init__(self, config: EngineConfig, stages: Stages, name: str = "engine") -> None:
        self.config = config
        self.stages = stages
        self.counters = EngineCounters()
        self._name = name
        self._cv = threading.Condition()  # guards every field below but _running
        self._ready: deque[Work] = deque()  # pre-processed, waiting to join
        self._background: deque[tuple[float, Callable[[], None]]] = deque()
        self._unfinished: dict[int, Work] = {}  # every accepted invocation not yet answered
        self._ids = itertools.count(1)
        self._pending_pre = 0
        self._adapter_waits = 0  # encoded, waiting for their adapter files to be read
        self._running_count = 0  # snapshot of the running batch, published by the loop
        self._stopping = False
        self._error: str | None = None  # why the loop died
        self._fault: BaseException | None = None
        self._thread: threading.Thread | None = None
        # The engine thread's own state: never touched by another thread while it runs.
        self._running: dict[Hashable, list[Work]] = {}
        self._loading: list[Work] = []  # ready, their adapter sets attached between steps
        self._turn = itertools.count()

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """Started, its thread running, not stopping and not crashed."""
        with self._cv:
            return self._accepting()

    @property
    def stopping(self) -> bool:
        """Asked by a background job between its steps: a stopping engine runs none to the
        end (``stop`` would otherwise wait for a whole bake)."""
        with self._cv:
            return self._stopping

    @property
    def error(self) -> str | None:
        with self._cv:
            return self._error

    def stop(self, timeout: float = STOP_JOIN_S) -> None:
        """Stop the loop and fail every unfinished invocation (``engine_unavailable``)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)
        self._fail_unfinished("the executor is shutting down")

    def inject_fault(self, message: str = "injected fault") -> None:
        """Make the loop raise at its next iteration, as a bug would (fault tests only)."""
        with self._cv:
            self._fault = InjectedFault(message)
            self._cv.notify_all()

    # ---- called from other threads ------------------------------------------------------
    def submit(self, work: Work) -> Future:
        """Accept an invocation and start its pre-processing; it joins once that is done.

        Raises :class:`EngineUnavailable` when the engine is dead or stopping."""
        with self._cv:
            if not self._accepting():
                raise EngineUnavailable(self._refusal(), code=self._refusal_code())
            work.id = next(self._ids)
            self._unfinished[work.id] = work
            work.future.add_done_callback(lambda _: self._forget(work))
            if self.config.disaggregated:
                self._pending_pre += 1
        if self.config.disaggregated:
            self.stages.encode(work).add_done_callback(lambda f: self._pre_finished(work, f))
        else:
            self._when_adapters_read(work)  # encoded on the engine thread at join
        return work.future

    def cancel(self, work: Work) -> bool:
        """Cancel an invocation: one still pre-processing or ready fails with
        :class:`Canceled` now or when its encode returns; a running one leaves its batch
        before the next denoising step (the others go on). False when it already ended."""
        with self._cv:
            if work.future.done() or work.id not in self._unfinished:
                return False
            work.cancel_requested = True
            waiting = work in self._ready
            if waiting:
                self._ready.remove(work)
            self._cv.notify()
        if waiting:
            self._cancel_now(work)
        return True

    def _cancel_now(self, work: Work) -> None:
        self.counters.canceled += 1
        self._fail(work, Canceled(f"invocation {work.id} was canceled"))

    def submit_background(self, job: Callable[[], None]) -> None:
        with self._cv:
            self._background.append((time.perf_counter(), job))
            self._cv.notify()

    def load(self) -> dict[str, int]:
        """Counts by stage; the running count is the loop's last published snapshot."""
        with self._cv:
            return {
                "preprocessing": self._pending_pre,
                "ready": len(self._ready),
                "running": self._running_count,
                "background": len(self._background),
                "adapter_waits": self._adapter_waits,
            }

    def _accepting(self) -> bool:
        thread = self._thread
        return (
            thread is not None and thread.is_alive() and not self._stopping and self._error is None
        )

    def _refusal(self) -> str:
        if self._error is not None:
            return f"the engine died: {self._error}"
        if self._stopping:
            return "the executor is shutting down"
        return "the engine is not running"

    def _refusal_code(self) -> str:
        return "engine_dead" if self._error is not None else "engine_unavailable"

    def _forget(self, work: Work) -> None:
        with self._cv:
            self._unfinished.pop(work.id, None)

    def _pre_finished(self, work: Work, fut: Future) -> None:
        with self._cv:
            self._pending_pre -= 1
            accepting = self._accepting()
        if fut.exception() is not None:
            self._fail(work, fut.exception())
            return
        if not accepting:  # died or stopped meanwhile: already failed by the stopper
            self._fail(work, EngineUnavailable(self.error_message(), code="engine_dead"))
            return
        if work.cancel_requested:
            self._cancel_now(work)
            return
        work.encoded, work.pre_done = fut.result(), time.perf_counter()
        self._when_adapters_read(work)

    def _when_adapters_read(self, work: Work) -> None:
        """Queue the work to join, once its adapter files are in memory (read in the
        background): it waits there without holding up the running batch."""
        read = None if work.adapters is None else work.adapters.read
        if read is None or read.done():
            self._make_ready(work, read)
            return
        with self._cv:
            self._adapter_waits += 1
            work.status = WorkStatus.WAITING_ADAPTERS

        def read_done(f: Future) -> None:
            with self._cv:
                self._adapter_waits -= 1
            self._make_ready(work, f)

        read.add_done_callback(read_done)

    def _make_ready(self, work: Work, read: Future | None) -> None:
        if read is not None and read.exception() is not None:
            self._fail(work, read.exception())
            return
        if work.cancel_requested:
            self._cancel_now(work)
            return
        with self._cv:
            accepting = self._accepting()
            if accepting:
                work.status = WorkStatus.READY
                self._ready.append(work)
                self._cv.notify()
        if not accepting:  # died or stopped meanwhile
            self._fail(work, EngineUnavailable(self.error_message(), code="engine_dead"))

    def error_message(self) -> str:
        with self._cv:
            return self._refusal()

    def _fail_unfinished(self, why: str) -> None:
        with self._cv:
            works = list(self._unfinished.values())
            self._ready.clear()
            code = self._refusal_code()
        for work in works:
            self._fail(work, EngineUnavailable(why, code=code))

    # ---- the engine thread --------------------------------------------------------------
    def _loop(self) -> None:
        renice_this_thread(self.config.nice, "engine thread")
        try:
            self._iterate()
        except BaseException as exc:  # a bug in the loop itself: fail everything, never hang
            log.exception("engine loop crashed")
            with self._cv:
                self._error = f"{type(exc).__name__}: {exc}"
            self._fail_unfinished(f"the engine died: {self._error}")

    def _iterate(self) -> None:
        while True:
            with self._cv:
                self._running_count = sum(len(v) for v in self._running.values())
                while not (
                    self._stopping
                    or self._fault
                    or self._ready
                    or self._running
                    or self._background
                ):
                    self._cv.wait()
                if self._fault is not None:
                    raise self._fault
                if self._stopping:
                    return
                joining = self._admit()
                starved = self._starved_job()
            loading_s = self._advance_loads()
            if loading_s and any(w.adapters.resident for w in self._loading):
                with self._cv:  # its set just became resident: it joins this step
                    joining += self._admit(joining)
            started = time.perf_counter() - loading_s
            for work in joining:
                self._join(work)
            if starved is not None:
                self._run_background(starved)
            if self._running:
                self._step(started)
            elif not joining:
                self._idle_background()

    def _admit(self, admitted: list[Work] | None = None) -> list[Work]:
        """Ready invocations that join now (under the lock), as :func:`schedule` decides;
        ``admitted``: those this iteration admitted already."""
        running = {k: len(v) for k, v in self._running.items()}
        admission = schedule(list(self._ready), running, self.config, admitted or ())
        for work in admission.joining:
            self._ready.remove(work)
        if self.config.mode is EngineMode.CONTINUOUS:
            self._loading = list(admission.loading)
        return list(admission.joining)

    def _advance_loads(self) -> float:
        """Attach a slice of the first waiting adapter set's layers; the seconds it took.
        A failed load fails the ready invocations of that set."""
        waiting = [w for w in self._loading if not w.adapters.resident]
        if not waiting:
            return 0.0
        use = waiting[0].adapters
        last_step_s = self.counters.history[-1].step_ms / 1e3 if self.counters.history else 0.0
        started = time.perf_counter()
        try:
            use.load_step(self.config.adapter_load_share * last_step_s)
        except Exception as exc:
            log.exception("loading adapter set %s failed", use.set_id)
            with self._cv:
                failed = [w for w in self._ready if _same_set(w.adapters, use)]
                for work in failed:
                    self._ready.remove(work)
            for work in failed:
                self._fail(work, exc)
        return time.perf_counter() - started

    def _join(self, work: Work) -> None:
        try:
            if work.encoded is None:  # naive mode: pre-processing on the engine thread
                self._interrupt()
                work.encoded = (work.encode_inline or work.editor.encode)(work.request)
                work.pre_done = time.perf_counter()
            work.reader, work.cache = work.acquire()
            work.state = work.editor.assemble(work.request, work.encoded, work.reader)
        except Exception as exc:
            self._fail(work, exc)
            return
        work.encoded = None
        work.joined = time.perf_counter()
        work.status = WorkStatus.RUNNING
        self._running.setdefault(work.key, []).append(work)

    def _leave_canceled(self) -> None:
        """Canceled invocations leave the running batch between steps."""
        for key, group in list(self._running.items()):
            gone = [w for w in group if w.cancel_requested]
            if not gone:
                continue
            self._running[key] = [w for w in group if not w.cancel_requested]
            if not self._running[key]:
                del self._running[key]
            for work in gone:
                work.state = None
                self._cancel_now(work)

    def _step(self, started: float) -> None:
        self._leave_canceled()
        if not self._running:
            return
        keys = [k for k, v in self._running.items() if v]
        key = keys[next(self._turn) % len(keys)]
        group = self._running[key]
        editor = group[0].editor
        states = [w.state for w in group]
        try:
            mixed = _mixed_rows(group, editor, self.config.mixed_adapters)
            if mixed is None and group[0].adapters is not None:  # its set, swapped in
                group[0].adapters.activate()
            modes = editor.plan(states, editor.blocks)
            t0 = time.perf_counter()
            if mixed is None:
                editor.step(states, modes)
            else:  # each row its set's updates; the padded layout keeps a request per row
                with rows_with(group[0].adapters.denoiser, mixed):
                    editor.step(states, modes, packed=False)
        except Exception as exc:
            log.exception("denoising step failed for a batch of %d", len(group))
            for work in group:
                self._fail(work, exc)
            del self._running[key]
            return
        t1 = time.perf_counter()
        self.counters.steps += 1
        sparse = sum(m is Mode.SPARSE for m in modes.values())
        self.counters.history.append(
            StepRecord(
                len(group),
                (t0 - started) * 1e3,
                (t1 - t0) * 1e3,
                _load_wait_ms(editor),
                sparse,
                len(modes),
                _predicted_ms(editor),
                group[0].model,
            )
        )
        for work in group:
            work.first_step = work.first_step or t0
            work.last_step = t1
            work.batch_sizes.append(len(group))
            if work.on_step is not None:
                try:
                    work.on_step(work.state.index, len(work.state.timesteps))
                except Exception:  # a progress listener never breaks the batch
                    log.exception("progress callback of invocation %d failed", work.id)
        done = [w for w in group if w.state.done]
        self._running[key] = [w for w in group if not w.state.done]
        if not self._running[key]:
            del self._running[key]
        for work in done:
            try:
                self._retire(work)
            except Exception as exc:  # this invocation's finish failed, not the batch's
                log.exception("finishing invocation %d failed", work.id)
                self._fail(work, exc)

    def _retire(self, work: Work) -> None:
        latents = work.editor.final_latents(work.state)
        release = getattr(work.reader, "release", None)
        if release is not None:
            release()
        work.reader_released = True
        work.state = None
        work.status = WorkStatus.POSTPROCESSING
        if self.config.disaggregated:
            self.stages.decode(work, latents).add_done_callback(
                lambda f: self._post_finished(work, f)
            )
            return
        self._interrupt()
        try:
            image = work.editor.decode(latents, work.request)
            if work.feather_px is not None:
                request = work.request
                image = composite(image, request.image, request.mask, work.feather_px)
            output = Output(encode_image(image, work.fmt), image.width, image.height)
        except Exception as exc:
            self._fail(work, exc)
            return
        work.post_done = time.perf_counter()
        if not work.future.done():
            work.status = WorkStatus.DONE
            work.future.set_result(work.report(output))

    def _post_finished(self, work: Work, fut: Future) -> None:
        if fut.exception() is not None:
            self._fail(work, fut.exception())
            return
        work.post_done = time.perf_counter()
        if not work.future.done():
            work.status = WorkStatus.DONE
            work.future.set_result(work.report(Output(*fut.result())))

    def _interrupt(self) -> None:
        """Non-denoising work on the engine thread while invocations are running."""
        running = [w for group in self._running.values() for w in group]
        if running:
            self.counters.interruptions += 1
        for work in running:
            work.interruptions += 1

    def _fail(self, work: Work, exc: BaseException) -> None:
        release = None if work.reader_released else getattr(work.reader, "release", None)
        if release is not None:
            work.reader_released = True
            release()
        if not work.future.done():
            work.status = WorkStatus.CANCELED if isinstance(exc, Canceled) else WorkStatus.FAILED
            work.future.set_exception(exc)

    def _starved_job(self) -> Callable[[], None] | None:
        """(lock held) The oldest background job, once it has waited ``bake_starvation_s``
        *and* the load is sustained: some invocation that arrived after it was queued is
        waiting or running. Without newer work the engine becomes idle when the current
        invocations end, and the job runs then; so a single long edit (a first edit of an
        uploaded image on a CPU) is not stalled by the bake it queued itself."""
        if not self._background:
            return None
        queued_at = self._background[0][0]
        if time.perf_counter() - queued_at <= self.config.bake_starvation_s:
            return None
        running = (w for group in self._running.values() for w in group)
        if not any(w.arrived > queued_at for w in (*self._ready, *running)):
            return None
        return self._background.popleft()[1]

    def _idle_background(self) -> None:
        with self._cv:
            job = self._background.popleft()[1] if self._background and not self._ready else None
        if job is not None:
            self._run_background(job)

    def _run_background(self, job: Callable[[], None]) -> None:
        """A bake: denoising work, but not for the running invocations (counted apart)."""
        try:
            job()
        except Exception:
            log.exception("background job failed")
        self.counters.bakes += 1


def _same_set(a: AdapterUse | None, b: AdapterUse) -> bool:
    return a is not None and a.residency is b.residency and a.set_id == b.set_id


def _predicted_ms(editor: MaskAwareEditor) -> float:
    """What the step just run was expected to take: its layout's replay time from graph
    warm-up (the gateway's tables hold the same), else the planner's latency (0 without
    a cost model)."""
    if editor.last_expected_s is not None:
        return editor.last_expected_s * 1e3
    plan = getattr(editor.plan, "last", None)
    return plan.latency * 1e3 if plan is not None else 0.0


def _load_wait_ms(editor: MaskAwareEditor) -> float:
    """How long the step's blocks waited for cached rows (0 without a row loader)."""
    loader = attached(editor)
    return loader.last.wait_s * 1e3 if loader is not None and loader.last is not None else 0.0
