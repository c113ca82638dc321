"""Webhook deliveries and event streams under a crash and a slow receiver, on real
processes: a gateway that is SIGKILLed while a delivery is failing makes it after its
restart (once, under the same idempotency id), an SSE reader resuming with its last id
after the restart gets the rest and the terminal event, a receiver sleeping 8 s per
delivery does not delay another receiver's ``completed``, each tenant's deliveries are
signed with the secret that tenant (and only it) reads from ``/v1/webhooks/secret``, and a
URL that a second parser could read differently, or whose host no resolver can look up, is
refused at submission.

One gateway for the file (restarted once, on the same data dir); receivers are small HTTP
servers on loopback, one port each (the gateway queues deliveries per receiver).
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
import pytest

from retouch.functions.errors import RetouchError, Unavailable
from retouch.functions.wire.jobs import JobEvent
from retouch.platform.api.client import Client, read_spec_file
from retouch.platform.api.server import ServerProcess
from retouch.platform.jobs.webhooks import tenant_secret, verify
from retouch.platform.state.auth import token_tenant
from tests.support import wait_for

from .conftest import ADMIN, INVOKE, TOKENS
from .receiver import Receiver

FUNCTION, TEMPLATE, STEPS = "hooks-sd", "street", 3
LONG_STEPS = 20  # a job still running when the gateway is killed
SECRET = "delivery-test-secret"
ENV = {**TOKENS, "RETOUCH_WEBHOOK_SECRET": SECRET}
ARGS = ["--progress-interval", "0"]
SLOW_S = 8.0
MASK = np.zeros((128, 128), bool)
MASK[24:88, 16:80] = True


@dataclass
class Gateway:
    data: Path
    proc: ServerProcess

    def restart_after_sigkill(self) -> None:
        assert self.proc.process is not None
        self.proc.process.send_signal(signal.SIGKILL)
        self.proc.process.wait()
        self.proc = ServerProcess(self.data, env=ENV, extra_args=ARGS).start()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, examples: Path) -> Iterator[Gateway]:
    data = tmp_path_factory.mktemp("data")
    gw = Gateway(data, ServerProcess(data, env=ENV, extra_args=ARGS).start())
    try:
        spec, images = read_spec_file(examples / "tiny-sd.toml")
        spec = dataclasses.replace(
            spec, name=FUNCTION, steps=STEPS, templates={TEMPLATE: spec.templates[TEMPLATE]}
        )
        with Client(gw.proc.url, ADMIN) as admin:
            assert admin.deploy(spec, {TEMPLATE: images[TEMPLATE]})["status"] == "ready"
        yield gw
    finally:
        gw.proc.stop()


def submit(url: str, seed: int, token: str = INVOKE, **options) -> str:
    with Client(url, token) as client:
        job = client.submit(FUNCTION, TEMPLATE, MASK, "a red door", seed=seed, **options)
        return job.id


def key(url: str, token: str = INVOKE) -> bytes:
    """The webhook secret of the token's tenant, as a receiver reads it."""
    with Client(url, token) as client:
        return client.webhook_secret()


def finished(url: str, job_id: str, token: str = INVOKE) -> dict:
    with Client(url, token) as client:
        job = client.job(job_id)
        job.wait(timeout=180)
        return job.status()


class Reader:
    """An SSE reader on its own thread that keeps what it read until the stream ends or
    the gateway goes away."""

    def __init__(self, url: str, job_id: str, after: int = 0) -> None:
        self.events: list[JobEvent] = []
        self.done = threading.Event()

        def read() -> None:
            try:
                with Client(url, INVOKE) as client:
                    self.events.extend(client.job_events(job_id, after))
            except Unavailable:
                pass  # the gateway was killed under it
            finally:
                self.done.set()

        threading.Thread(target=read, daemon=True).start()


