"""What the gateway keeps of jobs, and how much: caps on live jobs and retained bytes.

A durable job holds its request payload (mask, uploaded image) while it is queued or
running; once it ends it keeps its result and a small record (its request without the
payload: :func:`slim_request`), for the retention time. So what a tenant can make the
gateway hold is bounded by four caps, checked when a job is submitted:

* live jobs (queued or running), all tenants and per tenant;
* retained bytes (the payloads of live jobs plus the results of finished ones, in memory
  or in the journal), all tenants and per tenant.

Beyond a cap the answer is ``429`` with ``Retry-After``: for live jobs a short wait (jobs
end in seconds), for bytes the time until enough finished results expire. Synchronous
invocations are not kept, so they are bounded by the gateway queue instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from retouch.functions import wire
from retouch.functions.errors import Overloaded

if TYPE_CHECKING:
    from retouch.platform.jobs import Job

LIVE_RETRY_AFTER_S = 2  # a live job usually ends within seconds


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


def payload_bytes(request: wire.JobRequest) -> int:
    """What a request's payload holds (mask, uploaded image, prompt)."""
    invoke = request.invoke
    return len(invoke.mask) + len(invoke.image or b"") + len(invoke.prompt.encode())


def slim_request(request: wire.JobRequest, template: str) -> wire.JobRequest:
    """``request`` without its payload (mask and uploaded image): what a finished job
    keeps. ``template``: what it edited (an upload's content id when it uploaded one)."""
    invoke = dataclasses.replace(request.invoke, template=template, mask=b"", image=None)
    return dataclasses.replace(request, invoke=invoke)


@dataclass(frozen=True)
class Usage:
    """Live jobs and retained bytes, of one tenant or of all."""

    live: int
    retained: int


class Retention:
    """Admission of a new durable job against the caps."""

    def __init__(self, limits: RetentionLimits) -> None:
        self.limits = limits

    @staticmethod
    def usage(jobs: Iterable[Job], tenant: str | None = None) -> Usage:
        kept = [j for j in jobs if j.durable and (tenant is None or j.owner == tenant)]
        live = sum(not j.status.terminal for j in kept)
        return Usage(live, sum(j.retained_bytes for j in kept))

    def admit(
        self, jobs: list[Job], tenant: str, nbytes: int, now: float, retention_s: float
    ) -> None:
        """Refuse (429) a job of ``nbytes`` payload that would pass a cap."""
        limits = self.limits
        scopes = (
            (None, limits.max_live_jobs, limits.max_retained_bytes, "the gateway"),
            (
                tenant,
                limits.max_live_jobs_per_tenant,
                limits.max_retained_bytes_per_tenant,
                f"tenant {tenant!r}",
            ),
        )
        for who, max_live, max_bytes, name in scopes:
            usage = self.usage(jobs, who)
            if usage.live >= max_live:
                raise Overloaded(
                    f"{name} has {usage.live} queued or running jobs, the most it may have",
                    code="too_many_jobs",
                    retry_after_s=LIVE_RETRY_AFTER_S,
                )
            if usage.retained + nbytes > max_bytes:
                needed = usage.retained + nbytes - max_bytes
                wait = _until_freed(jobs, who, needed, now, retention_s)
                raise Overloaded(
                    f"{name} retains {usage.retained} bytes of jobs and results; this job's "
                    f"{nbytes} would pass the {max_bytes} it may retain",
                    code="retention_full",
                    retry_after_s=math.ceil(wait),
                )


def _until_freed(
    jobs: list[Job], tenant: str | None, needed: int, now: float, retention_s: float
) -> float:
    """Seconds until finished results of ``tenant`` (None: anyone's) worth ``needed`` bytes
    expire; a short wait when finished results cannot free that much (live payloads)."""
    finished = sorted(
        (j.completed_at, j.retained_bytes)
        for j in jobs
        if j.durable
        and j.status.terminal
        and j.completed_at is not None
        and (tenant is None or j.owner == tenant)
    )
    freed = 0
    for completed_at, nbytes in finished:
        freed += nbytes
        if freed >= needed:
            return max(1.0, completed_at + retention_s - now)
    return LIVE_RETRY_AFTER_S
