"""The executor's internal HTTP API (msgpack, bearer token).

``GET /healthz`` (open, for liveness probes: 200, or 503 ``engine_dead`` and why once the
engine thread died, so the pool restarts the executor), ``GET /state`` (a :class:`~retouch.functions.wire.executor.ExecutorState`),
``PUT /functions/{name}``, ``DELETE /functions/{name}``, ``POST /invoke``,
``POST /invoke/stream`` (the same invocation answered as a stream of msgpack frames: one
:class:`~retouch.functions.wire.executor.StepProgress` per denoising step as the engine takes it,
then the result or the error), ``POST /invocations/{id}/cancel``, and
``GET /changes?after=N&timeout=S`` (a long poll on the change feed: bakes done, templates
entering host memory; see :mod:`retouch.runtime.executor.changes`), ``POST /sleep`` and
``POST /wake`` (the device given back and taken again, process and store kept; each answers
a :class:`~retouch.functions.wire.executor.SleepInfo`, see
:mod:`retouch.runtime.executor.sleep`). Every route but
``/healthz`` requires the internal token.

An invocation beyond the executor's room (see
:func:`~retouch.runtime.executor.options.room`) is refused with 429 ``executor_full``: the
gateway that sent it queues it again, so gateways sharing an executor never overcommit it.

Progress travels on the invocation's own response rather than on a side channel: it needs
no subscription, ends with the invocation, and a gateway that goes away closes the stream,
which cancels the invocation here (its steps would be wasted).

The app owns the core's lifecycle through its lifespan: the engine starts with the server
and, at shutdown, the engine, the pre/post workers and the store are closed (every
unfinished invocation fails with ``engine_unavailable``, which the gateway re-places).
Nothing slow runs on the event loop: deploys and template decoding run on a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from retouch.functions.errors import BadRequest, RetouchError, Unavailable
from retouch.functions.imaging import decode_image
from retouch.functions.spec import parse_spec
from retouch.functions.wire.codec import as_map, decode_bytes, pack
from retouch.functions.wire.executor import (
    StepProgress,
    error_frame,
    progress_frame,
    result_frame,
)
from retouch.functions.wire.invoke import ExecutorInvoke
from retouch.runtime import requestparams
from retouch.runtime.asgi import (
    check_token,
    endpoint,
    read_body,
    structured_http_errors,
)

if TYPE_CHECKING:
    from PIL import Image

    from retouch.functions.spec import FunctionSpec
    from retouch.runtime.executor.core import ExecutorCore

log = logging.getLogger(__name__)

TOKEN_ENV = "RETOUCH_EXECUTOR_TOKEN"
STREAM_MEDIA_TYPE = "application/msgpack"  # a sequence of msgpack maps
MAX_BODY = 1 << 30  # the gateway already enforced the public limit
CHANGES_WAIT_S = 20  # a change-feed long poll answers after this long when nothing changed
MAX_CHANGES_WAIT_S = 60
MAX_GENERATION = 2**62


def read_token(token_file: Path | None) -> str:
    """The internal token gateways and executors share: the first line of ``token_file``,
    else ``$RETOUCH_EXECUTOR_TOKEN`` (a file keeps it out of the process's environment, e.g.
    a mounted Kubernetes Secret). Raises :class:`ValueError` when there is none."""
    text = token_file.read_text() if token_file is not None else os.environ.get(TOKEN_ENV, "")
    token = text.strip().partition("\n")[0].strip()
    if not token:
        where = f"{token_file} is empty" if token_file is not None else f"{TOKEN_ENV} is not set"
        raise ValueError(f"no internal executor token: {where}")
    return token


def _generation(raw: Any) -> int:
    """The gateway's sequence number of a control operation on a function name."""
    if isinstance(raw, str):
        raw = requestparams.integer(raw, "generation", 0, MAX_GENERATION)
    if type(raw) is not int or raw < 0:
        raise BadRequest(
            "generation must be a non-negative integer", field="generation", code="invalid_field"
        )
    return raw


def _parse_deploy(body: Any) -> tuple[FunctionSpec, dict[str, Image.Image], int]:
    body = as_map(body)
    generation = _generation(body.get("generation"))
    spec = parse_spec(body.get("spec"))
    raw = body.get("templates") or {}
    images = {
        tid: decode_image(
            decode_bytes(raw.get(tid), f"templates.{tid}"), f"templates.{tid}"
        ).convert("RGB")
        for tid in spec.templates
    }
    return spec, images, generation


