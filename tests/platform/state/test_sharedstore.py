"""The shared state store on a real PostgreSQL: what several gateways rely on.

Two :class:`StateStore` connections are two gateways. A job's row is written only by the
gateway it names while the job is live (a late writer is refused: the job ends once); a
gateway silent past the TTL has its jobs and deliveries claimed by another; the caps hold
over every gateway's jobs; the registry numbers every change from one sequence and shows
deletes to followers; generated secrets are the same for all."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from retouch.functions.errors import Overloaded
from retouch.functions.spec import parse_spec
from retouch.functions.wire.jobs import JobEventKind, JobStatus
from retouch.platform.jobs import source as jobsource
from retouch.platform.jobs.job import Runner
from retouch.platform.jobs.retention import JOB_OVERHEAD_BYTES, RetentionLimits
from retouch.platform.jobs.sharedjournal import SharedDeliveryJournal, SharedJobJournal, TakenOver
from retouch.platform.jobs.source import SharedJobs
from retouch.platform.jobs.store import JobStore
from retouch.platform.state.auth import OPEN
from retouch.platform.state.sharedregistry import SharedRegistry
from retouch.platform.state.statestore import StateStore, StoreUnavailable, redact
from tests.platform.jobs.test_jobs import FakeRun, prepared, request, result, store, stream, sync
from tests.postgres import PostgresServer

TTL_S = 0.5
LIMITS = RetentionLimits(max_live_jobs=10, max_live_jobs_per_tenant=2)


@pytest.fixture
def stores(postgres: PostgresServer) -> Iterator[tuple[StateStore, StateStore]]:
    url = postgres.database()
    a, b = StateStore(url, TTL_S).open(), StateStore(url, TTL_S).open()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def record(job_id: str, tenant: str = "alice", status: str = "queued") -> dict:
    return {
        "id": job_id,
        "function": "fn",
        "owner": tenant,
        "request": request().to_wire(),
        "status": status,
        "created_at": time.time(),
        "run": 0,
    }


def job_id(n: int) -> str:
    return f"{n:032x}"


def test_a_dead_gateways_job_is_taken_and_ends_once(stores) -> None:
    b = stores[1]
    ja, jb = (SharedJobJournal(s, LIMITS, 3600.0) for s in stores)
    ja.accept(record(job_id(1)), 100)
    with pytest.raises(TakenOver):  # the other gateway does not run it: it cannot write it
        jb.write(record(job_id(1), status="succeeded"))
    assert jb.claim() == []  # its gateway is alive
    time.sleep(TTL_S * 2)  # a stops stamping: dead to b
    b.heartbeat()
    [claimed] = jb.claim()
    assert claimed["id"] == job_id(1) and not claimed["cancel_requested"]
    with pytest.raises(TakenOver):  # the gateway thought dead comes back: refused
        ja.write(record(job_id(1), status="succeeded"))
    jb.write(record(job_id(1), status="succeeded"))
    with pytest.raises(TakenOver):  # ended: no second end, not even by its runner
        jb.write(record(job_id(1), status="failed"))
    assert ja.read(job_id(1))["status"] == "succeeded"  # readable from any gateway
    with pytest.raises(FileNotFoundError):
        ja.read(job_id(2))


def test_caps_hold_over_every_gateways_jobs(stores) -> None:
    ja, jb = (SharedJobJournal(s, LIMITS, 3600.0) for s in stores)
    ja.accept(record(job_id(1)), JOB_OVERHEAD_BYTES)
    jb.accept(record(job_id(2)), JOB_OVERHEAD_BYTES)
    with pytest.raises(Overloaded) as refused:  # alice's third live job, on either gateway
        ja.accept(record(job_id(3)), JOB_OVERHEAD_BYTES)
    assert refused.value.code == "too_many_jobs" and refused.value.status == 429
    jb.accept(record(job_id(4), tenant="bob"), JOB_OVERHEAD_BYTES)  # another tenant's room
    jb.write(record(job_id(2), status="succeeded"))
    ja.accept(record(job_id(3)), JOB_OVERHEAD_BYTES)  # one of alice's ended: room again
    listed = [r.record["id"] for r in jb.listing("alice", None, None, 10, None)]
    assert listed == [job_id(3), job_id(2), job_id(1)]  # newest first, every gateway's
    done = ja.listing("alice", "succeeded", None, 10, None)
    assert [r.record["id"] for r in done] == [job_id(2)]


def test_listings_read_small_records_and_the_running_status(stores) -> None:
    ja, jb = (SharedJobJournal(s, LIMITS, 3600.0) for s in stores)
    big = record(job_id(1))
    ja.accept(big, 100)
    ja.mark_running(job_id(1))
    jb.mark_running(job_id(1))  # not b's job: no effect (fenced), no error
    [row] = jb.listing("alice", "running", None, 10, None)
    assert row.status == "running" and row.record["request"]["mask"] == b""  # no payload
    assert jb.fetch(job_id(1)).record["request"]["mask"] == b"png"  # the record has it
    assert jb.listing("alice", "queued", None, 10, None) == []
    jb.delete(job_id(1))  # a live job's row is not removed (its gateway runs it)
    assert jb.fetch(job_id(1)) is not None
    ended = {**big, "status": "succeeded", "result": result().to_wire()}
    ja.write(ended)
    [row] = jb.listing("alice", None, None, 10, None)
    assert row.record["result"]["image"] == b"" and jb.fetch(job_id(1)).record["result"]["image"]
    jb.delete(job_id(1))
    assert jb.fetch(job_id(1)) is None


def test_a_gateway_sees_its_jobs_taken_and_gives_back_what_it_cannot_run(stores) -> None:
    a, b = stores
    ja, jb = (SharedJobJournal(s, LIMITS, 3600.0) for s in stores)
    ja.accept(record(job_id(1)), 100)
    ja.accept(record(job_id(2)), 100)
    assert ja.taken([job_id(1), job_id(2)]) == [] and ja.owns(job_id(1))
    time.sleep(TTL_S * 2)
    b.heartbeat()
    assert sorted(r["id"] for r in jb.claim()) == [job_id(1), job_id(2)]
    assert ja.taken([job_id(1), job_id(2)]) == [job_id(1), job_id(2)]  # a must stop them
    assert not ja.owns(job_id(1)) and jb.owns(job_id(1))
    jb.release(job_id(2))  # b could not take it up: any living gateway claims it next
    a.heartbeat()
    assert [r["id"] for r in ja.claim()] == [job_id(2)]


def test_a_cancel_reaches_the_gateway_that_runs_the_job(stores) -> None:
    ja, jb = (SharedJobJournal(s, LIMITS, 3600.0) for s in stores)
    ja.accept(record(job_id(1)), 100)
    assert ja.cancels() == []
    assert jb.request_cancel(job_id(1))
    assert ja.cancels() == [job_id(1)] and jb.cancels() == []
    ja.write(record(job_id(1), status="canceled"))
    assert not jb.request_cancel(job_id(1))  # ended: nothing to cancel
    assert ja.cancels() == []


def test_pending_deliveries_of_a_dead_gateway_are_taken(stores) -> None:
    a, b = stores
    da, db = SharedDeliveryJournal(a), SharedDeliveryJournal(b)
    da.write({"id": f"{job_id(1)}-completed", "created_at": 2.0})
    da.write({"id": f"{job_id(2)}-completed", "created_at": 1.0})
    assert [r["id"] for r in da.load()] == [f"{job_id(2)}-completed", f"{job_id(1)}-completed"]
    assert db.load() == [] and db.claim() == []
    time.sleep(TTL_S * 2)
    b.heartbeat()
    assert [r["id"] for r in db.claim()] == [f"{job_id(2)}-completed", f"{job_id(1)}-completed"]
    assert da.load() == [] and len(db.load()) == 2
    db.delete(f"{job_id(1)}-completed")
    assert [r["id"] for r in db.load()] == [f"{job_id(2)}-completed"]


def test_the_registry_numbers_changes_once_for_every_gateway(stores) -> None:
    ra, rb = (SharedRegistry(s) for s in stores)
    spec = parse_spec(
        {
            "name": "fn",
            "model": "m",
            "family": "sd-inpaint",
            "resolution": 64,
            "templates": {"t": {"prompt": "x", "seed": 2}},
        }
    )
    first = ra.put(spec, {"t": b"png-1"})
    second = rb.put(spec, {"t": b"png-2"})  # a redeploy through the other gateway
    assert second > first
    loaded = ra.load_all()["fn"]
    assert loaded.templates == {"t": b"png-2"} and loaded.revision == second
    changes = rb.changes(first)
    assert [s.revision for s in changes.stored] == [second] and changes.revision == second
    gone = ra.delete("fn")
    assert gone is not None and gone > second and ra.delete("fn") is None
    after = rb.changes(second)
    assert after.stored == [] and after.deleted == [("fn", gone)]
    assert ra.load_all() == {}


def test_generated_secrets_are_shared_and_urls_are_redacted(stores) -> None:
    a, b = stores
    assert a.secret("link-key") == b.secret("link-key") != a.secret("upload-key")
    assert sorted(a.alive_gateways()) == sorted([a.gateway, b.gateway])
    assert redact("postgresql://user:hunter2@db:5432/x") == "postgresql://user:***@db:5432/x"
    assert redact("postgresql://db/x") == "postgresql://db/x"


def test_an_unreachable_store_is_one_clear_error() -> None:
    with pytest.raises(ConnectionError) as err:
        StateStore("postgresql://nobody:secret@127.0.0.1:1/x").open(timeout_s=1.0)
    assert "secret" not in str(err.value) and "127.0.0.1:1" in str(err.value)


@sync
async def test_a_job_taken_over_mid_run_ends_once_and_its_readers_follow_it(stores) -> None:
    """Gateway a is thought dead while it runs a job: b claims it; a's run then finds the
    job is not its own any more and records nothing, and a's readers (an event stream, a
    long poll) get b's end."""
    a, b = stores
    run = FakeRun(gated=True)
    ja = SharedJobJournal(a, LIMITS, 3600.0)
    jobs = store(run, source=SharedJobs(ja))
    await jobs.start()
    job = await jobs.submit("f", request(), prepared(), owner="alice")
    reader = asyncio.create_task(stream(jobs, job))
    poll = asyncio.create_task(jobs.settle(job, 60.0))  # GET /v1/jobs/{id}, Prefer: wait=60
    await asyncio.sleep(TTL_S * 2)  # a's stamp goes stale (no failover loop here)
    await asyncio.to_thread(b.heartbeat)
    jb = SharedJobJournal(b, LIMITS, 3600.0)
    [claimed] = await asyncio.to_thread(jb.claim)
    run.release.set()  # a's run ends now: its end is not a's to record
    await asyncio.sleep(0.3)
    assert (
        job.id not in jobs.jobs and job.runner is Runner.ELSEWHERE
    )  # handed over, nothing recorded by a
    assert (await asyncio.to_thread(jb.fetch, job.id)).record["status"] == "queued"
    ended = {**claimed, "status": "succeeded", "result": result().to_wire(), "last_seq": 7}
    await asyncio.to_thread(jb.write, ended)  # b's run ends
    events = await asyncio.wait_for(reader, 10)
    assert events[-1].kind is JobEventKind.SUCCEEDED and events[-1].seq == 7
    assert [e.kind for e in events].count(JobEventKind.SUCCEEDED) == 1
    polled = await asyncio.wait_for(poll, 10)  # at b's end, not when its 60 s are over
    assert polled.status is JobStatus.SUCCEEDED and polled.result is not None
    await jobs.close()


