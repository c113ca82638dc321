"""What the gateway keeps of jobs, and how much: caps on live jobs and retained bytes.

A durable job holds its request payload (mask, uploaded image) while it is queued or
running; once it ends it keeps its result and a small record (its request without the
payload: :func:`slim_request`), for the retention time. So what a tenant can make the
gateway hold is bounded by four caps, checked when a job is submitted:

* live jobs (queued or running), all tenants and per tenant;
* retained bytes (the payloads of live jobs plus the results of finished ones, in memory
  or in the journal, and a fixed overhead per job), all tenants and per tenant.

Beyond a cap the answer is ``429`` with ``Retry-After``: for live jobs a short wait (jobs
end in seconds), for bytes the time until enough finished results expire. A refusal by a
gateway-wide cap states no figure (they are every tenant's together). Usage is counted as
jobs are taken, end and are removed, so admission reads counters, not every job.
Synchronous invocations are not kept, so they are bounded by the gateway queue instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from retouch.functions.errors import Overloaded
from retouch.functions.wire.jobs import JobRequest

if TYPE_CHECKING:
    from retouch.platform.jobs.job import Job

LIVE_RETRY_AFTER_S = 2  # a live job usually ends within seconds
# What keeping one job costs beside its payload or result: its ``Job`` object, small record,
# terminal event, task, event and index entries (tracemalloc: 5.4 KB per finished job of a
# few bytes, Python 3.11). Charged so that many tiny jobs fill the byte caps as their
# memory does.
JOB_OVERHEAD_BYTES = 6 << 10


@dataclass(frozen=True)
class RetentionLimits:
    """The caps (``retouch serve --max-live-jobs`` ...); each must be positive."""

    max_live_jobs: int = 512
    max_live_jobs_per_tenant: int = 64
    max_retained_bytes: int = 2 << 30
    max_retained_bytes_per_tenant: int = 512 << 20

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"{f.name} must be positive, got {getattr(self, f.name)}")


def payload_bytes(request: JobRequest) -> int:
    """What a request's payload holds (mask, uploaded image, prompt)."""
    invoke = request.invoke
    return len(invoke.mask) + len(invoke.image or b"") + len(invoke.prompt.encode())


def retained_bytes(request: JobRequest, result: bytes = b"") -> int:
    """What a durable job is charged: its payload while live (its result's image once
    finished, beside its small record) plus the fixed cost of keeping a job at all."""
    return JOB_OVERHEAD_BYTES + payload_bytes(request) + len(result)


def slim_request(request: JobRequest, template: str) -> JobRequest:
    """``request`` without its payload (mask and uploaded image): what a finished job
    keeps. ``template``: what it edited (an upload's content id when it uploaded one)."""
    invoke = request.invoke.model_copy(update={"template": template, "mask": b"", "image": None})
    return request.model_copy(update={"invoke": invoke})


def shed_payload(job: Job) -> None:
    """A finished job keeps its result and a small record, not its request's payload
    (mask, uploaded image) nor the arrays decoded from it."""
    template = job.request.invoke.template or ""
    if job.prepared is not None and job.request.invoke.image is not None:
        template = job.prepared.invocation.template  # an upload's content id
    job.request, job.prepared = slim_request(job.request, template), None
    image = job.result.image if job.result is not None else b""
    job.retained_bytes = retained_bytes(job.request, image)


def shed_image(job: Job) -> None:
    """Finished results are kept for a day: their images stay in their records (read
    back when asked for), not in memory."""
    if job.result is not None and job.result.image:
        job.result = job.result.model_copy(update={"image": b""})
        job.image_on_disk = True


@dataclass
class Usage:
    """Live jobs and retained bytes, of one tenant or of all: counters kept as jobs are
    taken, end and are removed, so an admission reads them without scanning any job."""

    live: int = 0
    retained: int = 0
    finished: int = 0  # the part of ``retained`` that finished jobs hold (expiry frees it)


