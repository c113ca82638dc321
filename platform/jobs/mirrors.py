"""Following a job another gateway runs: its record, read from the job source now and then.

A gateway of a shared store can be asked about any gateway's job. One it does not run is a
*mirror* (its :class:`~retouch.platform.jobs.job.Runner` is ``ELSEWHERE``): a copy of its
stored record,
read again every :data:`MIRROR_POLL_S` while a reader waits, cancelled by asking the
source (the gateway that runs it passes the cancel on), and streamed as keep-alives until
its record ends. A job may change hands meanwhile: one this gateway takes over is followed
as its own from then on, and one of its own handed over is followed here. Alone, a gateway
meets no mirror: its source knows no job it does not keep.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping

from retouch.functions.errors import RetouchError
from retouch.functions.wire.jobs import JobEvent, JobStatus
from retouch.platform.jobs.following import Follow, already_ended
from retouch.platform.jobs.job import END_EVENT, Job, Runner
from retouch.platform.jobs.sharedjournal import StoredJob
from retouch.platform.jobs.source import JobSource

log = logging.getLogger(__name__)

MIRROR_POLL_S = 0.5  # how often a job another gateway runs is read again (events, cancel)


class Mirrors:
    """The jobs another gateway runs, as this gateway's readers see them (a
    :class:`~retouch.platform.jobs.following.Following`)."""

    def __init__(
        self,
        source: JobSource,
        kept: Mapping[str, Job],
        output_url: Callable[[Job], str | None],
        follow: Follow,
    ) -> None:
        self.source = source
        self.kept = kept  # the job store's own jobs, by id (a takeover lands there)
        self.output_url = output_url
        self._follow = follow  # who follows a job taken over by this gateway meanwhile

    async def read(self, job_id: str) -> Job | None:
        """The job as the gateway that runs it recorded it (None: no such job)."""
        stored = await self.source.fetch(job_id)
        if stored is None:
            return None
        job = self.copy(stored)
        if job is not None and job.status.terminal:
            job.record(END_EVENT[job.status], job.describe(False, False))
        return job

    def copy(self, stored: StoredJob) -> Job | None:
        """A job another gateway runs or ran, from its stored record (None: unreadable)."""
        try:
            job = Job.from_record(stored.record)
        except (RetouchError, KeyError, TypeError, ValueError) as exc:
            log.error("job record %s is unreadable: %s", stored.record.get("id"), exc)
            return None
        job.runner = Runner.ELSEWHERE
        if job.status.terminal:
            job.output = self.output_url(job)
        else:  # not the ids of a run: a reader of this gateway gets only the end's id
            job.run, job._seq = int(stored.record.get("run", 0)), 0
            if stored.status == JobStatus.RUNNING.value:
                job.status = JobStatus.RUNNING
        return job

    def known(self, stored: StoredJob) -> Job | None:
        """A listed job: the one this gateway runs (with its progress), else a copy."""
        return self.kept.get(str(stored.record.get("id"))) or self.copy(stored)

    async def cancel(self, job: Job, wait_s: float) -> Job:
        """Ask the gateway that runs the job to cancel it (through the source) and wait,
        bounded, until its record ends: the job as the source has it then (a 409
        ``job_finished`` if it ended otherwise). One this gateway takes over meanwhile is
        canceled here."""
        deadline = time.monotonic() + wait_s
        job = await self._asked_to_cancel(job, deadline)
        if job.runner is Runner.HERE:
            return await self._follow(job).cancel(job, deadline - time.monotonic())
        if job.status.terminal and job.status is not JobStatus.CANCELED:
            raise already_ended(job)
        return job

    async def _asked_to_cancel(self, job: Job, deadline: float) -> Job:
        if not await self.source.request_cancel(job.id):
            return await self.read(job.id) or job
        while time.monotonic() < deadline:
            await asyncio.sleep(MIRROR_POLL_S)
            now = await self.read(job.id)
            if now is None or now.status.terminal:
                return now or job
            if job.id in self.kept:  # taken over by this gateway meanwhile
                return self.kept[job.id]
        job.cancel_requested = True
        return job

    async def wait(self, job: Job, timeout_s: float) -> Job:
        """Until its record ends or ``timeout_s`` passes, read again now and then."""
        deadline = time.monotonic() + timeout_s
        while not job.status.terminal:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            job = await self.poll(job, left)
            if job.runner is Runner.HERE:  # taken over by this gateway meanwhile
                return await self._follow(job).wait(job, deadline - time.monotonic())
        return job

    async def poll(self, job: Job, left_s: float) -> Job:
        """The job after one poll (within ``left_s``): this gateway's own if it took it
        over meanwhile, else its record as read again."""
        await asyncio.sleep(min(MIRROR_POLL_S, left_s))
        own = self._own(job)
        if own is not None:  # taken over before this poll: no read
            return own
        record = await self.read(job.id) or job
        return self._own(job) or record  # taken over during the read: its run, not the record

    def _own(self, job: Job) -> Job | None:
        """This gateway's own run of ``job``, once it has taken the job over."""
        local = self.kept.get(job.id)
        return local if local is not None and local.runner is Runner.HERE else None

    async def events(self, job: Job, after: int) -> AsyncIterator[JobEvent | None]:
        """Its terminal event once its record ends (with the id it has everywhere),
        keep-alives until then; one taken over by this gateway meanwhile is followed as its
        own. Progress is seen on the gateway that runs it."""
        while not job.ended:
            yield None
            await asyncio.sleep(MIRROR_POLL_S)
            local = self.kept.get(job.id)
            if local is not None:
                async for event in self._follow(local).events(local, after):
                    yield event
                return
            job = await self.read(job.id) or job
        if job.events[-1].seq != after:
            yield job.events[-1]
