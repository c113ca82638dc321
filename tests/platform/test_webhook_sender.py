"""The webhook sender without a gateway: a real receiver on loopback, the delivery journal
on disk. A delivery pending when the sender stops is made by the next one under the same
id; any failure of an attempt (a timeout, a URL no parser should have let through) is
counted and settled, never raised; a full receiver queue drops its oldest non-final
delivery; the connection goes to the checked address while ``Host`` names the URL's."""

from __future__ import annotations

import asyncio
import time

from retouch.functions import wire
from retouch.functions.wire import JobEventKind, WebhookEvent
from retouch.platform.deliveryjournal import DeliveryJournal
from retouch.platform.jobs import Job
from retouch.platform.receiverqueue import ReceiverQueue
from retouch.platform.webhooks import RetryPolicy, WebhookSender
from tests.e2e.receiver import Receiver

from .test_jobs import request, sync

SECRET = b"sender-secret"
FAST_RETRY = RetryPolicy(attempts=3, base_s=0.05, timeout_s=2.0)


def job(url: str, seed: int = 1) -> Job:
    return Job(f"{seed:032x}", "f", request(seed, webhook=url), 1.0)


def completed(j: Job, seq: int = 5) -> wire.JobEvent:
    return wire.JobEvent(seq, JobEventKind.SUCCEEDED, {})


async def until(what, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := what()):
        assert time.monotonic() < deadline, "not seen in time"
        await asyncio.sleep(0.02)
    return value


@sync
async def test_a_pending_delivery_is_made_after_a_restart_under_its_id(tmp_path) -> None:
    answer = {"status": 503}
    with Receiver(SECRET, lambda path, n: answer["status"]) as receiver:
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
    with Receiver(SECRET, delay_s=1.0) as slow:
        sender = WebhookSender(
            SECRET, retry=RetryPolicy(attempts=2, base_s=0.01, timeout_s=0.2), journal=journal
        )
        await sender.start()
        j = job(f"{slow.url}/late")  # every attempt times out
        await sender.notify(j, completed(j))
        # a record no parser should let through (as an older gateway could have written)
        bad = f"http://example.invalid\n@127.0.0.1:{slow.url.rsplit(':', 1)[1]}/"
        journal.write(
            {"id": f"{'e' * 32}-completed", "url": bad, "job_id": "e" * 32,
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
    with Receiver(SECRET) as receiver:
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
    assert queue.put(("e", c)) == ("b", c)  # all final: the oldest goes
    release.set()
    await until(lambda: queue.idle)
