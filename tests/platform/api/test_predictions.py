"""Replicate-style predictions without a server: the prediction document (Replicate's status
words, the ``starting`` of a waited-out answer), the stream as Replicate's own client decodes
it, the request body's checks (fields named as the prediction holds them), webhook event
filters, listing cursors and Standard Webhooks signatures that Replicate's ``validate``
accepts."""

from __future__ import annotations

import pytest
from replicate.prediction import Prediction
from replicate.stream import EventSource
from replicate.webhook import InvalidSignatureError, Webhooks, WebhookSigningSecret

from retouch.functions.errors import BadRequest, RetouchError
from retouch.functions.wire.jobs import (
    JobEvent,
    JobEventKind,
    JobProgress,
    JobRequest,
    JobStatus,
    WebhookEvent,
    WebhookFormat,
)
from retouch.platform.api import predictions
from retouch.platform.api.httpapi import MAX_WAIT_S, parse_prefer_wait
from retouch.platform.jobs import prediction, webhooks
from retouch.platform.jobs.job import Job
from tests.platform.jobs.test_jobs import request

BASE = "http://gw.example:8000"
INPUT = {"template": "t", "mask": "cG5n", "prompt": "p", "seed": 1}


def job(status: JobStatus = JobStatus.QUEUED, **fields) -> Job:
    return Job("a" * 32, "inpaint", request(), 10.0, status=status, **fields)


def test_document_speaks_replicate_and_parses_as_its_prediction() -> None:
    for status, word in prediction.STATUS.items():
        doc = prediction.document(job(status), BASE)
        assert doc["status"] == word
        parsed = Prediction(**doc)  # what Replicate's client builds from it
        assert (parsed.model, parsed.version) == ("retouch/inpaint", "inpaint")
    doc = prediction.document(job(JobStatus.RUNNING, started_at=11.0), BASE)
    assert doc["urls"] == {
        "get": f"{BASE}/v1/predictions/{'a' * 32}",
        "cancel": f"{BASE}/v1/predictions/{'a' * 32}/cancel",
        "stream": f"{BASE}/v1/predictions/{'a' * 32}/stream",
    }
    assert doc["input"]["prompt"] == "p" and doc["input"]["mask"] == "<3 bytes>"
    # a Prefer: wait that ran out reads "starting", so replicate.run goes on polling
    assert prediction.document(job(JobStatus.RUNNING), BASE, waited_out=True)["status"] == (
        "starting"
    )
    failed = job(JobStatus.FAILED, error=RetouchError("boom", code="executor_error"))
    assert prediction.document(failed, BASE, waited_out=True)["error"] == "boom"


def test_running_logs_carry_progress_replicates_client_reads() -> None:
    running = job(JobStatus.RUNNING, started_at=11.0, executor="exec-0")
    running.progress = JobProgress(2, 8)
    progress = Prediction(**prediction.document(running, BASE)).progress
    assert progress is not None and (progress.current, progress.total) == (2, 8)
    assert progress.percentage == 0.25


class Lines:
    """A response stand-in for Replicate's ``EventSource``: SSE bytes as its lines."""

    def __init__(self, data: bytes) -> None:
        self.headers = {"content-type": "text/event-stream"}
        self.data = data

    def iter_lines(self):
        yield from self.data.decode().split("\n")


def decoded(events: list[JobEvent]) -> list[tuple[str, str, str]]:
    data = b"".join(prediction.frames(e) for e in events)
    source = EventSource(None, Lines(data), use_file_output=False)  # type: ignore[arg-type]
    return [(e.event.value, e.data, e.id) for e in source]


def test_stream_as_replicates_client_decodes_it() -> None:
    url = f"{BASE}/v1/images/{'a' * 32}.png?expires=1&sig=x"
    events = [
        JobEvent(1, JobEventKind.QUEUED, {"position": None}),  # nothing to say yet
        JobEvent(2, JobEventKind.QUEUED, {"position": 1}),
        JobEvent(3, JobEventKind.STARTED, {"executor": "e", "attempt": 1, "started_at": "T"}),
        JobEvent(4, JobEventKind.PROGRESS, {"step": 1, "total": 2}),
        JobEvent(5, JobEventKind.SUCCEEDED, {"output": url}),
    ]
    assert decoded(events) == [
        ("logs", "waiting in the queue at position 1", "2"),
        ("logs", "T started on e (attempt 1)", "3"),
        ("logs", " 50%|#####     | 1/2", "4"),
        ("output", url, "5"),
        ("done", "{}", "5"),
    ]
    canceled = JobEvent(6, JobEventKind.CANCELED, {})
    assert decoded([canceled]) == [("done", '{"reason":"canceled"}', "6")]
    failed = JobEvent(7, JobEventKind.FAILED, {"error": {"message": "no executor"}})
    with pytest.raises(RuntimeError, match="no executor"):  # how the client reports it
        decoded([failed])


