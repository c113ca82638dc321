"""Signed webhook deliveries of job events: journaled, retried, one queue per receiver,
sent only to the checked address of an allow-listed target.

A job may name a ``webhook`` URL and the events it wants (``started``, ``progress``,
``completed``). Each delivery is a JSON ``POST`` (retouch's envelope around the job
document, or for a prediction Replicate's prediction document) signed twice with the job
owner's secret: like Stripe's, ``Retouch-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256
of "<t>.<body>">``, and as Standard Webhooks specify (what Replicate's clients verify),
``webhook-timestamp: <t>`` and ``webhook-signature: v1,<base64 HMAC-SHA256 of
"<webhook-id>.<t>.<body>">`` with the secret written ``whsec_<base64>``
(:func:`standard_key`). Either way a receiver checks the body is ours and fresh (reject
an old ``t``: no replay). Each tenant has its own secret, derived from the server's
(:func:`tenant_secret`), so a receiver holding one tenant's secret cannot sign deliveries
that another tenant's receiver would accept. Every delivery has an id (the ``webhook-id``
header, as in Standard Webhooks, and ``id`` in the signed body) that stays the same across
retries and gateway restarts, so a receiver dedupes on it: delivery is at least once.

Deliveries are journaled (``platform/jobs/deliveryjournal.py``) before their first attempt and
removed when delivered or given up; a restarted gateway resumes every pending one. They
run on their own tasks (never on the engine, never in the request that caused them), one
bounded queue per tenant and receiver (``platform/jobs/receiverqueue.py``) so a slow receiver,
or a tenant flooding a receiver others use too, delays only its own deliveries, are
retried with exponential backoff on any failure (network, non-2xx, or an error of the
sender's own), and are counted in ``/metrics``.

Targets are checked against an allow-list (``platform/jobs/allowlist.py``) at submission *and*
at each attempt, where the check is the connection's: the request goes to a checked
address. By default only loopback, so a webhook cannot be used to reach hosts inside the
server's network.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import httpx

from retouch.functions.errors import BadRequest, Unavailable
from retouch.functions.wire.jobs import (
    JobEvent,
    JobEventKind,
    WebhookEvent,
    WebhookFormat,
    parse_target_url,
)
from retouch.platform.fleet.tls import tls_context
from retouch.platform.jobs import prediction
from retouch.platform.jobs.allowlist import AllowList, host_of, pinned
from retouch.platform.jobs.deliveryjournal import DeliveryJournal
from retouch.platform.jobs.receiverqueue import ReceiverQueue
from retouch.platform.jobs.resolver import Address, Resolver
from retouch.platform.jobs.sharedjournal import SharedDeliveryJournal

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "Retouch-Signature"
ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"  # Standard Webhooks' three headers: id, time, signature
STANDARD_SIGNATURE_HEADER = "webhook-signature"
STANDARD_KEY_PREFIX = "whsec_"
DEFAULT_ALLOW = ("127.0.0.0/8", "::1/128", "localhost")
RECEIVER_CONCURRENCY = 4  # deliveries in flight to one receiver
RECEIVER_BACKLOG = 1024  # deliveries of one tenant waiting for one receiver (see ReceiverQueue)
ReceiverKey = tuple[str, str]  # (tenant, receiver): one queue each

# Which webhook event a job event is (``queued`` is never delivered).
WEBHOOK_EVENT = {
    JobEventKind.STARTED: WebhookEvent.STARTED,
    JobEventKind.PROGRESS: WebhookEvent.PROGRESS,
    JobEventKind.SUCCEEDED: WebhookEvent.COMPLETED,
    JobEventKind.FAILED: WebhookEvent.COMPLETED,
    JobEventKind.CANCELED: WebhookEvent.COMPLETED,
}


def sign(secret: bytes, body: bytes, timestamp: int) -> str:
    """The ``Retouch-Signature`` header value of ``body`` sent at ``timestamp``."""
    mac = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(
    secret: bytes, body: bytes, header: str, tolerance_s: float = 300.0, now: float | None = None
) -> bool:
    """What a receiver does: a matching MAC and a timestamp within ``tolerance_s``."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        timestamp = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    expected = sign(secret, body, timestamp).split("v1=", 1)[1]
    return hmac.compare_digest(expected, parts.get("v1", ""))


