"""Server-sent events (text/event-stream): the framing the gateway writes and the parser
the client reads. Data lines are JSON; a comment line keeps idle connections open."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from retouch.functions.wire.jobs import JobEvent, JobEventKind

MEDIA_TYPE = "text/event-stream"
KEEPALIVE = b": keep-alive\n\n"


def frame(event: JobEvent) -> bytes:
    """A job event as retouch's streams carry it: its kind, its data as one JSON line."""
    return text_frame(event.seq, event.kind.value, json_data(event.data))


def text_frame(seq: int, name: str, data: str) -> bytes:
    """One event: ``data`` on as many ``data:`` lines as it has lines."""
    lines = "".join(f"data: {line}\n" for line in data.split("\n"))
    return f"id: {seq}\nevent: {name}\n{lines}\n".encode()


def json_data(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), default=_no_bytes)


def _no_bytes(value: Any) -> Any:
    raise TypeError(f"not JSON serializable in an event: {type(value).__name__}")


def parse(lines: Iterable[str]) -> Iterator[JobEvent]:
    """Events from the lines of a stream (comments and unknown event names skipped)."""
    seq, kind, data = 0, "", []
    for line in lines:
        if line == "":
            event = _event(seq, kind, data)
            if event is not None:
                yield event
            seq, kind, data = 0, "", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id" and value.isdigit():
            seq = int(value)
        elif name == "event":
            kind = value
        elif name == "data":
            data.append(value)


def _event(seq: int, kind: str, data: list[str]) -> JobEvent | None:
    """None for an event this client does not know (or one without data)."""
    if not kind or not data:
        return None
    try:
        return JobEvent(seq, JobEventKind(kind), json.loads("\n".join(data)))
    except ValueError:
        return None


class Parser:
    """Incremental form of :func:`parse` for async streams: feed lines, take events."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def feed(self, line: str) -> list[JobEvent]:
        self._lines.append(line)
        if line != "":
            return []
        events = list(parse(self._lines))
        self._lines = []
        return events
