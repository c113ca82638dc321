"""Where a gateway's jobs are kept, and what the other gateways know of them: the job
store's one seam between "this gateway alone" and "several gateways sharing a store".

The job store (``platform/jobs/store.py``) runs the jobs it keeps the same way either way;
what differs is where a durable job's record goes and who else may know a job. Alone, a
gateway keeps its jobs in memory (:class:`MemoryJobs`, no data dir) or journals them in
files (:class:`JournaledJobs`), and nobody else knows them. Among several, every job is a
row of the shared store (:class:`SharedJobs`, on ``platform/jobs/sharedjournal.py``): any
gateway's job can be read, listed, asked to cancel, and a job may be taken over. The store
asks a :class:`JobSource` and never tests which kind it has, as a diffusers attention
module calls its processor.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from retouch.functions.wire.jobs import JobStatus
from retouch.platform.jobs.job import Job
from retouch.platform.jobs.journal import JobJournal
from retouch.platform.jobs.sharedjournal import SharedJobJournal, StoredJob, TakenOver
from retouch.platform.state.statestore import StoreUnavailable

log = logging.getLogger(__name__)

RELEASE_PAUSE_S = 2.0  # between tries to give back a claimed job while the store fails
END_WRITE_TRIES = 30  # a job's final record, into a shared store that does not answer
END_WRITE_PAUSE_S = 2.0

# How this gateway shows a stored job: the one it runs, with its progress, else a mirror
Known = Callable[[StoredJob], Job | None]


@dataclass(frozen=True)
class Listing:
    """One page of a job listing: newest first, ``limit`` jobs older than ``before`` (a
    page's last :func:`listing_key`), filtered on what is given (``tenant`` None: all)."""

    tenant: str | None
    status: JobStatus | None
    function: str | None
    limit: int
    before: tuple[float, str] | None

    def matches(self, job: Job) -> bool:
        """Whether a job of the listed tenant belongs on the page (bar the limit)."""
        return (
            (self.status is None or job.status is self.status)
            and (self.function is None or job.function == self.function)
            and (self.before is None or listing_key(job) < self.before)
        )


class JobSource(Protocol):
    """Where the job store keeps its durable jobs' records, and the other gateways."""

    # ---- this gateway's records ----------------------------------------------------------
    async def load(self) -> list[dict[str, Any]]:
        """The records of the jobs this gateway kept before it stopped (none: none kept)."""

    async def accept(self, record: dict[str, Any], nbytes: int) -> None:
        """Record a durable job just accepted (before the client hears of it)."""

    async def rerun(self, job: Job) -> None:
        """Record the new run of a resumed or adopted job (raises when it must not be
        taken up here)."""

    async def record_end(self, job: Job, journaled: Awaitable[None] | None) -> bool:
        """Record a durable job's end, after its webhook delivery's journal write
        (``journaled``); True when its image may be read back from the record (then it
        leaves memory). :class:`~retouch.platform.jobs.sharedjournal.TakenOver` when
        another gateway runs the job now."""

    async def rewrite(self, record: dict[str, Any]) -> None:
        """Replace a finished job's record (compacted); a failure is logged."""

    async def read(self, job_id: str) -> dict[str, Any]:
        """A kept record (its result's image); ``OSError`` when it is gone."""

    async def delete(self, job_id: str) -> None:
        """Remove an expired job's record; a failure is logged."""

    # ---- the other gateways --------------------------------------------------------------
    def keep(self, job: Job) -> None:
        """This gateway keeps a durable job (until :meth:`forget`)."""

    def forget(self, job: Job) -> None:
        """This gateway no longer keeps the job (expired, or handed over)."""

    async def fetch(self, job_id: str) -> StoredJob | None:
        """A job this gateway does not keep, as the gateway that runs it recorded it."""

    async def listing(self, page: Listing, known: Known) -> list[Job]:
        """The page, every gateway's jobs on it shown through ``known``."""

    async def owns(self, job_id: str) -> bool:
        """Whether this gateway still runs the job, asked before its end is announced."""

    def started(self, job_id: str) -> None:
        """A durable job started here (told without waiting: others show it running)."""

    async def request_cancel(self, job_id: str) -> bool:
        """Ask the gateway that runs the job to cancel it; False when none will."""

    async def release(self, job_id: str) -> None:
        """Give back a job claimed from a dead gateway that could not be taken up."""

    async def purge(self, cutoff: float) -> int:
        """Remove the jobs no gateway keeps that ended before ``cutoff``; how many."""

    async def close(self) -> None:
        """Stop what is in flight (the gateway is stopping)."""


class MemoryJobs:
    """This gateway alone, without a data dir: every job is its own, kept in memory only
    (a finished job keeps its image there), and its memory is the whole listing (by
    owner, so a tenant's page reads only that tenant's jobs)."""

    def __init__(self) -> None:
        self._owned: dict[str, dict[str, Job]] = {}

    async def load(self) -> list[dict[str, Any]]:
        return []

    async def accept(self, record: dict[str, Any], nbytes: int) -> None:
        """Nothing to write: the job lives as long as the process."""

    async def rerun(self, job: Job) -> None:
        """Never reached: nothing is loaded, nothing adopted."""

    async def record_end(self, job: Job, journaled: Awaitable[None] | None) -> bool:
        return False  # its image stays in memory, the only copy

    async def rewrite(self, record: dict[str, Any]) -> None:
        """Nothing written, nothing to compact."""

    async def read(self, job_id: str) -> dict[str, Any]:
        raise FileNotFoundError(job_id)  # no record: every image is in memory

    async def delete(self, job_id: str) -> None:
        """Nothing written, nothing to remove."""

    def keep(self, job: Job) -> None:
        self._owned.setdefault(job.owner, {})[job.id] = job

    def forget(self, job: Job) -> None:
        owned = self._owned.get(job.owner, {})
        owned.pop(job.id, None)
        if not owned:
            self._owned.pop(job.owner, None)

    async def fetch(self, job_id: str) -> StoredJob | None:
        return None

    async def listing(self, page: Listing, known: Known) -> list[Job]:
        if page.tenant is None:
            kept = (j for owned in self._owned.values() for j in owned.values())
        else:
            kept = iter(self._owned.get(page.tenant, {}).values())
        return heapq.nlargest(page.limit, filter(page.matches, kept), key=listing_key)

    async def owns(self, job_id: str) -> bool:
        return True

    def started(self, job_id: str) -> None:
        """Nobody else shows the job: its status here is the only one."""

    async def request_cancel(self, job_id: str) -> bool:
        return False

    async def release(self, job_id: str) -> None:
        """Never reached: one gateway claims no other gateway's jobs."""

    async def purge(self, cutoff: float) -> int:
        return 0  # no other gateway's records to expire

    async def close(self) -> None:
        """Nothing in flight: one gateway writes no peer state."""


class Journaled:
    """The records of a source whose journal keeps them (files, or the shared store's
    rows): loaded, accepted, compacted, read back and removed through it."""

    journal: JobJournal | SharedJobJournal

    async def load(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.journal.load)

    async def accept(self, record: dict[str, Any], nbytes: int) -> None:
        """(The shared journal also checks the caps of every gateway's jobs here.)"""
        await asyncio.to_thread(self.journal.accept, record, nbytes)

    async def rewrite(self, record: dict[str, Any]) -> None:
        await _rewrite(self.journal.write, record)

    async def read(self, job_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.journal.read, job_id)

    async def delete(self, job_id: str) -> None:
        await _delete(self.journal.delete, job_id)


class JournaledJobs(Journaled, MemoryJobs):
    """This gateway alone, with its jobs journaled in files (``<data dir>/jobs``): they
    survive a restart, and a finished job's image is read back from its record."""

    def __init__(self, journal: JobJournal) -> None:
        super().__init__()
        self.journal = journal

    async def rerun(self, job: Job) -> None:
        """A failed write is logged and the job runs anyway: only a second crash could
        repeat its event ids."""
        try:
            await asyncio.to_thread(self.journal.write, job.to_record())
        except OSError as exc:
            log.error("could not record the new run of job %s", job.id, exc_info=exc)

    async def record_end(self, job: Job, journaled: Awaitable[None] | None) -> bool:
        return await _record_end(self._write, job, journaled)

    async def _write(self, record: dict[str, Any]) -> None:
        await asyncio.to_thread(self.journal.write, record)


class SharedJobs(Journaled):
    """The gateways of one shared store (``SharedJobJournal``): it holds every gateway's
    jobs, so this gateway indexes none of its own, and writes only the rows it runs."""

    def __init__(self, journal: SharedJobJournal) -> None:
        self.journal = journal
        self._writes: set[asyncio.Task] = set()  # store writes in flight

    async def rerun(self, job: Job) -> None:
        """A failed write means the job was taken over meanwhile, or the store is down:
        not this gateway's to run (the error is raised)."""
        await asyncio.to_thread(self.journal.write, job.to_record())

    async def record_end(self, job: Job, journaled: Awaitable[None] | None) -> bool:
        return await _record_end(self._write_end, job, journaled)

    async def _write_end(self, record: dict[str, Any]) -> None:
        """The final record, tried again while the store is down (its row would otherwise
        stay live, this gateway's, and never claimed)."""
        for attempt in range(END_WRITE_TRIES):
            try:
                await asyncio.to_thread(self.journal.write, record)
                return
            except StoreUnavailable:
                if attempt == END_WRITE_TRIES - 1:
                    raise
                log.warning("the end of job %s not recorded yet; trying again", record["id"])
                await asyncio.sleep(END_WRITE_PAUSE_S)

    def keep(self, job: Job) -> None:
        """The store already holds the job's row: listings read it there."""

    def forget(self, job: Job) -> None:
        """The row stays in the store (purged by age), for every gateway to read."""

    async def fetch(self, job_id: str) -> StoredJob | None:
        return await asyncio.to_thread(self.journal.fetch, job_id)

    async def listing(self, page: Listing, known: Known) -> list[Job]:
        status = None if page.status is None else page.status.value
        stored = await asyncio.to_thread(
            self.journal.listing, page.tenant, status, page.function, page.limit, page.before
        )
        return [job for job in map(known, stored) if job is not None]

    async def owns(self, job_id: str) -> bool:
        """A store that does not answer is no proof of the contrary: the fenced write of
        the job's end decides."""
        try:
            return await asyncio.to_thread(self.journal.owns, job_id)
        except StoreUnavailable:
            return True

    def started(self, job_id: str) -> None:
        """Listings filter on the row's status: marked running in the background."""
        self._in_background(self._mark_running(job_id))

    async def _mark_running(self, job_id: str) -> None:
        try:
            await asyncio.to_thread(self.journal.mark_running, job_id)
        except OSError as exc:
            log.warning("state store: mark_running of job %s failed: %s", job_id, exc)

    async def request_cancel(self, job_id: str) -> bool:
        return await asyncio.to_thread(self.journal.request_cancel, job_id)

    async def release(self, job_id: str) -> None:
        """Tried again in the background while the store fails: a row left naming this
        gateway, which does not run it, would be claimed by nobody while it lives."""
        try:
            await asyncio.to_thread(self.journal.release, job_id)
        except OSError as exc:
            log.warning("could not give back job %s (%s); trying again", job_id, exc)
            self._in_background(self._release_later(job_id, self.journal.store.gateway))

    async def _release_later(self, job_id: str, gateway: str) -> None:
        while True:
            await asyncio.sleep(RELEASE_PAUSE_S)
            if self.journal.store.gateway != gateway:
                return  # a new id: the old one's rows are claimable as a dead gateway's
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self.journal.release, job_id)
                return

    async def purge(self, cutoff: float) -> int:
        """A dead gateway's finished jobs expire too."""
        return await asyncio.to_thread(self.journal.purge, cutoff)

    def _in_background(self, work: Coroutine[None, None, None]) -> None:
        """A store write nobody waits for (until :meth:`close`)."""
        task = asyncio.create_task(work)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def close(self) -> None:
        tasks = list(self._writes)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def listing_key(job: Job) -> tuple[float, str]:
    """The order of listings (newest first): creation time, ties broken by id."""
    return job.created_at, job.id


Write = Callable[[dict[str, Any]], Awaitable[None]]


async def _record_end(write: Write, job: Job, journaled: Awaitable[None] | None) -> bool:
    """The webhook's delivery is journaled before the job's end: a crash between the two
    re-runs the job (same delivery id); the other order could lose the delivery."""
    if journaled is not None:  # a failed write is the sender's to log
        with contextlib.suppress(Exception):
            await asyncio.shield(journaled)
    try:
        await write(job.to_record())
    except TakenOver:
        raise  # this gateway was thought dead: the new runner's end counts
    except OSError:
        log.exception("could not record the end of job %s", job.id)
        return False
    return True


async def _rewrite(write: Callable[[dict[str, Any]], None], record: dict[str, Any]) -> None:
    try:
        await asyncio.to_thread(write, record)
    except OSError:
        log.exception("could not compact the record of job %s", record["id"])


async def _delete(delete: Callable[[str], None], job_id: str) -> None:
    try:
        await asyncio.to_thread(delete, job_id)
    except OSError:
        log.exception("could not delete the record of expired job %s", job_id)
