"""Pre/post-processing in worker processes, so the engine thread only runs denoising steps:
the pool, on the engine process's side (the worker process is :mod:`.worker_server`).

FlashPS (§4.3) measured that pre- and post-processing inside the continuous-batching loop
interrupt every running request (+40 % P95); moving them to other processes took −29 % P95.
:class:`PrePostPool` runs ``pre`` workers (text encoding, VAE encode: ``editor.encode``) and
``post`` workers (VAE decode and image encoding: ``editor.decode`` + ``encode_image``).
Each is a process (forked from a fork server on a CPU, spawned on CUDA) holding the model's
pipeline *without* its denoiser (post workers also without text encoders), on the
executor's device and dtype, loaded on first use and kept per model.

Jobs travel as a msgpack header over a pipe (``send_bytes``/``recv_bytes``) plus one
shared-memory block of tensors per direction (:mod:`retouch.runtime.shm`); nothing is
pickled. One dispatcher thread per worker feeds it one job at a time from its role's
queue, so an idle worker takes the next job. A worker that dies fails its job with
:class:`WorkerDied` naming it, its blocks are unlinked, and it is restarted.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
import multiprocessing
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from retouch.functions.adapters import AdapterSpec
from retouch.functions.errors import RetouchError
from retouch.functions.wire.codec import pack, unpack
from retouch.functions.wire.invoke import OUTPUT_FORMATS
from retouch.runtime import shm
from retouch.runtime.maskaware.editor import Encoded
from retouch.runtime.maskaware.request import EditRequest
from retouch.runtime.models import default_device
from retouch.runtime.worker_server import POST, PRE, WorkerSpec, serve

log = logging.getLogger(__name__)

TIMINGS_KEPT = 1024


class WorkerDied(RuntimeError):
    """The worker process running a job exited before answering it."""


class WorkerError(RuntimeError):
    """A job raised in its worker; ``kind`` is the exception's class name there."""

    def __init__(self, worker: str, kind: str, message: str) -> None:
        super().__init__(f"{worker}: {kind}: {message}")
        self.kind = kind


class PoolClosed(RuntimeError):
    """The pool was closed before the job ran."""


@dataclass(frozen=True)
class JobTiming:
    """One job as the pool saw it: ``total_s`` round trip, ``compute_s`` the worker's own
    work (model loading included); the rest is transport (shared memory, pipe, wake-ups)."""

    op: str
    total_s: float
    compute_s: float
    payload_bytes: int

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.compute_s


@dataclass
class _Job:
    """One job; ``items`` is built by the dispatcher thread, off the submitting thread."""

    op: str
    meta: dict[str, Any]
    items: Callable[[], dict[str, shm.Item]]
    parse: Callable[[dict[str, Any], dict[str, shm.Item]], Any]
    future: Future = field(default_factory=Future)


# -- the pool (engine process) --------------------------------------------------------------


