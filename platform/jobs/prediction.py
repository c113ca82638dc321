"""A job in Replicate's words: the prediction document and its stream's frames.

What ``platform/api/predictions.py`` answers and what the webhook sender delivers in the
``replicate`` format (``platform/jobs/webhooks.py``) are the same document, rendered here from
the job (``platform/jobs/job.py``) with no HTTP of its own.
"""

from __future__ import annotations

from typing import Any

from retouch.functions.wire.jobs import JobEvent, JobEventKind, JobStatus
from retouch.platform.jobs import sse
from retouch.platform.jobs.job import Job, iso, progress_line, queue_line, start_line

MODEL_OWNER = "retouch"  # the owner a prediction's ``model`` names
# A job's status in Replicate's words.
STATUS = {
    JobStatus.QUEUED: "starting",
    JobStatus.RUNNING: "processing",
    JobStatus.SUCCEEDED: "succeeded",
    JobStatus.FAILED: "failed",
    JobStatus.CANCELED: "canceled",
}


def document(job: Job, base_url: str, waited_out: bool = False) -> dict[str, Any]:
    """A job as Replicate's prediction. ``waited_out``: the answer to a ``Prefer: wait``
    that ended before the job did; it reads ``starting`` as Replicate's does, which is
    what tells its ``replicate.run`` to go on polling (``processing`` would end it)."""
    status = STATUS[job.status]
    if waited_out and not job.status.terminal:
        status = STATUS[JobStatus.QUEUED]
    url = f"{base_url}/v1/predictions/{job.id}"
    return {
        "id": job.id,
        "model": f"{MODEL_OWNER}/{job.function}",
        "version": job.function,
        "status": status,
        "input": job.request.invoke.echo(),
        "output": job.output,
        "logs": job.logs(),
        "error": None if job.error is None else job.error.message,
        "metrics": job.metrics(),
        "urls": {"get": url, "cancel": f"{url}/cancel", "stream": f"{url}/stream"},
        "created_at": iso(job.created_at),
        "started_at": iso(job.started_at),
        "completed_at": iso(job.completed_at),
        "data_removed": job.status is JobStatus.SUCCEEDED and job.output is None,
        "source": "api",
    }


def frames(event: JobEvent) -> bytes:
    """A job event as Replicate's stream carries it (``logs`` lines, the ``output`` URL,
    an ``error``, then ``done``), under the job event's id (so ``Last-Event-ID`` resumes)."""
    data, seq = event.data, event.seq
    if event.kind is JobEventKind.QUEUED:
        position = data.get("position")
        return b"" if position is None else sse.text_frame(seq, "logs", queue_line(position))
    if event.kind is JobEventKind.STARTED:
        line = start_line(data.get("started_at"), data["executor"], data["attempt"])
        return sse.text_frame(seq, "logs", line)
    if event.kind is JobEventKind.PROGRESS:
        return sse.text_frame(seq, "logs", progress_line(data["step"], data["total"]))
    if event.kind is JobEventKind.SUCCEEDED:
        output = sse.text_frame(seq, "output", data.get("output") or "")
        return output + sse.text_frame(seq, "done", "{}")
    if event.kind is JobEventKind.FAILED:
        detail = (data.get("error") or {}).get("message", "the prediction failed")
        error = sse.text_frame(seq, "error", sse.json_data({"detail": detail}))
        return error + sse.text_frame(seq, "done", sse.json_data({"reason": "error"}))
    return sse.text_frame(seq, "done", sse.json_data({"reason": "canceled"}))
