"""Following a job another gateway runs (``platform/jobs/mirrors.py``): a long poll on a job
this gateway takes over while the poll reads the shared store answers with this gateway's
own run, not with the record it read meanwhile."""

from __future__ import annotations

import asyncio

from retouch.functions.wire.jobs import JobStatus
from retouch.platform.jobs.job import Job, Runner
from retouch.platform.jobs.mirrors import Mirrors
from tests.platform.jobs.test_jobs import request

JOB_ID = "c" * 32


class TakenOverDuringRead(Mirrors):
    """A store read during which this gateway adopts the job and its run ends: the record
    read is the end another gateway's copy shows."""

    def __init__(self, kept: dict[str, Job], own: Job) -> None:
        no_source, no_follow = None, None  # never reached: read is this class's own
        super().__init__(no_source, kept, lambda job: None, no_follow)  # type: ignore[arg-type]
        self.own = own

    async def read(self, job_id: str) -> Job | None:
        self.kept[job_id] = self.own  # the takeover lands while the read is in flight
        ended = Job(job_id, "f", request(), 1.0, status=JobStatus.SUCCEEDED, completed_at=2.0)
        ended.runner = Runner.ELSEWHERE
        return ended


def test_a_poll_during_a_takeover_answers_with_this_gateways_run() -> None:
    own = Job(JOB_ID, "f", request(), 1.0, status=JobStatus.SUCCEEDED, completed_at=2.0)
    mirrors = TakenOverDuringRead({}, own)
    mirror = Job(JOB_ID, "f", request(), 1.0, status=JobStatus.RUNNING)
    mirror.runner = Runner.ELSEWHERE
    polled = asyncio.run(mirrors.poll(mirror, 0.01))
    assert polled is own and polled.runner is Runner.HERE
