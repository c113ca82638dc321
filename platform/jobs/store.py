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
gateways know of jobs, and where a durable job's record goes, it asks its job source
(``platform/jobs/source.py``); a job another gateway runs is followed through it
(``platform/jobs/mirrors.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from retouch.functions.errors import Canceled, NotFound, RetouchError
from retouch.functions.wire.executor import StepProgress
from retouch.functions.wire.invoke import InvokeResult
from retouch.functions.wire.jobs import JobEvent, JobEventKind, JobRequest, JobStatus, check_job_id
from retouch.platform.jobs.following import Following, RunHere
from retouch.platform.jobs.job import END_EVENT, Job, PreparedInvocation, Runner, new_job_id
from retouch.platform.jobs.links import LinkSigner
from retouch.platform.jobs.mirrors import Mirrors
from retouch.platform.jobs.retention import (
    Retention,
    RetentionLimits,
    payload_bytes,
    retained_bytes,
    shed_image,
    shed_payload,
)
from retouch.platform.jobs.sharedjournal import TakenOver
from retouch.platform.jobs.source import JobSource, Listing
from retouch.platform.state.auth import ANONYMOUS, Principal

log = logging.getLogger(__name__)

DEFAULT_RETENTION_S = 24 * 3600.0
DEFAULT_PROGRESS_INTERVAL_S = 0.25
POSITION_POLL_S = 0.25  # how often queue positions are re-read for ``queued`` events

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
        source: JobSource,
        *,
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
        # Where durable jobs are recorded and what the other gateways know: chosen in one
        # place (the gateway's composition), never guessed here.
        self.source = source
        self.retention_s = retention_s
        self.progress_interval_s = progress_interval_s
        self._notify = notify
        self._clock = clock
        self.links = links  # signs result links (``output``); none: jobs have no ``output``
        self.jobs: dict[str, Job] = {}
        self._tasks: list[asyncio.Task] = []
        self.retention = Retention(limits or RetentionLimits(), retention_s)
        self.here = RunHere(cancel, self.follow)
        self.mirrors = Mirrors(source, self.jobs, self.output_url, self.follow)

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Reload the journal and resume every job that had not ended."""
        loaded = [await self._load(r) for r in await self.source.load()]
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

    async def _load(self, record: dict[str, Any]) -> Job | None:
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
            job.record(END_EVENT[job.status], job.describe(False, False))
            had = payload_bytes(job.request)
            shed_payload(job)  # a record written before payloads were shed: rewritten small
            if had > payload_bytes(job.request):
                await self.source.rewrite(job.to_record())
        else:
            job.retained_bytes = retained_bytes(job.request)
            await self.source.rerun(job)
            self._record(job, JobEventKind.QUEUED, {"position": None})
        shed_image(job)
        return job

    async def close(self) -> None:
        """Stop without ending any job: unfinished durable jobs resume at the next start."""
        tasks = [*self._tasks, *(j.task for j in self.jobs.values() if j.task is not None)]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.source.close()

    # ---- lookup -------------------------------------------------------------------------
    async def get(self, job_id: str, viewer: Principal) -> Job:
        """The job, if ``viewer`` may see it: another tenant's job is as unknown as a
        missing one (the same 404), so ids cannot be probed. A job another gateway runs
        is read from the source (its runner ``ELSEWHERE``)."""
        job = self.jobs.get(check_job_id(job_id))
        if job is None:
            job = await self.mirrors.read(job_id)
        if job is None or not job.durable or not viewer.owns(job.owner):
            raise NotFound(f"no job {job_id!r}", field="id", code="job_not_found")
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
        return await self.source.listing(page, self.mirrors.known)

    def output_url(self, job: Job, ttl_s: float | None = None) -> str | None:
        """A signed link to a succeeded durable job's image, valid ``ttl_s`` (never past
        its retention end; ``None``: until then). A job that is not kept has none."""
        if job.result is None or not job.durable or self.links is None:
            return None
        not_after = job.retained_until(self.retention_s)
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
                await self.source.accept(job.to_record(), job.retained_bytes)
            except BaseException:
                self.retention.release(job)
                raise
            self.source.keep(job)
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
            result = await self._execute(job, *self._reporting(job))
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

    def _reporting(self, job: Job) -> tuple[OnStart, OnProgress]:
        """What the pool reports a run of ``job`` through: its start on an executor (told
        to the source too: other gateways show it running), and its steps."""

        def started(executor: str, attempt: int) -> None:
            data = job.start_run(executor, attempt, self._clock())
            if job.durable:
                self.source.started(job.id)
            self._record(job, JobEventKind.STARTED, data)

        def progressed(step: StepProgress) -> None:
            progress = job.step_progress(step, self.progress_interval_s)
            if progress is not None:
                self._record(job, JobEventKind.PROGRESS, progress.to_wire())

        return started, progressed

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
        shed_payload(job)
        if job.durable:
            self.retention.ended(job, held)
        event = job.next_event(
            END_EVENT[status], job.describe(with_image=False, with_webhook=False)
        )
        if job.durable and not await self.source.owns(job.id):
            self._hand_over(job)
            return
        if job.durable:  # its webhook delivery's journal write comes first
            journaled = self._notify(job, event) if self._notify else None
            try:
                if await self.source.record_end(job, journaled):
                    shed_image(job)
            except TakenOver:  # this gateway was thought dead: the new runner's end counts
                self._hand_over(job)
                return
        job.publish(event)
        job.trim()

    def _hand_over(self, job: Job) -> None:
        """Another gateway runs the job now (this one was thought dead): forget it here;
        its readers here follow it through the store from now on."""
        log.warning("job %s is run by another gateway now; its run here is dropped", job.id)
        self._forget_kept(job)
        job.runner = Runner.ELSEWHERE
        job._changed.set()

    async def document(self, job: Job, with_webhook: bool = True) -> dict[str, Any]:
        """The job document with its result's image (read back from the journal)."""
        doc = job.describe(with_webhook=with_webhook)
        if job.image_on_disk and "result" in doc:
            try:
                record = await self.source.read(job.id)
            except OSError:  # removed meanwhile (retention)
                raise NotFound(f"no job {job.id!r}", field="id", code="job_not_found") from None
            doc["result"]["image"] = (record.get("result") or {}).get("image", b"")
        return doc

    # ---- cancel and waiting: asked of whoever runs the job ---------------------------------
    def follow(self, job: Job) -> Following:
        """Who a reader of ``job`` asks: this gateway's run, or the shared store for a job
        another gateway runs (``platform/jobs/following.py``)."""
        return self.mirrors if job.runner is Runner.ELSEWHERE else self.here

    async def cancel(self, job: Job, wait_s: float = 10.0) -> Job:
        """Cancel a job: idempotent on a canceled job; a finished one is a 409
        ``job_finished``. Waits (bounded) until the job has left its executor."""
        return await self.follow(job).cancel(job, wait_s)

    async def wait(self, job: Job, timeout_s: float) -> Job:
        """Until the job ends or ``timeout_s`` passes; the job as it stands then."""
        return await self.follow(job).wait(job, timeout_s)

    async def settle(self, job: Job, wait_s: float | None) -> Job:
        """A job as an answer shows it: once it ended or ``wait_s`` passed (``Prefer:
        wait``; ``None``: at once), a queued one with its position in the queue now."""
        if wait_s is not None:
            job = await self.wait(job, wait_s)
        if job.status is JobStatus.QUEUED:
            job.position = self._positions().get(job.id, job.position)
        return job

    def events(self, job: Job, after: int = 0) -> AsyncIterator[JobEvent | None]:
        """The job's events with ``seq > after`` in order, live until it ends; ``None``
        items mark idle periods (for keep-alives). A stream always ends with the terminal
        event unless the reader says it has it (``after`` is its id): one resuming from an
        id this job never gave still gets it."""
        return self.follow(job).events(job, after)

    # ---- several gateways ------------------------------------------------------------------
    async def adopt(self, records: list[dict[str, Any]]) -> int:
        """Run the unfinished jobs a dead gateway left (claimed from the shared store), as
        a restart resumes its own: each from the start, with ids above its last run's."""
        adopted = 0
        for record in records:
            if record.get("id") in self.jobs:
                continue
            try:
                job = await self._load(record)
            except TakenOver:  # this gateway was thought dead meanwhile: not ours after all
                continue
            except OSError as exc:  # the store failed: give it back for the next claim
                log.warning("could not take up job %s (%s); giving it back", record["id"], exc)
                await self.source.release(str(record["id"]))
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
    def _record(self, job: Job, kind: JobEventKind, data: dict[str, Any]) -> None:
        """A new event of a job this gateway runs, handed to the webhook sender too."""
        event = job.record(kind, data)
        if event is not None and self._notify is not None and job.durable:
            self._notify(job, event)  # its journal write completes on its own

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
            await self.source.delete(job.id)
        return len(expired) + await self.source.purge(self._clock() - self.retention_s)

    def _keep(self, job: Job) -> None:
        """Keep a durable job: by id, told to the source (one gateway indexes it by owner for
        listings), and counted against the caps."""
        self.jobs[job.id] = job
        self.source.keep(job)
        self.retention.take(job)

    def _forget_kept(self, job: Job) -> None:
        """Undo :meth:`_keep`."""
        self.jobs.pop(job.id, None)
        self.source.forget(job)
        self.retention.release(job)


def _ended_order(job: Job) -> tuple[float, float]:
    """Finished jobs by their end, then unfinished ones by their creation."""
    return (
        job.completed_at if job.status.terminal and job.completed_at else math.inf,
        job.created_at,
    )