def standard_key(secret: bytes) -> str:
    """A tenant's secret as Standard Webhooks write one, ``whsec_<base64>``: what
    ``GET /v1/webhooks/default/secret`` gives and Replicate's ``Webhooks.validate`` takes."""
    return STANDARD_KEY_PREFIX + base64.b64encode(secret).decode()


def sign_standard(secret: bytes, delivery_id: str, body: bytes, timestamp: int) -> str:
    """The ``webhook-signature`` header value (Standard Webhooks, version 1)."""
    content = f"{delivery_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret, content, hashlib.sha256).digest()).decode()


def tenant_secret(master: bytes, tenant: str) -> bytes:
    """The key ``tenant``'s deliveries are signed with (and its receivers verify with):
    HMAC-SHA256 of the tenant's name under the server's secret, in hex. Derived, so nothing
    per tenant is stored and replacing the server's secret replaces every tenant's."""
    mac = hmac.new(master, f"retouch-webhook:{tenant}".encode(), hashlib.sha256)
    return mac.hexdigest().encode()


def load_secret(data_dir: Path, given: str | None = None) -> bytes:
    """The server's secret, from which each tenant's is derived: given
    (``RETOUCH_WEBHOOK_SECRET``), else one generated once and kept in
    ``<data dir>/webhook-secret`` (mode 0600) so it survives restarts."""
    if given:
        return given.encode()
    path = data_dir / "webhook-secret"
    if not path.exists():
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip().encode()


@dataclass
class Delivery:
    """One webhook POST, as journaled: its body (with its id) is fixed when the event
    happens, so every retry and every resumption sends the same bytes."""

    id: str
    url: str
    job_id: str
    owner: str  # the job's tenant: whose secret signs it, whose queue it waits in
    event: WebhookEvent
    body: bytes
    created_at: float
    journaled: Awaitable[None]  # its journal write (done for a resumed delivery)
    attempts: int = 0

    def to_record(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "job_id": self.job_id,
            "owner": self.owner,
            "event": self.event.value,
            "body": self.body,
            "created_at": self.created_at,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any], journaled: Awaitable[None]) -> Delivery:
        return cls(
            id=str(record["id"]),
            url=str(record["url"]),
            job_id=str(record["job_id"]),
            owner=str(record["owner"]),
            event=WebhookEvent(record["event"]),
            body=bytes(record["body"]),
            created_at=float(record["created_at"]),
            journaled=journaled,
        )


def delivery_id(job_id: str, kind: WebhookEvent, seq: int) -> str:
    """A job completes once, so its ``completed`` id does not depend on which run's
    event says so (a job re-run after a crash re-sends the same id); the others are
    numbered by their event id, which is unique across the job's runs."""
    return f"{job_id}-{'completed' if kind is WebhookEvent.COMPLETED else seq}"


class Outcome(Enum):
    DELIVERED = "delivered"
    REFUSED = "refused"  # not a target we may call (any more): dropped, not retried
    FAILED = "failed"  # retried, then given up


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6  # the first try and 5 retries
    base_s: float = 0.5  # 0.5, 1, 2, 4, 8 s between tries
    max_s: float = 30.0
    timeout_s: float = 10.0


@dataclass
class WebhookStats:
    delivered: dict[str, int] = field(default_factory=dict)  # by webhook event
    failed: dict[str, int] = field(default_factory=dict)  # gave up after every retry
    retried: int = 0
    dropped: int = 0  # refused by the allow-list at delivery, or its queue's backlog was full


