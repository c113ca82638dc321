"""Bounded retention in the job store (no processes): a finished job keeps its result and a
small record, not its payload; live jobs and retained bytes (each job charged a fixed
overhead) are capped per tenant and in all, with 429 ``Retry-After``, counted from the
admission on (before the journal write); the journal compacts old records, keeping their
event ids, and drops expired ones, and purging outlives errors."""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from retouch.functions.errors import Overloaded
from retouch.functions.wire.invoke import InvokeResult
from retouch.functions.wire.jobs import JobRequest, JobStatus
from retouch.platform.jobs.job import Job
from retouch.platform.jobs.journal import JobJournal
from retouch.platform.jobs.retention import JOB_OVERHEAD_BYTES, RetentionLimits, Usage
from retouch.platform.jobs.store import JobStore
from tests.platform.jobs.test_jobs import FakeRun, prepared, request, result, store, sync

MASK = b"m" * (1 << 20)  # a 1 MiB payload


def big_request(seed: int = 1) -> JobRequest:
    return JobRequest.from_wire({"template": "t", "mask": MASK, "prompt": "p", "seed": seed})


class BigResults(FakeRun):
    """Runs as :class:`FakeRun` and answers a 1 MiB image."""

    async def execute(self, job: Job, on_start, on_progress) -> InvokeResult:
        await super().execute(job, on_start, on_progress)
        return result().model_copy(update={"image": MASK})


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
    assert job.retained_bytes < JOB_OVERHEAD_BYTES + 100
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
    old = Job("a" * 32, "f", big_request(), now - 60, status=JobStatus.SUCCEEDED)
    old.completed_at, old.result = now - 50, result()
    expired = Job("b" * 32, "f", big_request(), now - 900, status=JobStatus.SUCCEEDED)
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


def scanned(jobs: JobStore, tenant: str | None = None) -> Usage:
    """What the caps' counters must say, counted the slow way."""
    kept = [j for j in jobs.jobs.values() if j.durable and tenant in (None, j.owner)]
    finished = [j.retained_bytes for j in kept if j.status.terminal]
    return Usage(
        sum(not j.status.terminal for j in kept), sum(j.retained_bytes for j in kept), sum(finished)
    )


@sync
async def test_the_usage_counters_agree_with_the_jobs_kept() -> None:
    now = [1000.0]
    run = FakeRun(hold=True)
    jobs = store(run, retention_s=600, clock=lambda: now[0], limits=limits())
    await jobs.start()
    held = [await jobs.submit("f", big_request(i), prepared(), owner="ab"[i % 2]) for i in range(4)]
    await jobs.submit("f", big_request(9), prepared(), durable=False, owner="a")  # not counted
    for job in held[:3]:
        run.canceled.add(job.id)
        await jobs.wait(job, 5)
        now[0] += 100
    for tenant in (None, "a", "b"):
        assert jobs.retention.usage(tenant) == scanned(jobs, tenant)
    assert jobs.retention.usage("a").live == 0 and jobs.retention.usage("b").live == 1
    now[0] += 450  # the first two finished jobs expire
    assert await jobs.purge() == 2
    for tenant in (None, "a", "b"):
        assert jobs.retention.usage(tenant) == scanned(jobs, tenant)
    run.canceled.add(held[3].id)
    await jobs.close()


@sync
async def test_tiny_jobs_fill_the_byte_cap_by_their_overhead() -> None:
    """A job with next to no payload and result still costs memory: each is charged
    ``JOB_OVERHEAD_BYTES``, so a tenant cannot keep an unbounded number of them."""
    jobs = store(FakeRun(), limits=limits(max_retained_bytes_per_tenant=10 * JOB_OVERHEAD_BYTES))
    await jobs.start()
    kept = 0
    with pytest.raises(Overloaded) as refused:
        for i in range(20):
            await jobs.wait(await jobs.submit("f", request(i), prepared(), owner="a"), 5)
            kept += 1
    assert refused.value.code == "retention_full" and 5 <= kept < 10
    await jobs.submit("f", request(99), prepared(), owner="b")  # another tenant has room
    await jobs.close()


class SlowJournal(JobJournal):
    """A journal whose writes take until released (an fsync under load), or fail."""

    def __init__(self, root: Path, fail: bool = False) -> None:
        super().__init__(root)
        self.go, self.fail = threading.Event(), fail

    def write(self, record: dict[str, Any]) -> None:
        assert self.go.wait(10)
        if self.fail:
            raise OSError("disk full")
        super().write(record)