def build_app(core: ExecutorCore, token: str) -> Starlette:
    """The executor's internal API; every route but ``/healthz`` requires the token."""

    def authorize(request: Request) -> None:
        check_token(request, token)

    def anyone(request: Request) -> None:
        """A liveness probe (Kubernetes') carries no token; the answer tells it nothing."""

    async def healthz(request: Request) -> dict[str, Any]:
        if not core.healthy:
            raise Unavailable(core.engine.error_message(), code="engine_dead")
        return {"ok": True}

    async def state(request: Request) -> dict[str, Any]:
        return core.state().to_wire()

    async def changes(request: Request) -> dict[str, Any]:
        """Long poll: the change feed's events after ``after``, as soon as there are any."""
        query = request.query_params
        after = requestparams.integer(query.get("after"), "after", 0, 2**62, default=0)
        timeout_s = requestparams.integer(
            query.get("timeout"), "timeout", 0, MAX_CHANGES_WAIT_S, default=CHANGES_WAIT_S
        )
        return (await core.changes.wait(after, timeout_s)).to_wire()

    async def put_function(request: Request) -> dict[str, Any]:
        body = await read_body(request, MAX_BODY)
        spec, images, generation = await asyncio.to_thread(_parse_deploy, body)
        await asyncio.wrap_future(core.deploy_async(spec, images, generation))
        return {"name": spec.name, "loaded": True, "generation": generation}

    async def delete_function(request: Request) -> dict[str, Any]:
        generation = _generation(request.query_params.get("generation"))
        removed = await asyncio.to_thread(core.remove, request.path_params["name"], generation)
        return {"removed": removed, "generation": generation}

    async def invoke(request: Request) -> dict[str, Any]:
        inv = ExecutorInvoke.from_wire(await read_body(request, MAX_BODY))
        return (await core.invoke(inv)).to_wire()

    async def invoke_stream(request: Request) -> StreamingResponse:
        inv = ExecutorInvoke.from_wire(await read_body(request, MAX_BODY))
        loop = asyncio.get_running_loop()
        frames: asyncio.Queue[StepProgress | None] = asyncio.Queue()

        def on_step(step: int, total: int) -> None:  # the engine thread: hand over, never wait
            loop.call_soon_threadsafe(frames.put_nowait, StepProgress(step=step, total=total))

        task = asyncio.ensure_future(core.begin(inv, on_step))  # bad input: a plain 4xx here
        task.add_done_callback(lambda _: frames.put_nowait(None))
        return StreamingResponse(_stream(core, inv, task, frames), media_type=STREAM_MEDIA_TYPE)

    async def sleep(request: Request) -> dict[str, Any]:
        return (await asyncio.to_thread(core.sleep.sleep)).to_wire()

    async def wake(request: Request) -> dict[str, Any]:
        return (await asyncio.to_thread(core.sleep.wake)).to_wire()

    async def cancel(request: Request) -> dict[str, Any]:
        invocation = request.path_params["id"]
        return {"id": invocation, "canceled": core.cancel(invocation)}

    def route(path: str, handler, method: str = "GET", auth=authorize) -> Route:
        return Route(path, endpoint(handler, auth), methods=[method])

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        core.start()
        try:
            yield
        finally:
            await asyncio.to_thread(core.close)

    return Starlette(
        routes=[
            route("/healthz", healthz, auth=anyone),
            route("/state", state),
            route("/changes", changes),
            route("/functions/{name}", put_function, "PUT"),
            route("/functions/{name}", delete_function, "DELETE"),
            route("/invoke", invoke, "POST"),
            route("/invoke/stream", invoke_stream, "POST"),
            route("/invocations/{id}/cancel", cancel, "POST"),
            route("/sleep", sleep, "POST"),
            route("/wake", wake, "POST"),
        ],
        exception_handlers=structured_http_errors(),
        lifespan=lifespan,
    )


async def _stream(
    core: ExecutorCore,
    inv: ExecutorInvoke,
    task: asyncio.Future,
    frames: asyncio.Queue,
) -> AsyncIterator[bytes]:
    """Progress frames in step order (call_soon_threadsafe keeps the engine's order, and the
    result's own callback comes after its last step), then the result or the error."""
    try:
        while (frame := await frames.get()) is not None:
            yield pack(progress_frame(frame))
        try:
            yield pack(result_frame(task.result()))
        except RetouchError as exc:
            yield pack(error_frame(exc))
        except Exception as exc:
            log.exception("invocation %s failed", inv.id or "(no id)")
            yield pack(error_frame(RetouchError(f"{type(exc).__name__}: {exc}")))
    finally:
        if not task.done():  # the gateway went away: stop computing for nobody
            if inv.id:
                core.cancel(inv.id)
            task.cancel()
