"""A second tenant tried as a hostile one would, on one real ``retouch serve``: two invoke
tokens (tenants ``alice`` and ``bob``) and an admin token, across jobs, events, cancel,
results, uploads, signed image links, listing and webhooks.

Seen to hold: no tenant reads, streams, cancels or lists another's job (the same 404 as an
unknown id: no existence oracle); an admin sees every tenant's, without their webhook URLs;
one tenant's upload is neither listed to nor baked for another, nor shown in another's view
of the executors; webhooks go to their own job's receiver only; every bad number or id
(Unicode digits, 5000 digits, out of range) is a structured 400 naming the parameter; every
``/v1/images/*`` answer, the auth check's included, has OpenAI's error fields; the HTTP
server's own rejections are structured too; nothing answers 5xx.

One server for the module (one executor, a 2-step function on the tiny model).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from retouch.functions.wire.invoke import MAX_STEPS, CacheTier, InvokePath, InvokeResult
from retouch.functions.wire.jobs import JobEventKind
from retouch.platform.api.client import Call, Client, read_spec_file
from retouch.platform.api.server import ServerProcess
from tests.support import wait_for

FUNCTION, TEMPLATE, STEPS, SIZE = "tenancy-sd", "street", 2, 128
ALICE, BOB, ADMIN = "alice-token", "bob-token", "ops-token"
TOKEN_FILE = f"invoke {ALICE} alice\ninvoke {BOB} bob\nadmin {ADMIN} ops\n"
ALICE_HOOK_KEY = "alice-hook-credential"  # in alice's webhook URL's query string
MASK = np.zeros((SIZE, SIZE), bool)
MASK[32:80, 40:96] = True
UNKNOWN = "0" * 32
HUGE = "9" * 5000


class Receiver:
    """A loopback webhook receiver that records what each path was sent."""

    def __init__(self) -> None:
        self.got: list[tuple[str, dict[str, Any]]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.got.append((self.path, json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def job_ids(self, path_prefix: str) -> set[str]:
        return {body["job"]["id"] for path, body in self.got if path.startswith(path_prefix)}


@dataclasses.dataclass(frozen=True)
class World:
    """What the module's setup made: each tenant's finished job, upload and link."""

    url: str
    a_done: str  # alice's finished job, with a webhook whose URL holds a credential
    b_done: str  # bob's finished job, with his own webhook
    a_upload: str  # alice's upload id (baked)
    b_upload: str  # bob's upload id of the same image
    b_upload_result: InvokeResult
    a_second_upload_result: InvokeResult
    link: str  # alice's signed image link (path and query)
    receiver: Receiver


def photo() -> bytes:
    rng = np.random.default_rng(7)
    small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((SIZE, SIZE), Image.BILINEAR).save(buf, format="PNG")
    return buf.getvalue()


def mask_png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(MASK.astype(np.uint8) * 255).save(buf, format="PNG")
    return buf.getvalue()


def auth(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def upload_edit(client: Client, image: bytes, seed: int) -> InvokeResult:
    return client.invoke(FUNCTION, None, MASK, "a red door", seed=seed, image=image, format="raw")


def openai_url_edit(url: str, token: str) -> str:
    files = {"image": (None, TEMPLATE), "mask": ("mask.png", mask_png(), "image/png")}
    data = {"model": FUNCTION, "prompt": "a red door", "response_format": "url", "seed": "3"}
    resp = httpx.post(f"{url}/v1/images/edits", data=data, files=files, headers=auth(token))
    assert resp.status_code == 200, resp.text
    return httpx.URL(resp.json()["data"][0]["url"]).raw_path.decode()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, examples: Path) -> Iterator[World]:
    data_dir = tmp_path_factory.mktemp("tenancy")
    token_file = data_dir / "tokens"
    token_file.write_text(TOKEN_FILE)
    receiver = Receiver()
    args = ["--token-file", str(token_file), "--progress-interval", "0"]
    with ServerProcess(data_dir, env={"RETOUCH_WEBHOOK_SECRET": "s"}, extra_args=args) as proc:
        spec, images = read_spec_file(examples / "tiny-sd.toml")
        spec = dataclasses.replace(
            spec, name=FUNCTION, steps=STEPS, templates={TEMPLATE: spec.templates[TEMPLATE]}
        )
        with (
            Client(proc.url, ADMIN) as admin,
            Client(proc.url, ALICE) as alice,
            Client(proc.url, BOB) as bob,
        ):
            assert admin.deploy(spec, {TEMPLATE: images[TEMPLATE]})["status"] == "ready"
            hook = f"{receiver.url}/alice?key={ALICE_HOOK_KEY}"
            a_job = alice.submit(FUNCTION, TEMPLATE, MASK, "a door", seed=1, webhook=hook)
            b_job = bob.submit(
                FUNCTION, TEMPLATE, MASK, "a door", seed=2, webhook=f"{receiver.url}/bob"
            )
            a_job.wait(120), b_job.wait(120)
            image = photo()
            a_upload = upload_edit(alice, image, 1).template
            wait_for(
                "alice's upload baked",
                lambda: alice.get(FUNCTION)["uploads"].get(a_upload, {}).get("state") == "baked",
                180,
            )
            a_second = upload_edit(alice, image, 2)
            b_first = upload_edit(bob, image, 2)
            link = openai_url_edit(proc.url, ALICE)
            wait_for("both webhooks delivered", lambda: len(receiver.got) >= 2, 60)
        yield World(
            proc.url,
            a_job.id,
            b_job.id,
            a_upload,
            b_first.template,
            b_first,
            a_second,
            link,
            receiver,
        )
    receiver.server.shutdown()


@pytest.fixture(scope="module")
def http(world: World) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=world.url, timeout=60) as client:
        yield client


# ---- the corpus: one request each, its status and error --------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    token: str | None
    method: str
    path: str  # formatted with the World's fields
    status: int
    code: str | None = None
    field: str | None = None
    headers: dict[str, bytes] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        return self.name


def header(value: str) -> bytes:
    """A header value as the server decodes it (latin-1), so '²' arrives as '²'."""
    return value.encode("latin-1")


NOT_FOUND = ("job_not_found", "id")
BAD_NUMBERS = {"sup2": "²", "arabic": "١٢", "fullwidth": "１２", "underscore": "1_0",
               "space": " 5", "huge": HUGE, "negative": "-1", "empty": "", "float": "1.5"}  # fmt: skip
HEADER_BAD_NUMBERS = {"sup2": "²", "huge": HUGE, "negative": "-1", "float": "1.5", "nan": "nan"}
BAD_IDS = {"short": "abc", "upper": "A" * 32, "long": "a" * 33, "fullwidth": "０" * 32,
           "huge": "a" * 5000, "dots": "." * 32}  # fmt: skip
BAD_WAITS = {"sup2": "²", "nan": "nan", "inf": "inf", "over": "61", "huge": HUGE, "under": "1_0"}

CASES: list[Case] = [
    # cross-tenant: another tenant's job is exactly an unknown one
    Case("bob-get-alices-job", BOB, "GET", "/v1/jobs/{a_done}", 404, *NOT_FOUND),
    Case("bob-get-unknown-job", BOB, "GET", f"/v1/jobs/{UNKNOWN}", 404, *NOT_FOUND),
    Case("alice-get-bobs-job", ALICE, "GET", "/v1/jobs/{b_done}", 404, *NOT_FOUND),
    Case("bob-wait-alices-job", BOB, "GET", "/v1/jobs/{a_done}", 404, *NOT_FOUND, {"prefer": b"wait=1"}),
    Case("bob-stream-alices-job", BOB, "GET", "/v1/jobs/{a_done}/events", 404, *NOT_FOUND),
    Case("bob-resume-alices-stream", BOB, "GET", "/v1/jobs/{a_done}/events", 404, *NOT_FOUND, {"last-event-id": b"1"}),
    Case("bob-stream-alices-after", BOB, "GET", "/v1/jobs/{a_done}/events?after=2", 404, *NOT_FOUND),
    Case("bob-cancel-alices-job", BOB, "POST", "/v1/jobs/{a_done}/cancel", 404, *NOT_FOUND),
    Case("alice-cancel-bobs-job", ALICE, "POST", "/v1/jobs/{b_done}/cancel", 404, *NOT_FOUND),
    Case("bob-cancel-unknown-job", BOB, "POST", f"/v1/jobs/{UNKNOWN}/cancel", 404, *NOT_FOUND),
    Case("bob-lists-alices-tenant", BOB, "GET", "/v1/jobs?tenant=alice", 403, "insufficient_scope", "tenant"),
    # the owner and the admin
    Case("alice-get-own-job", ALICE, "GET", "/v1/jobs/{a_done}", 200),
    Case("alice-stream-own-job", ALICE, "GET", "/v1/jobs/{a_done}/events", 200),
    Case("alice-cancel-own-finished", ALICE, "POST", "/v1/jobs/{a_done}/cancel", 409, "job_finished", "id"),
    Case("admin-get-alices-job", ADMIN, "GET", "/v1/jobs/{a_done}", 200),
    Case("admin-stream-bobs-job", ADMIN, "GET", "/v1/jobs/{b_done}/events", 200),
    Case("admin-cancel-bobs-finished", ADMIN, "POST", "/v1/jobs/{b_done}/cancel", 409, "job_finished", "id"),
    Case("admin-lists-one-tenant", ADMIN, "GET", "/v1/jobs?tenant=bob", 200),
    Case("bob-lists-own-tenant", BOB, "GET", "/v1/jobs?tenant=bob", 200),
    # results: a signed link needs no token; it cannot be bent to another job or time
    Case("link-no-token", None, "GET", "{link}", 200),
    Case("link-other-job", None, "GET", "/v1/images/{b_done}.png?expires=9999999999&sig=00", 400, "invalid_signature", "sig"),
    Case("link-no-expires", None, "GET", "/v1/images/{a_done}.png?sig=00", 400, "missing_field", "expires"),
    Case("link-bad-name", None, "GET", "/v1/images/nothing.png?expires=1&sig=00", 404, "image_not_found", "name"),
    # OpenAI's error fields on every /v1/images answer, the auth check's and router's too
    Case("edits-no-token", None, "POST", "/v1/images/edits", 401, "missing_token"),
    Case("edits-wrong-token", "nobody", "POST", "/v1/images/edits", 401, "invalid_token"),
    Case("edits-delete", ALICE, "DELETE", "/v1/images/edits", 405, "method_not_allowed"),
    Case("edits-get-is-a-link", ALICE, "GET", "/v1/images/edits", 404, "image_not_found", "name"),
    Case("images-unknown-route", ALICE, "GET", "/v1/images/a/b", 404, "route_not_found"),
    Case("edits-not-multipart", ALICE, "POST", "/v1/images/edits", 415, "unsupported_media_type"),
    # ids in paths and queries
    *[Case(f"job-id-{k}", ALICE, "GET", f"/v1/jobs/{v}", 400, "invalid_field", "id") for k, v in BAD_IDS.items()],
    *[Case(f"events-id-{k}", ALICE, "GET", f"/v1/jobs/{v}/events", 400, "invalid_field", "id") for k, v in BAD_IDS.items() if k != "huge"],
    *[Case(f"cancel-id-{k}", BOB, "POST", f"/v1/jobs/{v}/cancel", 400, "invalid_field", "id") for k, v in BAD_IDS.items() if k != "huge"],
    Case("tenant-bad", ADMIN, "GET", "/v1/jobs?tenant=a%2Fb", 400, "invalid_field", "tenant"),
    Case("tenant-unicode", ADMIN, "GET", "/v1/jobs?tenant=%C3%A9", 400, "invalid_field", "tenant"),
    Case("tenant-long", ADMIN, "GET", "/v1/jobs?tenant=" + "a" * 65, 400, "invalid_field", "tenant"),
    # numbers in queries and headers
    *[Case(f"limit-{k}", BOB, "GET", "/v1/jobs?limit=" + httpx.QueryParams({"x": v})["x"], 400, "invalid_field", "limit") for k, v in BAD_NUMBERS.items()],
    Case("limit-zero", BOB, "GET", "/v1/jobs?limit=0", 400, "invalid_field", "limit"),
    Case("limit-over", BOB, "GET", "/v1/jobs?limit=1001", 400, "invalid_field", "limit"),
    *[Case(f"after-{k}", ALICE, "GET", "/v1/jobs/{a_done}/events?after=" + httpx.QueryParams({"x": v})["x"], 400, "invalid_field", "after") for k, v in BAD_NUMBERS.items()],
    *[Case(f"last-event-id-{k}", ALICE, "GET", "/v1/jobs/{a_done}/events", 400, "invalid_field", "Last-Event-ID", {"last-event-id": header(v)}) for k, v in HEADER_BAD_NUMBERS.items()],
    *[Case(f"prefer-wait-{k}", ALICE, "GET", "/v1/jobs/{a_done}", 400, "invalid_field", "Prefer", {"prefer": header(f"wait={v}")}) for k, v in BAD_WAITS.items()],
    *[Case(f"expires-{k}", None, "GET", "/v1/images/{a_done}.png?sig=00&expires=" + httpx.QueryParams({"x": v})["x"], 400, "invalid_field", "expires") for k, v in BAD_NUMBERS.items()],
]  # fmt: skip


def format_path(path: str, world: World) -> str:
    return path.format(**{f.name: getattr(world, f.name) for f in dataclasses.fields(world)})


@pytest.mark.parametrize("case", CASES, ids=str)
def test_case(http: httpx.Client, world: World, case: Case) -> None:
    path = format_path(case.path, world)
    headers = {**auth(case.token), **case.headers}
    if case.method == "GET" and case.path.endswith("/events") and case.status == 200:
        with http.stream("GET", path, headers=headers) as resp:
            assert resp.status_code == 200
            return
    resp = http.request(case.method, path, headers=headers)
    assert resp.status_code == case.status, resp.text[:300]
    assert resp.status_code < 500
    if case.code is None:
        return
    error = resp.json()["error"]
    assert (error["code"], error["field"]) == (case.code, case.field), error
    if path.startswith("/v1/images/"):
        assert error["type"] == "invalid_request_error" and error["param"] == case.field


OPENAI_FORM_NUMBERS = [
    ("n", "²"), ("n", "١"), ("n", "11"), ("n", HUGE), ("seed", "١٢"), ("seed", "1_0"),
    ("seed", str(2**63)), ("num_inference_steps", "1e3"), ("num_inference_steps", "２"),
    ("guidance_scale", "nan"), ("guidance_scale", "inf"), ("guidance_scale", "1_0"),
    ("guidance_scale", HUGE), ("size", "１２８x１２８"), ("size", "128x"),
]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), OPENAI_FORM_NUMBERS, ids=lambda v: repr(v)[:12])
def test_openai_form_numbers(http: httpx.Client, field: str, value: str) -> None:
    """The edit form's numbers go through the same parser: OpenAI-shaped 400 naming them."""
    data = {"model": FUNCTION, "prompt": "x", "image": TEMPLATE, field: value}
    files = {"mask": ("mask.png", mask_png(), "image/png")}
    resp = http.post("/v1/images/edits", data=data, files=files, headers=auth(ALICE))
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert (error["code"], error["field"], error["param"]) == ("invalid_field", field, field)
    assert error["type"] == "invalid_request_error"


