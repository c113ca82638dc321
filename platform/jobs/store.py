"""Jobs: every invocation's life in the gateway, asynchronous or not.

A job is accepted (recorded in the journal first when it is durable), waits in the gateway
queue (``queued``, with its position), runs on an executor (``running``, with the step
progress the executor's engine streams) and ends ``succeeded``, ``failed`` or
``canceled``. Its events are kept in order for server-sent-event readers (who may join late
or reconnect) and handed to the webhook sender. The synchronous invoke is a job that is not
journaled and is forgotten once answered: one machinery for both.

Accepted jobs survive a gateway restart: :meth:`JobStore.start` reloads the journal and
re-runs every job that had not ended (edits are deterministic, so a job that was running is
simply run again; only its final record counts). Finished jobs are kept for ``retention_s``
and then removed. Alone or among several gateways the store is the same: what the other
gateways know of jobs it asks its peers (``platform/jobs/peers.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from retouch.functions.errors import Canceled, Conflict, NotFound, RetouchError
from retouch.functions.wire.executor import StepProgress
from retouch.functions.wire.invoke import InvokeResult
from retouch.functions.wire.jobs import (
    JobEvent,
    JobEventKind,
    JobProgress,
    JobRequest,
    JobStatus,
    check_job_id,
)
from retouch.platform.jobs.job import (
    END_EVENT,
    RUN_SEQ_SPAN,
    Job,
    PreparedInvocation,
    iso,
    new_job_id,
)
from retouch.platform.jobs.journal import JobJournal
from retouch.platform.jobs.links import LinkSigner
from retouch.platform.jobs.peers import JobPeers, Listing
from retouch.platform.jobs.retention import (
    Retention,
    RetentionLimits,
    payload_bytes,
    retained_bytes,
    slim_request,
)
from retouch.platform.jobs.sharedjournal import SharedJobJournal, StoredJob, TakenOver
from retouch.platform.state.auth import ANONYMOUS, Principal
from retouch.platform.state.statestore import StoreUnavailable

log = logging.getLogger(__name__)

DEFAULT_RETENTION_S = 24 * 3600.0
DEFAULT_PROGRESS_INTERVAL_S = 0.25
POSITION_POLL_S = 0.25  # how often queue positions are re-read for ``queued`` events
MAX_EVENTS = 512  # kept per live job for late readers (progress is throttled, so rarely reached)
END_WRITE_TRIES = 30  # a job's final record, into a shared store that does not answer
END_WRITE_PAUSE_S = 2.0
MIRROR_POLL_S = 0.5  # how often a job another gateway runs is read again (events, cancel)

OnStart = Callable[[str, int], None]
OnProgress = Callable[[StepProgress], None]
Execute = Callable[["Job", OnStart, OnProgress], Awaitable[InvokeResult]]
# The webhook sender: returns its delivery's journal write (awaited for the terminal event,
# which is durable before the job's final record), or None when nothing is delivered.
Notify = Callable[["Job", JobEvent], Awaitable[None] | None]


class JobStore:
    """Jobs by id: submission, execution, cancel, events, journal and retention."""

    def __init__(
        self,
        execute: Execute,
        positions: Callable[[], dict[str, int]],
        cancel: Callable[[str], Awaitable[bool]],
        journal: JobJournal | SharedJobJournal | None = None,
        *,
        peers: JobPeers,
        retention_s: float = DEFAULT_RETENTION_S,
        progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
        notify: Notify | None = None,
        clock: Callable[[], float] = time.time,
        limits: RetentionLimits | None = None,
        links: LinkSigner | None = None,
    ) -> None:
        self._execute = execute
        self._positions = positions  # the gateway queue's positions by invocation id
        self._cancel = cancel  # the pool's cancel of a running invocation
        self.journal = journal
        # What the other gateways know: chosen with the journal, in one place (the gateway's
        # ``_journals``), never guessed here (a shared journal without its peers would run
        # another gateway's jobs).
        self.peers = peers
        self.retention_s = retention_s
        self.progress_interval_s = progress_interval_s
        self._notify = notify
        self._clock = clock
        self.links = links  # signs result links (``output``); none: jobs have no ``output``
        self.jobs: dict[str, Job] = {}
        self._tasks: list[asyncio.Task] = []
        self.retention = Retention(limits or RetentionLimits(), retention_s)

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Reload the journal and resume every job that had not ended."""
        if self.journal is not None:
            journal = self.journal
            loaded = [await self._load(journal, r) for r in await asyncio.to_thread(journal.load)]
            # in the order they ended (the order they expire in); unfinished ones last
            for job in sorted((j for j in loaded if j is not None), key=_ended_order):
                self._keep(job)
                if not job.status.terminal:
                    job.task = asyncio.create_task(self._run(job))
            resumed = sum(not j.status.terminal for j in self.jobs.values())
            if self.jobs:
                log.info("journal: %d jobs, %d resumed", len(self.jobs), resumed)
            await self.purge()  # expired while the gateway was down
        self._tasks = [
            asyncio.create_task(self._watch_positions()),
            asyncio.create_task(self._purge_expired()),
        ]

    async def _load(self, journal: JobJournal, record: dict[str, Any]) -> Job | None:
        """A journaled job, ready to be kept: a finished one with its terminal event under
        its own id (then its record compacted, so the id it stores is that one), an
        unfinished one with its new run number journaled before it issues an event id."""
        try:
            job = Job.from_record(record)
        except (RetouchError, KeyError, TypeError, ValueError) as exc:
            log.error("job record %s cannot be resumed: %s", record.get("id"), exc)
            return None
        if job.status.terminal:  # its end, again, for readers; webhooks had it
            job.output = self.output_url(job)
            self._record(job, END_EVENT[job.status], job.describe(False, False), notify=False)
            await self._compact(job)
        else:
            job.retained_bytes = retained_bytes(job.request)
            try:
                await asyncio.to_thread(journal.write, job.to_record())
            except OSError as exc:
                self.peers.run_not_recorded(job.id, exc)
            self._record(job, JobEventKind.QUEUED, {"position": None})
        self._drop_image(job)
        return job

    async def close(self) -> None:
        """Stop without ending any job: unfinished durable jobs resume at the next start."""
        tasks = [*self._tasks, *(j.task for j in self.jobs.values() if j.task is not None)]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.peers.close()

    # ---- lookup -------------------------------------------------------------------------
    async def get(self, job_id: str, viewer: Principal) -> Job:
        """The job, if ``viewer`` may see it: another tenant's job is as unknown as a
        missing one (the same 404), so ids cannot be probed. A job another gateway runs
        is read from the peers (a :attr:`Job.mirror`)."""
        job = self.jobs.get(check_job_id(job_id))
        if job is None:
            job = await self._read_mirror(job_id)
        if job is None or not job.durable or not viewer.owns(job.owner):
            raise NotFound(f"no job {job_id!r}", field="id", code="job_not_found")
        return job

    async def _read_mirror(self, job_id: str) -> Job | None:
        """The job as the gateway that runs it recorded it (None: no such job)."""
        stored = await self.peers.fetch(job_id)
        if stored is None:
            return None
        job = self._mirror(stored)
        if job is not None and job.status.terminal:
            self._record(job, END_EVENT[job.status], job.describe(False, False), notify=False)
        return job

    def _mirror(self, stored: StoredJob) -> Job | None:
        """A job another gateway runs or ran, from its stored record (None: unreadable)."""
        try:
            job = Job.from_record(stored.record)
        except (RetouchError, KeyError, TypeError, ValueError) as exc:
            log.error("job record %s is unreadable: %s", stored.record.get("id"), exc)
            return None
        job.mirror = True
        if job.status.terminal:
            job.output = self.output_url(job)
        else:  # not the ids of a run: a reader of this gateway gets only the end's id
            job.run, job._seq = int(stored.record.get("run", 0)), 0
            if stored.status == JobStatus.RUNNING.value:
                job.status = JobStatus.RUNNING
        return job

    async def list(
        self,
        viewer: Principal,
        status: JobStatus | None = None,
        function: str | None = None,
        limit: int = 100,
        tenant: str | None = None,
        before: tuple[float, str] | None = None,
    ) -> list[Job]:
        """Newest first: the viewer's own jobs (an admin's: every tenant's, or ``tenant``'s),
        those older than ``before`` (a page's last ``listing_key``) if given. Only the
        listed tenant's jobs are read, not every job the gateway keeps."""
        if tenant is None and not viewer.admin:
            tenant = viewer.tenant
        if tenant is not None and not viewer.owns(tenant):
            return []
        page = Listing(tenant, status, function, limit, before)
        return await self.peers.listing(page, self._known)

    def _known(self, stored: StoredJob) -> Job | None:
        """A listed job: the one this gateway runs (with its progress), else a mirror."""
        return self.jobs.get(str(stored.record.get("id"))) or self._mirror(stored)

    def retained_until(self, job: Job) -> float:
        """When a finished job's record and result are removed (``inf`` while it runs)."""
        if job.completed_at is None:
            return math.inf
        return job.completed_at + self.retention_s

    def output_url(self, job: Job, ttl_s: float | None = None) -> str | None:
        """A signed link to a succeeded durable job's image, valid ``ttl_s`` (never past
        its retention end; ``None``: until then). A job that is not kept has none."""
        if job.result is None or not job.durable or self.links is None:
            return None
        not_after = self.retained_until(job)
        expires = not_after if ttl_s is None else min(self._clock() + ttl_s, not_after)
        return self.links.url(job.id, job.result.format, int(expires), not_after)

    # ---- submission and execution -------------------------------------------------------
    def admit(self, owner: str, nbytes: int) -> None:
        """429 when a durable job with ``nbytes`` of payload would pass a live-job or
        retained-bytes cap of its owner or of all (``platform/jobs/retention.py``). The gateway
        asks twice: with the body's declared length before reading it (a refusal costs no
        memory), then with the decoded request's payload."""
        self.retention.admit(owner, nbytes, self._clock())

    async def submit(
        self,
        function: str,
        request: JobRequest,
        prepared: PreparedInvocation,
        durable: bool = True,
        job_id: str | None = None,
        owner: str = ANONYMOUS,
    ) -> Job:
        """Accept a job (journaled first when durable, within the caps) and start it. A
        durable job counts against the caps from its admission on, before its journal write
        (others admitted meanwhile see it); a failed write takes it back."""
        if durable:
            self.admit(owner, payload_bytes(request))
        job = Job(
            job_id or new_job_id(), function, request, self._clock(), durable=durable, owner=owner
        )
        job.prepared = prepared
        job.retained_bytes = retained_bytes(request)
        if durable:
            self.retention.take(job)
            try:
                if self.journal is not None:
                    await asyncio.to_thread(
                        self.journal.accept, job.to_record(), job.retained_bytes
                    )
            except BaseException:
                self.retention.release(job)
                raise
            self.peers.keep(job)
        self.jobs[job.id] = job
        self._record(job, JobEventKind.QUEUED, {"position": None})
        job.task = asyncio.create_task(self._run(job))
        return job

    def forget(self, job: Job) -> None:
        """Drop a job that is not kept (a synchronous invocation, once answered)."""
        self.jobs.pop(job.id, None)

    async def _run(self, job: Job) -> None:
        try:
            if job.cancel_requested:
                raise Canceled(f"job {job.id} was canceled")
            result = await self._execute(
                job, lambda name, attempt: self._started(job, name, attempt),
                lambda step: self._progressed(job, step),
            )  # fmt: skip
        except asyncio.CancelledError:
            raise  # the gateway is stopping: the job stays unfinished in the journal
        except RetouchError as exc:  # a cancel may come back as an executor's 409 canceled
            if isinstance(exc, Canceled) or exc.code == Canceled.code:
                await self._finish(job, JobStatus.CANCELED)
            else:
                await self._finish(job, JobStatus.FAILED, error=exc)
        except Exception as exc:
            log.exception("job %s failed", job.id)
            await self._finish(
                job, JobStatus.FAILED, error=RetouchError(f"internal error: {type(exc).__name__}")
            )
        else:
            await self._finish(job, JobStatus.SUCCEEDED, result=result)

    def _started(self, job: Job, executor: str, attempt: int) -> None:
        job.status, job.executor, job.attempts = JobStatus.RUNNING, executor, attempt
        job.position, job.progress, job._first_step = None, None, None
        if job.started_at is None:
            job.started_at = self._clock()
        if job.durable:
            self.peers.started(job.id)
        self._record(
            job,
            JobEventKind.STARTED,
            {"executor": executor, "attempt": attempt, "started_at": iso(job.started_at)},
        )

    def _progressed(self, job: Job, step: StepProgress) -> None:
        now = time.monotonic()
        if job._first_step is None or step.step <= 1:
            job._first_step = now
            eta = None
        else:
            eta = (now - job._first_step) / (step.step - 1) * (step.total - step.step)
        job.progress = JobProgress(step.step, step.total, eta)
        due = now - job._last_progress_event >= self.progress_interval_s
        if due or step.step >= step.total:
            job._last_progress_event = now
            self._record(job, JobEventKind.PROGRESS, job.progress.to_wire())

    async def _finish(
        self,
        job: Job,
        status: JobStatus,
        result: InvokeResult | None = None,
        error: RetouchError | None = None,
    ) -> None:
        job.status, job.result, job.error = status, result, error
        job.completed_at = self._clock()
        job.output = self.output_url(job)
        job.position = None
        held = job.retained_bytes
        self._drop_payload(job)
        if job.durable:
            self.retention.ended(job, held)
        event = self._event(
            job, END_EVENT[status], job.describe(with_image=False, with_webhook=False)
        )
        if job.durable and not await self.peers.owns(job.id):
            self._hand_over(job)
            return
        # The webhook's delivery is journaled before the job's end: a crash between the two
        # re-runs the job (same delivery id); the other order could lose the delivery.
        journaled = self._notify(job, event) if self._notify and job.durable else None
        if job.durable and self.journal is not None:
            try:
                if journaled is not None:  # a failed write is the sender's to log
                    with contextlib.suppress(Exception):
                        await asyncio.shield(journaled)
                await self._write_end(job)
                self._drop_image(job)
            except TakenOver:  # this gateway was thought dead: the new runner's end counts
                self._hand_over(job)
                return
            except OSError:
                log.exception("could not record the end of job %s", job.id)
        self._publish(job, event)
        self._trim(job)

    async def _write_end(self, job: Job) -> None:
        """The final record; into a shared store, tried again while the store is down
        (its row would otherwise stay live, this gateway's, and never claimed)."""
        assert self.journal is not None
        for attempt in range(END_WRITE_TRIES):
            try:
                await asyncio.to_thread(self.journal.write, job.to_record())
                return
            except StoreUnavailable:
                if attempt == END_WRITE_TRIES - 1:
                    raise
                log.warning("the end of job %s not recorded yet; trying again", job.id)
                await asyncio.sleep(END_WRITE_PAUSE_S)

    def _hand_over(self, job: Job) -> None:
        """Another gateway runs the job now (this one was thought dead): forget it here;
        its readers here follow it in the store (:meth:`events` sees it is a mirror)."""
        log.warning("job %s is run by another gateway now; its run here is dropped", job.id)
        self._forget_kept(job)
        job.mirror = True
        job._changed.set()

    def _drop_payload(self, job: Job) -> None:
        """A finished job keeps its result and a small record, not its request's payload
        (mask, uploaded image) nor the arrays decoded from it."""
        template = job.request.invoke.template or ""
        if job.prepared is not None and job.request.invoke.image is not None:
            template = job.prepared.invocation.template  # an upload's content id
        job.request, job.prepared = slim_request(job.request, template), None
        image = job.result.image if job.result is not None else b""
        job.retained_bytes = retained_bytes(job.request, image)

    async def _compact(self, job: Job) -> None:
        """A finished job's record, small: one written before payloads were dropped at
        the end is rewritten without its payload."""
        had = payload_bytes(job.request)
        self._drop_payload(job)
        if had > payload_bytes(job.request) and self.journal is not None:
            try:
                await asyncio.to_thread(self.journal.write, job.to_record())
            except OSError:
                log.exception("could not compact the record of job %s", job.id)

    def _drop_image(self, job: Job) -> None:
        """Finished results are kept for a day: their images stay on disk, not in memory."""
        if job.result is not None and job.result.image:
            job.result = dataclasses.replace(job.result, image=b"")
            job.image_on_disk = True

    async def document(self, job: Job, with_webhook: bool = True) -> dict[str, Any]:
        """The job document with its result's image (read back from the journal)."""
        doc = job.describe(with_webhook=with_webhook)
        if job.image_on_disk and "result" in doc and self.journal is not None:
            try:
                record = await asyncio.to_thread(self.journal.read, job.id)
            except OSError:  # removed meanwhile (retention)
                raise NotFound(f"no job {job.id!r}", field="id", code="job_not_found") from None
            doc["result"]["image"] = (record.get("result") or {}).get("image", b"")
        return doc

    # ---- cancel and waiting -------------------------------------------------------------
    async def cancel(self, job: Job, wait_s: float = 10.0) -> Job:
        """Cancel a job: idempotent on a canceled job; a finished one is a 409
        ``job_finished``. Waits (bounded) until the job has left its executor."""
        if job.mirror:
            job = await self._cancel_mirror(job, wait_s)
            if job.mirror and not job.status.terminal:  # asked; not ended within wait_s
                return job
        if job.status is JobStatus.CANCELED:
            return job
        if job.status.terminal:
            raise Conflict(
                f"job {job.id} already {job.status.value}; only a queued or running job can be "
                "canceled",
                field="id",
                code="job_finished",
            )
        job.cancel_requested = True
        await self._cancel(job.id)
        job = await self.wait(job, wait_s)
        if job.status.terminal and job.status is not JobStatus.CANCELED:
            raise Conflict(
                f"job {job.id} {job.status.value} before the cancel reached it",
                field="id",
                code="job_finished",
            )
        return job

    async def _cancel_mirror(self, job: Job, wait_s: float) -> Job:
        """Ask the gateway that runs the job to cancel it (through the shared store) and
        wait, bounded, until its record ends; the job as the store has it then."""
        if not await self.peers.request_cancel(job.id):
            return await self._read_mirror(job.id) or job
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(MIRROR_POLL_S)
            now = await self._read_mirror(job.id)
            if now is None or now.status.terminal:
                return now or job
            if job.id in self.jobs:  # taken over by this gateway meanwhile
                return self.jobs[job.id]
        job.cancel_requested = True
        return job

    async def wait(self, job: Job, timeout_s: float) -> Job:
        """Until the job ends or ``timeout_s`` passes; the job as it stands then. A job
        another gateway runs (a mirror, or one handed over meanwhile) sends no event here:
        its record is read again every ``MIRROR_POLL_S``, and one this gateway takes over
        meanwhile is waited on here."""
        deadline = time.monotonic() + timeout_s
        while not (job.status.terminal if job.mirror else job.ended):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if job.mirror:
                await asyncio.sleep(min(MIRROR_POLL_S, left))
                job = await self._current(job)
                continue
            job._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(job._changed.wait(), left)
        return job

    async def _current(self, mirror: Job) -> Job:
        """A mirrored job now: this gateway's own if it took it over, else its record."""
        local = self.jobs.get(mirror.id)
        if local is not None and not local.mirror:
            return local
        return await self._read_mirror(mirror.id) or mirror

    async def settle(self, job: Job, wait_s: float | None) -> Job:
        """A job as an answer shows it: once it ended or ``wait_s`` passed (``Prefer:
        wait``; ``None``: at once), a queued one with its position in the queue now."""
        if wait_s is not None:
            job = await self.wait(job, wait_s)
        if job.status is JobStatus.QUEUED:
            job.position = self._positions().get(job.id, job.position)
        return job

    async def events(self, job: Job, after: int = 0):
        """The job's events with ``seq > after`` in order, live until it ends; ``None``
        items mark idle periods (for keep-alives). A stream always ends with the terminal
        event unless the reader says it has it (``after`` is its id): one resuming from an
        id this job never gave still gets it."""
        if job.mirror:
            async for event in self._mirror_events(job, after):
                yield event
            return
        sent = after
        job._readers += 1
        try:
            while True:
                for event in [e for e in job.events if e.seq > sent]:
                    sent = event.seq
                    yield event
                if job.ended and sent >= job.events[-1].seq:
                    if sent > job.events[-1].seq:
                        yield job.events[-1]
                    return
                if job.mirror:  # handed over to another gateway: follow it in the store
                    async for event in self._mirror_events(job, sent):
                        yield event
                    return
                job._changed.clear()
                try:
                    await asyncio.wait_for(job._changed.wait(), 1.0)
                except TimeoutError:
                    yield None
        finally:
            job._readers -= 1
            self._trim(job)

    async def _mirror_events(self, job: Job, after: int):
        """A job another gateway runs, as read from the shared store now and then: its
        terminal event once its record ends (with the id it has everywhere), keep-alives
        until then. Progress is seen on the gateway that runs it."""
        while not job.ended:
            yield None
            await asyncio.sleep(MIRROR_POLL_S)
            local = self.jobs.get(job.id)  # taken over by this gateway meanwhile
            if local is not None:
                async for event in self.events(local, after):
                    yield event
                return
            job = await self._read_mirror(job.id) or job
        if job.events[-1].seq != after:
            yield job.events[-1]

    # ---- several gateways ------------------------------------------------------------------
    async def adopt(self, records: list[dict[str, Any]]) -> int:
        """Run the unfinished jobs a dead gateway left (claimed from the shared store), as
        a restart resumes its own: each from the start, with ids above its last run's."""
        adopted = 0
        for record in records:
            if record.get("id") in self.jobs:
                continue
            try:
                job = await self._load(self.journal, record)
            except TakenOver:  # this gateway was thought dead meanwhile: not ours after all
                continue
            except OSError as exc:  # the store failed: give it back for the next claim
                log.warning("could not take up job %s (%s); giving it back", record["id"], exc)
                await self.peers.release(str(record["id"]))
                continue
            if job is None or job.status.terminal:
                continue
            job.cancel_requested = bool(record.get("cancel_requested"))
            self._keep(job)
            job.task = asyncio.create_task(self._run(job))
            adopted += 1
        if adopted:
            log.info("took over %d jobs of a gateway that stopped answering", adopted)
        return adopted

    def live_ids(self) -> list[str]:
        """The durable jobs this gateway runs now."""
        return [j.id for j in self.jobs.values() if j.durable and not j.status.terminal]

    async def drop(self, job_ids: list[str]) -> None:
        """Stop running jobs this gateway no longer owns (taken over while it was thought
        dead, or it lost the store for longer than the TTL): their runs end here, with no
        end recorded or announced; readers here follow them in the store."""
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None or job.status.terminal:
                continue
            if job.task is not None:
                job.task.cancel()
            with contextlib.suppress(Exception):
                await self._cancel(job.id)  # off its executor (or out of the queue)
            self._hand_over(job)

    async def cancel_requested(self, job_ids: list[str]) -> None:
        """Cancels another gateway was asked for, of jobs this one runs."""
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None or job.status.terminal or job.cancel_requested:
                continue
            job.cancel_requested = True
            await self._cancel(job.id)

    # ---- internals ----------------------------------------------------------------------
    def _record(
        self, job: Job, kind: JobEventKind, data: dict[str, Any], notify: bool = True
    ) -> None:
        if job._seq - job.run * RUN_SEQ_SPAN >= RUN_SEQ_SPAN - 1:
            return  # this run's ids are spent but for its terminal event's
        event = self._event(job, kind, data)
        self._publish(job, event)
        if self._notify is not None and job.durable and notify:
            self._notify(job, event)  # its journal write completes on its own

    @staticmethod
    def _event(job: Job, kind: JobEventKind, data: dict[str, Any]) -> JobEvent:
        job._seq += 1
        return JobEvent(job._seq, kind, data)

    @staticmethod
    def _publish(job: Job, event: JobEvent) -> None:
        """Into the job's history, for its readers."""
        job.events.append(event)
        if len(job.events) > MAX_EVENTS:  # drop the oldest progress event, keep the rest
            for i, old in enumerate(job.events):
                if old.kind is JobEventKind.PROGRESS:
                    del job.events[i]
                    break
        job._changed.set()

    @staticmethod
    def _trim(job: Job) -> None:
        """A finished job keeps its last progress event and its terminal event, once no
        stream is reading the events before them: its history is not kept for a day, and a
        stream opened later still shows how far it got (``retouch jobs watch``'s bar)."""
        if job.ended and job._readers == 0 and len(job.events) > 2:
            progress = [e for e in job.events[:-1] if e.kind is JobEventKind.PROGRESS]
            job.events = [*progress[-1:], job.events[-1]]

    async def _watch_positions(self) -> None:
        """``queued`` events whenever a job's place in the gateway queue changes."""
        while True:
            await asyncio.sleep(POSITION_POLL_S)
            for job_id, position in self._positions().items():  # the queue's, not every job
                job = self.jobs.get(job_id)
                if job is None or job.status is not JobStatus.QUEUED:
                    continue
                if position != job.position:
                    job.position = position
                    self._record(job, JobEventKind.QUEUED, {"position": position})

    async def _purge_expired(self) -> None:
        """Purge now and then, for as long as the store runs: an error is logged, never
        the end of purging (the caps would fill for good)."""
        while True:
            await asyncio.sleep(min(60.0, max(0.5, self.retention_s / 4)))
            try:
                await self.purge()
            except Exception:
                log.exception("purging expired jobs failed; trying again later")

    async def purge(self) -> int:
        """Remove finished jobs older than the retention time (memory and journal). A
        record that cannot be deleted is logged and left (the next start purges it)."""
        expired = self.retention.expired(self._clock() - self.retention_s)
        for job in expired:
            self._forget_kept(job)
            if self.journal is not None:
                try:
                    await asyncio.to_thread(self.journal.delete, job.id)
                except OSError:
                    log.exception("could not delete the record of expired job %s", job.id)
        return len(expired) + await self.peers.purge(self._clock() - self.retention_s)

    def _keep(self, job: Job) -> None:
        """Keep a durable job: by id, told to the peers (one gateway indexes it by owner for
        listings), and counted against the caps."""
        self.jobs[job.id] = job
        self.peers.keep(job)
        self.retention.take(job)

    def _forget_kept(self, job: Job) -> None:
        """Undo :meth:`_keep`."""
        self.jobs.pop(job.id, None)
        self.peers.forget(job)
        self.retention.release(job)


def _ended_order(job: Job) -> tuple[float, float]:
    """Finished jobs by their end, then unfinished ones by their creation."""
    return (
        job.completed_at if job.status.terminal and job.completed_at else math.inf,
        job.created_at,
    )