def test_delivery_and_event_ids_survive_a_gateway_sigkill(gateway: Gateway) -> None:
    """A job ends while its receiver fails; the gateway is SIGKILLed mid-retries (and mid
    another job) and restarted: the receiver then gets exactly one ``completed``, under the
    id the failed attempts carried, and readers resume from their last ids."""
    answer = {"status": 503}
    with Receiver(key(gateway.proc.url), lambda path, n: answer["status"]) as down:
        hooked = submit(gateway.proc.url, 1, webhook=f"{down.url}/hook")
        assert finished(gateway.proc.url, hooked)["status"] == "succeeded"
        failed = wait_for("two failed attempts", lambda: len(down.arrivals) >= 2 and down.arrivals)
        ids = {a.headers["webhook-id"] for a in failed}
        assert ids == {a.body["id"] for a in failed} and len(ids) == 1  # retries keep it
        assert list((gateway.data / "webhooks").glob("*.delivery"))  # journaled, pending

        # a finished job's stream: its last progress event (if it had one) and its end
        ended = Reader(gateway.proc.url, hooked)
        ended.done.wait(30)
        terminal = ended.events[-1]
        assert terminal.kind.value == "succeeded" and len(ended.events) < terminal.seq
        assert [e.kind.value for e in ended.events[:-1]] in ([], ["progress"])

        running = submit(gateway.proc.url, 2, steps=LONG_STEPS)
        live = Reader(gateway.proc.url, running)
        wait_for("the long job's progress", lambda: "progress" in [e.kind for e in live.events])
        answer["status"] = 200
        gateway.restart_after_sigkill()
        live.done.wait(30)
        last_seen = live.events[-1].seq
        assert live.events[-1].kind.value in ("started", "progress")

        url = gateway.proc.url
        # the job that was running is run again: its new events are read from now on (a
        # reader that came after its end would get the ended job's short history)
        after_restart = Reader(url, running, after=last_seen)
        delivered = wait_for("the completed delivery", lambda: down.accepted(hooked), timeout=60)
        time.sleep(2.0)  # time for a duplicate, were there one
        assert len(down.accepted(hooked)) == 1 and delivered[0].body["type"] == "completed"
        assert delivered[0].headers["webhook-id"] == delivered[0].body["id"] == ids.pop()
        assert delivered[0].body["job"]["status"] == "succeeded"
        journal = gateway.data / "webhooks"
        wait_for("the delivery off the journal", lambda: not list(journal.glob("*")), 10)

    # the finished job: resuming before its end gives the end under the same id
    resumed = Reader(url, hooked, after=terminal.seq - 1)
    assert resumed.done.wait(30)
    # the same event; its output link is the same signed path under the restarted
    # gateway's own address (this test's gateway binds a new port)
    (again,) = resumed.events
    assert again.data["output"] and relative(again) == relative(terminal)
    terminal = again  # as the restarted gateway gives it
    # the job that was run again: all of its new events, ids above the last seen
    assert after_restart.done.wait(180)
    kinds = [e.kind.value for e in after_restart.events]
    assert kinds[0] == "queued" and kinds[-1] == "succeeded", kinds
    seqs = [e.seq for e in after_restart.events]
    assert seqs == sorted(seqs) and seqs[0] > last_seen
    # an id the job never gave still ends the stream with the terminal event
    beyond = Reader(url, hooked, after=10**12)
    assert beyond.done.wait(30) and beyond.events == [terminal]


def test_a_slow_receiver_does_not_delay_another(gateway: Gateway) -> None:
    """Two jobs report every event to a receiver that takes 8 s per delivery (more
    deliveries than the sender runs at once); a third job's ``completed`` reaches another
    receiver within 1 s of the job's end."""
    every = ["started", "progress", "completed"]
    with (
        Receiver(key(gateway.proc.url), delay_s=SLOW_S) as slow,
        Receiver(key(gateway.proc.url)) as fast,
    ):
        url = gateway.proc.url
        for seed in (3, 4):
            submit(url, seed, webhook=f"{slow.url}/slow", webhook_events=every)
        job = submit(url, 5, webhook=f"{fast.url}/fast")
        doc = finished(url, job)
        arrival = wait_for("the fast receiver's delivery", lambda: fast.accepted(job), 30)[0]
        delay = arrival.at - datetime.fromisoformat(doc["completed_at"]).timestamp()
        assert len(slow.arrivals) >= 4  # the slow receiver was busy meanwhile
        print(f"completed delivered {delay * 1e3:.0f} ms after the job ended")
        assert delay < 1.0, delay


def test_urls_that_do_not_read_back_are_refused_at_submission(gateway: Gateway) -> None:
    port = gateway.proc.port
    for url in (
        f"http://example.invalid\n@127.0.0.1:{port}/",  # parsers disagree on its host
        f"http://user:pw@127.0.0.1:{port}/",
        f"http://127.0.0.1:{port}/a b",
        f"HTTP://127.0.0.1:{port}/x",
        "http://127.0.0.1:99999/",
        f"http://{'a' * 64}.example/",  # a label over 63 characters (IDNA refuses it)
        "http://a..b/",  # an empty label
    ):
        with pytest.raises(RetouchError) as err:
            submit(gateway.proc.url, 1, webhook=url)
        assert (err.value.status, err.value.code, err.value.field) == (
            400,
            "invalid_field",
            "webhook",
        ), url


def test_each_tenant_is_signed_with_the_secret_only_it_reads(gateway: Gateway) -> None:
    """Two tenants' jobs hook the same receiver: each delivery verifies with its owner's
    secret (from ``GET /v1/webhooks/secret``), not the other's, so neither tenant can sign
    a delivery the other's receiver would accept."""
    url = gateway.proc.url
    secrets = {token: key(url, token) for token in (INVOKE, ADMIN)}
    for token, secret in secrets.items():
        assert secret == tenant_secret(SECRET.encode(), token_tenant(token))
    assert secrets[INVOKE] != secrets[ADMIN]
    anonymous = httpx.get(f"{url}/v1/webhooks/secret")
    assert (anonymous.status_code, anonymous.json()["error"]["code"]) == (401, "missing_token")
    with Receiver(secrets[INVOKE]) as receiver:
        jobs = {
            token: submit(url, 6, token, webhook=f"{receiver.url}/t") for token in (INVOKE, ADMIN)
        }
        for token, job_id in jobs.items():
            finished(url, job_id, token)
        wait_for("both deliveries", lambda: len(receiver.arrivals) >= 2, 30)
    for token, job_id in jobs.items():
        (arrival,) = [a for a in receiver.arrivals if a.body["job"]["id"] == job_id]
        signature = arrival.headers["retouch-signature"]
        other = secrets[ADMIN if token == INVOKE else INVOKE]
        assert verify(secrets[token], arrival.raw, signature)
        assert not verify(other, arrival.raw, signature)


def relative(event: JobEvent) -> JobEvent:
    """``event`` with its output link's path only (not the gateway's address)."""
    link = (event.data.get("output") or "").partition("/v1/")[2]
    return dataclasses.replace(event, data={**event.data, "output": link})
