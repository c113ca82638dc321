"""A webhook receiver for tests: a small HTTP server on its own loopback port that keeps
every request it gets (with its arrival time) and answers what the test says."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from retouch.platform.jobs import webhooks


@dataclass(frozen=True)
class Arrival:
    path: str
    headers: dict[str, str]  # names in lowercase
    raw: bytes
    status: int  # what the receiver answered
    at: float  # wall clock, comparable with the gateway's times on this machine

    @property
    def body(self) -> dict[str, Any]:
        return json.loads(self.raw)


class Receiver:
    """``answer(path, n)`` is the status of the ``n``-th request (from 1) on ``path``,
    sent after ``delay_s``. Use as a context manager (it stops the server)."""

    def __init__(
        self,
        secret: bytes,
        answer: Callable[[str, int], int] = lambda path, n: 200,
        delay_s: float = 0.0,
    ) -> None:
        self.secret = secret
        self.arrivals: list[Arrival] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                at = time.time()
                raw = self.rfile.read(int(self.headers["content-length"]))
                n = 1 + sum(a.path == self.path for a in receiver.arrivals)
                status = answer(self.path, n)
                headers = {k.lower(): v for k, v in self.headers.items()}
                receiver.arrivals.append(Arrival(self.path, headers, raw, status, at))
                time.sleep(delay_s)
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()

    def calls(self, path: str) -> int:
        return sum(a.path == path for a in self.arrivals)

    def delivered(self, path: str) -> list[dict[str, Any]]:
        """The bodies of the signed requests on ``path`` answered 200."""
        return [a.body for a in self.accepted() if a.path == path]

    def accepted(self, job_id: str | None = None, kind: str | None = None) -> list[Arrival]:
        """The signed requests answered 200 (for one job, one webhook event type)."""
        return [
            a
            for a in self.arrivals
            if a.status == 200
            and webhooks.verify(self.secret, a.raw, a.headers["retouch-signature"])
            and (job_id is None or a.body["job"]["id"] == job_id)
            and (kind is None or a.body["type"] == kind)
        ]
