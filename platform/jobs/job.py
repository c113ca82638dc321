"""One job: its request, state, result and events, and the documents that show it.

The job store (``platform/jobs/store.py``) runs jobs; this module holds what one job is: its
state (:class:`Job`), what its request became for the pool (:class:`PreparedInvocation`),
its durable record, and the job document of ``GET /v1/jobs/{id}`` (also what events and
webhooks carry, without the image).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from retouch.functions.errors import RetouchError
from retouch.functions.wire.executor import StepProgress
from retouch.functions.wire.invoke import ExecutorInvoke, InvokeResult
from retouch.functions.wire.jobs import (
    JobEvent,
    JobEventKind,
    JobProgress,
    JobRequest,
    JobStatus,
    check_job_id,
)
from retouch.platform.control.cluster import PlacementRequest
from retouch.platform.control.queue import Seat
from retouch.platform.jobs.reframe import Frame
from retouch.platform.state.auth import ANONYMOUS

RECORD_VERSION = 1
# Event ids of a job's n-th run (0: as accepted, 1: resumed after a restart, ...) start
# above n * RUN_SEQ_SPAN, so the ids a reader saw before a restart stay below the new ones.
RUN_SEQ_SPAN = 1_000_000
PROGRESS_BAR = 10  # characters of a log's progress bar
MAX_EVENTS = 512  # kept per live job for late readers (progress is throttled, so rarely reached)


class Runner(StrEnum):
    """Which gateway runs a job, as this gateway knows it: its readers follow it here, or
    through the shared store (``platform/jobs/following.py``, ``platform/jobs/mirrors.py``)."""

    HERE = "here"
    ELSEWHERE = "elsewhere"  # its record is read and its cancel asked through the store


@dataclass(frozen=True)
class PreparedInvocation:
    """A request decoded for the pool (``platform/api/frontdoor.py`` builds it): what the
    executor gets, and what placement and admission read of it. Kept in memory only."""

    invocation: ExecutorInvoke
    placement: PlacementRequest
    seat: Seat | None = None  # its place in the queue, held from admission (none: resumed)
    # An input the executor edits resized or cropped (``platform/jobs/reframe.py``): its result
    # is pasted back into it. None: the executor's result is the answer as it comes. Only
    # the plan: the input's pixels are decoded again for the paste (a queued job holds its
    # encoded input, which retention charges, not input-sized arrays).
    frame: Frame | None = None


END_EVENT = {
    JobStatus.SUCCEEDED: JobEventKind.SUCCEEDED,
    JobStatus.FAILED: JobEventKind.FAILED,
    JobStatus.CANCELED: JobEventKind.CANCELED,
}
TERMINAL_EVENTS = frozenset(END_EVENT.values())


def iso(t: float | None) -> str | None:
    """A Unix time as RFC 3339 UTC with milliseconds (``2026-11-23T01:02:03.456Z``)."""
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def queue_line(position: int) -> str:
    return f"waiting in the queue at position {position}"


def start_line(started_at: str | None, executor: str, attempt: int) -> str:
    return f"{started_at} started on {executor} (attempt {attempt})"


def progress_line(step: int, total: int) -> str:
    """A progress bar as tqdm writes it (`` 33%|###       | 1/3``): what Replicate's
    clients parse a prediction's progress from (``Prediction.progress``)."""
    fraction = step / total if total else 0.0
    bar = ("#" * int(fraction * PROGRESS_BAR)).ljust(PROGRESS_BAR)
    return f"{int(fraction * 100):3d}%|{bar}| {step}/{total}"


def new_job_id() -> str:
    return uuid.uuid4().hex


@dataclass(eq=False)
class Job:
    """One job: its request, state, result and event history (event-loop state)."""

    id: str
    function: str
    request: JobRequest
    created_at: float
    durable: bool = True
    owner: str = ANONYMOUS  # the tenant that submitted it: only it (and admin) may see it
    status: JobStatus = JobStatus.QUEUED
    started_at: float | None = None
    completed_at: float | None = None
    executor: str | None = None
    attempts: int = 0
    progress: JobProgress | None = None
    result: InvokeResult | None = None
    error: RetouchError | None = None
    # In memory only: the decoded invocation (rebuilt from the request after a restart).
    prepared: PreparedInvocation | None = None
    cancel_requested: bool = False
    events: list[JobEvent] = field(default_factory=list)
    task: asyncio.Task | None = None
    position: int | None = None
    image_on_disk: bool = False  # the result's image is read from the journal when asked for
    output: str | None = None  # a succeeded job's signed image link (the job store signs it)
    retained_bytes: int = 0  # charged to its owner: payload while live, result once finished
    run: int = 0  # how many times a gateway resumed it from the journal
    runner: Runner = Runner.HERE  # in memory only (ELSEWHERE: a copy of a stored record)
    _seq: int = 0  # the last event id given (journaled in the final record)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _first_step: float | None = None  # monotonic time of the first progress frame
    _last_progress_event: float = 0.0
    _readers: int = 0  # event streams reading it now: its history is kept for them

    def retained_until(self, retention_s: float) -> float:
        """When a finished job's record and result are removed (``inf`` while it runs)."""
        return math.inf if self.completed_at is None else self.completed_at + retention_s

    @property
    def ended(self) -> bool:
        """Its terminal event is out (its final record, if durable, is written by then)."""
        return bool(self.events) and self.events[-1].kind in TERMINAL_EVENTS

    # ---- a run ---------------------------------------------------------------------------
    def start_run(self, executor: str, attempt: int, now: float) -> dict[str, Any]:
        """Running on ``executor`` (its ``attempt``-th try); the ``started`` event's data."""
        self.status, self.executor, self.attempts = JobStatus.RUNNING, executor, attempt
        self.position, self.progress, self._first_step = None, None, None
        if self.started_at is None:
            self.started_at = now
        return {"executor": executor, "attempt": attempt, "started_at": iso(self.started_at)}

    def step_progress(self, step: StepProgress, interval_s: float) -> JobProgress | None:
        """Its progress after ``step`` (with an ETA from the steps so far); returned when
        a ``progress`` event is due (one per ``interval_s``, and the last step's)."""
        now = time.monotonic()
        if self._first_step is None or step.step <= 1:
            self._first_step = now
            eta = None
        else:
            eta = (now - self._first_step) / (step.step - 1) * (step.total - step.step)
        self.progress = JobProgress(step.step, step.total, eta)
        if now - self._last_progress_event < interval_s and step.step < step.total:
            return None
        self._last_progress_event = now
        return self.progress

    # ---- event history -------------------------------------------------------------------
    def record(self, kind: JobEventKind, data: dict[str, Any]) -> JobEvent | None:
        """A new event, published; None when this run's ids are spent (but for its
        terminal event's, which :meth:`next_event` gives)."""
        if self._seq - self.run * RUN_SEQ_SPAN >= RUN_SEQ_SPAN - 1:
            return None
        event = self.next_event(kind, data)
        self.publish(event)
        return event

    def next_event(self, kind: JobEventKind, data: dict[str, Any]) -> JobEvent:
        """The next event under the next id (published apart: an end is recorded first)."""
        self._seq += 1
        return JobEvent(self._seq, kind, data)

    def publish(self, event: JobEvent) -> None:
        """Into the job's history, for its readers."""
        self.events.append(event)
        if len(self.events) > MAX_EVENTS:  # drop the oldest progress event, keep the rest
            for i, old in enumerate(self.events):
                if old.kind is JobEventKind.PROGRESS:
                    del self.events[i]
                    break
        self._changed.set()

    def trim(self) -> None:
        """A finished job keeps its last progress event and its terminal event, once no
        stream is reading the events before them: its history is not kept for a day, and a
        stream opened later still shows how far it got (``retouch jobs watch``'s bar)."""
        if self.ended and self._readers == 0 and len(self.events) > 2:
            progress = [e for e in self.events[:-1] if e.kind is JobEventKind.PROGRESS]
            self.events = [*progress[-1:], self.events[-1]]

    @property
    def urls(self) -> dict[str, str]:
        base = f"/v1/jobs/{self.id}"
        return {"get": base, "stream": f"{base}/events", "cancel": f"{base}/cancel"}

    def describe(self, with_image: bool = True, with_webhook: bool = True) -> dict[str, Any]:
        """The job document of ``GET /v1/jobs/{id}`` (without the image in events). The
        webhook URL (it may hold the receiver's credentials) is its owner's only: not in
        events, nor in the document an admin reads of another tenant's job. Its fields
        follow Replicate's prediction (``input``, ``output``, ``logs``, ``metrics``,
        ``urls``) beside retouch's own (``result``, ``progress``, ``queue_position``)."""
        doc: dict[str, Any] = {
            "id": self.id,
            "function": self.function,
            "status": self.status.value,
            "input": self.request.invoke.echo(),
            "output": self.output,
            "created_at": iso(self.created_at),
            "started_at": iso(self.started_at),
            "completed_at": iso(self.completed_at),
            "urls": self.urls,
            "logs": self.logs(),
            "metrics": self.metrics(),
        }
        if self.status is JobStatus.QUEUED:
            doc["queue_position"] = self.position
        if self.status is JobStatus.RUNNING:
            doc["executor"] = self.executor
            doc["progress"] = self.progress.to_wire() if self.progress else None
        if self.result is not None:
            result = self.result.to_wire()
            if not with_image:
                result.pop("image")
            doc["result"] = result
        if self.error is not None:
            doc["error"] = {**self.error.to_wire()["error"], "status": self.error.status}
        if self.request.webhook is not None and with_webhook:
            doc["webhook"] = self.request.webhook
            doc["webhook_events"] = [e.value for e in self.request.webhook_events]
        return doc

    def logs(self) -> str:
        """What happened to the job, a line an event (Replicate's ``logs``), from its state."""
        lines = [f"{iso(self.created_at)} accepted for {self.function}"]
        if self.status is JobStatus.QUEUED and self.position is not None:
            lines.append(queue_line(self.position))
        if self.started_at is not None and self.executor is not None:
            lines.append(start_line(iso(self.started_at), self.executor, self.attempts))
        if self.progress is not None and not self.status.terminal:
            lines.append(progress_line(self.progress.step, self.progress.total))
        if self.result is not None:
            r = self.result
            lines.append(
                f"{iso(self.completed_at)} succeeded on {r.executor}: {r.path.value} path, "
                f"mask {r.mask_ratio:.1%}, {r.engine.steps} steps, "
                f"{r.timings.total_ms / 1e3:.2f} s in all"
            )
        elif self.error is not None:
            lines.append(
                f"{iso(self.completed_at)} failed: {self.error.code}: {self.error.message}"
            )
        elif self.status is JobStatus.CANCELED:
            lines.append(f"{iso(self.completed_at)} canceled")
        return "\n".join(lines)

    def metrics(self) -> dict[str, Any]:
        """Replicate's ``metrics`` (seconds): ``predict_time`` from start to end,
        ``total_time`` from acceptance to end; and retouch's own of a result."""
        out: dict[str, Any] = {}
        if self.completed_at is not None:
            out["total_time"] = round(self.completed_at - self.created_at, 4)
            if self.started_at is not None:
                out["predict_time"] = round(self.completed_at - self.started_at, 4)
        if self.result is not None:
            r = self.result
            out |= {
                "queue_time": round(r.timings.gateway_queue_ms / 1e3, 4),
                "inference_steps": r.engine.steps,
                "mask_ratio": r.mask_ratio,
                "path": r.path.value,
                "path_reason": r.path_reason,
            }
        return out

    # ---- durable form ------------------------------------------------------------------
    def to_record(self) -> dict[str, Any]:
        return {
            "v": RECORD_VERSION,
            "id": self.id,
            "function": self.function,
            "owner": self.owner,
            "request": self.request.to_wire(),
            "created_at": self.created_at,
            "status": self.status.value,
            "run": self.run,
            "last_seq": self._seq,
            "started_at": self.started_at,
            "completed_at": self.completed_at,
            "executor": self.executor,
            "attempts": self.attempts,
            "result": None if self.result is None else self.result.to_wire(),
            "error": None
            if self.error is None
            else {**self.error.to_wire()["error"], "status": self.error.status},
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Job:
        error = record.get("error")
        job = cls(
            id=check_job_id(str(record["id"])),
            function=str(record["function"]),
            request=JobRequest.from_wire(record["request"]),
            created_at=float(record["created_at"]),
            owner=str(record.get("owner", ANONYMOUS)),
            status=JobStatus(record["status"]),
            started_at=record.get("started_at"),
            completed_at=record.get("completed_at"),
            result=None
            if record.get("result") is None
            else InvokeResult.from_wire(record["result"]),
            error=None
            if error is None
            else RetouchError.from_wire(int(error.get("status", 500)), {"error": error}),
        )
        last_seq, run = int(record.get("last_seq", 0)), int(record.get("run", 0))
        if job.status.terminal:  # its terminal event comes again under its own id
            job.run, job._seq = run, max(last_seq, 1) - 1
            job.executor, job.attempts = record.get("executor"), int(record.get("attempts", 0))
        else:  # it had not ended: run it again from the start, with ids above the last run's
            job.status, job.started_at = JobStatus.QUEUED, None
            job.run = run + 1
            job._seq = job.run * RUN_SEQ_SPAN
        return job
