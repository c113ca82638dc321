"""The webhook sender without a gateway: a real receiver on loopback, the delivery journal
on disk. A delivery pending when the sender stops is made by the next one under the same
id; any failure of an attempt (a timeout, a URL no parser should have let through) is
counted and settled, never raised; a full receiver queue drops its oldest non-final
delivery and never a ``completed``; each tenant's deliveries are signed with its own key
and wait in its own queue; host lookups run on their own threads with a deadline and a
share per tenant; the connection goes to the checked address while ``Host`` names the
URL's."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from replicate.webhook import Webhooks, WebhookSigningSecret

from retouch.functions.errors import BadRequest, RetouchError
from retouch.functions.wire.jobs import (
    JobEvent,
    JobEventKind,
    JobStatus,
    WebhookEvent,
    parse_target_url,
)
from retouch.platform.jobs.deliveryjournal import DeliveryJournal
from retouch.platform.jobs.job import Job
from retouch.platform.jobs.receiverqueue import ReceiverQueue
from retouch.platform.jobs.resolver import Resolver
from retouch.platform.jobs.webhooks import RetryPolicy, WebhookSender, tenant_secret, verify
from retouch.platform.state.auth import ANONYMOUS
from tests.e2e.receiver import Receiver
from tests.platform.jobs.test_jobs import request, sync

SECRET = b"sender-secret"  # the server's; receivers verify with their tenant's
KEY = tenant_secret(SECRET, ANONYMOUS)
# a generous attempt timeout: deliveries here succeed however loaded the machine is
FAST_RETRY = RetryPolicy(attempts=3, base_s=0.05, timeout_s=10.0)


def job(url: str, seed: int = 1, owner: str = ANONYMOUS, **extra) -> Job:
    return Job(f"{seed:032x}", "f", request(seed, webhook=url, **extra), 1.0, owner=owner)


def completed(j: Job, seq: int = 5) -> JobEvent:
    return JobEvent(seq, JobEventKind.SUCCEEDED, {})


async def until(what, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := what()):
        assert time.monotonic() < deadline, "not seen in time"
        await asyncio.sleep(0.02)
    return value


@sync
async def test_a_pending_delivery_is_made_after_a_restart_under_its_id(tmp_path) -> None:
    answer = {"status": 503}
    with Receiver(KEY, lambda path, n: answer["status"]) as receiver:
        first = WebhookSender(SECRET, retry=FAST_RETRY, journal=DeliveryJournal(tmp_path))
        await first.start()
        j = job(f"{receiver.url}/hook")
        journaled = first.notify(j, completed(j))
        assert journaled is not None
        await journaled
        assert len(list(tmp_path.glob("*.delivery"))) == 1
        await until(lambda: receiver.arrivals)
        await first.close()  # stops mid-retries: the record stays
        assert len(list(tmp_path.glob("*.delivery"))) == 1

        answer["status"] = 200
        second = WebhookSender(SECRET, retry=FAST_RETRY, journal=DeliveryJournal(tmp_path))
        await second.start()
        await until(lambda: receiver.accepted(j.id))
        await until(lambda: not list(tmp_path.glob("*")))
        await second.close()
    ids = {a.headers["webhook-id"] for a in receiver.arrivals}
    assert ids == {f"{j.id}-completed"} == {a.body["id"] for a in receiver.arrivals}
    assert second.stats.delivered == {"completed": 1}


@sync
async def test_failed_attempts_are_counted_never_raised(tmp_path) -> None:
    journal = DeliveryJournal(tmp_path)
    with Receiver(KEY, delay_s=1.0) as slow:
        sender = WebhookSender(
            SECRET, retry=RetryPolicy(attempts=2, base_s=0.01, timeout_s=0.2), journal=journal
        )
        await sender.start()
        j = job(f"{slow.url}/late")  # every attempt times out
        await sender.notify(j, completed(j))
        # a record no parser should let through (as an older gateway could have written)
        bad = f"http://example.invalid\n@127.0.0.1:{slow.url.rsplit(':', 1)[1]}/"
        journal.write(
            {"id": f"{'e' * 32}-completed", "url": bad, "job_id": "e" * 32, "owner": "t",
             "event": "completed", "body": b"{}", "created_at": 1.0}
        )  # fmt: skip
        await sender.close()
        sender = WebhookSender(
            SECRET, retry=RetryPolicy(attempts=2, base_s=0.01, timeout_s=0.2), journal=journal
        )
        await sender.start()
        await until(lambda: sender.stats.failed.get("completed") == 1 and sender.stats.dropped)
        await until(lambda: not list(tmp_path.glob("*")))
        await sender.close()
    assert sender.stats.retried == 1 and sender.stats.dropped == 1


@sync
async def test_the_connection_goes_to_the_checked_address_as_the_host() -> None:
    with Receiver(KEY) as receiver:
        port = receiver.url.rsplit(":", 1)[1]
        sender = WebhookSender(SECRET, retry=FAST_RETRY)
        await sender.start()
        j = job(f"http://localhost:{port}/named")  # resolved once, checked, connected to
        sender.notify(j, completed(j))
        (arrival,) = await until(lambda: receiver.accepted(j.id))
        await sender.close()
    assert arrival.headers["host"] == f"localhost:{port}"


@sync
async def test_a_full_receiver_queue_drops_its_oldest_non_final_delivery() -> None:
    release = asyncio.Event()

    async def send(item: tuple[str, WebhookEvent]) -> None:
        await release.wait()

    queue: ReceiverQueue[tuple[str, WebhookEvent]] = ReceiverQueue(
        send, 1, 2, evictable=lambda d: d[1] is not WebhookEvent.COMPLETED, on_idle=lambda: None
    )
    p, c = WebhookEvent.PROGRESS, WebhookEvent.COMPLETED
    assert queue.put(("a", p)) is None and queue.put(("b", c)) is None
    assert queue.put(("c", p)) == ("a", p)
    assert queue.put(("d", c)) == ("c", p)
    assert queue.put(("e", c)) is None  # all final: none is dropped, the queue grows
    assert queue.waiting == 3
    assert queue.put(("f", p)) == ("f", p)  # the only one that may go
    release.set()
    await until(lambda: queue.idle)


@sync
async def test_each_tenant_signs_with_its_own_key_and_reads_only_that() -> None:
    alice, bob = tenant_secret(SECRET, "alice"), tenant_secret(SECRET, "bob")
    assert len({alice, bob, SECRET}) == 3 and tenant_secret(SECRET, "alice") == alice
    with Receiver(alice) as receiver:
        sender = WebhookSender(SECRET, retry=FAST_RETRY)
        await sender.start()
        assert sender.secret_for("alice") == alice
        a, b = job(f"{receiver.url}/a", 1, "alice"), job(f"{receiver.url}/b", 2, "bob")
        sender.notify(a, completed(a))
        sender.notify(b, completed(b))
        await until(lambda: len(receiver.arrivals) == 2)
        await sender.close()
    by_path = {arrival.path: arrival for arrival in receiver.arrivals}
    for path, key, others in (("/a", alice, (bob, SECRET)), ("/b", bob, (alice, SECRET))):
        arrival = by_path[path]
        header = arrival.headers["retouch-signature"]
        assert verify(key, arrival.raw, header)
        assert not any(verify(other, arrival.raw, header) for other in others)


@sync
async def test_a_tenant_flooding_a_shared_receiver_neither_delays_nor_drops_another() -> None:
    bob_arrived = threading.Event()

    def answer(path: str, n: int) -> int:
        """Alice's deliveries are held until bob's has arrived: behind her backlog, his
        never would (hers would time out instead)."""
        if path == "/b":
            bob_arrived.set()
        else:
            bob_arrived.wait(30)
        return 200

    with Receiver(KEY, answer) as shared:
        sender = WebhookSender(SECRET, retry=FAST_RETRY, concurrency=1, backlog=2)
        await sender.start()
        flood = job(f"{shared.url}/a", 1, "alice", webhook_events=["progress", "completed"])
        for seq in range(1, 7):  # queued at once: all but the last two are dropped
            sender.notify(flood, JobEvent(seq, JobEventKind.PROGRESS, {}))
        for seed in (2, 3, 4):  # the last two progress make room; no completed is dropped
            j = job(f"{shared.url}/a", seed, "alice")
            sender.notify(j, completed(j))
        bob = job(f"{shared.url}/b", 9, "bob")
        sender.notify(bob, completed(bob))
        await until(lambda: sum(a.body["type"] == "completed" for a in shared.arrivals) == 4)
        await sender.close()
    assert sender.stats.dropped == 6 and not sender.stats.failed and sender.stats.retried == 0
    assert shared.arrivals[0].path == "/b"  # not behind alice's backlog
    assert [a.body["type"] for a in shared.arrivals if a.path == "/a"] == ["completed"] * 3


@sync
async def test_lookups_have_their_own_threads_a_deadline_and_a_share_per_tenant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stuck, real = threading.Event(), socket.getaddrinfo

    def getaddrinfo(host: str, *args, **kwargs):
        if host.startswith("stuck"):  # a name whose DNS servers do not answer
            stuck.wait(10)
        return real("127.0.0.1", *args, **kwargs)

    def late(error: pytest.ExceptionInfo[RetouchError]) -> bool:
        return (error.value.status, error.value.code, error.value.field) == (
            503,
            "webhook_lookup_timeout",
            "webhook",
        )

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    resolver = Resolver(threads=3, per_tenant=2, timeout_s=0.3)
    try:
        for n in (1, 2):
            with pytest.raises(RetouchError) as error:
                await resolver.resolve(f"stuck{n}.example", "alice")
            assert late(error)
        # alice's abandoned lookups still hold her share: her next one waits, then is late
        with pytest.raises(RetouchError) as error:
            await resolver.resolve("fine.example", "alice")
        assert late(error)
        # another tenant still gets a thread, and asyncio's own pool was never involved (the
        # lookups from here on may take as long as a loaded machine needs)
        resolver.timeout_s = 30.0
        assert [str(a) for a in await resolver.resolve("fine.example", "bob")] == ["127.0.0.1"]
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 30.0) == "free"
        stuck.set()  # the stuck lookups end: alice's share is hers again
        assert await resolver.resolve("fine.example", "alice")
    finally:
        stuck.set()
        resolver.close()


@sync
async def test_a_host_name_idna_refuses_is_a_400_at_submission_never_a_500() -> None:
    sender = WebhookSender(SECRET)
    too_long, empty = f"http://{'a' * 64}.example/", "http://a..b/"
    try:
        for url in (too_long, empty, "http://.a/", f"http://{'a.' * 127}b/"):
            with pytest.raises(BadRequest) as err:
                await sender.check(url, "alice")
            assert (err.value.code, err.value.field) == ("invalid_field", "webhook"), url
        # a name that reaches the resolver anyway does not resolve; it does not raise
        assert await sender.resolver.resolve(too_long[7:-1], "alice") == []
        assert await sender.resolver.resolve("a..b", "alice") == []
        parse_target_url(f"http://{'a' * 63}.example./")  # the longest label is fine
    finally:
        await sender.close()


@sync
async def test_a_predictions_delivery_is_its_document_signed_as_standard_webhooks() -> None:
    """A job submitted as a prediction gets Replicate's prediction document, which
    Replicate's own ``Webhooks.validate`` accepts with the tenant's ``whsec_`` key."""
    with Receiver(KEY) as receiver:
        sender = WebhookSender(SECRET, retry=FAST_RETRY, public_url="http://gw.example")
        await sender.start()
        j = job(f"{receiver.url}/hook", webhook_format="replicate")
        j.status = JobStatus.SUCCEEDED
        sender.notify(j, completed(j))
        (arrival,) = await until(lambda: receiver.accepted())
        await sender.close()
    assert arrival.body["id"] == j.id and arrival.body["status"] == "succeeded"
    assert arrival.body["urls"]["get"] == f"http://gw.example/v1/predictions/{j.id}"
    secret = WebhookSigningSecret(key=sender.standard_key_for(ANONYMOUS))
    Webhooks.validate(headers=arrival.headers, body=arrival.raw.decode(), secret=secret)
