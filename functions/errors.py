"""The one error hierarchy of retouch.

Every failure a caller can act on is a :class:`RetouchError` carrying a stable ``code``, a
human ``message``, the offending ``field`` (or ``None``) and the HTTP status it maps to. The
gateway, the executor and the CLI all render these the same way, so a bad request reads
identically whether it failed in validation, in the gateway or on an executor.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class RetouchError(Exception):
    """Base of all structured errors; subclasses fix the HTTP status and a default code."""

    status: int = 500
    code: str = "internal"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        code: str | None = None,
        detail: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.field = field
        # machine-readable facts beside the message (e.g. where a 429 was decided), so that
        # a caller never has to parse ``message``; absent from the body when None
        self.detail = detail
        if code is not None:
            self.code = code

    def to_wire(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message, "field": self.field}
        if self.detail is not None:
            err["detail"] = self.detail
        return {"error": err}

    @classmethod
    def from_wire(cls, status: int, body: Any) -> RetouchError:
        """Rebuild an error from a response body (used by the client and the gateway)."""
        err = body.get("error", {}) if isinstance(body, dict) else {}
        kind = _BY_STATUS.get(status, RetouchError)
        exc = kind(
            str(err.get("message", f"HTTP {status}")),
            field=err.get("field"),
            code=str(err.get("code", kind.code)),
        )
        detail = err.get("detail")
        exc.detail = detail if isinstance(detail, dict) else None
        exc.status = status
        return exc


class BadRequest(RetouchError):
    status, code = 400, "bad_request"


class Unauthorized(RetouchError):
    status, code = 401, "unauthorized"


class Forbidden(RetouchError):
    status, code = 403, "forbidden"


class NotFound(RetouchError):
    status, code = 404, "not_found"


class MethodNotAllowed(RetouchError):
    status, code = 405, "method_not_allowed"


class Conflict(RetouchError):
    status, code = 409, "conflict"


class Canceled(Conflict):
    """The invocation was canceled by its caller (a job's ``cancel``); it produced nothing."""

    code = "canceled"


class PayloadTooLarge(RetouchError):
    status, code = 413, "payload_too_large"


class UnsupportedMediaType(RetouchError):
    status, code = 415, "unsupported_media_type"


class InvalidSpec(RetouchError):
    status, code = 422, "invalid_spec"


class Overloaded(RetouchError):
    """Refused for lack of room; ``retry_after_s`` becomes the ``Retry-After`` header."""

    status, code = 429, "overloaded"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        code: str | None = None,
        retry_after_s: int = 1,
        detail: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message, field=field, code=code, detail=detail)
        self.retry_after_s = max(1, int(retry_after_s))


class ExecutorFull(Overloaded):
    """An executor refused an invocation beyond its room (running plus waiting). Internal:
    the gateway that sent it queues it again and places it when an executor has room; a
    client never sees it."""

    code = "executor_full"


class Unavailable(RetouchError):
    status, code = 503, "unavailable"


class GatewayTimeout(RetouchError):
    """The invocation's deadline passed before any executor answered it."""

    status, code = 504, "timeout"


_BY_STATUS: dict[int, type[RetouchError]] = {
    k.status: k
    for k in (
        BadRequest,
        Unauthorized,
        Forbidden,
        NotFound,
        MethodNotAllowed,
        Conflict,
        PayloadTooLarge,
        UnsupportedMediaType,
        InvalidSpec,
        Overloaded,
        Unavailable,
        GatewayTimeout,
    )
}


def unknown_field_message(key: str, allowed: Iterable[str]) -> str:
    """``unknown field 'x'`` with the closest known name, or the list of known ones."""
    known = list(allowed)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" — did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(known)}"
    return f"unknown field {key!r}{hint}"