# ---- what the corpus cannot say in one status ------------------------------------------
def listed(http: httpx.Client, token: str, query: str = "") -> list[dict[str, Any]]:
    resp = http.get(f"/v1/jobs?limit=1000{query}", headers=auth(token))
    assert resp.status_code == 200, resp.text
    return resp.json()["jobs"]


def test_a_tenant_lists_its_own_jobs_only(http: httpx.Client, world: World) -> None:
    for token, own, other in (
        (ALICE, world.a_done, world.b_done),
        (BOB, world.b_done, world.a_done),
    ):
        for query in ("", "&status=succeeded", f"&function={FUNCTION}"):
            ids = {j["id"] for j in listed(http, token, query)}
            assert own in ids and other not in ids
    assert ALICE_HOOK_KEY not in http.get("/v1/jobs", headers=auth(BOB)).text


def test_an_admin_lists_every_tenant_without_their_webhooks(
    http: httpx.Client, world: World
) -> None:
    everyone = {j["id"]: j for j in listed(http, ADMIN)}
    assert {world.a_done, world.b_done} <= set(everyone)
    assert "webhook" not in everyone[world.a_done]
    assert [j["id"] for j in listed(http, ADMIN, "&tenant=alice")].count(world.b_done) == 0
    assert world.a_done in {j["id"] for j in listed(http, ADMIN, "&tenant=alice")}
    admin_doc = http.get(f"/v1/jobs/{world.a_done}", headers=auth(ADMIN)).json()
    assert "webhook" not in admin_doc and ALICE_HOOK_KEY not in json.dumps(admin_doc)
    own = http.get(f"/v1/jobs/{world.a_done}", headers=auth(ALICE)).json()
    assert ALICE_HOOK_KEY in own["webhook"]


