"""How a reader follows a job: waiting for its end, cancelling it, streaming its events.

A job is followed by whoever runs it (:class:`~retouch.platform.jobs.job.Runner`): a job
this gateway runs through its own run (:class:`RunHere`: its events as they happen, its
cancel passed to the pool), one another gateway runs through the shared store
(:class:`~retouch.platform.jobs.mirrors.Mirrors`). The job store asks ``follow(job)`` which
one and never looks further; each hands a job that changes hands meanwhile (this gateway
was thought dead, or took over a dead one's job) to ``follow`` again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from retouch.functions.errors import Conflict
from retouch.functions.wire.jobs import JobEvent, JobStatus
from retouch.platform.jobs.job import Job, Runner


class Following(Protocol):
    """What a reader of one job may ask, wherever it runs."""

    async def cancel(self, job: Job, wait_s: float) -> Job: ...

    async def wait(self, job: Job, timeout_s: float) -> Job: ...

    def events(self, job: Job, after: int) -> AsyncIterator[JobEvent | None]: ...


Follow = Callable[[Job], Following]  # who follows a job now (the job store's choice)


def already_ended(job: Job) -> Conflict:
    """The 409 of a cancel of a job that ended otherwise."""
    return Conflict(
        f"job {job.id} already {job.status.value}; only a queued or running job can be canceled",
        field="id",
        code="job_finished",
    )


class RunHere:
    """The jobs this gateway runs: events as its run records them, cancels to the pool."""

    def __init__(self, cancel_run: Callable[[str], Awaitable[bool]], follow: Follow) -> None:
        self._cancel_run = cancel_run  # the pool's cancel of a queued or running invocation
        self._follow = follow

    async def cancel(self, job: Job, wait_s: float) -> Job:
        """Idempotent on a canceled job, a 409 ``job_finished`` on one that ended otherwise;
        waits (bounded) until the job has left its executor."""
        if job.status is JobStatus.CANCELED:
            return job
        if job.status.terminal:
            raise already_ended(job)
        job.cancel_requested = True
        await self._cancel_run(job.id)
        job = await self.wait(job, wait_s)
        if job.status.terminal and job.status is not JobStatus.CANCELED:
            raise Conflict(
                f"job {job.id} {job.status.value} before the cancel reached it",
                field="id",
                code="job_finished",
            )
        return job

    async def wait(self, job: Job, timeout_s: float) -> Job:
        """Until its end event is out or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while not job.ended:
            if job.runner is not Runner.HERE:  # handed over meanwhile
                return await self._follow(job).wait(job, deadline - time.monotonic())
            left = deadline - time.monotonic()
            if left <= 0:
                break
            job._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(job._changed.wait(), left)
        return job

    async def events(self, job: Job, after: int) -> AsyncIterator[JobEvent | None]:
        """Its events with ``seq > after`` as they happen, ``None`` each idle second."""
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
                if job.runner is not Runner.HERE:  # handed over: followed through the store
                    async for event in self._follow(job).events(job, sent):
                        yield event
                    return
                job._changed.clear()
                try:
                    await asyncio.wait_for(job._changed.wait(), 1.0)
                except TimeoutError:
                    yield None
        finally:
            job._readers -= 1
            job.trim()
