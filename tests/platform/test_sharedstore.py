"""The shared state store on a real PostgreSQL: what several gateways rely on.

Two :class:`StateStore` connections are two gateways. A job's row is written only by the
gateway it names while the job is live (a late writer is refused: the job ends once); a
gateway silent past the TTL has its jobs and deliveries claimed by another; the caps hold
over every gateway's jobs; the registry numbers every change from one sequence and shows
deletes to followers; generated secrets are the same for all."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from retouch.functions.errors import Overloaded
from retouch.functions.spec import parse_spec
from retouch.platform.retention import JOB_OVERHEAD_BYTES, RetentionLimits
from retouch.platform.sharedjournal import SharedDeliveryJournal, SharedJobJournal, TakenOver
from retouch.platform.sharedregistry import SharedRegistry
from retouch.platform.statestore import StateStore, redact
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
    listed = [r["id"] for r in jb.listing("alice", None, None, 10, None)]
    assert listed == [job_id(3), job_id(2), job_id(1)]  # newest first, every gateway's
    assert [r["id"] for r in ja.listing("alice", "succeeded", None, 10, None)] == [job_id(2)]


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