def test_the_same_404_for_anothers_job_as_for_none(http: httpx.Client, world: World) -> None:
    """No existence oracle: bob's answer on alice's id reads as on an unknown id (but
    for the id he sent himself)."""
    hidden = http.get(f"/v1/jobs/{world.a_done}", headers=auth(BOB))
    missing = http.get(f"/v1/jobs/{UNKNOWN}", headers=auth(BOB))
    assert hidden.status_code == missing.status_code == 404
    assert hidden.text.replace(world.a_done, UNKNOWN) == missing.text
    assert dict(hidden.headers).keys() == dict(missing.headers).keys()


def test_a_stream_ends_with_its_end_and_holds_no_webhook(http: httpx.Client, world: World) -> None:
    with Client(world.url, ALICE) as alice:
        events = list(alice.job_events(world.a_done))
    assert events[-1].kind is JobEventKind.SUCCEEDED
    assert all(ALICE_HOOK_KEY not in json.dumps(e.data) for e in events)


def test_another_tenant_cannot_cancel_a_running_job(world: World) -> None:
    with Client(world.url, ALICE) as alice, Client(world.url, BOB) as bob:
        job = alice.submit(FUNCTION, TEMPLATE, MASK, "a door", seed=9, steps=MAX_STEPS)
        refused = httpx.post(f"{world.url}/v1/jobs/{job.id}/cancel", headers=auth(BOB))
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "job_not_found"
        assert job.status()["status"] in ("queued", "running")
        assert job.id not in {j["id"] for j in bob.jobs(limit=1000)}
        with Client(world.url, ADMIN) as admin:
            canceled = admin.call(Call("POST", f"/v1/jobs/{job.id}/cancel"))
        assert canceled["status"] == "canceled"


