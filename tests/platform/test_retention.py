"""Bounded retention in the job store (no processes): a finished job keeps its result and a
small record, not its payload; live jobs and retained bytes are capped per tenant and in
all, with 429 ``Retry-After``; the journal compacts old records and drops expired ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from retouch.functions import wire
from retouch.functions.errors import Overloaded
from retouch.platform.jobs import Job
from retouch.platform.journal import JobJournal
from retouch.platform.retention import RetentionLimits
from tests.platform.test_jobs import FakeRun, prepared, result, store, sync

MASK = b"m" * (1 << 20)  # a 1 MiB payload


def big_request(seed: int = 1) -> wire.JobRequest:
    return wire.JobRequest.from_wire({"template": "t", "mask": MASK, "prompt": "p", "seed": seed})


class BigResults(FakeRun):
    """Runs as :class:`FakeRun` and answers a 1 MiB image."""

    async def execute(self, job: Job, on_start, on_progress) -> wire.InvokeResult:
        await super().execute(job, on_start, on_progress)
        return wire.InvokeResult(MASK, "raw", 2, 2, 1.0, "exec-0", wire.InvokePath.STOCK)


def limits(**caps: int) -> RetentionLimits:
    return RetentionLimits(**{"max_live_jobs": 100, "max_retained_bytes": 1 << 30, **caps})


@sync
async def test_a_finished_job_keeps_its_result_and_a_small_record(tmp_path: Path) -> None:
    jobs = store(FakeRun(), JobJournal(tmp_path))
    await jobs.start()
    job = await jobs.submit("f", big_request(), prepared())
    assert job.retained_bytes > len(MASK)
    await jobs.wait(job, 5)
    assert job.request.invoke.mask == b"" and job.prepared is None
    assert job.request.invoke.template == "t" and job.request.invoke.seed == 1
    assert job.retained_bytes < 100
    assert (tmp_path / f"{job.id}.job").stat().st_size < 2000  # the 1 MiB mask is gone
    assert (await jobs.document(job))["result"]["image"] == b"img"
    await jobs.close()


@sync
async def test_live_jobs_are_capped_per_tenant_with_retry_after() -> None:
    run = FakeRun(hold=True)
    jobs = store(run, limits=limits(max_live_jobs_per_tenant=2))
    await jobs.start()
    held = [await jobs.submit("f", big_request(i), prepared(), owner="a") for i in range(2)]
    with pytest.raises(Overloaded) as refused:
        await jobs.submit("f", big_request(3), prepared(), owner="a")
    assert refused.value.code == "too_many_jobs" and refused.value.retry_after_s >= 1
    other = await jobs.submit("f", big_request(4), prepared(), owner="b")  # not a's cap
    await jobs.submit("f", big_request(5), prepared(), durable=False, owner="a")  # sync
    for job in held:
        run.canceled.add(job.id)
        await jobs.wait(job, 5)
    await jobs.submit("f", big_request(6), prepared(), owner="a")  # room again
    assert other.owner == "b"
    await jobs.close()


@sync
async def test_retained_bytes_are_capped_until_results_expire() -> None:
    now = [1000.0]
    run = BigResults()
    cap = 3 * len(MASK)
    jobs = store(run, retention_s=600, clock=lambda: now[0], limits=limits(max_retained_bytes=cap))
    await jobs.start()
    for i in range(2):
        await jobs.wait(await jobs.submit("f", big_request(i), prepared()), 5)
        now[0] += 100
    with pytest.raises(Overloaded) as refused:  # two 1 MiB results + this 1 MiB payload
        await jobs.submit("f", big_request(9), prepared())
    assert refused.value.code == "retention_full"
    assert refused.value.retry_after_s == 400  # the first result expires at 1000 + 600
    now[0] += 401
    assert await jobs.purge() == 1
    await jobs.wait(await jobs.submit("f", big_request(9), prepared()), 5)
    await jobs.close()


@sync
async def test_the_journal_compacts_old_records_and_drops_expired_ones(tmp_path: Path) -> None:
    journal = JobJournal(tmp_path)
    now = 10_000.0
    old = Job("a" * 32, "f", big_request(), now - 60, status=wire.JobStatus.SUCCEEDED)
    old.completed_at, old.result = now - 50, result()
    expired = Job("b" * 32, "f", big_request(), now - 900, status=wire.JobStatus.SUCCEEDED)
    expired.completed_at, expired.result = now - 800, result()
    for job in (old, expired):
        journal.write(job.to_record())  # as written before payloads were dropped
    assert (tmp_path / f"{old.id}.job").stat().st_size > len(MASK)
    jobs = store(FakeRun(), JobJournal(tmp_path), retention_s=600, clock=lambda: now)
    await jobs.start()
    assert (tmp_path / f"{old.id}.job").stat().st_size < 2000
    assert not (tmp_path / f"{expired.id}.job").exists() and expired.id not in jobs.jobs
    assert (await jobs.document(jobs.jobs[old.id]))["result"]["image"] == b"img"
    await jobs.close()
