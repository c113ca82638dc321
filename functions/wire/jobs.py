"""Async jobs on the wire (the public API): the job request, its status and events,
webhook settings and the checks of a webhook's URL."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Self

import httpx
from pydantic import BeforeValidator, model_validator

from retouch.functions.errors import BadRequest
from retouch.functions.wire.codec import as_map
from retouch.functions.wire.invoke import InvokeRequest
from retouch.functions.wire.struct import Struct


class JobStatus(StrEnum):
    """A job's life: ``queued`` (in the gateway queue) -> ``running`` (sent to an executor)
    -> one of the terminal states."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELED)


class JobEventKind(StrEnum):
    """The events of ``GET /v1/jobs/{id}/events`` (server-sent events)."""

    QUEUED = "queued"
    STARTED = "started"
    PROGRESS = "progress"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"


class WebhookEvent(StrEnum):
    """What a job's webhook may be told: ``completed`` covers every terminal state."""

    STARTED = "started"
    PROGRESS = "progress"
    COMPLETED = "completed"


class WebhookFormat(StrEnum):
    """What a job's webhook deliveries carry: retouch's own envelope around the job
    document, or Replicate's prediction document (a job submitted as a prediction)."""

    RETOUCH = "retouch"
    REPLICATE = "replicate"


DEFAULT_WEBHOOK_EVENTS = (WebhookEvent.COMPLETED,)
JOB_ID = re.compile(r"[0-9a-f]{32}")
MAX_URL_CHARS = 2048
MAX_HOST_CHARS = 253  # a DNS name, without its trailing dot
MAX_LABEL_CHARS = 63


def check_job_id(raw: str) -> str:
    """A job id as the gateway makes them (32 lowercase hex digits), or ``invalid_field``."""
    if not JOB_ID.fullmatch(raw):
        raise BadRequest("a job id is 32 lowercase hex digits", field="id", code="invalid_field")
    return raw


def parse_target_url(raw: Any, field: str = "webhook") -> httpx.URL:
    """The one parser of URLs the gateway calls or fetches (webhooks at submission, in the
    allow-list and in the sender; remote ``image``/``mask`` inputs): an
    absolute http(s) URL with a host that is an IP literal or a DNS name (labels of 1-63
    characters, 253 in all), a valid port, no user info, and written the way it parses back
    (so no control character, space or alternative spelling can make a check and a
    connection read different hosts). Else ``invalid_field`` on ``field``."""
    if not isinstance(raw, str):
        raise BadRequest(f"{field} must be a URL string", field=field, code="invalid_field")
    if len(raw) > MAX_URL_CHARS:
        raise BadRequest(
            f"{field} longer than {MAX_URL_CHARS} characters", field=field, code="invalid_field"
        )
    try:
        url = httpx.URL(raw)
    except httpx.InvalidURL as exc:
        raise BadRequest(f"{field}: {exc}", field=field, code="invalid_field") from exc
    if url.scheme not in ("http", "https"):
        raise BadRequest(f"{field} must be an http or https URL", field=field, code="invalid_field")
    if not url.raw_host:
        raise BadRequest(f"{field} URL has no host", field=field, code="invalid_field")
    _check_host_name(url.raw_host.decode("ascii"), field)
    if url.port is not None and not 0 < url.port < 65536:
        raise BadRequest(f"{field} port {url.port} out of range", field=field, code="invalid_field")
    if url.userinfo:
        raise BadRequest(
            f"{field} URL must not carry user info (user@host)",
            field=field,
            code="invalid_field",
        )
    if str(url) != raw:
        raise BadRequest(
            f"{field} URL does not read back the same; write it as {str(url)!r}",
            field=field,
            code="invalid_field",
        )
    return url


def _check_host_name(host: str, field: str) -> None:
    """A host the resolver can look up: an IP literal, or a name whose labels are
    1-63 characters (253 in all, one trailing dot allowed), as DNS (RFC 1035) requires;
    else ``invalid_field`` on ``field`` rather than a lookup that fails at delivery."""
    if ":" in host:  # an IPv6 literal (httpx checked it); an IPv4 one passes as labels
        return
    name = host[:-1] if host.endswith(".") else host
    if len(name) > MAX_HOST_CHARS:
        raise BadRequest(
            f"{field} host name longer than {MAX_HOST_CHARS} characters",
            field=field,
            code="invalid_field",
        )
    for label in name.split("."):
        if not 0 < len(label) <= MAX_LABEL_CHARS:
            raise BadRequest(
                f"{field} host {host!r} has an empty label or one over {MAX_LABEL_CHARS} "
                "characters",
                field=field,
                code="invalid_field",
            )