def test_uploads_are_their_tenants_own(http: httpx.Client, world: World) -> None:
    """The same photo from bob is his own upload: not alice's bake (his first edit is the
    stock one while alice's second was mask-aware), nor listed to her, nor hers to him."""
    assert world.a_upload != world.b_upload
    assert world.a_second_upload_result.path is InvokePath.MASKAWARE
    assert world.b_upload_result.path is InvokePath.STOCK
    assert world.b_upload_result.cache.tier is CacheTier.NONE

    def uploads(token: str) -> set[str]:
        return set(http.get(f"/v1/functions/{FUNCTION}", headers=auth(token)).json()["uploads"])

    assert world.a_upload in uploads(ALICE) and world.b_upload not in uploads(ALICE)
    assert world.b_upload in uploads(BOB) and world.a_upload not in uploads(BOB)
    assert {world.a_upload, world.b_upload} <= uploads(ADMIN)
    listed_to_bob = http.get("/v1/functions", headers=auth(BOB)).json()["functions"]
    assert world.a_upload not in json.dumps(listed_to_bob)


def test_executors_show_each_tenant_its_own_uploads_only(http: httpx.Client, world: World) -> None:
    """``/v1/executors`` (invoke scope) holds the executors' template states and residency:
    another tenant's upload ids are not in it (an admin sees every tenant's), and the ids'
    owner tag is keyed, not a hash anyone can compute from a tenant's name."""

    def executors(token: str) -> str:
        resp = http.get("/v1/executors", headers=auth(token))
        assert resp.status_code == 200, resp.text[:300]
        return resp.text

    alice, bob, admin = executors(ALICE), executors(BOB), executors(ADMIN)
    assert world.a_upload in alice and world.b_upload not in alice
    assert world.b_upload in bob and world.a_upload not in bob
    assert world.a_upload in admin and world.b_upload in admin
    assert TEMPLATE in bob  # the deployed template is everyone's
    unkeyed = hashlib.sha256(b"upload-owner\0alice").hexdigest()[:12]
    assert unkeyed not in world.a_upload


