"""The web page: a playground (paint a mask, submit a job, watch it) and a dashboard.

Plain HTML, CSS and JavaScript in ``static/`` (package data, no build step), served by the
gateway at ``GET /`` and ``GET /ui/{file}``.

**Tokens.** The page's files hold no data and are the same for everyone, so they are served
without a token; everything the page shows comes from the API, which it calls with
``Authorization: Bearer <token>`` like any client. A browser cannot put that header on a
page load, and the alternatives leak or need more machinery: a token in the query string
ends up in access logs, the history and ``Referer`` headers; a cookie would make every API
endpoint accept ambient credentials (CSRF). So the page asks for the token (a login field)
and keeps it in the browser's ``localStorage``; ``retouch serve`` prints a link with the
token in the URL *fragment* (``/#token=...``), which browsers never send to a server — the
page moves it to ``localStorage`` and removes it from the address bar.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

from retouch.functions.errors import NotFound

STATIC = Path(__file__).resolve().parent / "static"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
# The page loads nothing from elsewhere and sends its requests only to this gateway.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' blob: data:; "
    "style-src 'self'; script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


class WebUI:
    """Serves the page's files (read once, at first use)."""

    def __init__(self, root: Path = STATIC) -> None:
        self.root = root
        self._files: dict[str, bytes] = {}

    def _read(self, name: str) -> Response:
        path = self.root / name
        if path.suffix not in MEDIA_TYPES or path.parent != self.root or not path.is_file():
            raise NotFound(f"no file {name!r}", field="file", code="route_not_found")
        if name not in self._files:
            self._files[name] = path.read_bytes()
        return Response(
            self._files[name], media_type=MEDIA_TYPES[path.suffix], headers=SECURITY_HEADERS
        )

    async def index(self, request: Request) -> Response:
        return self._read("index.html")

    async def asset(self, request: Request) -> Response:
        return self._read(request.path_params["file"])
