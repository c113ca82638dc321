"""Following a job another gateway runs: its record, read from the job source now and then.

A gateway of a shared store can be asked about any gateway's job. One it does not run is a
*mirror* (:attr:`~retouch.platform.jobs.job.Job.mirror`): a copy of its stored record,
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
from retouch.platform.jobs.job import END_EVENT, Job
from retouch.platform.jobs.sharedjournal import StoredJob
from retouch.platform.jobs.source import JobSource

log = logging.getLogger(__name__)

MIRROR_POLL_S = 0.5  # how often a job another gateway runs is read again (events, cancel)

# This gateway's own events of a job (the job store's), for one it took over meanwhile
OwnEvents = Callable[[Job, int], AsyncIterator[JobEvent | None]]


class Mirrors:
    """The jobs another gateway runs, as this gateway's readers see them."""

    def __init__(
        self,
        source: JobSource,
        kept: Mapping[str, Job],
        output_url: Callable[[Job], str | None],
    ) -> None:
        self.source = source
        self.kept = kept  # the job store's own jobs, by id (a takeover lands there)
        self.output_url = output_url

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
        job.mirror = True
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
        bounded, until its record ends; the job as the source has it then."""
        if not await self.source.request_cancel(job.id):
            return await self.read(job.id) or job
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(MIRROR_POLL_S)
            now = await self.read(job.id)
            if now is None or now.status.terminal:
                return now or job
            if job.id in self.kept:  # taken over by this gateway meanwhile
                return self.kept[job.id]
        job.cancel_requested = True
        return job

    async def poll(self, job: Job, left_s: float) -> Job:
        """The job after one poll (within ``left_s``): this gateway's own if it took it
        over meanwhile, else its record as read again."""
        await asyncio.sleep(min(MIRROR_POLL_S, left_s))
        local = self.kept.get(job.id)
        if local is not None and not local.mirror:
            return local
        return await self.read(job.id) or job

    async def events(self, job: Job, after: int, own: OwnEvents) -> AsyncIterator[JobEvent | None]:
        """Its terminal event once its record ends (with the id it has everywhere),
        keep-alives until then; one taken over by this gateway meanwhile is streamed as
        its own (``own``). Progress is seen on the gateway that runs it."""
        while not job.ended:
            yield None
            await asyncio.sleep(MIRROR_POLL_S)
            local = self.kept.get(job.id)
            if local is not None:
                async for event in own(local, after):
                    yield event
                return
            job = await self.read(job.id) or job
        if job.events[-1].seq != after:
            yield job.events[-1]
