"""Replicate-compatible predictions: what Replicate's clients call, served by retouch's jobs.

A prediction IS a job: ``POST /v1/predictions`` and ``POST /v1/models/{owner}/{name}/
predictions`` (what ``replicate.run("owner/name", input=...)`` calls) submit one through
the gateway's one way in for durable jobs (the admission, queue, caps, journal and
webhook checks of ``POST /v1/functions/{name}/jobs``), under the same id, readable at
``/v1/jobs/{id}`` too. This module reads Replicate's request body, renders a job as
Replicate's prediction document, and its events in the form Replicate's client streams
(``logs``, ``output``, ``error``, ``done``: ``platform/jobs/prediction.py``). Its webhooks are the sender's, in the
``replicate`` format: the prediction document, signed as Standard Webhooks specify.

Names: ``version`` and ``model`` name a function, as ``name`` or ``owner/name``. Function
names are one namespace per gateway, shared by its tenants, so ``owner`` looks nothing up
(any name of a tenant's form is accepted); a prediction's ``model`` reads
``retouch/<function>`` and its ``version`` the function's name.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from retouch.functions.errors import BadRequest, NotFound, RetouchError, unknown_field_message
from retouch.functions.wire.codec import as_map
from retouch.functions.wire.invoke import ALIASES, INVOKE_FIELDS, InvokeRequest
from retouch.functions.wire.jobs import JobRequest, WebhookEvent, WebhookFormat, parse_target_url
from retouch.platform.api.httpapi import event_stream, last_event_id, parse_prefer_wait
from retouch.platform.fleet.deployed import DeployedFunction
from retouch.platform.jobs.job import Job
from retouch.platform.jobs.prediction import document, frames
from retouch.platform.state.auth import TENANT, TENANT_RULE
from retouch.runtime import requestparams
from retouch.runtime.asgi import respond

if TYPE_CHECKING:
    from retouch.platform.api.frontdoor import FrontDoor
    from retouch.platform.jobs.webhooks import WebhookSender

PAGE_SIZE = 100  # predictions per listing page (Replicate's)
MAX_PAGE = 1000
# Replicate's webhook events and the job events that deliver them. One image is a job's
# output, there once it succeeded: ``output`` comes with its completion (one delivery).
WEBHOOK_EVENTS = {
    "start": (WebhookEvent.STARTED,),
    "output": (WebhookEvent.COMPLETED,),
    "logs": (WebhookEvent.STARTED, WebhookEvent.PROGRESS),
    "completed": (WebhookEvent.COMPLETED,),
}
MODEL_FIELDS = ("input", "webhook", "webhook_events_filter", "stream")
CREATE_FIELDS = ("version", "model", *MODEL_FIELDS)
MODEL_REF = re.compile(r"(?:([^/]{1,64})/)?([^/:]{1,63})")  # [owner/]name
CURSOR = re.compile(r"([0-9.eE+-]{1,32})-([0-9a-f]{32})")  # <created_at>-<job id>

# The gateway's intake of a durable job: a reader of the body into (function, request),
# and the function when the URL names it (admitted before the body is read).
Read = Callable[[Any], tuple[DeployedFunction, JobRequest]]
Accept = Callable[[Request, Read, DeployedFunction | None], Awaitable[Job]]


def known_fields(raw: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    """A prediction's body, every field one of ``allowed`` (else ``unknown_field``)."""
    body = as_map(raw)
    for key in body:
        if key not in allowed:
            raise BadRequest(unknown_field_message(key, allowed), field=key, code="unknown_field")
    return body


def job_request(body: dict[str, Any]) -> JobRequest:
    """A prediction's body (its ``input`` the invoke request's fields) as a job request
    with Replicate-format webhooks; an error in ``input`` names ``input.<field>``."""
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise BadRequest("stream must be true or false", field="stream", code="invalid_field")
    if not isinstance(body.get("input"), dict):
        code = "missing_field" if body.get("input") is None else "invalid_field"
        raise BadRequest("input must be a map of the edit's fields", field="input", code=code)
    webhook = None if body.get("webhook") is None else str(parse_target_url(body["webhook"]))
    events = webhook_events(body.get("webhook_events_filter"))
    try:
        invoke = InvokeRequest.from_wire(body["input"])
        return JobRequest(
            invoke=invoke,
            webhook=webhook,
            webhook_events=events,
            webhook_format=WebhookFormat.REPLICATE,
        )
    except RetouchError as exc:
        in_input(exc, reading_input=True)
        raise


