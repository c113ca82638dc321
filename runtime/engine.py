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
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future

from retouch.functions.errors import Canceled, Unavailable
from retouch.functions.imaging import composite, encode_image
from retouch.runtime.adapters import AdapterSetFailed
from retouch.runtime.batching import mixed_rows, same_set, schedule, starved, without_canceled
from retouch.runtime.engineconfig import EngineConfig, EngineMode
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.mixedlora import rows_with
from retouch.runtime.niceness import renice_this_thread
from retouch.runtime.stepstats import EngineCounters, StepRecord, load_wait_ms, predicted_ms
from retouch.runtime.work import Output, Stages, Work, WorkStatus

__all__ = ["Engine", "EngineConfig", "EngineMode", "EngineUnavailable", "Work", "WorkStatus"]

log = logging.getLogger(__name__)

STOP_JOIN_S = 30.0


class EngineUnavailable(Unavailable):
    """The engine died or is stopping: the invocation did not (and will not) finish here.

    The gateway re-places invocations that fail this way (edits are deterministic)."""

    code = "engine_unavailable"


class InjectedFault(RuntimeError):
    """Raised inside the engine loop by :meth:`Engine.inject_fault` (fault tests)."""


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
                message, code = refusal(self._error, self._stopping)
                raise EngineUnavailable(message, code=code)
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
            return refusal(self._error, self._stopping)[0]

    def _fail_unfinished(self, why: str) -> None:
        with self._cv:
            works = list(self._unfinished.values())
            self._ready.clear()
            code = refusal(self._error, self._stopping)[1]
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
                self._run_background()

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
                failed = [w for w in self._ready if same_set(w.adapters, use)]
                for work in failed:
                    self._ready.remove(work)
            for work in failed:
                self._fail(work, exc)
        return time.perf_counter() - started

    def _join(self, work: Work) -> None:
        try:
            if work.encoded is None:  # naive mode: pre-processing on the engine thread
                interrupt(self._running, self.counters)
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

    def _step(self, started: float) -> None:
        kept, gone = without_canceled(self._running)  # they leave between steps
        if gone:
            self._running = kept
        for work in gone:
            work.state = None
            self._cancel_now(work)
        if not self._running:
            return
        keys = [k for k, v in self._running.items() if v]
        key = keys[next(self._turn) % len(keys)]
        group = self._running[key]
        editor = group[0].editor
        states = [w.state for w in group]
        try:
            mixed = mixed_rows(group, editor, self.config.mixed_adapters)
            if mixed is None and group[0].adapters is not None:  # its set, swapped in
                group[0].adapters.activate()
            modes = editor.plan(states, editor.blocks)
            t0 = time.perf_counter()
            if mixed is None:
                editor.step(states, modes)
            else:  # each row its set's updates (packed only where the family's layers allow)
                with rows_with(group[0].adapters.denoiser, mixed):
                    editor.step(states, modes, packed=editor.impl.mixes_packed)
        except AdapterSetFailed as exc:  # only that set's requests: the others step on
            log.exception("adapter set %s failed in a mixed step", exc.set_id)
            failed = [
                w for w in group if w.adapters is not None and w.adapters.set_id == exc.set_id
            ]
            for work in failed:
                group.remove(work)
                self._fail(work, exc.cause)
            if not group:
                del self._running[key]
            return
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
                load_wait_ms(editor),
                sparse,
                len(modes),
                predicted_ms(editor),
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
        work.state = None
        work.status = WorkStatus.POSTPROCESSING
        if self.config.disaggregated:
            self.stages.decode(work, latents).add_done_callback(
                lambda f: self._post_finished(work, f)
            )
            return
        interrupt(self._running, self.counters)
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
        if work.status.finished:  # failed meanwhile (a stopping engine)
            return
        work.status = WorkStatus.DONE
        if not work.future.done():  # its waiter may have gone away
            work.future.set_result(work.report(output))

    def _post_finished(self, work: Work, fut: Future) -> None:
        if fut.exception() is not None:
            self._fail(work, fut.exception())
            return
        work.post_done = time.perf_counter()
        if work.status.finished:  # failed meanwhile (a stopping engine)
            return
        work.status = WorkStatus.DONE
        if not work.future.done():  # its waiter may have gone away
            work.future.set_result(work.report(Output(*fut.result())))

    def _fail(self, work: Work, exc: BaseException) -> None:
        """End ``work`` with ``exc`` (once), releasing its reader unless it retired
        already. Its status is set even when its waiter went away (its future canceled)."""
        if work.status.finished:
            return
        release = getattr(work.reader, "release", None)
        if release is not None and work.status is not WorkStatus.POSTPROCESSING:
            release()
        work.status = WorkStatus.CANCELED if isinstance(exc, Canceled) else WorkStatus.FAILED
        if not work.future.done():
            work.future.set_exception(exc)

    def _starved_job(self) -> Callable[[], None] | None:
        """(lock held) The oldest background job, if it starved (:func:`starved`)."""
        if not self._background:
            return None
        running = (w for group in self._running.values() for w in group)
        waiting = (*self._ready, *running)
        now, limit = time.perf_counter(), self.config.bake_starvation_s
        return (
            self._background.popleft()[1]
            if starved(self._background[0][0], waiting, now, limit)
            else None
        )

    def _run_background(self, job: Callable[[], None] | None = None) -> None:
        """A bake: denoising work, but not for the running invocations (counted apart);
        ``job`` None: the oldest one, if no invocation is ready (an idle engine)."""
        if job is None:
            with self._cv:
                if not self._background or self._ready:
                    return
                job = self._background.popleft()[1]
        try:
            job()
        except Exception:
            log.exception("background job failed")
        self.counters.bakes += 1


def refusal(error: str | None, stopping: bool) -> tuple[str, str]:
    """Why an engine refuses work, and the error code that says it."""
    if error is not None:
        return f"the engine died: {error}", "engine_dead"
    if stopping:
        return "the executor is shutting down", "engine_unavailable"
    return "the engine is not running", "engine_unavailable"


def interrupt(running: dict[Hashable, list[Work]], counters: EngineCounters) -> None:
    """Count non-denoising work on the engine thread while invocations are running."""
    works = [w for group in running.values() for w in group]
    if works:
        counters.interruptions += 1
    for work in works:
        work.interruptions += 1