@sync
async def test_a_long_poll_on_another_gateway_answers_at_the_jobs_end(stores) -> None:
    """A job a runs, read and waited on through b (a load balancer sends the poll to
    either gateway): b's answer comes when the job ends, with the end, not when the wait
    is over; and one b takes over while it waits is waited on as b runs it."""
    a, b = stores
    run = FakeRun(gated=True)
    ja, jb = SharedJobJournal(a, LIMITS, 3600.0), SharedJobJournal(b, LIMITS, 3600.0)
    on_a = store(run, source=SharedJobs(ja))
    on_b = store(FakeRun(), source=SharedJobs(jb))
    await on_a.start()
    await on_b.start()
    job = await on_a.submit("f", request(), prepared(), owner="alice")
    mirror = await on_b.get(job.id, OPEN)
    assert mirror.runner is Runner.ELSEWHERE and not mirror.status.terminal
    poll = asyncio.create_task(on_b.settle(mirror, 60.0))
    await asyncio.sleep(0.3)
    assert not poll.done()  # still running on a
    run.release.set()
    polled = await asyncio.wait_for(poll, 10)
    assert polled.status is JobStatus.SUCCEEDED and polled.result is not None

    run.release.clear()  # before the submit: a's run of it may start at once
    taken = await on_a.submit("f", request(), prepared(), owner="alice")  # a runs no more
    poll = asyncio.create_task(on_b.settle(await on_b.get(taken.id, OPEN), 60.0))
    await asyncio.sleep(TTL_S * 2)  # a's stamp goes stale: b claims and runs the job
    await asyncio.to_thread(b.heartbeat)
    assert await on_b.adopt(await asyncio.to_thread(jb.claim)) == 1
    polled = await asyncio.wait_for(poll, 10)
    assert polled.status is JobStatus.SUCCEEDED and polled.runner is Runner.HERE  # b's own run
    await on_a.close()
    await on_b.close()