def _webhook(value: Any) -> Any:
    return str(parse_target_url(value))


def _webhook_events(raw: Any) -> tuple[WebhookEvent, ...]:
    if not isinstance(raw, list | tuple) or not raw:
        raise BadRequest(
            "webhook_events must be a non-empty list of started, progress, completed",
            field="webhook_events",
            code="invalid_field",
        )
    try:
        return tuple(dict.fromkeys(WebhookEvent(e) for e in raw))
    except (ValueError, TypeError):
        raise BadRequest(
            f"webhook_events: unknown event in {raw!r}; known: started, progress, completed",
            field="webhook_events",
            code="invalid_field",
        ) from None


REPORTING = ("webhook", "webhook_events", "webhook_format")  # a job's fields beside the invoke's


class JobRequest(Struct):
    """``POST /v1/functions/{name}/jobs``: an invocation plus where to report on it, and
    in which form (``webhook_format``; a prediction's is ``replicate``). On the wire the
    reporting fields sit beside the invocation's own, in one map."""

    invoke: InvokeRequest
    webhook: Annotated[str, BeforeValidator(_webhook)] | None = None
    webhook_events: Annotated[tuple[WebhookEvent, ...], BeforeValidator(_webhook_events)] = (
        DEFAULT_WEBHOOK_EVENTS
    )
    webhook_format: Annotated[
        WebhookFormat, BeforeValidator(lambda v: _choice(v, WebhookFormat, "webhook_format"))
    ] = WebhookFormat.RETOUCH

    @model_validator(mode="after")
    def _one_image(self) -> Self:
        if self.invoke.num_images_per_prompt != 1:
            # A job is one image: one seat in the queue, one placement, one cancel, one
            # retained result, one ``output`` link (invoke fans several out into jobs).
            raise BadRequest(
                "a job makes one image: submit one job per image (seed, seed + 1, ...), "
                "or invoke with num_images_per_prompt",
                field="num_images_per_prompt",
                code="unsupported_field",
            )
        return self

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        body = as_map(obj)
        invoke = InvokeRequest.from_wire({k: v for k, v in body.items() if k not in REPORTING})
        return super().from_wire({**{k: body[k] for k in REPORTING if k in body}, "invoke": invoke})

    def to_wire(self) -> dict[str, Any]:
        out = self.invoke.to_wire()
        if self.webhook is not None:
            out["webhook"] = self.webhook
            out["webhook_events"] = [e.value for e in self.webhook_events]
        if self.webhook_format is not WebhookFormat.RETOUCH:
            out["webhook_format"] = self.webhook_format.value
        return out


def _choice(raw: Any, kind: type[StrEnum], name: str) -> Any:
    """One of ``kind``'s values, else ``invalid_field`` on ``name`` listing them."""
    try:
        return kind(raw)
    except (ValueError, TypeError):
        known = ", ".join(k.value for k in kind)
        raise BadRequest(
            f"{name} must be one of {known}", field=name, code="invalid_field"
        ) from None


@dataclass(frozen=True)
class JobProgress:
    """A running job's denoising progress (``eta_s`` from its own pace so far)."""

    step: int
    total: int
    eta_s: float | None = None

    @property
    def fraction(self) -> float:
        return self.step / self.total if self.total else 0.0

    def to_wire(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "total": self.total,
            "fraction": round(self.fraction, 4),
            "eta_s": None if self.eta_s is None else round(self.eta_s, 3),
        }


@dataclass(frozen=True)
class JobEvent:
    """One event of a job's stream; ``seq`` numbers a job's events from 1 (the SSE id, so a
    client reconnecting with ``Last-Event-ID`` gets only what it missed)."""

    seq: int
    kind: JobEventKind
    data: dict[str, Any]
