"""Signed webhook deliveries of job events, with retries, behind a target allow-list.

A job may name a ``webhook`` URL and the events it wants (``started``, ``progress``,
``completed``). Each delivery is a JSON ``POST`` signed like Stripe's: the header
``Retouch-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>" under the
server's secret>``, so a receiver checks the body is ours and fresh (reject an old ``t``:
no replay). Deliveries run on their own tasks (never on the engine, never in the request
that caused them), are retried with exponential backoff on a network error or a non-2xx
answer, and are counted in ``/metrics``.

Targets are checked against an allow-list at submission *and* again at delivery (a name
may resolve elsewhere later): by default only loopback, so a webhook cannot be used to
reach hosts inside the server's network. Entries are host names (exact, no resolution) or
IP networks (``10.0.0.0/8``, ``192.168.1.7``); a name not listed is resolved and every
address it resolves to must be inside a listed network.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from retouch.functions import wire
from retouch.functions.errors import BadRequest
from retouch.functions.wire import JobEventKind, WebhookEvent

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "Retouch-Signature"
DEFAULT_ALLOW = ("127.0.0.0/8", "::1/128", "localhost")
MAX_PENDING = 1024  # deliveries waiting; beyond it progress deliveries are dropped
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

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


def load_secret(data_dir: Path, given: str | None = None) -> bytes:
    """The signing secret: given (``RETOUCH_WEBHOOK_SECRET``), else one generated once
    and kept in ``<data dir>/webhook-secret`` (mode 0600) so it survives restarts."""
    if given:
        return given.encode()
    path = data_dir / "webhook-secret"
    if not path.exists():
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip().encode()


@dataclass(frozen=True)
class AllowList:
    """Webhook targets the server may call: host names and IP networks."""

    hosts: frozenset[str] = frozenset({"localhost"})
    networks: tuple[Network, ...] = (
        ipaddress.ip_network("127.0.0.0/8"),
        ipaddress.ip_network("::1/128"),
    )

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowList:
        hosts, networks = set(), []
        for entry in (e.strip() for e in entries):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                hosts.add(entry.lower().rstrip("."))
        return cls(frozenset(hosts), tuple(networks))

    def describe(self) -> list[str]:
        return sorted(self.hosts) + [str(n) for n in self.networks]

    async def check(self, url: str) -> None:
        """Refuse (400 ``webhook_not_allowed``, field ``webhook``) a target outside."""
        host = (urlsplit(url).hostname or "").lower().rstrip(".")
        if host in self.hosts:
            return
        try:
            addresses = [ipaddress.ip_address(host)]
        except ValueError:
            addresses = await _resolve(host)
        if addresses and all(any(a in n for n in self.networks) for a in addresses):
            return
        raise BadRequest(
            f"webhook host {host!r} is not in the server's webhook allow-list "
            f"({', '.join(self.describe()) or 'empty'}); see retouch serve --webhook-allow",
            field="webhook",
            code="webhook_not_allowed",
        )


async def _resolve(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    out = []
    for info in infos:
        with contextlib.suppress(ValueError):
            out.append(ipaddress.ip_address(info[4][0].split("%", 1)[0]))
    return out


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6  # the first try and 5 retries
    base_s: float = 0.5  # 0.5, 1, 2, 4, 8 s between tries
    max_s: float = 30.0
    timeout_s: float = 10.0


@dataclass
class Delivery:
    url: str
    job_id: str
    event: WebhookEvent
    body: bytes
    attempts: int = 0


@dataclass
class WebhookStats:
    delivered: dict[str, int] = field(default_factory=dict)  # by webhook event
    failed: dict[str, int] = field(default_factory=dict)  # gave up after every retry
    retried: int = 0
    dropped: int = 0  # refused by the allow-list at delivery, or the backlog was full


class WebhookSender:
    """Delivers job events to their webhooks; ``start()``/``close()`` on the event loop."""

    def __init__(
        self,
        secret: bytes,
        allow: AllowList | None = None,
        retry: RetryPolicy | None = None,
        workers: int = 4,
    ) -> None:
        self.secret = secret
        self.allow = allow or AllowList()
        self.retry = retry or RetryPolicy()
        self.stats = WebhookStats()
        self._workers = workers
        self._queue: asyncio.Queue[Delivery] | None = None
        self._tasks: list[asyncio.Task] = []
        self._retries: set[asyncio.Task] = set()
        self._http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._http = httpx.AsyncClient(timeout=self.retry.timeout_s, follow_redirects=False)
        self._tasks = [asyncio.create_task(self._work()) for _ in range(self._workers)]

    async def close(self) -> None:
        for task in [*self._tasks, *self._retries]:
            task.cancel()
        for task in [*self._tasks, *self._retries]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._http is not None:
            await self._http.aclose()

    def notify(self, job: Any, event: wire.JobEvent) -> None:
        """A job event happened; queue its delivery if the job asked for that event."""
        url = job.request.webhook
        kind = WEBHOOK_EVENT.get(event.kind)
        if url is None or kind is None or kind not in job.request.webhook_events:
            return
        if self._queue is None:
            return
        if kind is WebhookEvent.PROGRESS and self._queue.qsize() >= MAX_PENDING:
            self.stats.dropped += 1
            return
        payload = {
            "type": kind.value,
            "event": event.kind.value,
            "seq": event.seq,
            "sent_at": time.time(),
            "job": job.describe(with_image=False),
        }
        body = json.dumps(payload, separators=(",", ":")).encode()
        self._queue.put_nowait(Delivery(url, job.id, kind, body))

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            delivery = await self._queue.get()
            try:
                await self._attempt(delivery)
            except Exception:
                log.exception("webhook delivery for job %s failed", delivery.job_id)

    async def _attempt(self, delivery: Delivery) -> None:
        assert self._http is not None
        try:
            await self.allow.check(delivery.url)
        except BadRequest as exc:
            log.warning("webhook of job %s not delivered: %s", delivery.job_id, exc.message)
            self.stats.dropped += 1
            return
        delivery.attempts += 1
        timestamp = int(time.time())
        headers = {
            "content-type": "application/json",
            SIGNATURE_HEADER: sign(self.secret, delivery.body, timestamp),
            "user-agent": "retouch-webhooks",
        }
        try:
            resp = await self._http.post(delivery.url, content=delivery.body, headers=headers)
            ok, why = 200 <= resp.status_code < 300, f"HTTP {resp.status_code}"
        except httpx.HTTPError as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        key = delivery.event.value
        if ok:
            self.stats.delivered[key] = self.stats.delivered.get(key, 0) + 1
            return
        if delivery.attempts >= self.retry.attempts:
            self.stats.failed[key] = self.stats.failed.get(key, 0) + 1
            log.warning(
                "webhook %s of job %s failed %d times (%s); giving up",
                key,
                delivery.job_id,
                delivery.attempts,
                why,
            )
            return
        self.stats.retried += 1
        delay = min(self.retry.max_s, self.retry.base_s * 2 ** (delivery.attempts - 1))
        task = asyncio.create_task(self._later(delivery, delay))
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    async def _later(self, delivery: Delivery, delay: float) -> None:
        await asyncio.sleep(delay)
        assert self._queue is not None
        self._queue.put_nowait(delivery)