@sync
async def test_concurrent_submits_cannot_pass_a_cap_during_the_journal_write(
    tmp_path: Path,
) -> None:
    journal = SlowJournal(tmp_path)
    jobs = store(FakeRun(hold=True), journal, limits=limits(max_live_jobs_per_tenant=2))
    await jobs.start()
    submits = [
        asyncio.create_task(jobs.submit("f", request(i), prepared(), owner="a")) for i in range(6)
    ]
    await asyncio.sleep(0.05)  # all six are admitted or refused while the writes wait
    journal.go.set()
    outcomes = await asyncio.gather(*submits, return_exceptions=True)
    accepted = [o for o in outcomes if isinstance(o, Job)]
    refused = [o for o in outcomes if isinstance(o, Overloaded)]
    assert len(accepted) == 2 and len(refused) == 4
    assert {o.code for o in refused} == {"too_many_jobs"}
    await jobs.close()


@sync
async def test_a_failed_journal_write_gives_its_reservation_back(tmp_path: Path) -> None:
    journal = SlowJournal(tmp_path, fail=True)
    journal.go.set()
    jobs = store(FakeRun(), journal, limits=limits(max_live_jobs_per_tenant=1))
    await jobs.start()
    for i in range(3):  # each refusal is the disk's, never the cap's
        with pytest.raises(OSError):
            await jobs.submit("f", request(i), prepared(), owner="a")
    assert jobs.retention.usage("a") == Usage() and not jobs.jobs
    await jobs.close()


@sync
async def test_a_gateway_wide_refusal_states_no_other_tenants_figures() -> None:
    run = FakeRun(hold=True)
    jobs = store(run, limits=limits(max_live_jobs=3, max_retained_bytes=3 * len(MASK)))
    await jobs.start()
    held = [await jobs.submit("f", big_request(i), prepared(), owner="b") for i in range(2)]
    with pytest.raises(Overloaded) as bytes_refused:  # b's 2 MiB + a's 1 MiB > 3 MiB
        await jobs.submit("f", big_request(3), prepared(), owner="a")
    figures = [str(jobs.retention.usage("b").retained)]
    await jobs.submit("f", request(4), prepared(), owner="b")
    with pytest.raises(Overloaded) as live_refused:  # b's 3 live jobs
        await jobs.submit("f", request(5), prepared(), owner="a")
    figures.append(str(jobs.retention.usage("b").live))
    for refusal, code in ((bytes_refused, "retention_full"), (live_refused, "too_many_jobs")):
        assert refusal.value.code == code and "'b'" not in refusal.value.message
        assert not set(figures) & set(re.findall(r"\d+", refusal.value.message))
    for job in held:
        run.canceled.add(job.id)
    await jobs.close()


class FailingDeletes(JobJournal):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.tried: list[str] = []

    def delete(self, job_id: str) -> None:
        self.tried.append(job_id)
        raise OSError("read-only file system")


@sync
async def test_purging_goes_on_past_errors(tmp_path: Path) -> None:
    """A record that cannot be deleted is logged, the others still go; an error neither
    stops the start nor the periodic purge."""
    now = [10_000.0]
    for i in range(2):  # expired while the gateway was down
        old = Job(f"{i}" * 32, "f", request(i), now[0] - 900, status=JobStatus.SUCCEEDED)
        old.completed_at, old.result = now[0] - 800, result()
        JobJournal(tmp_path).write(old.to_record())
    journal = FailingDeletes(tmp_path)
    jobs = store(FakeRun(), journal, retention_s=2, clock=lambda: now[0])
    await jobs.start()  # does not raise
    assert sorted(journal.tried) == ["0" * 32, "1" * 32] and not jobs.jobs
    failures = [RuntimeError("a bug")]
    purge = jobs.purge

    async def flaky() -> int:
        if failures:
            raise failures.pop()
        return await purge()

    jobs.purge = flaky  # type: ignore[method-assign]
    job = await jobs.submit("f", request(7), prepared())
    await jobs.wait(job, 5)
    now[0] += 10
    # the loop runs every 0.5 s: its first run fails, a later one purges (within 30 s even
    # on a loaded machine; it breaks as soon as that is seen)
    for _ in range(300):
        if job.id not in jobs.jobs:
            break
        await asyncio.sleep(0.1)
    assert not failures and job.id not in jobs.jobs and job.id in journal.tried
    await jobs.close()


@sync
async def test_a_compacted_record_keeps_its_terminal_event_id(tmp_path: Path) -> None:
    """A finished job's record written with its payload is rewritten small at the next
    start, storing its terminal event's own id: restart after restart, the id holds."""
    job = Job("c" * 32, "f", big_request(), 100.0, status=JobStatus.SUCCEEDED)
    job.completed_at, job.result, job._seq = 200.0, result(), 7
    JobJournal(tmp_path).write(job.to_record())
    for _ in range(3):
        jobs = store(FakeRun(), JobJournal(tmp_path), clock=lambda: 300.0)
        await jobs.start()
        assert [e.seq for e in jobs.jobs[job.id].events] == [7]
        assert JobJournal(tmp_path).read(job.id)["last_seq"] == 7
        await jobs.close()
    assert (tmp_path / f"{job.id}.job").stat().st_size < 2000