class PrePostPool:
    """Pre and post worker processes for one executor; every method is thread-safe.

    ``device`` and the dtype rule (float16 on CUDA, else float32) follow the executor's
    :class:`~retouch.runtime.models.ModelCache`; ``threads`` caps torch's CPU threads per
    worker (None: torch's default).
    """

    def __init__(
        self,
        models_dir: Path,
        device: torch.device | str | None = None,
        *,
        pre: int = 1,
        post: int = 1,
        threads: int | None = None,
        nice: int = 0,
    ) -> None:
        if pre < 1 or post < 1:
            raise ValueError("a pool needs at least one pre and one post worker")
        device = str(device or default_device())
        self._context = _process_context(torch.device(device))
        self._prefix = f"rt{os.getpid()}{secrets.token_hex(3)}-"
        self._ids = itertools.count()
        self._jobs = threading.Condition()  # guards the queues and ``_closed``
        self._closed = False
        self._queues: dict[str, deque[_Job]] = {PRE: deque(), POST: deque()}
        self.timings: deque[JobTiming] = deque(maxlen=TIMINGS_KEPT)
        level = logging.getLogger().getEffectiveLevel()
        self._workers = [
            _Worker(self, WorkerSpec(role, index, str(models_dir), device, threads, level, nice))
            for role, count in ((PRE, pre), (POST, post))
            for index in range(count)
        ]
        atexit.register(self.close)
        for worker in self._workers:
            worker.start()

    # -- jobs -------------------------------------------------------------------------------

    def encode(
        self,
        model: str,
        family: str,
        scheduler: str,
        request: EditRequest,
        template_latents: torch.Tensor | None = None,
        adapters: tuple[AdapterSpec, ...] = (),
    ) -> Future[Encoded]:
        """``editor.encode(request, template_latents)`` in a pre worker, the prompt encoded
        with the text-encoder part of ``adapters`` (the function's LoRAs)."""
        meta = {
            "model": model,
            "family": family,
            "scheduler": scheduler,
            "request": request.wire_meta(),
            "adapters": [a.to_dict() for a in adapters],
        }
        items = functools.partial(_request_items, request, template_latents)
        return self._submit(PRE, _Job("encode", meta, items, _parse_encoded))

    def decode(
        self,
        model: str,
        family: str,
        latents: torch.Tensor,
        height: int,
        width: int,
        fmt: str,
        *,
        over: EditRequest | None = None,
        feather_px: int = 0,
    ) -> Future[tuple[bytes, int, int]]:
        """``editor.decode`` of final latents, then the image encoded as ``fmt`` ("png",
        "webp" or "raw"), in a post worker; resolves to ``(data, width, height)``. With
        ``over``, the decoded image is composited into that request's template inside its
        mask (``imaging.composite`` with ``feather_px``)."""
        if fmt not in OUTPUT_FORMATS:
            raise ValueError(f"unknown output format {fmt!r}")
        meta: dict[str, Any] = {
            "model": model,
            "family": family,
            "height": int(height),
            "width": int(width),
            "format": fmt,
        }
        if over is not None:
            meta["feather_px"] = int(feather_px)
        items = functools.partial(_decode_items, latents, over)
        return self._submit(POST, _Job("decode", meta, items, _parse_image))

    def load(
        self, model: str, family: str, adapters: tuple[AdapterSpec, ...] = ()
    ) -> list[Future[None]]:
        """Load ``model`` in every worker now (deploy time), not on its first job, and the
        text-encoder part of ``adapters`` where prompts are encoded (a LoRA that does not
        fit fails the deploy here, not an invocation)."""
        futures = []
        meta = {"model": model, "family": family, "adapters": [a.to_dict() for a in adapters]}
        for worker in self._workers:
            job = _Job("load", meta, dict, _parse_nothing)
            futures.append(self._submit(worker.spec.role, job, only=worker))
        return futures

    def echo(self, items: dict[str, shm.Item], role: str = PRE) -> Future[dict[str, shm.Item]]:
        """Send ``items`` through a worker and back: a health check and transport benchmark."""
        return self._submit(role, _Job("echo", {}, lambda: items, _parse_items))

    # -- introspection ----------------------------------------------------------------------

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until every worker process has started (imports done); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for worker in self._workers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not worker.wait_ready(left):
                return False
        return True

    def workers(self, role: str) -> int:
        """How many worker processes take ``role``'s jobs (PRE or POST)."""
        return sum(1 for worker in self._workers if worker.spec.role == role)

    def pids(self) -> dict[str, int | None]:
        """The process id of every worker, by name."""
        return {worker.spec.name: worker.pid for worker in self._workers}

    def stats(self) -> dict[str, dict[str, float]]:
        """Per job kind: count, mean round trip and mean/max transport overhead (ms)."""
        timings = list(self.timings)  # dispatcher threads append meanwhile
        out: dict[str, dict[str, float]] = {}
        for op in sorted({t.op for t in timings}):
            runs = [t for t in timings if t.op == op]
            overheads = [t.overhead_s * 1e3 for t in runs]
            out[op] = {
                "jobs": len(runs),
                "mean_ms": sum(t.total_s for t in runs) * 1e3 / len(runs),
                "mean_overhead_ms": sum(overheads) / len(runs),
                "max_overhead_ms": max(overheads),
                "mean_payload_kib": sum(t.payload_bytes for t in runs) / len(runs) / 1024,
            }
        return out

    # -- lifetime ---------------------------------------------------------------------------

    def close(self, timeout: float = 10.0) -> None:
        """Fail queued jobs, let running ones finish (up to ``timeout``), stop the workers."""
        with self._jobs:
            if self._closed:
                return
            self._closed = True
            queued = [job for q in self._queues.values() for job in q]
            queued += [job for worker in self._workers for job in worker.inbox]
            for q in (*self._queues.values(), *(w.inbox for w in self._workers)):
                q.clear()
            self._jobs.notify_all()
        atexit.unregister(self.close)
        for job in queued:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(PoolClosed("the pre/post pool closed before the job ran"))
        for worker in self._workers:
            if not worker.ready.is_set():
                worker.kill("still starting")  # nothing to finish; imports take seconds
        deadline = time.monotonic() + timeout
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for worker in self._workers:
            worker.kill("did not stop in time")  # only the ones still running (a hung job)
            worker.join(1.0)

    def __enter__(self) -> PrePostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def block_names(self, job_id: int) -> tuple[str, str]:
        """The shared-memory names of one job's request and reply (unique to this pool)."""
        return f"{self._prefix}{job_id}i", f"{self._prefix}{job_id}o"

    @property
    def block_prefix(self) -> str:
        return self._prefix

    def _submit(self, role: str, job: _Job, only: _Worker | None = None) -> Future:
        with self._jobs:
            if self._closed:
                raise PoolClosed("the pre/post pool is closed")
            (only.inbox if only is not None else self._queues[role]).append(job)
            self._jobs.notify_all()
        return job.future

    def _take(self, worker: _Worker) -> _Job | None:
        """The next job for ``worker`` (its own first, then its role's); None once closed."""
        shared = self._queues[worker.spec.role]
        with self._jobs:
            while not self._closed:
                if worker.inbox:
                    return worker.inbox.popleft()
                if shared:
                    return shared.popleft()
                self._jobs.wait()
        return None

    def _next_id(self) -> int:
        return next(self._ids)

    def _record(self, timing: JobTiming) -> None:
        self.timings.append(timing)


