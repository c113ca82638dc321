"""The public HTTP API (Starlette, msgpack; JSON accepted for control endpoints).

The gateway never touches a GPU: it authenticates, validates and decodes the payload, checks
the mask against the template, computes the mask ratio, lets placement pick an executor,
forwards, and answers. Deploys are stored durably first and then loaded onto executors in
the background; ``GET /v1/functions/{name}`` shows the progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from retouch.functions import wire
from retouch.functions.errors import BadRequest, InvalidSpec, NotFound, RetouchError, Unavailable
from retouch.functions.imaging import decode_image, decode_mask, encode_image, mask_ratio
from retouch.functions.spec import FunctionSpec, parse_spec
from retouch.platform.auth import TokenAuth
from retouch.platform.metrics import GatewayMetrics
from retouch.platform.pool import ExecutorPool
from retouch.platform.registry import Registry, StoredFunction
from retouch.runtime.asgi import bearer, decode_bytes, endpoint, read_body
from retouch.runtime.models import check_model

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 32 << 20
TEMPLATE_STATES = ("baked", "baking", "queued", "unbaked", "failed")


@dataclass
class DeployedFunction:
    """A function as the gateway tracks it: stored copy, sizes and deploy progress."""

    stored: StoredFunction
    status: str = "deploying"  # deploying | ready | failed
    error: str | None = None
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    task: asyncio.Task | None = None

    @property
    def spec(self) -> FunctionSpec:
        return self.stored.spec

    def describe(self, executor_states: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The status document; template states come from the executors when given."""
        spec = self.spec
        return {
            **spec.to_dict(),
            "status": self.status,
            "error": self.error,
            "templates": {
                tid: {
                    "state": self._template_state(tid, executor_states or []),
                    "width": w,
                    "height": h,
                    "prompt": spec.templates[tid].prompt,
                    "seed": spec.templates[tid].seed,
                }
                for tid, (w, h) in self.sizes.items()
            },
        }

    def _template_state(self, tid: str, executor_states: list[dict[str, Any]]) -> str:
        """pending while deploying; then the most advanced bake state any executor reports
        (they share the host's store): baked > baking > queued > unbaked > failed."""
        if self.status != "ready":
            return {"deploying": "pending", "failed": "failed"}[self.status]
        seen = {
            s.get("templates", {}).get(self.spec.name, {}).get(tid, {}).get("state")
            for s in executor_states
        }
        for state in TEMPLATE_STATES:
            if state in seen:
                return state
        return "unbaked"