def webhook_events(raw: Any) -> tuple[WebhookEvent, ...]:
    """``webhook_events_filter`` (Replicate's names) as the job events that deliver them;
    absent: every event."""
    names = list(WEBHOOK_EVENTS) if raw is None else raw
    if not isinstance(names, list) or not names or not all(n in WEBHOOK_EVENTS for n in names):
        raise BadRequest(
            f"webhook_events_filter must be a non-empty list of {', '.join(WEBHOOK_EVENTS)}",
            field="webhook_events_filter",
            code="invalid_field",
        )
    return tuple(dict.fromkeys(e for name in names for e in WEBHOOK_EVENTS[name]))


def in_input(exc: RetouchError, reading_input: bool = False) -> None:
    """Name an error about one of the edit's fields as the prediction holds it
    (``input.<field>``). ``reading_input``: raised reading ``input``, so whatever field
    it names (an unknown one too) is one of ``input``'s."""
    head = (exc.field or "").split(".", 1)[0]
    if exc.code == "unknown_field" and not reading_input:
        return  # a top-level field the body should not have (``prompt`` outside ``input``)
    if reading_input or head in INVOKE_FIELDS or head in ALIASES:
        exc.field = "input" if exc.field is None else f"input.{exc.field}"


def function_name(raw: Any, field: str) -> str:
    """The function a ``version`` or ``model`` names (``name`` or ``owner/name``)."""
    m = MODEL_REF.fullmatch(raw) if isinstance(raw, str) else None
    if m is None or (m.group(1) is not None and not TENANT.fullmatch(m.group(1))):
        raise BadRequest(
            f"{field} must name a function, as 'name' or 'owner/name'",
            field=field,
            code="invalid_field",
        )
    return m.group(2)