class _Worker:
    """One worker process and the dispatcher thread that feeds it (engine process side)."""

    def __init__(self, pool: PrePostPool, spec: WorkerSpec) -> None:
        self.pool, self.spec = pool, spec
        self.inbox: deque[_Job] = deque()  # jobs for this worker only (``load``)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.conn: Connection | None = None
        self.ready = threading.Event()  # the process imported everything and waits for jobs
        self.thread = threading.Thread(target=self._loop, name=f"retouch {spec.name}", daemon=True)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> None:
        """Start the dispatcher thread; it starts the process (a fork server's first start
        imports torch, which the executor does not wait for)."""
        self.thread.start()

    def wait_ready(self, timeout: float | None) -> bool:
        return self.ready.wait(timeout)

    def join(self, timeout: float) -> None:
        """Wait for the dispatcher thread (not from itself: a future's callback may close)."""
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def kill(self, why: str) -> None:
        """Kill the process if it is still running (at close)."""
        if self.process is not None and self.process.is_alive():
            log.info("%s (pid %s) %s; killing it", self.spec.name, self.pid, why)
            self.process.kill()

    # -- dispatcher thread ------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._spawn()
        except Exception:  # seen by _ensure_ready, which starts it again
            log.exception("%s could not start", self.spec.name)
        if self.pool.closed:  # closed while it started: nothing to finish
            self.kill("started after its pool closed")
        else:
            self._await_start()
        while (job := self.pool._take(self)) is not None:
            if job.future.set_running_or_notify_cancel():
                self._serve(job)
        self._stop_process()

    def _await_start(self) -> None:
        """Wait for the process's start-up (imports) while idle, not inside a job's timing."""
        try:
            self._ensure_ready()
        except WorkerDied as exc:
            if not self.pool.closed:
                log.error("%s", exc)

    def _serve(self, job: _Job) -> None:
        try:
            self._ensure_ready()
            result = self._run(job)
        except WorkerDied as exc:
            job.future.set_exception(exc)
            if not self.pool.closed:
                self._restart(str(exc))
                self._await_start()
        except BaseException as exc:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)

    def _run(self, job: _Job) -> Any:
        """One round trip; on every failure both of the job's blocks are unlinked."""
        blocks = self.pool.block_names(self.pool._next_id())
        started = time.perf_counter()
        taken = False
        try:
            header = shm.put_tensors(job.items(), blocks[0])
            reply = self._exchange(job, header, blocks)
            if not reply.get("ok") and isinstance(reply.get("error"), dict):
                raise RetouchError.from_wire(int(reply.get("status", 500)), reply)
            if not reply.get("ok"):
                raise WorkerError(
                    self.spec.name, reply.get("kind", "Error"), reply.get("error", "")
                )
            items = shm.take_tensors(reply["items"])
            taken = True
        finally:
            if not taken:
                for name in blocks:
                    shm.discard(name)
        total = time.perf_counter() - started
        payload = shm.header_bytes(header) + shm.header_bytes(reply["items"])
        self.pool._record(JobTiming(job.op, total, float(reply["compute_s"]), payload))
        return job.parse(reply["meta"], items)

    def _exchange(self, job: _Job, header: shm.Header, blocks: tuple[str, str]) -> dict:
        """Send the job's header and wait for the reply; a broken pipe is a dead worker."""
        message = {"op": job.op, "meta": job.meta, "items": header, "reply": blocks[1]}
        try:
            self.conn.send_bytes(pack(message))
            return unpack(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise WorkerDied(self._death(f"while running its {job.op} job")) from exc

    def _ensure_ready(self) -> None:
        """Restart a process found dead while idle; wait for its "ready" message."""
        if self.ready.is_set() and self._alive():
            return
        if not self._alive():
            self._restart("found dead" if self.ready.is_set() else "did not start")
        try:
            message = unpack(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise WorkerDied(self._death("while starting")) from exc
        if message.get("op") != "ready":
            raise WorkerDied(f"{self.spec.name} sent {message.get('op')!r} instead of 'ready'")
        self.ready.set()

    def _death(self, doing: str) -> str:
        self.process.join(2.0)
        code = self.process.exitcode
        return f"{self.spec.name} (pid {self.pid}) died with exit code {code} {doing}"

    # -- process ----------------------------------------------------------------------------

    def _spawn(self) -> None:
        ours, theirs = self.pool._context.Pipe(duplex=True)
        process = self.pool._context.Process(
            target=serve,
            args=(self.spec, theirs),
            name=f"retouch-{self.spec.role}-{self.spec.index}",
        )
        process.daemon = True
        process.start()
        theirs.close()
        self.process, self.conn = process, ours
        log.info("%s started (pid %s, %s)", self.spec.name, process.pid, self.spec.device)

    def _alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def _restart(self, why: str) -> None:
        log.error("%s restarting: %s", self.spec.name, why)
        self.ready.clear()
        if self.process is not None:
            self.process.join(0.1)
        if self.conn is not None:
            self.conn.close()
        self._spawn()

    def _stop_process(self) -> None:
        if self.process is None:
            return
        if self.process.is_alive():
            with contextlib.suppress(OSError):  # it may have died meanwhile
                self.conn.send_bytes(pack({"op": "stop"}))
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2.0)
        self.conn.close()


def _process_context(device: torch.device) -> multiprocessing.context.BaseContext:
    """How worker processes start. On a CPU: forked from a fork server that holds torch,
    diffusers and the worker's code (the executor's own fork, ``runtime/forkserver.py``;
    else a fresh one that imports them once), so a pool's workers (and every restart) skip
    the ~5 s of imports a fresh interpreter pays, and share those pages. On CUDA: spawned, since
    a process forked after anything touched the CUDA driver cannot use CUDA itself."""
    if device.type != "cpu":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([serve.__module__])
    return context


def _request_items(
    request: EditRequest, template_latents: torch.Tensor | None
) -> dict[str, shm.Item]:
    """The arrays of an encode job: the request's own (:meth:`EditRequest.wire_arrays`)."""
    items: dict[str, shm.Item] = dict(request.wire_arrays())
    if template_latents is not None:
        items["template_latents"] = template_latents
    return items


def _decode_items(latents: torch.Tensor, over: EditRequest | None) -> dict[str, shm.Item]:
    """The arrays of a decode job: the latents, and the template and mask to composite into."""
    items: dict[str, shm.Item] = {"latents": latents}
    if over is not None:
        items.update(over.wire_arrays())
    return items


def _parse_encoded(meta: dict[str, Any], items: dict[str, shm.Item]) -> Encoded:
    return Encoded(meta["family"], meta["height"], meta["width"], items)


def _parse_image(meta: dict[str, Any], items: dict[str, shm.Item]) -> tuple[bytes, int, int]:
    return items["image"], meta["width"], meta["height"]


def _parse_items(meta: dict[str, Any], items: dict[str, shm.Item]) -> dict[str, shm.Item]:
    return items


def _parse_nothing(meta: dict[str, Any], items: dict[str, shm.Item]) -> None:
    return None
