"""Signed result links (``response_format=url``) on a real gateway: signed with a key of
their own (``<data dir>/link-keys``, mode 0600), not the webhook secret; based on
``--public-url`` whatever ``Host`` the request names; never valid past the result's
retention end (``--job-retention`` 60 s here), whoever signed them. And the retention
caps refuse a job from its declared length, before its body is read, and so does the budget
of request bodies held at once."""

from __future__ import annotations

import hashlib
import hmac
import io
import socket
import stat
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import pytest
from PIL import Image

from retouch.functions.wire.codec import unpack
from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess
from retouch.platform.jobs.links import KEY_FILE, load_keys
from tests.support import wait_for

from .conftest import INVOKE, TOKENS
from .street import deploy_street

FUNCTION, STEPS, SIZE = "link-sd", 2, 128
RETENTION_S = 60
BODY_BUDGET = 16 << 20  # request bodies held at once
RETAINED_CAP = 8 << 20  # bytes a tenant's jobs may retain: room for these tests' edits


def white_mask() -> bytes:
    arr = np.zeros((SIZE, SIZE), np.uint8)
    arr[32:80, 40:96] = 255
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def server(data_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(data_dir, env=TOKENS)
    proc.extra_args = [
        "--public-url", f"http://localhost:{proc.port}/",
        "--job-retention", str(RETENTION_S),
        "--max-retained-bytes-per-tenant", str(RETAINED_CAP),
        "--body-memory-bytes", str(BODY_BUDGET),
    ]  # fmt: skip
    with proc:
        deploy_street(proc.url, FUNCTION, STEPS)
        yield proc


def edit_url(server: ServerProcess, headers: dict[str, str] | None = None) -> str:
    """One ``url`` edit through ``/v1/images/edits``; its link."""
    got = httpx.post(
        f"{server.url}/v1/images/edits",
        headers={"authorization": f"Bearer {INVOKE}", **(headers or {})},
        data={"model": FUNCTION, "prompt": "a red door", "response_format": "url", "seed": "3"},
        files={
            "image": ("street", b"street", "text/plain"),
            "mask": ("m.png", white_mask(), "image/png"),
        },
        timeout=120,
    )
    assert got.status_code == 200, got.text
    return got.json()["data"][0]["url"]


def resigned(url: str, key: bytes, expires: int, msg: str | None = None) -> str:
    """``url`` with another ``expires``, signed under ``key`` (as the gateway signs, unless
    ``msg`` gives another signed text)."""
    parts = urlsplit(url)
    job_id = parts.path.rsplit("/", 1)[1].split(".")[0]
    text = msg or f"retouch-image-link.v1.{job_id}.{expires}"
    sig = hmac.new(key, text.encode(), hashlib.sha256).hexdigest()
    return f"{parts.scheme}://{parts.netloc}{parts.path}?expires={expires}&sig={sig}"


def test_links_use_the_public_url_never_the_host_header(server: ServerProcess) -> None:
    public = f"http://localhost:{server.port}/v1/images/"
    plain = edit_url(server)
    spoofed = edit_url(server, {"host": "attacker.invalid:8443"})
    assert plain.startswith(public) and spoofed.startswith(public), (plain, spoofed)
    got = httpx.get(spoofed, timeout=30)  # a signed link: no token
    assert got.status_code == 200 and got.headers["content-type"] == "image/png"


def test_links_have_their_own_key_file_not_the_webhook_secret(
    server: ServerProcess, data_dir: Path
) -> None:
    key_file = data_dir / KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    (key,) = load_keys(key_file)
    url = edit_url(server)
    expires = int(parse_qs(urlsplit(url).query)["expires"][0])
    assert httpx.get(resigned(url, key, expires), timeout=30).status_code == 200
    webhook_secret = (data_dir / "webhook-secret").read_text().strip().encode()
    assert webhook_secret != key
    job_id = urlsplit(url).path.rsplit("/", 1)[1].split(".")[0]
    for forged in (
        resigned(url, webhook_secret, expires),  # the gateway's link text, a receiver's key
        resigned(url, webhook_secret, expires, f"image-url.{job_id}.{expires}"),  # the old form
    ):
        got = httpx.get(forged, timeout=30)
        assert got.status_code == 400, got.text
        assert got.json()["error"]["code"] == "invalid_signature"
        assert got.json()["error"]["field"] == "sig"


def test_a_link_never_outlives_its_result(server: ServerProcess, data_dir: Path) -> None:
    url = edit_url(server)
    expires = int(parse_qs(urlsplit(url).query)["expires"][0])
    job_id = urlsplit(url).path.rsplit("/", 1)[1].split(".")[0]
    with Client(server.url, INVOKE) as client:
        completed = client.job(job_id).doc["completed_at"]
    completed_s = datetime.fromisoformat(completed).timestamp()
    # signed for at most the retention (60 s), not the hour a link otherwise lasts
    assert expires <= completed_s + RETENTION_S + 1, (expires, completed)
    assert expires < time.time() + RETENTION_S + 1
    (key,) = load_keys(data_dir / KEY_FILE)
    got = httpx.get(resigned(url, key, expires + 3600), timeout=30)  # validly signed, too long
    assert got.status_code == 400, got.text
    assert got.json()["error"]["code"] == "link_outlives_result"
    assert got.json()["error"]["field"] == "expires"


def _declare(server: ServerProcess, route: str, length: int) -> socket.socket:
    """A connection that sent a request's head declaring ``length`` bytes of body, and no
    body."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(
        (
            f"POST /v1/functions/{FUNCTION}/{route} HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {INVOKE}\r\n"
            f"Content-Type: application/msgpack\r\nContent-Length: {length}\r\n\r\n"
        ).encode()
    )
    return sock


def _answer(sock: socket.socket) -> tuple[bytes, dict[str, str], bytes]:
    """(status line, headers, body) of the one answer on ``sock``."""
    answer = sock.makefile("rb")
    status_line = answer.readline()
    headers = dict(
        line.decode().strip().lower().split(": ", 1) for line in iter(answer.readline, b"\r\n")
    )
    return status_line, headers, answer.read(int(headers["content-length"]))


def _metric(server: ServerProcess, name: str, quantity: str) -> float:
    for line in httpx.get(server.metrics_url, timeout=30).text.splitlines():
        if line.startswith(f'{name}{{quantity="{quantity}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} {quantity} in /metrics")


def test_a_job_over_the_retention_cap_is_refused_before_its_body_is_read(
    server: ServerProcess,
) -> None:
    """Headers that declare a body above the tenant's retention cap, and no body: the
    gateway answers 429 ``retention_full`` at once (reading the body first would wait for
    bytes that never come, and hold them in memory if they did)."""
    with _declare(server, "jobs", RETAINED_CAP + 1) as sock:
        status_line, headers, body = _answer(sock)
    assert b" 429 " in status_line, (status_line, headers, body[:300])
    assert int(headers["retry-after"]) >= 1
    assert unpack(body)["error"]["code"] == "retention_full", body


def test_request_bodies_held_at_once_stay_within_the_body_budget(server: ServerProcess) -> None:
    """A first invoke declares 12 MiB and sends nothing: it holds that much of the 16 MiB
    budget while the gateway waits for its body. A second declaring 12 MiB is refused at
    once, ``429 too_many_bodies``, nothing read; ``/metrics`` shows the budget and the
    refusal, and the first one's share comes back when it ends."""
    bodies = "retouch_request_bodies"
    assert _metric(server, bodies, "budget_bytes") == BODY_BUDGET
    refused = _metric(server, bodies, "refused")
    with _declare(server, "invoke", 12 << 20):
        wait_for(
            "the first body held",
            lambda: _metric(server, bodies, "held_bytes") >= 12 << 20,
            timeout=30,
        )
        with _declare(server, "invoke", 12 << 20) as second:
            status_line, headers, body = _answer(second)
        assert b" 429 " in status_line, (status_line, headers, body[:300])
        assert unpack(body)["error"]["code"] == "too_many_bodies", body
        assert _metric(server, bodies, "refused") == refused + 1
    wait_for(
        "the first body's share back",
        lambda: _metric(server, bodies, "held_bytes") == 0,
        timeout=30,
    )
