"""One warm executor on one device, behind an internal HTTP API.

The gateway starts executors as processes (see ``retouch.platform.providers``), pushes every
deployed function to them and forwards invocations. The executor keeps models loaded and
runs one invocation at a time on a single worker thread, so the event loop stays free to
accept and queue work; the time between accepting and starting is reported as queue time.

Internal API (msgpack, bearer token, loopback only):
``GET /healthz``, ``GET /state``, ``PUT /functions/{name}``, ``DELETE /functions/{name}``,
``POST /invoke``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from retouch.cachestore.store import ActivationStore, StoreConfig
from retouch.functions import wire
from retouch.functions.errors import BadRequest, NotFound
from retouch.functions.imaging import decode_image, encode_image, mask_ratio
from retouch.functions.spec import FunctionSpec, parse_spec
from retouch.runtime.asgi import check_token, decode_bytes, endpoint, read_body
from retouch.runtime.costmodel import CostModel
from retouch.runtime.engine import Engine, EngineConfig, EngineMode, Output, Work
from retouch.runtime.fingerprint import model_fingerprint
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.loader import LoadMode, RowLoader, attach
from retouch.runtime.models import ModelCache
from retouch.runtime.plan import make_planner
from retouch.runtime.profiling import load_or_profile
from retouch.runtime.templates import BakeState, Template, TemplateCache, store_path
from retouch.runtime.workers import PrePostPool

log = logging.getLogger(__name__)

TOKEN_ENV = "RETOUCH_EXECUTOR_TOKEN"
MAX_BODY = 1 << 30  # the gateway already enforced the public limit


@dataclass
class WorkerStages:
    """Pre/post-processing of the engine's invocations in the pool's worker processes."""

    pool: PrePostPool

    def encode(self, work: Work) -> Future:
        return self.pool.encode(work.model, work.family, work.scheduler, work.request)

    def decode(self, work: Work, latents: torch.Tensor) -> Future:
        request = work.request
        return self.pool.decode(
            work.model, work.family, latents, request.height, request.width, work.fmt
        )


@dataclass
class FunctionEntry:
    """A deployed function as the executor holds it: its spec and decoded templates."""

    spec: FunctionSpec
    templates: dict[str, Image.Image]


@dataclass
class ExecutorStats:
    queued: int = 0
    completed: int = 0
    failed: int = 0


@dataclass
class ExecutorCore:
    """Functions, models, templates and the engine thread; no HTTP in here."""

    name: str
    models: ModelCache
    templates: TemplateCache
    engine: Engine
    stages: WorkerStages | None = None  # None: pre/post on the engine thread
    maskaware: bool = True  # False: every token computed, no cache (the "stock" configuration)
    data_dir: Path = Path(".")  # where device profiles are cached (profiles/)
    cost_models: dict[str, CostModel] = field(default_factory=dict)  # per model, on this device
    functions: dict[str, FunctionEntry] = field(default_factory=dict)
    stats: ExecutorStats = field(default_factory=ExecutorStats)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _editors: dict[tuple[str, str], MaskAwareEditor] = field(default_factory=dict)

    def deploy(self, spec: FunctionSpec, images: dict[str, Image.Image]) -> None:
        """Load the function's model (shared with other functions), register its templates
        and queue the bake of every template the store does not hold yet."""
        loaded = self.models.get(spec.model, spec.family)
        if self.stages is not None:  # load it in the workers now, not on the first request
            for future in self.stages.pool.load(spec.model, spec.family):
                future.result()
        editor = self.editor(spec)
        sched_config = dict(editor.impl.pipe.scheduler.config)
        registered = self.templates.register(
            spec, images, model_fingerprint(loaded.folder), sched_config
        )
        with self.lock:
            self.functions[spec.name] = FunctionEntry(spec, images)
        if self.maskaware:
            for template in registered:
                self._queue_bake(template)

    def remove(self, name: str) -> bool:
        with self.lock:
            removed = self.functions.pop(name, None) is not None
        self.templates.unregister(name)
        return removed

    def editor(self, spec: FunctionSpec) -> MaskAwareEditor:
        """One editor per (model, scheduler); editors of a model share its modules.

        A new editor gets an overlapped row loader and the bubble-free planner of the
        model's cost model on this device (profiled once, then read from the profile cache).
        """
        with self.lock:
            editor = self._editors.get((spec.model, spec.scheduler))
            if editor is None:
                loaded = self.models.get(spec.model, spec.family)
                editor = MaskAwareEditor(
                    loaded.pipeline_for(spec.scheduler), spec.family, loaded.device
                )
                attach(editor, RowLoader.for_editor(editor, LoadMode.OVERLAPPED))
                cost_model = load_or_profile(editor, loaded.folder, self.data_dir, spec.width)
                editor.plan = make_planner(cost_model)
                self.cost_models[spec.model] = cost_model
                self._editors[(spec.model, spec.scheduler)] = editor
            return editor

    def entry(self, name: str) -> FunctionEntry:
        with self.lock:
            entry = self.functions.get(name)
        if entry is None:
            raise NotFound(
                f"function {name!r} is not loaded on {self.name}",
                field="function",
                code="function_not_found",
            )
        return entry

    async def invoke(self, inv: wire.ExecutorInvoke) -> wire.InvokeResult:
        entry = self.entry(inv.function)
        template = self.templates.get(inv.function, inv.template)
        if template is None:
            raise NotFound(
                f"unknown template {inv.template!r}", field="template", code="template_not_found"
            )
        mask = inv.mask.to_numpy().astype(bool)
        if mask.shape != (template.image.height, template.image.width):
            raise BadRequest(
                "mask does not match the template size", field="mask", code="mask_size_mismatch"
            )
        arrived = time.perf_counter()
        if not mask.any():  # nothing to edit: the template, without running the model
            return self._template_result(template, inv, arrived)
        covered = self.maskaware and template.covers(inv.steps, inv.guidance)
        if covered:
            self.templates.prefetch(template)  # disk -> host while the invocation queues
        spec = entry.spec
        editor = self.editor(spec)
        request = EditRequest(
            template.image,
            mask,
            inv.prompt,
            inv.seed,
            inv.steps,
            inv.guidance,
            template.prompt,
            template.seed,
            spec.full_steps,
        )
        work = Work(
            key=(spec.model, spec.scheduler, spec.width, spec.height),
            model=spec.model,
            family=spec.family,
            scheduler=spec.scheduler,
            editor=editor,
            request=request,
            fmt=inv.format,
            acquire=lambda: self._acquire(template, covered),
            arrived=arrived,
        )
        self.stats.queued += 1
        try:
            report = await asyncio.wrap_future(self.engine.submit(work))
            self.stats.completed += 1
        except Exception:
            self.stats.failed += 1
            raise
        finally:
            self.stats.queued -= 1
        output: Output = report["output"]
        return wire.InvokeResult(
            image=output.image,
            format=inv.format,
            width=output.width,
            height=output.height,
            mask_ratio=mask_ratio(mask),
            executor=self.name,
            path=report["path"],
            timings=wire.Timings(**report["timings"]),
            cache=report["cache"],
            engine=report["engine"],
        )

    def _template_result(
        self, template: Template, inv: wire.ExecutorInvoke, arrived: float
    ) -> wire.InvokeResult:
        encoded = encode_image(template.image, inv.format)
        return wire.InvokeResult(
            image=encoded,
            format=inv.format,
            width=template.image.width,
            height=template.image.height,
            mask_ratio=0.0,
            executor=self.name,
            path="template",
            timings=wire.Timings(run_ms=(time.perf_counter() - arrived) * 1e3),
        )

    def _acquire(self, template: Template, covered: bool) -> tuple[Any, dict[str, Any]]:
        """At join (engine thread): the template's host-resident activations when it is
        baked for these settings; otherwise no reader (every token computed, i.e. the stock
        result) and the template is queued for baking (insert on miss)."""
        if covered and template.state is BakeState.BAKED:
            got = self.templates.acquire(template)
            if got.handle is not None:
                return got.handle, {"tier": got.tier, "wait_ms": got.wait_ms}
        if covered:
            self._queue_bake(template)
        return None, {"tier": "none", "wait_ms": 0.0}

    def _queue_bake(self, template: Template) -> None:
        if not self.templates.claim_bake(template):
            return
        with self.lock:
            spec = self.functions[template.function].spec
        editor = self.editor(spec)

        def record(writer) -> None:
            editor.bake(
                template.image,
                template.prompt,
                template.seed,
                template.steps,
                template.guidance,
                writer,
            )

        self.engine.submit_background(lambda: self.templates.bake(template, record))

    def state(self) -> dict[str, Any]:
        with self.lock:
            functions = sorted(self.functions)
        return {
            "name": self.name,
            "pid": os.getpid(),
            "device": str(self.models.device),
            "models": self.models.loaded(),
            "functions": functions,
            "maskaware": self.maskaware,
            "queued": self.stats.queued,
            "engine": {
                **self.engine.load(),
                **self.engine.counters.summary(),
                "mode": self.engine.config.mode.value,
                "max_batch": self.engine.config.max_batch,
                "disaggregated": self.engine.config.disaggregated,
            },
            "completed": self.stats.completed,
            "failed": self.stats.failed,
            "templates": self.templates.states(),
            "cost_models": {
                model: {"min_r2": cm.min_r2(), **cm.to_dict()}
                for model, cm in self.cost_models.items()
            },
            "cache": self.templates.store.stats(),
        }


def build_app(core: ExecutorCore, token: str) -> Starlette:
    """The executor's internal API; every route requires the internal token."""

    def authorize(request: Request) -> None:
        check_token(request, token)

    async def healthz(request: Request) -> dict[str, Any]:
        return {"ok": True}

    async def state(request: Request) -> dict[str, Any]:
        return core.state()

    async def put_function(request: Request) -> dict[str, Any]:
        body = wire.as_map(await read_body(request, MAX_BODY, allow_json=False))
        spec = parse_spec(body.get("spec"))
        raw = body.get("templates") or {}
        images = {
            tid: decode_image(
                decode_bytes(raw.get(tid), f"templates.{tid}"), f"templates.{tid}"
            ).convert("RGB")
            for tid in spec.templates
        }
        await asyncio.get_running_loop().run_in_executor(None, core.deploy, spec, images)
        return {"name": spec.name, "loaded": True}

    async def delete_function(request: Request) -> dict[str, Any]:
        return {"removed": core.remove(request.path_params["name"])}

    async def invoke(request: Request) -> dict[str, Any]:
        inv = wire.ExecutorInvoke.from_wire(await read_body(request, MAX_BODY, allow_json=False))
        return (await core.invoke(inv)).to_wire()

    def route(path: str, handler, method: str = "GET") -> Route:
        return Route(path, endpoint(handler, authorize), methods=[method])

    return Starlette(
        routes=[
            route("/healthz", healthz),
            route("/state", state),
            route("/functions/{name}", put_function, "PUT"),
            route("/functions/{name}", delete_function, "DELETE"),
            route("/invoke", invoke, "POST"),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    """Process entry point: ``python -m retouch.runtime.executor --name N --device D ...``."""
    parser = argparse.ArgumentParser(prog="retouch-executor")
    parser.add_argument("--name", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument(
        "--shared-dir",
        type=Path,
        default=None,
        help="built demo models and device profiles (default: the data dir)",
    )
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument(
        "--host-cache-bytes",
        type=int,
        default=4 << 30,
        help="host-RAM budget of the activation store",
    )
    parser.add_argument(
        "--no-maskaware", action="store_true", help="compute every token, never read the cache"
    )
    parser.add_argument(
        "--engine", choices=[m.value for m in EngineMode], default=EngineMode.CONTINUOUS.value
    )
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument(
        "--inline-prepost",
        action="store_true",
        help="pre/post-processing on the engine thread (naive batching)",
    )
    parser.add_argument("--pre-workers", type=int, default=1)
    parser.add_argument("--post-workers", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("RETOUCH_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s",
    )
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise SystemExit(f"{TOKEN_ENV} must be set")
    _exit_with_parent()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    store = ActivationStore(
        StoreConfig(path=store_path(args.data_dir), host_budget_bytes=args.host_cache_bytes)
    )
    shared = args.shared_dir or args.data_dir
    engine_config = EngineConfig(
        EngineMode(args.engine), args.max_batch, disaggregated=not args.inline_prepost
    )
    stages = (
        None
        if args.inline_prepost
        else WorkerStages(
            PrePostPool(
                shared / "models",
                device,
                pre=args.pre_workers,
                post=args.post_workers,
                threads=1,
            )
        )
    )
    engine = Engine(engine_config, stages)
    core = ExecutorCore(
        args.name,
        ModelCache(shared / "models", device),
        TemplateCache(store),
        engine,
        stages,
        maskaware=not args.no_maskaware,
        data_dir=shared,
    )
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose
    # proto says TCP, and without it every response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    # Publish the port only once bound: the pool reads it, then polls /healthz.
    tmp = args.port_file.with_suffix(".tmp")
    tmp.write_text(str(sock.getsockname()[1]))
    tmp.replace(args.port_file)
    config = uvicorn.Config(
        build_app(core, token), log_level="warning", access_log=False, timeout_graceful_shutdown=5
    )
    uvicorn.Server(config).run(sockets=[sock])


def _exit_with_parent() -> None:
    """Executors are children of one gateway: if it dies (even by SIGKILL), so do they."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        log.warning("gateway (pid %d) is gone; exiting", parent)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    main()
