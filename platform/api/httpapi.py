"""The gateway's own HTTP conventions, on top of the layer it shares with the executors
(``runtime/asgi.py``: bodies, msgpack or strict JSON, structured errors, auth).

Only the public API has them: the ``Prefer: wait=N`` and ``Last-Event-ID`` headers, and job
events as a server-sent event stream.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse

from retouch.functions.wire.jobs import JobEvent
from retouch.platform.jobs import sse
from retouch.runtime import requestparams

MAX_WAIT_S = 60.0  # the longest ``Prefer: wait=N`` honoured
KEEPALIVE_S = 15.0  # a comment line on an idle event stream
MAX_EVENT_ID = 2**53 - 1  # event ids are counters; this is any client's safe integer


def parse_prefer_wait(header: str | None) -> float | None:
    """``Prefer: wait=N`` (RFC 7240, as Replicate uses it): seconds to block, at most 60;
    a bare ``Prefer: wait`` (what Replicate's clients send for ``wait=True``) is 60."""
    if not header:
        return None
    for part in header.split(","):
        name, eq, value = part.strip().partition("=")
        if name.strip().lower() == "wait":
            if not eq:
                return MAX_WAIT_S
            return requestparams.decimal(value.strip().strip('"'), "Prefer", 0.0, MAX_WAIT_S)
    return None


def last_event_id(request: Request) -> int:
    """Where a reader resumes an event stream: ``Last-Event-ID`` (an ``EventSource``
    reconnecting) or ``?after=`` (a first connection); 0 replays every event."""
    header = request.headers.get("last-event-id")
    if header:
        return requestparams.integer(header, "Last-Event-ID", 0, MAX_EVENT_ID)
    return requestparams.integer(request.query_params.get("after"), "after", 0, MAX_EVENT_ID, 0)


def event_stream(
    events: AsyncIterator[JobEvent | None],
    render: Callable[[JobEvent], bytes] = sse.frame,
) -> StreamingResponse:
    """A job's events as ``text/event-stream`` (each as ``render`` frames it: retouch's
    events, or a prediction's); ``None`` items mark idle periods, and an idle stream gets a
    keep-alive comment every ``KEEPALIVE_S`` so proxies keep it open."""

    async def stream() -> AsyncIterator[bytes]:
        idle_since = time.monotonic()
        async for event in events:
            if event is not None:
                idle_since = time.monotonic()
                yield render(event)
            elif time.monotonic() - idle_since >= KEEPALIVE_S:
                idle_since = time.monotonic()
                yield sse.KEEPALIVE

    headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
    return StreamingResponse(stream(), media_type=sse.MEDIA_TYPE, headers=headers)