async def claimed_by_b(stores) -> tuple[SharedJobJournal, SharedJobJournal, JobStore, list]:
    """A job a accepted, claimed by b (a's stamp gone stale), and b's job store."""
    a, b = stores
    ja, jb = SharedJobJournal(a, LIMITS, 3600.0), SharedJobJournal(b, LIMITS, 3600.0)
    await asyncio.to_thread(ja.accept, record(job_id(1)), 100)
    await asyncio.sleep(TTL_S * 2)
    await asyncio.to_thread(b.heartbeat)
    jobs = store(FakeRun(), source=SharedJobs(jb))
    await jobs.start()
    return ja, jb, jobs, await asyncio.to_thread(jb.claim)


def down(*args, **kwargs) -> None:
    """A store write while the store is down."""
    raise StoreUnavailable("the state store failed: connection lost")


@sync
async def test_a_claimed_job_that_cannot_be_taken_up_is_given_back(stores, monkeypatch) -> None:
    a = stores[0]
    ja, jb, jobs, claimed = await claimed_by_b(stores)
    monkeypatch.setattr(jb, "write", down)
    assert await jobs.adopt(claimed) == 0 and jobs.jobs == {}
    monkeypatch.undo()
    await asyncio.to_thread(a.heartbeat)
    assert [r["id"] for r in await asyncio.to_thread(ja.claim)] == [job_id(1)]  # given back
    assert await jobs.adopt(claimed) == 0  # a runs it now: b's write is refused, b skips it
    await jobs.close()


@sync
async def test_a_job_not_given_back_while_the_store_fails_is_given_back_later(
    stores, monkeypatch
) -> None:
    """The store fails while b takes up a job it claimed, and again as b gives it back:
    b gives it back once the store answers (a row naming b, which does not run it, would
    not be claimed by anyone while b lives)."""
    b = stores[1]
    ja, jb, jobs, claimed = await claimed_by_b(stores)
    monkeypatch.setattr(jobsource, "RELEASE_PAUSE_S", 0.05)
    monkeypatch.setattr(jb, "write", down)
    monkeypatch.setattr(jb, "release", down)
    assert await jobs.adopt(claimed) == 0 and jobs.jobs == {}
    await asyncio.to_thread(b.heartbeat)
    assert await asyncio.to_thread(ja.claim) == []  # still b's
    monkeypatch.delattr(jb, "release")  # the store answers again
    await asyncio.sleep(0.3)
    await asyncio.to_thread(b.heartbeat)  # b lives on: the job is a's to claim all the same
    assert [r["id"] for r in await asyncio.to_thread(ja.claim)] == [job_id(1)]
    await jobs.close()