class Retention:
    """What durable jobs hold, by tenant and in all, and admission against the caps."""

    def __init__(self, limits: RetentionLimits, retention_s: float) -> None:
        self.limits = limits
        self.retention_s = retention_s  # how long a finished job is kept
        self._usage: dict[str | None, Usage] = {None: Usage()}  # None: all tenants
        # Finished jobs in the order they ended (the order they expire in), by tenant.
        self._finished: dict[str | None, dict[str, Job]] = {None: {}}

    def usage(self, tenant: str | None = None) -> Usage:
        return dataclasses.replace(self._usage.get(tenant, Usage()))

    def take(self, job: Job) -> None:
        """Count a durable job kept: live (its payload) or finished (its result)."""
        for scope in (None, job.owner):
            usage = self._usage.setdefault(scope, Usage())
            usage.retained += job.retained_bytes
            if job.status.terminal:
                usage.finished += job.retained_bytes
                self._finished.setdefault(scope, {})[job.id] = job
            else:
                usage.live += 1

    def release(self, job: Job) -> None:
        """Stop counting a job taken: removed, or its journal write failed."""
        for scope in (None, job.owner):
            usage = self._usage[scope]
            usage.retained -= job.retained_bytes
            if self._finished.get(scope, {}).pop(job.id, None) is not None:
                usage.finished -= job.retained_bytes
            else:
                usage.live -= 1
        if self._usage[job.owner] == Usage():
            del self._usage[job.owner]
            self._finished.pop(job.owner, None)

    def ended(self, job: Job, held: int) -> None:
        """A live job taken with ``held`` bytes ended; it now holds ``job.retained_bytes``."""
        for scope in (None, job.owner):
            usage = self._usage[scope]
            usage.live -= 1
            usage.retained += job.retained_bytes - held
            usage.finished += job.retained_bytes
            self._finished.setdefault(scope, {})[job.id] = job

    def expired(self, cutoff: float) -> list[Job]:
        """Finished jobs that ended before ``cutoff``, oldest first (those at the front of
        the order they ended in: no scan of the rest)."""
        out = []
        for job in self._finished[None].values():
            if job.completed_at is None:  # a record without its end time: never expires
                continue
            if job.completed_at >= cutoff:
                break
            out.append(job)
        return out

    def admit(self, tenant: str, nbytes: int, now: float) -> None:
        """Refuse (429) a job of ``nbytes`` payload that would pass a cap."""
        refuse_beyond_caps(
            self.limits,
            tenant,
            nbytes,
            self.usage,
            lambda who, usage, needed: self._until_freed(who, usage, needed, now),
        )

    def _until_freed(self, tenant: str | None, usage: Usage, needed: int, now: float) -> float:
        """Seconds until finished results of ``tenant`` (None: anyone's) worth ``needed``
        bytes expire; a short wait when finished results cannot free that much (live
        payloads)."""
        if usage.finished < needed:
            return LIVE_RETRY_AFTER_S
        freed = 0
        for job in self._finished.get(tenant, {}).values():
            freed += job.retained_bytes
            if freed >= needed:
                return max(1.0, (job.completed_at or now) + self.retention_s - now)
        return LIVE_RETRY_AFTER_S


def refuse_beyond_caps(
    limits: RetentionLimits,
    tenant: str,
    nbytes: int,
    usage_of: Callable[[str | None], Usage],
    until_freed: Callable[[str | None, Usage, int], float],
) -> None:
    """Refuse (429) a job of ``nbytes`` payload that would pass a cap, given the usage of
    all tenants (``usage_of(None)``) and of ``tenant``; ``until_freed`` says how long
    until enough finished results expire. One check for one gateway's counters and for
    the shared store's (``platform/jobs/sharedjournal.py``). A refusal by the gateway-wide caps
    states no figure: those are every tenant's together."""
    nbytes += JOB_OVERHEAD_BYTES
    scopes = (
        (None, limits.max_live_jobs, limits.max_retained_bytes),
        (tenant, limits.max_live_jobs_per_tenant, limits.max_retained_bytes_per_tenant),
    )
    for who, max_live, max_bytes in scopes:
        usage = usage_of(who)
        if usage.live >= max_live:
            raise Overloaded(
                "the gateway has as many queued or running jobs as it may hold"
                if who is None
                else f"tenant {who!r} has {usage.live} queued or running jobs, the most "
                "it may have",
                code="too_many_jobs",
                retry_after_s=LIVE_RETRY_AFTER_S,
            )
        if usage.retained + nbytes > max_bytes:
            wait = until_freed(who, usage, usage.retained + nbytes - max_bytes)
            raise Overloaded(
                f"the gateway retains as many jobs and results as it may; this job's "
                f"{nbytes} bytes do not fit"
                if who is None
                else f"tenant {who!r} retains {usage.retained} bytes of jobs and results; "
                f"this job's {nbytes} would pass the {max_bytes} it may retain",
                code="retention_full",
                retry_after_s=math.ceil(wait),
            )
