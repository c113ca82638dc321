"""Remote ``image``/``mask`` inputs: fetched only from allow-listed hosts, from a checked
address, 2xx only, no redirects, bounded in size; off unless the operator allows hosts."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from retouch.functions.errors import BadRequest, PayloadTooLarge
from retouch.platform.allowlist import AllowList
from retouch.platform.remoteinputs import InputFetcher

PNG = b"\x89PNG\r\n\x1a\n" + b"x" * 100


class Files(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/mask.png":
            self._answer(200, PNG)
        elif self.path == "/big.png":
            self._answer(200, b"x" * 5000)
        elif self.path == "/moved.png":
            self.send_response(302)
            self.send_header("location", "/mask.png")
            self.end_headers()
        else:
            self._answer(404, b"no")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def files() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def inline(fetcher: InputFetcher, body: dict) -> dict:
    async def run() -> dict:
        await fetcher.start()
        try:
            return await fetcher.inline(body, "alice")
        finally:
            await fetcher.close()

    return asyncio.run(run())


LOOPBACK = AllowList.parse(["127.0.0.0/8"], "--fetch-allow", "fetch_not_allowed")


def test_an_allowed_url_becomes_its_bytes(files: str) -> None:
    body = {"template": "t", "mask": f"{files}/mask.png", "image": "aGk=", "prompt": "p"}
    out = inline(InputFetcher(LOOPBACK, 4096), body)
    assert out == {**body, "mask": PNG}  # base64 and every other field left as sent


@pytest.mark.parametrize(
    ("allow", "path", "code"),
    [
        (None, "/mask.png", "fetch_disabled"),  # the default: no fetching at all
        (AllowList.parse(["10.0.0.0/8"], "--fetch-allow", "fetch_not_allowed"), "/mask.png",
         "fetch_not_allowed"),
        (LOOPBACK, "/missing.png", "fetch_failed"),
        (LOOPBACK, "/moved.png", "fetch_failed"),  # redirects are not followed
        (LOOPBACK, "/big.png", "payload_too_large"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(files: str, allow: AllowList | None, path: str, code: str) -> None:
    with pytest.raises((BadRequest, PayloadTooLarge)) as err:
        inline(InputFetcher(allow, 4096), {"mask": f"{files}{path}"})
    assert (err.value.code, err.value.field) == (code, "mask")


def test_a_url_must_read_back_as_written() -> None:
    with pytest.raises(BadRequest) as err:
        inline(InputFetcher(LOOPBACK, 4096), {"image": "http://user@127.0.0.1/x.png"})
    assert (err.value.code, err.value.field) == ("invalid_field", "image")
