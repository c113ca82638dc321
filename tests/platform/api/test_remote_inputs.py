"""Remote ``image``/``mask`` inputs: fetched only from allow-listed hosts, from a checked
address, 2xx only, no redirects, bounded in size; off unless the operator allows hosts."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from retouch.functions.errors import BadRequest, Overloaded, PayloadTooLarge, Unavailable
from retouch.platform.api.bodybudget import BodyBudget
from retouch.platform.api.remoteinputs import InputFetcher
from retouch.platform.jobs.allowlist import AllowList

PNG = b"\x89PNG\r\n\x1a\n" + b"x" * 100


class Files(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/mask.png":
            self._answer(200, PNG)
        elif self.path == "/big.png":
            self._answer(200, b"x" * 5000)
        elif self.path == "/garbage.png":  # not HTTP at all
            self.wfile.write(b"garbage\r\n\r\n")
        elif self.path == "/gzip.png":  # small on the wire, large once inflated
            self.send_response(200)
            self.send_header("content-encoding", "gzip")
            self.send_header("content-length", "4")
            self.end_headers()
            self.wfile.write(b"\x1f\x8b\x08\x00")
        elif self.path == "/drip.png":  # a byte at a time, each read within its timeout
            self.send_response(200)
            self.send_header("content-length", "20")
            self.end_headers()
            for _ in range(20):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
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
            with contextlib.ExitStack() as held:
                return await fetcher.inline(body, "alice", held)
        finally:
            await fetcher.close()

    return asyncio.run(run())


LOOPBACK = AllowList.parse(["127.0.0.0/8"], "--fetch-allow", "fetch_not_allowed")


def test_an_allowed_url_becomes_its_bytes(files: str) -> None:
    body = {"template": "t", "mask": f"{files}/mask.png", "image": "aGk=", "prompt": "p"}
    out = inline(InputFetcher(LOOPBACK, 4096, BodyBudget(1 << 20)), body)
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
        (LOOPBACK, "/garbage.png", "fetch_failed"),
        (LOOPBACK, "/gzip.png", "fetch_failed"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(files: str, allow: AllowList | None, path: str, code: str) -> None:
    with pytest.raises((BadRequest, PayloadTooLarge)) as err:
        inline(InputFetcher(allow, 4096, BodyBudget(1 << 20)), {"mask": f"{files}{path}"})
    assert (err.value.code, err.value.field) == (code, "mask")


def test_a_fetch_has_one_deadline_for_all_of_it(files: str) -> None:
    with pytest.raises(Unavailable) as err:
        inline(
            InputFetcher(LOOPBACK, 4096, BodyBudget(1 << 20), timeout_s=0.5),
            {"image": f"{files}/drip.png"},
        )
    assert (err.value.code, err.value.field) == ("fetch_timeout", "image")


def test_a_fetch_reserves_its_bound_in_the_body_budget(files: str) -> None:
    """What a request makes the gateway fetch counts like its body: held while it is
    answered, and refused (429) when the budget has no room, before anything is fetched."""
    budget = BodyBudget(10_000)
    fetcher = InputFetcher(LOOPBACK, 4096, budget)

    async def run() -> tuple[int, int]:
        await fetcher.start()
        try:
            with contextlib.ExitStack() as held:
                await fetcher.inline({"mask": f"{files}/mask.png"}, "alice", held)
                during = budget.in_use
            return during, budget.in_use
        finally:
            await fetcher.close()

    assert asyncio.run(run()) == (4096, 0)
    budget.in_use = 8000  # others' bodies: no room for a 4096-byte bound
    with pytest.raises(Overloaded) as err:
        inline(fetcher, {"mask": f"{files}/mask.png"})
    assert err.value.code == "too_many_bodies"


def test_a_url_must_read_back_as_written() -> None:
    with pytest.raises(BadRequest) as err:
        inline(
            InputFetcher(LOOPBACK, 4096, BodyBudget(1 << 20)),
            {"image": "http://user@127.0.0.1/x.png"},
        )
    assert (err.value.code, err.value.field) == ("invalid_field", "image")