@dataclass
class Gateway:
    registry: Registry
    pool: ExecutorPool
    auth: TokenAuth
    max_body: int = DEFAULT_MAX_BODY
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    functions: dict[str, DeployedFunction] = field(default_factory=dict)

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        await self.pool.start()
        for stored in self.registry.load_all().values():
            self._track(stored)

    async def stop(self) -> None:
        for fn in self.functions.values():
            if fn.task:
                fn.task.cancel()
        await self.pool.close()

    def _track(self, stored: StoredFunction) -> DeployedFunction:
        fn = DeployedFunction(
            stored,
            sizes={tid: Image.open(io.BytesIO(png)).size for tid, png in stored.templates.items()},
        )
        previous = self.functions.get(stored.spec.name)
        if previous and previous.task:
            previous.task.cancel()
        self.functions[stored.spec.name] = fn
        fn.task = asyncio.create_task(self._load(fn))
        self.metrics.functions.set(len(self.functions))
        return fn

    async def _load(self, fn: DeployedFunction) -> None:
        try:
            await self.pool.load(fn.stored)
            fn.status = "ready"
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            fn.status, fn.error = "failed", str(getattr(exc, "message", exc))
            log.error("deploying %s failed: %s", fn.spec.name, fn.error)

    # ---- auth & lookup -----------------------------------------------------------------
    def scope(self, scope: str):
        def authorize(request: Request) -> None:
            self.auth.authorize(bearer(request), scope)

        return authorize

    def function(self, name: str) -> DeployedFunction:
        fn = self.functions.get(name)
        if fn is None:
            raise NotFound(f"no function named {name!r}", field="name", code="function_not_found")
        return fn

    def count_error(self, exc: RetouchError) -> None:
        self.metrics.errors.labels(exc.code, str(exc.status)).inc()

    # ---- handlers ------------------------------------------------------------------------
    async def healthz(self, request: Request) -> dict[str, Any]:
        return {"status": "ok"}

    async def readyz(self, request: Request) -> Any:
        healthy = sum(e.healthy for e in self.pool.executors)
        self.metrics.executors.set(healthy)
        pending = sorted(n for n, f in self.functions.items() if f.status == "deploying")
        if not healthy:
            raise Unavailable("no healthy executor", code="not_ready")
        return {"status": "ready", "executors": healthy, "deploying": pending}

    async def metrics_text(self, request: Request) -> Response:
        self.metrics.executors.set(sum(e.healthy for e in self.pool.executors))
        for state in await self.pool.states():
            self._export_engine(state)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def list_functions(self, request: Request) -> dict[str, Any]:
        states = await self.pool.states()
        return {"functions": [f.describe(states) for _, f in sorted(self.functions.items())]}

    async def get_function(self, request: Request) -> dict[str, Any]:
        fn = self.function(request.path_params["name"])
        return fn.describe(await self.pool.states())

    async def put_function(self, request: Request) -> dict[str, Any]:
        name = request.path_params["name"]
        body = wire.as_map(await read_body(request, self.max_body))
        raw_spec = body.get("spec")
        if isinstance(raw_spec, dict):
            raw_spec = {"name": name, **raw_spec}
        spec = parse_spec(raw_spec)
        if spec.name != name:
            raise InvalidSpec(
                f"spec name {spec.name!r} does not match the URL name {name!r}", field="name"
            )
        check_model(spec.model, spec.family)
        templates = self._templates(spec, body.get("templates"))
        await asyncio.get_running_loop().run_in_executor(None, self.registry.put, spec, templates)
        return self._track(StoredFunction(spec, templates)).describe()

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
                img = decode_image(decode_bytes(raw[tid], where), where)
            except BadRequest as exc:
                raise InvalidSpec(exc.message, field=where, code=exc.code) from exc
            if img.size != (spec.width, spec.height):
                raise InvalidSpec(
                    f"image is {img.width}x{img.height}, the spec's resolution is {spec.width}x{spec.height}",
                    field=where,
                )
            out[tid] = encode_image(img, "png")
        extra = sorted(set(raw) - set(spec.templates))
        if extra:
            raise InvalidSpec(
                f"image uploaded for undeclared template {extra[0]!r}",
                field=f"templates.{extra[0]}",
            )
        return out

    async def delete_function(self, request: Request) -> dict[str, Any]:
        name = request.path_params["name"]
        fn = self.function(name)
        if fn.task:
            fn.task.cancel()
        del self.functions[name]
        self.metrics.functions.set(len(self.functions))
        await asyncio.get_running_loop().run_in_executor(None, self.registry.delete, name)
        await self.pool.unload(name)
        return {"deleted": name}

    async def executors(self, request: Request) -> dict[str, Any]:
        states = {s["name"]: s for s in await self.pool.states()}
        executors = [{**e, "state": states.get(e["name"])} for e in self.pool.describe()]
        return {"executors": executors, "placement": self.pool.placement.name}

    async def invoke(self, request: Request) -> dict[str, Any]:
        received = time.perf_counter()
        fn = self.function(request.path_params["name"])
        req = wire.InvokeRequest.from_wire(
            await read_body(request, self.max_body, allow_json=False)
        )
        size = fn.sizes.get(req.template)
        if size is None:
            raise NotFound(
                f"function {fn.spec.name!r} has no template {req.template!r}",
                field="template",
                code="template_not_found",
            )
        mask = decode_mask(req.mask, size)
        if fn.status != "ready":
            raise Unavailable(
                f"function {fn.spec.name!r} is {fn.status}" + (f": {fn.error}" if fn.error else ""),
                code="function_not_ready",
            )
        ratio = mask_ratio(mask)
        inv = wire.ExecutorInvoke(
            function=fn.spec.name,
            template=req.template,
            mask=wire.RawArray.of(mask.astype("uint8")),
            prompt=req.prompt,
            seed=req.seed,
            steps=req.steps or fn.spec.steps,
            guidance=fn.spec.guidance if req.guidance is None else float(req.guidance),
            format=req.format,
        )
        result = await self.pool.invoke(inv, ratio)
        result.timings.total_ms = (time.perf_counter() - received) * 1e3
        self._observe(fn.spec.name, result, ratio)
        return result.to_wire()

    def _export_engine(self, state: dict[str, Any]) -> None:
        """Per-step figures live in the executors; they are read at scrape time."""
        engine = state.get("engine") or {}
        plan = engine.get("last_plan") or {}
        values = {
            "batch_overhead_ms_p50": engine.get("batch_overhead_ms_p50"),
            "step_ms_p50": engine.get("step_ms_p50"),
            "batch_mean": engine.get("batch_mean"),
            "load_wait_ms_p50": engine.get("load_wait_ms_p50"),
            "plan_sparse_blocks": plan.get("sparse"),
            "plan_blocks": plan.get("blocks"),
            "running": engine.get("running"),
            "ready": engine.get("ready"),
            "preprocessing": engine.get("preprocessing"),
        }
        for quantity, value in values.items():
            if value is not None:
                self.metrics.engine.labels(state["name"], quantity).set(float(value))

    def _observe(self, function: str, result: wire.InvokeResult, ratio: float) -> None:
        t = result.timings
        self.metrics.invocations.labels(function, result.path).inc()
        if result.path == "maskaware":
            self.metrics.cache_reads.labels(result.cache.get("tier", "none")).inc()
            self.metrics.prefetch_wait.observe(float(result.cache.get("wait_ms", 0.0)) / 1e3)
        self.metrics.latency.labels(function).observe(t.total_ms / 1e3)
        self.metrics.run.labels(function).observe(t.run_ms / 1e3)
        self.metrics.queue.labels(function).observe(t.queue_ms / 1e3)
        self.metrics.overhead.observe(max(0.0, t.total_ms - t.run_ms - t.queue_ms) / 1e3)
        self.metrics.mask_ratio.observe(ratio)
        self.metrics.pre.labels(function).observe(t.pre_ms / 1e3)
        self.metrics.post.labels(function).observe(t.post_ms / 1e3)
        self.metrics.steps.labels(function).inc(result.engine.get("steps", 0))
        self.metrics.interruptions.labels(function).inc(result.engine.get("interruptions", 0))
        for size in result.engine.get("batch_sizes", []):
            self.metrics.batch_size.observe(size)

    # ---- app -----------------------------------------------------------------------------
    def app(self) -> Starlette:
        def route(
            path: str, handler, method: str = "GET", scope: str | None = None, status: int = 200
        ) -> Route:
            authorize = self.scope(scope) if scope else (lambda request: None)
            return Route(
                path, endpoint(handler, authorize, self.count_error, status), methods=[method]
            )

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
                route("/metrics", self.metrics_text),
                route("/v1/functions", self.list_functions, scope="invoke"),
                route("/v1/functions/{name}", self.get_function, scope="invoke"),
                route("/v1/functions/{name}", self.put_function, "PUT", scope="admin", status=202),
                route("/v1/functions/{name}", self.delete_function, "DELETE", scope="admin"),
                route("/v1/functions/{name}/invoke", self.invoke, "POST", scope="invoke"),
                route("/v1/executors", self.executors, scope="invoke"),
            ],
            lifespan=lifespan,
        )
