"""Bad input gets the right 4xx and a structured error, and the server stays healthy."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from retouch.functions.imaging import encode_mask
from retouch.functions.wire.codec import pack, unpack
from retouch.functions.wire.invoke import InvokeResult
from retouch.platform.api.client import Client, read_spec_file
from retouch.platform.api.server import ServerProcess

MSGPACK = {"content-type": "application/msgpack"}


@pytest.fixture(scope="module", autouse=True)
def deployed(server: ServerProcess, examples: Path, tokens: dict[str, str]) -> None:
    with Client(server.url, tokens["RETOUCH_ADMIN_TOKEN"]) as admin:
        assert admin.deploy_file(examples / "tiny-flux.toml")["status"] == "ready"


def _auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def _invoke_body(**overrides: Any) -> dict[str, Any]:
    body = {
        "template": "shirt",
        "mask": encode_mask(np.ones((128, 128), bool)),
        "prompt": "a hat",
        "seed": 1,
        "steps": 1,
    }
    body.update(overrides)
    return {k: v for k, v in body.items() if v is not None}


def _post_invoke(
    server: ServerProcess,
    tokens: dict[str, str],
    content: bytes,
    function: str = "tiny-flux",
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/functions/{function}/invoke",
        content=content,
        headers={**MSGPACK, **_auth(tokens["RETOUCH_INVOKE_TOKEN"]), **(headers or {})},
        timeout=60,
    )


def _error(resp: httpx.Response, status: int, code: str, field: str | None = None) -> None:
    assert resp.status_code == status, resp.content
    body = (
        unpack(resp.content)
        if resp.headers["content-type"].startswith("application/msgpack")
        else resp.json()
    )
    assert set(body["error"]) == {"code", "message", "field"}
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    assert body["error"]["field"] == field


BAD_INVOKES = [
    ("malformed msgpack", b"\xc1\xff\x00garbage", 400, "malformed_body", None),
    ("truncated msgpack", pack(_invoke_body())[:50], 400, "malformed_body", None),
    ("not a map", pack([1, 2, 3]), 400, "malformed_body", None),
    ("missing prompt", pack(_invoke_body(prompt=None)), 400, "missing_field", "prompt"),
    ("missing mask", pack(_invoke_body(mask=None)), 400, "missing_field", "mask"),
    ("seed is a string", pack(_invoke_body(seed="7")), 400, "invalid_field", "seed"),
    ("steps out of range", pack(_invoke_body(steps=0)), 400, "invalid_field", "steps"),
    ("unknown format", pack(_invoke_body(format="gif")), 400, "invalid_field", "format"),
    (
        "crop around an empty mask",
        pack(_invoke_body(mask=encode_mask(np.zeros((64, 128), bool)), padding_mask_crop=8)),
        400,
        "invalid_field",
        "padding_mask_crop",
    ),
    (
        "undecodable mask",
        pack(_invoke_body(mask=b"\x89PNG\r\n\x1a\nnot really")),
        400,
        "undecodable_image",
        "mask",
    ),
    (
        "unknown template",
        pack(_invoke_body(template="nope")),
        404,
        "template_not_found",
        "template",
    ),
]


@pytest.mark.parametrize(
    ("case", "content", "status", "code", "field"), BAD_INVOKES, ids=[c[0] for c in BAD_INVOKES]
)
def test_bad_invocations(
    server: ServerProcess,
    tokens: dict[str, str],
    case: str,
    content: bytes,
    status: int,
    code: str,
    field: str | None,
) -> None:
    _error(_post_invoke(server, tokens, content), status, code, field)


def test_unknown_function(server: ServerProcess, tokens: dict[str, str]) -> None:
    _error(
        _post_invoke(server, tokens, pack(_invoke_body()), function="nope"),
        404,
        "function_not_found",
        "name",
    )


def test_wrong_content_type_answers_in_json(server: ServerProcess, tokens: dict[str, str]) -> None:
    resp = _post_invoke(server, tokens, b"<a/>", headers={"content-type": "application/xml"})
    _error(resp, 415, "unsupported_media_type")
    assert resp.headers["content-type"].startswith("application/json")
    resp = _post_invoke(server, tokens, b"{}", headers={"content-type": "application/json"})
    _error(resp, 400, "missing_field", "template")  # JSON is read like msgpack, answered in JSON
    assert resp.headers["content-type"].startswith("application/json")


def test_oversize_payload(server: ServerProcess, tokens: dict[str, str]) -> None:
    big = pack(_invoke_body(prompt="x", mask=b"\0" * (33 << 20)))
    _error(_post_invoke(server, tokens, big), 413, "payload_too_large")


def test_oversize_payload_without_content_length(
    server: ServerProcess, tokens: dict[str, str]
) -> None:
    def chunks():
        for _ in range(40):
            yield b"\0" * (1 << 20)

    resp = httpx.post(
        f"{server.url}/v1/functions/tiny-flux/invoke",
        content=chunks(),
        headers={**MSGPACK, **_auth(tokens["RETOUCH_INVOKE_TOKEN"])},
        timeout=60,
    )
    _error(resp, 413, "payload_too_large")


def test_tokens(server: ServerProcess, tokens: dict[str, str], examples: Path) -> None:
    url = f"{server.url}/v1/functions/tiny-flux/invoke"
    body = pack(_invoke_body())
    _error(httpx.post(url, content=body, headers=MSGPACK), 401, "missing_token")
    _error(
        httpx.post(url, content=body, headers={**MSGPACK, **_auth("wrong")}), 401, "invalid_token"
    )
    _error(httpx.get(f"{server.url}/v1/functions", headers=_auth("wrong")), 401, "invalid_token")
    spec, images = read_spec_file(examples / "tiny-flux.toml")
    deploy = pack({"spec": spec.to_dict(), "templates": images})
    resp = httpx.put(
        f"{server.url}/v1/functions/tiny-flux",
        content=deploy,
        headers={**MSGPACK, **_auth(tokens["RETOUCH_INVOKE_TOKEN"])},
    )
    _error(resp, 403, "insufficient_scope")
    resp = httpx.delete(
        f"{server.url}/v1/functions/tiny-flux", headers=_auth(tokens["RETOUCH_INVOKE_TOKEN"])
    )
    _error(resp, 403, "insufficient_scope")


def _spec_doc(examples: Path, **changes: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
    spec, images = read_spec_file(examples / "tiny-flux.toml")
    doc = spec.to_dict()
    doc["name"] = "broken"
    doc.update(changes)
    return doc, images


def _png(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("case", "changes", "images", "field", "code"),
    [
        ("bad family", {"family": "gan"}, None, "family", "invalid_spec"),
        (
            "family does not match model",
            {"family": "sd-inpaint", "scheduler": "ddim"},
            None,
            "family",
            "invalid_spec",
        ),
        ("unknown builtin model", {"model": "retouch:huge"}, None, "model", "invalid_spec"),
        ("model folder missing", {"model": "/nonexistent/model"}, None, "model", "invalid_spec"),
        (
            "resolution not a multiple of 16",
            {"resolution": 100},
            None,
            "resolution",
            "invalid_spec",
        ),
        ("steps not an integer", {"steps": "ten"}, None, "steps", "invalid_spec"),
        ("scheduler of another family", {"scheduler": "ddim"}, None, "scheduler", "invalid_spec"),
        ("no templates", {"templates": {}}, None, "templates", "invalid_spec"),
        ("template image missing", None, {"shirt": None}, "templates.shirt.image", "invalid_spec"),
        (
            "template image wrong size",
            None,
            {"shirt": _png((64, 64))},
            "templates.shirt.image",
            "invalid_spec",
        ),
        (
            "template image undecodable",
            None,
            {"shirt": b"not an image"},
            "templates.shirt.image",
            "undecodable_image",
        ),
    ],
)
def test_invalid_spec(
    server: ServerProcess,
    tokens: dict[str, str],
    examples: Path,
    case: str,
    changes: dict | None,
    images: dict | None,
    field: str,
    code: str,
) -> None:
    doc, uploaded = _spec_doc(examples, **(changes or {}))
    for tid, data in (images or {}).items():
        if data is None:
            uploaded.pop(tid)
        else:
            uploaded[tid] = data
    body = pack({"spec": doc, "templates": uploaded})
    resp = httpx.put(
        f"{server.url}/v1/functions/broken",
        content=body,
        headers={**MSGPACK, **_auth(tokens["RETOUCH_ADMIN_TOKEN"])},
    )
    _error(resp, 422, code, field)


def test_invalid_spec_as_json_gets_json(server: ServerProcess, tokens: dict[str, str]) -> None:
    resp = httpx.put(
        f"{server.url}/v1/functions/broken",
        json={"spec": {"name": "broken", "family": "sd-inpaint"}},
        headers=_auth(tokens["RETOUCH_ADMIN_TOKEN"]),
    )
    _error(resp, 422, "invalid_spec", "model")
    resp = httpx.put(
        f"{server.url}/v1/functions/broken",
        content=b"{nope",
        headers={"content-type": "application/json", **_auth(tokens["RETOUCH_ADMIN_TOKEN"])},
    )
    _error(resp, 400, "malformed_body")


def test_server_healthy_after_bad_input(server: ServerProcess, tokens: dict[str, str]) -> None:
    """Runs last in this module: every bad request above left the server serving."""
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    assert httpx.get(f"{server.url}/readyz").status_code == 200
    resp = _post_invoke(server, tokens, pack(_invoke_body()))
    assert resp.status_code == 200
    result = InvokeResult.from_wire(unpack(resp.content))
    assert result.path in ("stock", "maskaware") and result.width == 128
    with Client(server.url, tokens["RETOUCH_ADMIN_TOKEN"]) as admin:
        assert [f["name"] for f in admin.list()] == ["tiny-flux"]