def test_body_checks_name_the_field_as_the_prediction_holds_it() -> None:
    req = predictions.job_request({"input": INPUT, "webhook": "http://127.0.0.1:9/h"})
    assert req.webhook_format is WebhookFormat.REPLICATE
    assert set(req.webhook_events) == set(WebhookEvent)  # no filter: every event
    assert JobRequest.from_wire(req.to_wire()) == req  # journaled and resumed as is
    cases = [
        ({"input": {**INPUT, "prompt": 5}}, "input.prompt"),
        ({"input": {**INPUT, "steps": 0}}, "input.steps"),
        ({"input": {**INPUT, "colour": "red"}}, "input.colour"),
        ({"input": {"mask": "cG5n", "prompt": "p"}}, "input.template"),
        ({"input": "x"}, "input"),
        ({}, "input"),
        ({"input": INPUT, "stream": "yes"}, "stream"),
        ({"input": INPUT, "webhook": "ftp://127.0.0.1/h"}, "webhook"),
        ({"input": INPUT, "webhook_events_filter": ["begin"]}, "webhook_events_filter"),
        ({"input": INPUT, "webhook_events_filter": []}, "webhook_events_filter"),
    ]
    for body, field in cases:
        with pytest.raises(BadRequest) as err:
            predictions.job_request(body)
        assert err.value.field == field, body
    with pytest.raises(BadRequest) as err:
        predictions.known_fields({"input": INPUT, "webhook_completed": "x"}, ("input",))
    assert (err.value.field, err.value.code) == ("webhook_completed", "unknown_field")
    with pytest.raises(BadRequest) as err:  # an edit field outside input is the body's
        predictions.known_fields({"input": INPUT, "prompt": "x"}, ("input",))
    predictions.in_input(err.value)
    assert (err.value.field, err.value.code) == ("prompt", "unknown_field")
    for raw in ("a/b/c", "owner/", "fn:v1", 5, "bad owner/fn"):
        with pytest.raises(BadRequest) as err:
            predictions.function_name(raw, "model")
        assert err.value.field == "model", raw
    assert predictions.function_name("acme/inpaint", "model") == "inpaint"
    assert predictions.function_name("inpaint", "version") == "inpaint"


def test_webhook_event_filter_maps_replicates_names() -> None:
    assert predictions.webhook_events(["start"]) == (WebhookEvent.STARTED,)
    assert predictions.webhook_events(["completed", "output"]) == (WebhookEvent.COMPLETED,)
    assert set(predictions.webhook_events(["logs"])) == {
        WebhookEvent.STARTED,
        WebhookEvent.PROGRESS,
    }
    with pytest.raises(BadRequest) as err:
        JobRequest.from_wire({**INPUT, "webhook_format": "cog"})
    assert err.value.field == "webhook_format"


def test_cursor_round_trip_and_bad_cursors() -> None:
    j = job()
    assert predictions.parse_cursor(predictions.cursor(j)) == (10.0, j.id)
    for bad in ("", "abc", f"10.0-{'A' * 32}", f"1e99-{'a' * 32}", "10.0-" + "a" * 31):
        with pytest.raises(BadRequest) as err:
            predictions.parse_cursor(bad)
        assert err.value.field == "cursor", bad


def test_standard_webhooks_signature_replicate_validates() -> None:
    key = webhooks.tenant_secret(b"server", "tenant-a")
    body = b'{"id":"x","status":"succeeded"}'
    headers = {
        "webhook-id": "x-completed",
        "webhook-timestamp": "1000",
        "webhook-signature": webhooks.sign_standard(key, "x-completed", body, 1000),
    }
    secret = WebhookSigningSecret(key=webhooks.standard_key(key))
    assert Webhooks.validate(headers=headers, body=body.decode(), secret=secret) is None
    other = WebhookSigningSecret(key=webhooks.standard_key(b"another tenant's"))
    with pytest.raises(InvalidSignatureError):
        Webhooks.validate(headers=headers, body=body.decode(), secret=other)
    with pytest.raises(InvalidSignatureError):
        Webhooks.validate(headers={**headers, "webhook-id": "y"}, body=body.decode(), secret=secret)


def test_bare_prefer_wait_is_the_longest() -> None:
    assert parse_prefer_wait("wait") == MAX_WAIT_S
    assert parse_prefer_wait("respond-async, wait") == MAX_WAIT_S
