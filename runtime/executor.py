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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
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
from retouch.runtime.engine import Engine, Priority
from retouch.runtime.fingerprint import model_fingerprint
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.models import ModelCache
from retouch.runtime.templates import BakeState, Template, TemplateCache, store_path

log = logging.getLogger(__name__)

TOKEN_ENV = "RETOUCH_EXECUTOR_TOKEN"
MAX_BODY = 1 << 30  # the gateway already enforced the public limit


@dataclass
class FunctionEntry:
    """A deployed function as the executor holds it: its spec and decoded templates."""

    spec: FunctionSpec
    templates: dict[str, Image.Image]


@dataclass
class ExecutorStats:
    queued: int = 0
    running: int = 0
    completed: int = 0
    failed: int = 0


@dataclass
class ExecutorCore:
    """Functions, models, templates and the engine thread; no HTTP in here."""

    name: str
    models: ModelCache
    templates: TemplateCache
    maskaware: bool = True  # False: always the stock path (the "stock" configuration)
    functions: dict[str, FunctionEntry] = field(default_factory=dict)
    stats: ExecutorStats = field(default_factory=ExecutorStats)
    engine: Engine = field(default_factory=Engine)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _editors: dict[tuple[str, str], MaskAwareEditor] = field(default_factory=dict)

    def deploy(self, spec: FunctionSpec, images: dict[str, Image.Image]) -> None:
        """Load the function's model (shared with other functions), register its templates
        and queue the bake of every template the store does not hold yet."""
        loaded = self.models.get(spec.model, spec.family)
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
        """One editor per (model, scheduler); editors of a model share its modules."""
        with self.lock:
            editor = self._editors.get((spec.model, spec.scheduler))
            if editor is None:
                loaded = self.models.get(spec.model, spec.family)
                editor = MaskAwareEditor(
                    loaded.pipeline_for(spec.scheduler), spec.family, loaded.device
                )
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
        if self.maskaware and mask.any() and template.covers(inv.steps, inv.guidance):
            self.templates.prefetch(template)  # disk -> host while the invocation queues
        enqueued = time.perf_counter()
        self.stats.queued += 1
        future = self.engine.submit(lambda: self._run(entry, template, mask, inv, enqueued))
        try:
            return await asyncio.wrap_future(future)
        finally:
            self.stats.queued -= 1

    def _run(
        self,
        entry: FunctionEntry,
        template: Template,
        mask: np.ndarray,
        inv: wire.ExecutorInvoke,
        enqueued: float,
    ) -> wire.InvokeResult:
        started = time.perf_counter()
        self.stats.running += 1
        cache = {"tier": "none", "wait_ms": 0.0}
        try:
            if not mask.any():  # nothing to edit: the template, without running the model
                image, path = template.image, "template"
            else:
                image, path, cache = self._edit(entry, template, mask, inv)
            encoded = encode_image(image, inv.format)
            self.stats.completed += 1
        except Exception:
            self.stats.failed += 1
            raise
        finally:
            self.stats.running -= 1
        done = time.perf_counter()
        return wire.InvokeResult(
            image=encoded,
            format=inv.format,
            width=image.width,
            height=image.height,
            mask_ratio=mask_ratio(mask),
            executor=self.name,
            path=path,
            timings=wire.Timings(
                queue_ms=(started - enqueued) * 1e3, run_ms=(done - started) * 1e3
            ),
            cache=cache,
        )

    def _edit(
        self, entry: FunctionEntry, template: Template, mask: np.ndarray, inv: wire.ExecutorInvoke
    ) -> tuple[Image.Image, str, dict[str, Any]]:
        """Mask-aware from the template's activations when it is baked for these settings;
        otherwise the stock path, and the template is queued for baking (insert on miss)."""
        editor = self.editor(entry.spec)
        request = EditRequest(
            template.image,
            mask,
            inv.prompt,
            inv.seed,
            inv.steps,
            inv.guidance,
            template.prompt,
            template.seed,
        )
        covered = self.maskaware and template.covers(inv.steps, inv.guidance)
        if covered and template.state is BakeState.BAKED:
            got = self.templates.acquire(template)
            if got.handle is not None:
                with got.handle:
                    image = editor.edit(request, got.handle)
                return image, "maskaware", {"tier": got.tier, "wait_ms": got.wait_ms}
        image = editor.stock_edit(request)
        if covered:
            self._queue_bake(template)
        return image, "stock", {"tier": "none", "wait_ms": 0.0}

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

        self.engine.submit(lambda: self.templates.bake(template, record), Priority.BACKGROUND)

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
            "running": self.stats.running,
            "completed": self.stats.completed,
            "failed": self.stats.failed,
            "templates": self.templates.states(),
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
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument(
        "--host-cache-bytes",
        type=int,
        default=4 << 30,
        help="host-RAM budget of the activation store",
    )
    parser.add_argument("--no-maskaware", action="store_true", help="always run the stock path")
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
    core = ExecutorCore(
        args.name,
        ModelCache(args.data_dir / "models", device),
        TemplateCache(store),
        maskaware=not args.no_maskaware,
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