class Predictions:
    """The handlers of Replicate's prediction routes, on the gateway's job store."""

    def __init__(
        self, door: FrontDoor, accept: Accept, webhooks: WebhookSender, base_url: str
    ) -> None:
        self.door = door
        self.jobs = door.jobs
        self.accept = accept  # the gateway's intake of durable jobs
        self.webhooks = webhooks
        self.base_url = base_url  # the public URL: prediction URLs are absolute, as Replicate's

    # ---- create --------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        """``POST /v1/predictions``: ``version`` or ``model`` names the function."""
        wait_s = parse_prefer_wait(request.headers.get("prefer"))
        return await self._answer(
            request, await self._submit(request, self._read_create), wait_s, 201
        )

    async def create_for_model(self, request: Request) -> Response:
        """``POST /v1/models/{owner}/{name}/predictions``: the URL names the function."""
        requestparams.identifier(request.path_params["owner"], "owner", TENANT, TENANT_RULE)
        wait_s = parse_prefer_wait(request.headers.get("prefer"))
        fn = self._function(request.path_params["name"], "name")
        job = await self._submit(
            request, lambda raw: (fn, job_request(known_fields(raw, MODEL_FIELDS))), fn
        )
        return await self._answer(request, job, wait_s, 201)

    async def _submit(
        self, request: Request, read: Read, fn: DeployedFunction | None = None
    ) -> Job:
        """Through the gateway's intake; what the front door finds wrong with the edit
        (its template, its mask) is named as ``input``'s."""
        try:
            return await self.accept(request, read, fn)
        except RetouchError as exc:
            in_input(exc)
            raise

    def _read_create(self, raw: Any) -> tuple[DeployedFunction, JobRequest]:
        body = known_fields(raw, CREATE_FIELDS)
        given = [k for k in ("version", "model") if body.get(k) is not None]
        if len(given) != 1:
            raise BadRequest(
                "give the function as one of version or model",
                field="version",
                code="missing_field" if not given else "invalid_field",
            )
        name = function_name(body[given[0]], given[0])
        return self._function(name, given[0]), job_request(body)

    def _function(self, name: str, field: str) -> DeployedFunction:
        try:
            return self.door.servable(name)
        except NotFound as exc:
            exc.field = field
            raise

    # ---- read, list, cancel, stream ------------------------------------------------------
    async def get(self, request: Request) -> Response:
        job = await self.jobs.get(request.path_params["id"], request.state.principal)
        return await self._answer(request, job, parse_prefer_wait(request.headers.get("prefer")))

    async def list(self, request: Request) -> dict[str, Any]:
        """Replicate's page: ``{"next", "previous", "results"}``, newest first; ``next``
        is the URL of the following page (``previous`` is always null)."""
        query = request.query_params
        limit = requestparams.integer(query.get("limit"), "limit", 1, MAX_PAGE, PAGE_SIZE)
        before = None if query.get("cursor") is None else parse_cursor(query["cursor"])
        jobs = await self.jobs.list(request.state.principal, limit=limit + 1, before=before)
        page, more = jobs[:limit], len(jobs) > limit
        following = None
        if more:
            following = f"{self.base_url}/v1/predictions?cursor={cursor(page[-1])}"
            if limit != PAGE_SIZE:
                following += f"&limit={limit}"
        results = [document(job, self.base_url) for job in page]
        return {"next": following, "previous": None, "results": results}

    async def cancel(self, request: Request) -> dict[str, Any]:
        job = await self.jobs.get(request.path_params["id"], request.state.principal)
        return document(await self.jobs.cancel(job), self.base_url)

    async def stream(self, request: Request) -> StreamingResponse:
        job = await self.jobs.get(request.path_params["id"], request.state.principal)
        return event_stream(self.jobs.events(job, last_event_id(request)), frames)

    async def webhook_secret(self, request: Request) -> Response:
        """``GET /v1/webhooks/default/secret``: the caller's own tenant's signing secret,
        as Standard Webhooks write it (what ``Webhooks.validate`` takes)."""
        doc = {"key": self.webhooks.standard_key_for(request.state.principal.tenant)}
        return respond(request, doc, 200, {"cache-control": "no-store"})

    async def _answer(
        self, request: Request, job: Job, wait_s: float | None, status: int = 200
    ) -> Response:
        job = await self.jobs.settle(job, wait_s)
        headers = None if wait_s is None else {"preference-applied": f"wait={wait_s:g}"}
        doc = document(job, self.base_url, waited_out=wait_s is not None)
        return respond(request, doc, status, headers)


def cursor(job: Job) -> str:
    """Where a listing page ends: its last job's creation time and id."""
    return f"{job.created_at!r}-{job.id}"


def parse_cursor(raw: str) -> tuple[float, str]:
    m = CURSOR.fullmatch(raw)
    if m is None:
        raise BadRequest(
            "cursor must be a listing's next link's, as it gave it",
            field="cursor",
            code="invalid_field",
        )
    return requestparams.decimal(m.group(1), "cursor", 0.0, 1e12), m.group(2)


def answers_replicate(request: Request) -> bool:
    """Whether ``request`` is one of Replicate's routes (its errors Replicate-shaped)."""
    path = request.url.path
    return path.startswith(("/v1/predictions", "/v1/models/", "/v1/webhooks/default/"))


def replicate_error(
    request: Request, exc: RetouchError, headers: dict[str, str] | None = None
) -> Response:
    """retouch's error body plus RFC 7807's ``title``, ``detail`` and ``status``, which
    Replicate's clients read into ``ReplicateError`` (``detail`` names the field)."""
    body: dict[str, Any] = exc.to_wire()
    detail = exc.message if exc.field is None else f"{exc.field}: {exc.message}"
    body |= {"title": exc.code, "detail": detail, "status": exc.status}
    return respond(request, body, exc.status, headers)
