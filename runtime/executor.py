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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from retouch.functions import wire
from retouch.functions.errors import BadRequest, NotFound
from retouch.functions.imaging import decode_image, encode_image, mask_ratio
from retouch.functions.spec import FunctionSpec, parse_spec
from retouch.runtime.asgi import check_token, decode_bytes, endpoint, read_body
from retouch.runtime.models import ModelCache
from retouch.runtime.stock import stock_edit

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
    """Functions, models and the single inference worker; no HTTP in here."""

    name: str
    models: ModelCache
    functions: dict[str, FunctionEntry] = field(default_factory=dict)
    stats: ExecutorStats = field(default_factory=ExecutorStats)
    worker: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "engine"))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def deploy(self, spec: FunctionSpec, images: dict[str, Image.Image]) -> None:
        """Load the function's model (shared with other functions) and keep its templates."""
        self.models.get(spec.model, spec.family)
        with self.lock:
            self.functions[spec.name] = FunctionEntry(spec, images)

    def remove(self, name: str) -> bool:
        with self.lock:
            return self.functions.pop(name, None) is not None

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
        template = entry.templates.get(inv.template)
        if template is None:
            raise NotFound(
                f"unknown template {inv.template!r}", field="template", code="template_not_found"
            )
        mask = inv.mask.to_numpy().astype(bool)
        if mask.shape != (template.height, template.width):
            raise BadRequest(
                "mask does not match the template size", field="mask", code="mask_size_mismatch"
            )
        enqueued = time.perf_counter()
        self.stats.queued += 1
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self.worker, self._run, entry, template, mask, inv, enqueued
            )
        finally:
            self.stats.queued -= 1

    def _run(
        self,
        entry: FunctionEntry,
        template: Image.Image,
        mask,
        inv: wire.ExecutorInvoke,
        enqueued: float,
    ) -> wire.InvokeResult:
        started = time.perf_counter()
        self.stats.running += 1
        try:
            if not mask.any():  # nothing to edit: the template, without running the model
                image, path = template, "template"
            else:
                loaded = self.models.get(entry.spec.model, entry.spec.family)
                image = stock_edit(
                    loaded,
                    entry.spec.scheduler,
                    template,
                    mask,
                    inv.prompt,
                    inv.seed,
                    inv.steps,
                    inv.guidance,
                )
                path = "stock"
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
        )

    def state(self) -> dict[str, Any]:
        with self.lock:
            functions = sorted(self.functions)
        return {
            "name": self.name,
            "device": str(self.models.device),
            "models": self.models.loaded(),
            "functions": functions,
            "queued": self.stats.queued,
            "running": self.stats.running,
            "completed": self.stats.completed,
            "failed": self.stats.failed,
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
    core = ExecutorCore(args.name, ModelCache(args.data_dir / "models", device))
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