class WebhookSender:
    """Delivers job events to their webhooks; ``start()``/``close()`` on the event loop."""

    def __init__(
        self,
        master: bytes,
        allow: AllowList | None = None,
        retry: RetryPolicy | None = None,
        journal: DeliveryJournal | SharedDeliveryJournal | None = None,
        concurrency: int = RECEIVER_CONCURRENCY,
        backlog: int = RECEIVER_BACKLOG,
        resolver: Resolver | None = None,
        public_url: str = "",
    ) -> None:
        self._master = master  # the server's secret; deliveries are signed with a tenant's
        self.public_url = public_url  # the base of a prediction document's URLs
        self.allow = allow or AllowList()
        self.retry = retry or RetryPolicy()
        self.journal = journal
        self.resolver = resolver or Resolver()
        self.stats = WebhookStats()
        self._concurrency, self._backlog = concurrency, backlog
        self._receivers: dict[ReceiverKey, ReceiverQueue[Delivery]] = {}
        self._timers: set[asyncio.Future[None]] = set()  # retries waiting for their time
        self._journaling: set[asyncio.Future[None]] = set()  # journal writes and removals
        self._http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        """Resume every delivery a previous run left pending, oldest first."""
        self._http = httpx.AsyncClient(
            timeout=self.retry.timeout_s, follow_redirects=False, verify=tls_context()
        )
        if self.journal is None:
            return
        if self.adopt(await asyncio.to_thread(self.journal.load)):
            log.info("webhooks: pending deliveries resumed")

    def adopt(self, records: list[dict[str, Any]]) -> int:
        """Queue journaled deliveries, oldest first: this gateway's own at its start, or
        those a dead gateway left (claimed from the shared store)."""
        for record in records:
            try:
                self._enqueue(Delivery.from_record(record, _done()))
            except (KeyError, TypeError, ValueError) as exc:
                log.error("delivery record %s cannot be resumed: %s", record.get("id"), exc)
        return len(records)

    async def close(self) -> None:
        """Stop sending; what is pending stays journaled for the next start."""
        for receiver in list(self._receivers.values()):
            await receiver.close()
        for timer in list(self._timers):
            timer.cancel()
        # settled deliveries leave the journal (not re-sent at the next start)
        await asyncio.gather(*self._timers, *self._journaling, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
        self.resolver.close()

    def secret_for(self, tenant: str) -> bytes:
        """The key ``tenant``'s deliveries are signed with: what its receivers verify with."""
        return tenant_secret(self._master, tenant)

    def standard_key_for(self, tenant: str) -> str:
        """``tenant``'s key as Standard Webhooks write it (``whsec_<base64>``)."""
        return standard_key(self.secret_for(tenant))

    async def check(self, raw: str, tenant: str) -> None:
        """At submission: ``tenant``'s webhook target is allowed (else a structured error on
        field ``webhook``)."""
        await self.allow.check(raw, self.resolver, tenant)

    def notify(self, job: Any, event: JobEvent) -> Awaitable[None] | None:
        """A job event happened: journal and queue its delivery if the job asked for that
        event. Returns the journal write (the job store awaits it for the terminal event)."""
        url = job.request.webhook
        kind = WEBHOOK_EVENT.get(event.kind)
        if url is None or kind is None or kind not in job.request.webhook_events:
            return None
        if self._http is None:
            return None
        ident = delivery_id(job.id, kind, event.seq)
        body = json.dumps(self._payload(job, event, kind, ident), separators=(",", ":")).encode()
        delivery = Delivery(ident, url, job.id, job.owner, kind, body, time.time(), _done())
        if self.journal is not None:
            delivery.journaled = self._background(
                self._journaling, asyncio.to_thread(self.journal.write, delivery.to_record())
            )
        self._enqueue(delivery)
        return delivery.journaled

    def _payload(self, job: Any, event: JobEvent, kind: WebhookEvent, ident: str) -> dict[str, Any]:
        """What a delivery carries, in the job's webhook format."""
        if job.request.webhook_format is WebhookFormat.REPLICATE:
            return prediction.document(job, self.public_url)
        return {
            "id": ident,
            "type": kind.value,
            "event": event.kind.value,
            "seq": event.seq,
            "sent_at": time.time(),
            "job": job.describe(with_image=False),
        }

    def _enqueue(self, delivery: Delivery) -> None:
        try:
            key = (delivery.owner, receiver_key(parse_target_url(delivery.url)))
        except BadRequest as exc:
            self._drop(delivery, exc.message)
            return
        receiver = self._receivers.get(key)
        if receiver is None:
            receiver = ReceiverQueue(
                self._deliver,
                self._concurrency,
                self._backlog,
                evictable=lambda d: d.event is not WebhookEvent.COMPLETED,
                on_idle=lambda: self._retire(key),
            )
            self._receivers[key] = receiver
        evicted = receiver.put(delivery)
        if evicted is not None:
            self._drop(evicted, f"{key[0]}'s queue for {key[1]} is full ({self._backlog})")

    def _retire(self, key: ReceiverKey) -> None:
        """Forget an idle receiver's queue (a new one is made for its next delivery)."""
        receiver = self._receivers.get(key)
        if receiver is not None and receiver.idle:
            del self._receivers[key]

    def _drop(self, delivery: Delivery, why: str) -> None:
        log.warning("webhook %s of job %s dropped: %s", delivery.id, delivery.job_id, why)
        self.stats.dropped += 1
        self._forget(delivery)

    def _forget(self, delivery: Delivery) -> None:
        """Settled: off the journal (after its write, which may still be under way)."""
        if self.journal is not None:
            self._background(self._journaling, self._unjournal(delivery))

    async def _unjournal(self, delivery: Delivery) -> None:
        assert self.journal is not None
        with contextlib.suppress(Exception):
            await delivery.journaled
        await asyncio.to_thread(self.journal.delete, delivery.id)

    def _background(
        self, tasks: set[asyncio.Future[None]], work: Awaitable[None]
    ) -> asyncio.Future[None]:
        """``work`` on its own task, kept in ``tasks`` until done (a failure logged)."""
        task = asyncio.ensure_future(work)
        tasks.add(task)
        task.add_done_callback(lambda done: self._settled(tasks, done))
        return task

    @staticmethod
    def _settled(tasks: set[asyncio.Future[None]], task: asyncio.Future[None]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("webhook journal: %s", task.exception())

    async def _deliver(self, delivery: Delivery) -> None:
        """One attempt and what follows from it; never raises (any error is a failed
        attempt: counted, then retried or given up)."""
        try:
            outcome, why = await self._attempt(delivery)
        except Exception as exc:
            log.debug("webhook %s attempt raised", delivery.id, exc_info=True)
            outcome, why = Outcome.FAILED, f"{type(exc).__name__}: {exc}"
        key = delivery.event.value
        if outcome is Outcome.DELIVERED:
            self.stats.delivered[key] = self.stats.delivered.get(key, 0) + 1
            self._forget(delivery)
        elif outcome is Outcome.REFUSED:
            self._drop(delivery, why)
        elif delivery.attempts >= self.retry.attempts:
            self.stats.failed[key] = self.stats.failed.get(key, 0) + 1
            log.warning(
                "webhook %s of job %s failed %d times (%s); giving up",
                key,
                delivery.job_id,
                delivery.attempts,
                why,
            )
            self._forget(delivery)
        else:
            self.stats.retried += 1
            delay = min(self.retry.max_s, self.retry.base_s * 2 ** (delivery.attempts - 1))
            self._background(self._timers, self._later(delivery, delay))

    async def _later(self, delivery: Delivery, delay: float) -> None:
        await asyncio.sleep(delay)
        self._enqueue(delivery)

    async def _attempt(self, delivery: Delivery) -> tuple[Outcome, str]:
        with contextlib.suppress(Exception):  # not on disk: still worth sending
            await asyncio.shield(delivery.journaled)
        delivery.attempts += 1
        try:
            url = parse_target_url(delivery.url)
            addresses = await self.allow.addresses(url, self.resolver, delivery.owner)
        except BadRequest as exc:
            return Outcome.REFUSED, exc.message
        except Unavailable as exc:  # the lookup did not answer in time: try again later
            return Outcome.FAILED, exc.message
        if not addresses:
            return Outcome.FAILED, f"{host_of(url)} does not resolve"
        refused: httpx.ConnectError | None = None
        for address in addresses:
            try:
                resp = await self._post(url, address, delivery)
            except httpx.ConnectError as exc:  # the next checked address, if any
                refused = exc
                continue
            ok = 200 <= resp.status_code < 300
            return (Outcome.DELIVERED if ok else Outcome.FAILED), f"HTTP {resp.status_code}"
        return Outcome.FAILED, f"ConnectError: {refused}"

    async def _post(self, url: httpx.URL, address: Address, delivery: Delivery) -> httpx.Response:
        """POST to ``address``, the checked one, as if to the URL's host."""
        assert self._http is not None
        target, headers, extensions = pinned(url, address)
        secret, now = self.secret_for(delivery.owner), int(time.time())
        headers |= {
            "content-type": "application/json",
            SIGNATURE_HEADER: sign(secret, delivery.body, now),
            ID_HEADER: delivery.id,
            TIMESTAMP_HEADER: str(now),
            STANDARD_SIGNATURE_HEADER: sign_standard(secret, delivery.id, delivery.body, now),
            "user-agent": "retouch-webhooks",
        }
        return await self._http.post(
            target, content=delivery.body, headers=headers, extensions=extensions
        )


def receiver_key(url: httpx.URL) -> str:
    """The receiver a URL names: its scheme, host and port (a queue is per tenant and this)."""
    port = url.port or (443 if url.scheme == "https" else 80)
    return f"{url.scheme}://{host_of(url)}:{port}"


def _done() -> asyncio.Future[None]:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future
