"""The public HTTP API (Starlette, msgpack; JSON accepted for control endpoints).

The gateway never touches a GPU (nor imports torch): it authenticates, validates and
decodes the payload (image decoding off the event loop, bounded by the declared size),
checks the mask against the template, computes the mask ratio, queues the invocation until
an executor has room (429 when the queue is full), forwards it, and answers — re-placing it
if its executor is lost. Deploys are stored durably first and then loaded onto executors in
the background; ``GET /v1/functions/{name}`` shows the progress.

Control operations on one function name (PUT, DELETE) are serialised by a per-name lock
and numbered (``platform/api/served.py``). What the gateway is built from (its home alone
or shared, the pool, the job store...) is decided in ``platform/api/composition.py``: here
are the routes, and the start and stop of the parts they use.

Every invocation is a job (``platform/jobs/store.py``): ``POST .../jobs`` answers 202 at once
(durable, with progress, events, cancel and webhooks), the synchronous ``POST .../invoke``
submits an unjournaled job and answers with its result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from retouch.functions.adaptercheck import check_adapters
from retouch.functions.errors import (
    BadRequest,
    Forbidden,
    InvalidSpec,
    NotFound,
    RetouchError,
    Unavailable,
)
from retouch.functions.imaging import declared_size, decode_image, encode_image
from retouch.functions.spec import FunctionSpec, parse_spec
from retouch.functions.wire.codec import as_map, decode_bytes
from retouch.functions.wire.executor import DeployStatus
from retouch.functions.wire.invoke import InvokeRequest
from retouch.functions.wire.jobs import JobRequest, JobStatus
from retouch.platform.api.bodybudget import BodyBudget
from retouch.platform.api.frontdoor import FrontDoor
from retouch.platform.api.home import Home
from retouch.platform.api.httpapi import event_stream, last_event_id, parse_prefer_wait
from retouch.platform.api.limits import GatewayLimits
from retouch.platform.api.metrics import GatewayMetrics
from retouch.platform.api.openai_images import OpenAIImages, answers_openai, openai_error
from retouch.platform.api.outputs import serve_output
from retouch.platform.api.predictions import Predictions, Read, answers_replicate, replicate_error
from retouch.platform.api.remoteinputs import InputFetcher
from retouch.platform.api.served import ServedFunctions
from retouch.platform.api.uploads import UploadNames
from retouch.platform.api.web import WebUI
from retouch.platform.fleet.deployed import DeployedFunction
from retouch.platform.fleet.pool import ExecutorPool
from retouch.platform.jobs.job import Job
from retouch.platform.jobs.links import LinkSigner
from retouch.platform.jobs.store import JobStore
from retouch.platform.jobs.webhooks import WebhookSender
from retouch.platform.state.auth import TENANT, TENANT_RULE, Principal, TokenAuth
from retouch.platform.state.catalogue import ModelCatalogue
from retouch.platform.state.registry import StoredFunction
from retouch.runtime import requestparams
from retouch.runtime.asgi import (
    bearer,
    endpoint,
    error_response,
    read_body,
    respond,
    structured_http_errors,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 32 << 20
MAX_JOB_LIST = 1000


@dataclass
class Gateway:
    """The routes, on the parts the composition built."""

    home: Home  # alone or shared: the registry, journals and secrets, and their loops
    pool: ExecutorPool
    auth: TokenAuth
    served: ServedFunctions  # the deployed functions, loaded onto the pool
    door: FrontDoor  # the one way in, and the job store
    webhooks: WebhookSender
    inputs: InputFetcher
    bodies: BodyBudget
    limits: GatewayLimits
    uploads: UploadNames  # whose uploads a viewer may see
    links: LinkSigner
    models: ModelCatalogue  # empty: the local check
    metrics: GatewayMetrics
    max_body: int = DEFAULT_MAX_BODY
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def jobs(self) -> JobStore:
        return self.door.jobs

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        for line in self.limits.log_lines():
            log.info(line)
        await self.pool.start()
        await self.served.load()
        await self.webhooks.start()
        await self.inputs.start()
        await self.jobs.start()  # resumes unfinished jobs: functions are tracked by now
        loops = self.home.background(self.jobs, self.webhooks, self.served)
        self._tasks = [asyncio.create_task(loop) for loop in loops]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.jobs.close()
        await self.inputs.close()
        await self.webhooks.close()
        self.served.cancel_loads()
        await self.pool.close()
        await self.home.close()

    # ---- auth & lookup -----------------------------------------------------------------
    def scope(self, scope: str):
        def authorize(request: Request) -> None:
            request.state.principal = self.auth.authorize(bearer(request), scope)

        return authorize

    def function(self, name: str) -> DeployedFunction:
        return self.door.function(name)

    def count_error(self, exc: RetouchError) -> None:
        self.metrics.errors.labels(exc.code, str(exc.status)).inc()

    # ---- handlers ------------------------------------------------------------------------
    async def healthz(self, request: Request) -> dict[str, Any]:
        return {"status": "ok"}

    async def readyz(self, request: Request) -> Any:
        healthy = sum(e.healthy for e in self.pool.fleet.executors)
        self.metrics.executors.set(healthy)
        pending = sorted(
            n for n, f in self.served.functions.items() if f.status is DeployStatus.DEPLOYING
        )
        if not self.pool.ready:  # an autoscaled pool is ready at zero: it starts one
            raise Unavailable("no healthy executor", code="not_ready")
        return {"status": "ready", "executors": healthy, "deploying": pending}

    async def metrics_text(self, request: Request) -> Response:
        for state in await self.pool.report.states():
            self.metrics.export_engine(state)
            self.metrics.export_adapters(state)
            self.metrics.export_startup(state)
        self.metrics.export_pool(self.pool.report)
        self.metrics.export_jobs(self.jobs.jobs.values(), self.webhooks.stats)
        self.metrics.export_decodes(self.door.images)
        self.metrics.export_bodies(self.bodies)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def list_functions(self, request: Request) -> dict[str, Any]:
        states, viewer = await self.pool.report.states(), principal(request)
        return {
            "functions": [
                self.uploads.own_uploads(f.describe(states), viewer)
                for _, f in sorted(self.served.functions.items())
            ]
        }

    async def get_function(self, request: Request) -> dict[str, Any]:
        fn = self.function(request.path_params["name"])
        return self.uploads.own_uploads(
            fn.describe(await self.pool.report.states()), principal(request)
        )

    async def put_function(self, request: Request) -> dict[str, Any]:
        name = request.path_params["name"]
        body = as_map(await read_body(request, self.max_body, json_ok=True))
        raw_spec = body.get("spec")
        if isinstance(raw_spec, dict):
            raw_spec = {"name": name, **raw_spec}
        spec = parse_spec(raw_spec)
        if spec.name != name:
            raise InvalidSpec(
                f"spec name {spec.name!r} does not match the URL name {name!r}", field="name"
            )
        files = await asyncio.to_thread(self.models.check, spec.source, spec.family)
        await asyncio.to_thread(
            check_adapters, spec.adapters, spec.family, spec.model, files, spec.source.variant
        )
        templates = await asyncio.to_thread(self._templates, spec, body.get("templates"))
        async with self.served.lock(name):
            revision = await asyncio.to_thread(self.served.registry.put, spec, templates)
            return self.served.track(StoredFunction(spec, templates, revision)).describe()

    def _templates(self, spec: FunctionSpec, raw: Any) -> dict[str, bytes]:
        """Decode every template image, check its size, store it as PNG."""
        if not isinstance(raw, dict):
            raise InvalidSpec("templates must map template id to image bytes", field="templates")
        out = {}
        for tid in spec.templates:
            where = f"templates.{tid}.image"
            if tid not in raw:
                raise InvalidSpec(f"no image uploaded for template {tid!r}", field=where)
            try:
                data = decode_bytes(raw[tid], where)
                width, height = declared_size(data, where, self.door.images.max_pixels)
                if (width, height) != (spec.width, spec.height):  # refused before decoding
                    raise InvalidSpec(
                        f"image is {width}x{height}, the spec's resolution is {spec.width}x{spec.height}",
                        field=where,
                    )
                img = decode_image(data, where)
            except BadRequest as exc:
                raise InvalidSpec(exc.message, field=where, code=exc.code) from exc
            out[tid] = encode_image(img, "png")
        extra = sorted(set(raw) - set(spec.templates))
        if extra:
            raise InvalidSpec(
                f"image uploaded for undeclared template {extra[0]!r}",
                field=f"templates.{extra[0]}",
            )
        return out

    async def template_image(self, request: Request) -> Response:
        """A deployed template's image (PNG), for the web page."""
        fn = self.function(request.path_params["name"])
        png = fn.stored.templates.get(request.path_params["template"])
        if png is None:
            raise NotFound(
                f"function {fn.spec.name!r} has no template {request.path_params['template']!r}",
                field="template",
                code="template_not_found",
            )
        return Response(png, media_type="image/png", headers={"cache-control": "no-cache"})

    async def delete_function(self, request: Request) -> dict[str, Any]:
        name = request.path_params["name"]
        async with self.served.lock(name):
            self.function(name)  # 404 when unknown
            self.served.untrack(name)
            revision = await asyncio.to_thread(self.served.registry.delete, name)
            if revision is not None:  # None: another gateway deleted it (and unloaded it)
                await self.pool.unload(name, revision)
        return {"deleted": name}

    async def executors(self, request: Request) -> dict[str, Any]:
        viewer = principal(request)
        states = {
            s.name: self.uploads.own_state(s, viewer) for s in await self.pool.report.states()
        }
        report, queue = self.pool.report, self.pool.dispatcher.queue
        executors = [
            {
                **e,
                "templates": self.uploads.own_residency(e["templates"], viewer),
                "state": states.get(e["name"]),
            }
            for e in report.describe()
        ]
        return {
            "executors": executors,
            "placement": queue.placement.name,
            "queue": {"waiting": len(queue), **asdict(queue.stats)},
            "latency": self.metrics.latency_summary(),
            "control": report.placement_summary(),
            "autoscaler": report.describe_autoscaler(),
        }

    async def invoke(self, request: Request) -> dict[str, Any]:
        received = time.perf_counter()
        fn = self.door.servable(request.path_params["name"])
        # the body (and what it makes the gateway fetch) held until answered
        with self.bodies.hold(request, self.max_body), contextlib.ExitStack() as held:
            with self.door.arrival(fn, received):  # a 429 comes before the body is read
                owner = principal(request).tenant
                raw = await read_body(request, self.max_body, json_ok=True)
                body = await self.inputs.inline(raw, owner, held)
                req = InvokeRequest.from_wire(body)
                jobs = await self.door.accept_images(fn, req, durable=False, owner=owner)
            results = await self.door.answers(jobs)
        total_ms = (time.perf_counter() - received) * 1e3
        for result in results:
            result.timings.total_ms = total_ms
        if req.num_images_per_prompt == 1:
            return results[0].to_wire()
        return {"results": [r.to_wire() for r in results]}  # the images asked for, in order

    # ---- jobs ----------------------------------------------------------------------------
    async def submit_job(self, request: Request) -> Response:
        fn = self.door.servable(request.path_params["name"])
        wait_s = parse_prefer_wait(request.headers.get("prefer"))
        job = await self.accept_job(request, lambda body: (fn, JobRequest.from_wire(body)), fn)
        return await self._job_response(request, job, wait_s, 202)

    async def accept_job(
        self, request: Request, read: Read, fn: DeployedFunction | None = None
    ) -> Job:
        """The one way a durable job comes in over HTTP (``.../jobs`` and predictions):
        the caps on the declared length, then (for a function the URL names, ``fn``) the
        arrival check, both before the body is read; ``read`` makes the body the function
        and the job request; the webhook's target is checked; the front door accepts it."""
        received = time.perf_counter()
        owner = principal(request).tenant
        declared = request.headers.get("content-length")
        # Over a cap, refused before the body is read: a burst of large jobs costs nothing.
        self.jobs.admit(owner, requestparams.integer(declared, "content-length", 0, 2**62, 0))
        with contextlib.ExitStack() as admitted:
            if fn is not None:
                admitted.enter_context(self.door.arrival(fn, received))
            admitted.enter_context(self.bodies.hold(request, self.max_body))
            raw = await read_body(request, self.max_body, json_ok=True)
            body = await self.inputs.inline(raw, owner, admitted)
            named, req = read(body)
            if fn is None:  # named by the body: admitted once it is read
                admitted.enter_context(self.door.arrival(named, received))
            if req.webhook is not None:
                await self.webhooks.check(req.webhook, owner)
            return await self.door.accept(named, req, durable=True, owner=owner)

    async def _job_response(
        self, request: Request, job: Job, wait_s: float | None, status: int = 200
    ) -> Response:
        job = await self.jobs.settle(job, wait_s)
        headers = None if wait_s is None else {"preference-applied": f"wait={wait_s:g}"}
        is_owner = job.owner == principal(request).tenant  # not: an admin reading another's
        return respond(request, await self.jobs.document(job, is_owner), status, headers)

    async def get_job(self, request: Request) -> Response:
        job = await self.jobs.get(request.path_params["id"], principal(request))
        return await self._job_response(
            request, job, parse_prefer_wait(request.headers.get("prefer"))
        )

    async def list_jobs(self, request: Request) -> dict[str, Any]:
        query = request.query_params
        status = None
        if query.get("status"):
            try:
                status = JobStatus(query["status"])
            except ValueError:
                raise BadRequest(
                    f"status must be one of {', '.join(s.value for s in JobStatus)}",
                    field="status",
                    code="invalid_field",
                ) from None
        limit = requestparams.integer(query.get("limit"), "limit", 1, MAX_JOB_LIST, default=100)
        viewer = principal(request)
        jobs = await self.jobs.list(
            viewer, status, query.get("function") or None, limit, tenant_filter(request)
        )
        positions = self.pool.dispatcher.queue_positions()
        for job in jobs:
            if job.status is JobStatus.QUEUED:
                job.position = positions.get(job.id, job.position)
        return {"jobs": [j.describe(False, with_webhook=j.owner == viewer.tenant) for j in jobs]}

    async def cancel_job(self, request: Request) -> dict[str, Any]:
        viewer = principal(request)
        job = await self.jobs.cancel(await self.jobs.get(request.path_params["id"], viewer))
        return await self.jobs.document(job, job.owner == viewer.tenant)

    async def job_events(self, request: Request) -> StreamingResponse:
        job = await self.jobs.get(request.path_params["id"], principal(request))
        return event_stream(self.jobs.events(job, last_event_id(request)))

    async def output(self, request: Request) -> Response:
        return await serve_output(self.jobs, request)

    async def webhook_secret_of(self, request: Request) -> Response:
        """The caller's own webhook signing secret: what its receivers verify with."""
        tenant = principal(request).tenant
        doc = {"tenant": tenant, "secret": self.webhooks.secret_for(tenant).decode()}
        return respond(request, doc, 200, {"cache-control": "no-store"})

    # ---- app -----------------------------------------------------------------------------
    def app(self) -> Starlette:
        def route(
            path: str, handler, method: str = "GET", scope: str | None = None, status: int = 200
        ) -> Route:
            authorize = self.scope(scope) if scope else (lambda request: None)
            return Route(
                path,
                endpoint(handler, authorize, self.count_error, status, render_error),
                methods=[method],
            )

        images = OpenAIImages(self.door, max_body=self.max_body, bodies=self.bodies)
        predictions = Predictions(self.door, self.accept_job, self.webhooks, self.links.base_url)
        web = WebUI()

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            await self.start()
            try:
                yield
            finally:
                await self.stop()

        return Starlette(
            routes=[
                route("/healthz", self.healthz),
                route("/readyz", self.readyz),
                route("/v1/functions", self.list_functions, scope="invoke"),
                route("/v1/functions/{name}", self.get_function, scope="invoke"),
                route("/v1/functions/{name}", self.put_function, "PUT", scope="admin", status=202),
                route("/v1/functions/{name}", self.delete_function, "DELETE", scope="admin"),
                route("/v1/functions/{name}/invoke", self.invoke, "POST", scope="invoke"),
                route("/v1/functions/{name}/jobs", self.submit_job, "POST", scope="invoke"),
                route("/v1/jobs", self.list_jobs, scope="invoke"),
                route("/v1/jobs/{id}", self.get_job, scope="invoke"),
                route("/v1/jobs/{id}/cancel", self.cancel_job, "POST", scope="invoke"),
                route("/v1/jobs/{id}/events", self.job_events, scope="invoke"),
                route("/v1/webhooks/secret", self.webhook_secret_of, scope="invoke"),
                route("/v1/executors", self.executors, scope="invoke"),
                route(
                    "/v1/functions/{name}/templates/{template}", self.template_image, scope="invoke"
                ),
                route("/v1/predictions", predictions.create, "POST", scope="invoke"),
                route("/v1/predictions", predictions.list, scope="invoke"),
                route("/v1/predictions/{id}", predictions.get, scope="invoke"),
                route("/v1/predictions/{id}/cancel", predictions.cancel, "POST", scope="invoke"),
                route("/v1/predictions/{id}/stream", predictions.stream, scope="invoke"),
                route(
                    "/v1/models/{owner}/{name}/predictions",
                    predictions.create_for_model,
                    "POST",
                    scope="invoke",
                ),
                route("/v1/webhooks/default/secret", predictions.webhook_secret, scope="invoke"),
                route("/v1/images/edits", images.edits, "POST", scope="invoke"),
                route("/v1/images/{name}", self.output),  # a signed link: no token
                route("/", web.index),  # the page holds no data; its API calls carry a token
                route("/ui/{file}", web.asset),
            ],
            exception_handlers=structured_http_errors(self.count_error, render_error),
            lifespan=lifespan,
        )

    def metrics_app(self) -> Starlette:
        """The metrics listener's app: ``GET /metrics`` without a token, nothing else. It
        names every function, error count and executor, which no tenant may read, so it is
        served on a port of its own (``--metrics-port``) and the API's answers it 404."""
        metrics = endpoint(self.metrics_text, lambda request: None, self.count_error)
        return Starlette(
            routes=[Route("/metrics", metrics, methods=["GET"])],
            exception_handlers=structured_http_errors(self.count_error),
        )


def render_error(
    request: Request, exc: RetouchError, headers: dict[str, str] | None = None
) -> Response:
    """An error answer in the convention of the API the request's path belongs to."""
    if answers_openai(request):
        return openai_error(request, exc, headers)
    if answers_replicate(request):
        return replicate_error(request, exc, headers)
    return error_response(request, exc, headers)


def principal(request: Request) -> Principal:
    """Who the request acts for (set by the route's scope check)."""
    return request.state.principal


def tenant_filter(request: Request) -> str | None:
    """``GET /v1/jobs?tenant=``: an admin's filter; other tokens list their own anyway, so
    for them only their own tenant (or none) is allowed."""
    raw = request.query_params.get("tenant")
    if raw is None:
        return None
    tenant = requestparams.identifier(raw, "tenant", TENANT, TENANT_RULE)
    viewer = principal(request)
    if not viewer.admin and tenant != viewer.tenant:
        raise Forbidden(
            "only an admin token lists other tenants' jobs",
            field="tenant",
            code="insufficient_scope",
        )
    return tenant
