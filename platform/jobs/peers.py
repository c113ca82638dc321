"""What the other gateways know of jobs: the job store's one seam between "this gateway
alone" and "several gateways sharing a store".

The job store (``platform/jobs/store.py``) runs the jobs it keeps the same way either way; what
differs is who else may know a job: nobody (:class:`NoPeers`: this gateway's memory
answers listings, every job it keeps is its own) or the other gateways of a shared store
(:class:`SharedPeers`, on ``platform/jobs/sharedjournal.py``: any gateway's job can be read,
listed, asked to cancel, and a job may be taken over). The store asks a :class:`JobPeers`
and never tests which kind it has, as a diffusers attention module calls its processor.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Protocol

from retouch.functions.wire.jobs import JobStatus
from retouch.platform.jobs.job import Job
from retouch.platform.jobs.sharedjournal import SharedJobJournal, StoredJob
from retouch.platform.state.statestore import StoreUnavailable

log = logging.getLogger(__name__)

RELEASE_PAUSE_S = 2.0  # between tries to give back a claimed job while the store fails

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


class JobPeers(Protocol):
    """The other gateways, as the job store asks them."""

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

    def run_not_recorded(self, job_id: str, exc: OSError) -> None:
        """A resumed or adopted job's new run could not be journaled: raises ``exc`` when
        the job must not be taken up here."""

    async def request_cancel(self, job_id: str) -> bool:
        """Ask the gateway that runs the job to cancel it; False when none will."""

    async def release(self, job_id: str) -> None:
        """Give back a job claimed from a dead gateway that could not be taken up."""

    async def purge(self, cutoff: float) -> int:
        """Remove the jobs no gateway keeps that ended before ``cutoff``; how many."""

    async def close(self) -> None:
        """Stop what is in flight (the gateway is stopping)."""


class NoPeers:
    """This gateway alone: every job is its own, and its memory is the whole listing (by
    owner, so a tenant's page reads only that tenant's jobs)."""

    def __init__(self) -> None:
        self._owned: dict[str, dict[str, Job]] = {}

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

    def run_not_recorded(self, job_id: str, exc: OSError) -> None:
        """The job runs anyway: only a second crash could repeat its event ids."""
        log.error("could not record the new run of job %s", job_id, exc_info=exc)

    async def request_cancel(self, job_id: str) -> bool:
        return False

    async def release(self, job_id: str) -> None:
        """Never reached: one gateway claims no other gateway's jobs."""

    async def purge(self, cutoff: float) -> int:
        return 0  # no other gateway's records to expire

    async def close(self) -> None:
        """Nothing in flight: one gateway writes no peer state."""


class SharedPeers:
    """The gateways of one shared store (``SharedJobJournal``): it holds every gateway's
    jobs, so this gateway indexes none of its own."""

    def __init__(self, journal: SharedJobJournal) -> None:
        self.journal = journal
        self._writes: set[asyncio.Task] = set()  # store writes in flight

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

    def run_not_recorded(self, job_id: str, exc: OSError) -> None:
        """Taken over meanwhile, or the store is down: not this gateway's to run."""
        raise exc

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
