"""uvicorn's HTTP/1.1 protocol, answering its own rejections with the API's error body.

A request the HTTP parser cannot read (a request head, i.e. request line plus headers,
longer than :data:`MAX_HEAD_BYTES`; a malformed request line or header; a bad
``content-length``) never reaches the app: uvicorn answers it itself, a ``400`` in plain
text. Here it is the structured error body instead. Which route the request meant is
unknown (its request line may be what failed), so the body carries both conventions of the
API: ``code``, ``message``, ``field`` and OpenAI's ``type`` and ``param``, which an OpenAI
client reads from an ``/v1/images/*`` answer.

The protocol is h11's, chosen explicitly (:data:`SERVER_OPTIONS`): uvicorn would otherwise
switch to httptools, whose rejections this does not cover, whenever it happens to be
installed. (uvicorn's other plain-text answer, a ``500`` when an app fails before it
starts a response, cannot be replaced from outside; the apps here answer every exception
themselves, so it does not occur.)
"""

from __future__ import annotations

import json
import sys
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEAD_BYTES = 16 << 10  # h11's default, stated: the longest request line plus headers


def rejection_body(status: int, code: str, message: str) -> bytes:
    """The structured error body with OpenAI's fields too (the route is not known)."""
    error: dict[str, Any] = {"code": code, "message": message, "field": None}
    error["type"] = "invalid_request_error" if status < 500 else "server_error"
    error["param"] = None
    return json.dumps({"error": error}).encode()


class StructuredH11Protocol(H11Protocol):
    """uvicorn's h11 protocol whose own rejections are structured JSON, and which holds
    every request head to :data:`MAX_HEAD_BYTES` (h11 alone only checks a head that is
    still incomplete: one that arrives whole in a single read, up to 256 KiB, passes).

    The check runs whenever a request may begin: on data received between requests, and
    when a pipelined request's turn comes (uvicorn handles buffered events again after
    each response), so a second request sent with the first is held to it too."""

    def handle_events(self) -> None:
        if self.conn.their_state is h11.IDLE and self._head_bytes() > MAX_HEAD_BYTES:
            self._reject("request_head_too_large", "request line and headers exceed "
                         f"{MAX_HEAD_BYTES} bytes")  # fmt: skip
            return
        super().handle_events()

    def _head_bytes(self) -> int:
        """The length of the next request's head received so far (up to its blank line)."""
        received = self.conn.trailing_data[0]
        end = received.find(b"\r\n\r\n")
        return len(received) if end < 0 else end

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this while handling h11's ``RemoteProtocolError``, whose message
        says what was wrong with the request."""
        exc = sys.exc_info()[1]
        if isinstance(exc, h11.RemoteProtocolError) and exc.error_status_hint == 431:
            self._reject("request_head_too_large", f"request line and headers exceed "
                         f"{MAX_HEAD_BYTES} bytes")  # fmt: skip
        else:
            self._reject("malformed_request", f"invalid HTTP request: {exc or msg}")

    def _reject(self, code: str, message: str) -> None:
        """A 400 with the error body, written as is (h11 has no request to answer)."""
        body = rejection_body(400, code, message)
        head = (
            "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()


# uvicorn.run / uvicorn.Config keyword arguments of every server here.
SERVER_OPTIONS: dict[str, Any] = {
    "http": StructuredH11Protocol,
    "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
}