def test_webhooks_reach_their_own_jobs_receiver_only(world: World) -> None:
    assert world.receiver.job_ids("/alice") == {world.a_done}
    assert world.receiver.job_ids("/bob") == {world.b_done}


def test_the_servers_own_rejections_are_structured(world: World) -> None:
    """An over-long request line and a malformed one never reach the app; the HTTP server
    answers them with the error body (both conventions: the route is unknown)."""
    port = int(world.url.rsplit(":", 1)[1])
    for request, code in (
        (f"GET /v1/jobs/{'a' * 20000} HTTP/1.1\r\nHost: x\r\n\r\n", "request_head_too_large"),
        (
            f"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {'b' * 20000}\r\n\r\n",
            "request_head_too_large",
        ),
        ("GET /v1/images/edits HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", "malformed_request"),
        ("NOT-HTTP\r\n\r\n", "malformed_request"),
    ):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request.encode())
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, raw[:200]
        error = json.loads(body)["error"]
        assert error["code"] == code and error["type"] == "invalid_request_error"
        assert {"message", "field", "param"} <= set(error)
    assert httpx.get(f"{world.url}/healthz").status_code == 200


def test_a_pipelined_request_head_is_held_to_the_limit_too(world: World) -> None:
    """Two requests in one write: a small one, then one whose head is 20 KB. The first is
    answered; the second gets the server's structured 400, as it would alone."""
    port = int(world.url.rsplit(":", 1)[1])
    small = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    large = f"GET /v1/jobs/{'a' * 20000} HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall((small + large).encode())
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    second = raw[raw.index(b"HTTP/1.1 ", 1) :]
    head, _, body = second.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), second[:200]
    assert json.loads(body)["error"]["code"] == "request_head_too_large"
