"""The small HTTP layer shared by the executor's internal API and the public gateway.

Bodies are read in one place (:func:`read_body`): msgpack (``application/msgpack``) for
both, strict JSON too where the public API takes it; the response uses the request's
content type (or, without a body, its ``Accept``) so a JSON caller gets JSON errors. Every
:class:`RetouchError` becomes a structured error response; nothing else leaks a traceback
to a caller. What only the public API speaks (its headers, event streams) is the
gateway's: ``platform/api/httpapi.py``.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match

from retouch.functions.errors import (
    BadRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RetouchError,
    Unauthorized,
    UnsupportedMediaType,
)
from retouch.functions.strictmaps import StrictMaps
from retouch.functions.wire.codec import pack, unpack
from retouch.runtime import requestparams

log = logging.getLogger(__name__)

MAX_CONTENT_LENGTH = 2**63 - 1
MSGPACK = "application/msgpack"
JSON = "application/json"


def wants_msgpack(request: Request) -> bool:
    """msgpack when the request body is msgpack (or a body-less request accepts it); JSON
    otherwise, so ``curl /healthz`` and JSON control calls read naturally."""
    ctype = request.headers.get("content-type", "")
    if ctype:
        return _is_msgpack(ctype)
    return "msgpack" in request.headers.get("accept", "")


def _is_msgpack(ctype: str) -> bool:
    return ctype.startswith(MSGPACK) or ctype.startswith("application/x-msgpack")


def respond(
    request: Request, payload: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    if wants_msgpack(request):
        return Response(pack(payload), status, headers, media_type=MSGPACK)
    return Response(json.dumps(payload, default=_json_bytes), status, headers, media_type=JSON)


def error_response(
    request: Request, exc: RetouchError, headers: dict[str, str] | None = None
) -> Response:
    return respond(request, exc.to_wire(), exc.status, headers)


async def read_raw_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 beyond ``limit`` bytes (declared, or while streaming)."""
    declared = request.headers.get("content-length")
    if declared is not None:  # the HTTP server checked its form; bounded here all the same
        size = requestparams.integer(declared, "content-length", 0, MAX_CONTENT_LENGTH)
        if size > limit:
            raise PayloadTooLarge(f"body of {size} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_body(request: Request, limit: int, json_ok: bool = False) -> Any:
    """A request body of at most ``limit`` bytes: msgpack (the fast path), or, where
    ``json_ok`` (the public API: ``curl`` and scripts, images as base64 or ``data:`` URIs),
    strict JSON. Any other content type is a 415."""
    data = await read_raw_body(request, limit)
    ctype = request.headers.get("content-type", MSGPACK)
    if json_ok and ctype.startswith(JSON):
        return parse_json(data)
    if not _is_msgpack(ctype):
        accepted = f"{MSGPACK} or {JSON}" if json_ok else MSGPACK
        raise UnsupportedMediaType(f"content type {ctype!r} is not supported; use {accepted}")
    return unpack(data)


def parse_json(data: bytes) -> Any:
    """Strict JSON: a duplicate key is refused (the last one would silently win), and so are
    the non-standard NaN/Infinity constants; nesting too deep for the parser or an integer
    too long to convert is ``malformed_body`` (a 400, not a 500)."""
    maps = StrictMaps()
    try:
        doc = json.loads(data, object_pairs_hook=maps.hook, parse_constant=_refuse_constant)
    except RecursionError as exc:
        raise BadRequest(
            "body is not valid JSON: nested too deeply", code="malformed_body"
        ) from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, huge integers
        raise BadRequest(f"body is not valid JSON: {exc}", code="malformed_body") from exc
    maps.check(doc)
    return doc


def _refuse_constant(name: str) -> Any:
    raise BadRequest(f"body is not valid JSON: {name} is not a JSON number", code="malformed_body")


RenderError = Callable[[Request, RetouchError, dict[str, str] | None], Response]


def structured_http_errors(
    on_error: Callable[[RetouchError], None] | None = None,
    render: RenderError = error_response,
) -> dict[Any, Callable[[Request, Exception], Response]]:
    """Starlette ``exception_handlers`` that answer routing failures (unknown route, wrong
    method) and anything unhandled outside :func:`endpoint` with the structured error body
    (as ``render`` writes it), so no caller ever reads a plain-text ``Not Found``. Pass to
    ``Starlette(...)``."""

    def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        headers = dict(exc.headers or {})
        err: RetouchError
        if exc.status_code == 404:
            err = NotFound(f"no route {request.url.path!r}", code="route_not_found")
        elif exc.status_code == 405:
            allowed = _allowed_methods(request) or headers.get("Allow", "")
            headers["Allow"] = allowed
            err = MethodNotAllowed(
                f"{request.method} is not allowed on {request.url.path!r}; allowed: {allowed}",
                code="method_not_allowed",
            )
        else:
            err = RetouchError(exc.detail, code=f"http_{exc.status_code}")
            err.status = exc.status_code
        if on_error is not None:
            on_error(err)
        return render(request, err, headers or None)

    def internal(request: Request, exc: Exception) -> Response:
        # Starlette's ServerErrorMiddleware logs the traceback and re-raises after this.
        err = RetouchError(f"internal error: {type(exc).__name__}")
        if on_error is not None:
            on_error(err)
        return render(request, err, None)

    return {HTTPException: http_error, Exception: internal}


def _allowed_methods(request: Request) -> str:
    """Every method of every route matching the path (Starlette names only the first)."""
    app = request.scope.get("app")
    routes = getattr(getattr(app, "router", None), "routes", [])
    methods: list[str] = []
    for route in routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods += [
                m for m in sorted(getattr(route, "methods", None) or ()) if m not in methods
            ]
    return ", ".join(methods)


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def check_token(request: Request, expected: str) -> None:
    """Constant-time check of the internal bearer token."""
    got = bearer(request)
    if got is None or not hmac.compare_digest(got.encode(), expected.encode()):
        raise Unauthorized("missing or wrong bearer token")


def _json_bytes(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


Handler = Callable[[Request], Awaitable[Any]]


def endpoint(
    handler: Handler,
    authorize: Callable[[Request], None],
    on_error: Callable[[RetouchError], None] | None = None,
    status: int = 200,
    render: RenderError = error_response,
) -> Callable[[Request], Awaitable[Response]]:
    """Wrap ``handler`` (returns the payload, or a ready ``Response``) with auth and errors.

    A :class:`RetouchError` (the auth check's included) becomes its structured response,
    as ``render`` writes it; anything else is logged with its traceback and answered as a
    500 ``internal`` error, and the server keeps serving.
    """

    async def route(request: Request) -> Response:
        try:
            authorize(request)
            result = await handler(request)
            return result if isinstance(result, Response) else respond(request, result, status)
        except RetouchError as exc:
            err = exc
        except Exception as exc:
            log.exception("unhandled error on %s %s", request.method, request.url.path)
            err = RetouchError(f"internal error: {type(exc).__name__}: {exc}")
        if on_error is not None:
            on_error(err)
        retry = getattr(err, "retry_after_s", 1)
        headers = {"retry-after": str(retry)} if err.status in (429, 503) else None
        return render(request, err, headers)

    return route
