"""A corpus of malformed requests against a real ``retouch serve`` and a real executor.

Every public endpoint of the gateway and every route of the executor's internal API gets
bad bodies, fields, images, names, specs, methods, routes and credentials. Each case must
answer the documented 4xx with the structured error body (``code`` and ``field`` checked)
or a documented 2xx/3xx, never a 5xx, and the server must answer ``/healthz`` after it.

The executor cases run against a standalone executor process started here with a token of
our own (``python -m retouch.runtime.executor``, its real entry point): the executors under
``retouch serve`` only accept the gateway's per-run token, which nothing exposes. That
process never loads a model, so it costs one start-up (~8 s on 2 cores).
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from dataclasses import field as default
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
from PIL import Image

from retouch.functions.wire.codec import RawArray, pack, unpack
from retouch.functions.wire.invoke import InvokeResult
from retouch.platform.api.client import Client, read_spec_file
from retouch.platform.api.server import ServerProcess
from tests.support import EXAMPLES, decodes_run, wait_for

FUNCTION = "tiny-sd"
SIZE = (128, 128)
MSGPACK = {"content-type": "application/msgpack"}
JSON = {"content-type": "application/json"}
EXEC_TOKEN = "bad-input-executor-token"
EXEC_TOKEN_ENV = "RETOUCH_EXECUTOR_TOKEN"  # what an executor process reads its token from

# Filled in by the fixtures below (tokens are fixed by tests/e2e/conftest.py).
ADMIN = {"authorization": "Bearer admin-secret-token"}
INVOKE = {"authorization": "Bearer invoke-secret-token"}
EXEC = {"authorization": f"Bearer {EXEC_TOKEN}"}


# ---- request bodies ---------------------------------------------------------------------


class Pairs(list):
    """A map encoded from a list of pairs: how a body with a duplicate key is written."""


def packp(obj: Any) -> bytes:
    """msgpack that can repeat keys (``Pairs``), which ``msgpack.packb`` cannot."""
    if isinstance(obj, dict):
        obj = Pairs(obj.items())
    if isinstance(obj, Pairs):
        out = bytearray(msgpack.Packer().pack_map_header(len(obj)))
        for key, value in obj:
            out += packp(key) + packp(value)
        return bytes(out)
    return pack(obj)


def _encode(img: Image.Image, fmt: str = "PNG", **params: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **params)
    return buf.getvalue()


SEL = np.zeros((SIZE[1], SIZE[0]), bool)
SEL[32:80, 16:96] = True  # the selection the "documented 200" masks encode
RATIO = float(SEL.mean())


def _grey(sel: np.ndarray = SEL) -> Image.Image:
    return Image.fromarray(sel.astype(np.uint8) * 255)


def _rgba(colour: int, alpha: np.ndarray) -> bytes:
    arr = np.full((*SEL.shape, 4), colour, np.uint8)
    arr[..., 3] = alpha
    return _encode(Image.fromarray(arr, "RGBA"))


def _lab(sel: np.ndarray = SEL) -> Image.Image:
    neutral = Image.new("L", SIZE, 128)  # a/b are offset by 128 in PIL's LAB
    return Image.merge("LAB", [_grey(sel), neutral, neutral])


def _header_only(size: tuple[int, int]) -> bytes:
    """A PNG that declares ``size`` and carries no pixel data: only a header-first check can
    answer it without decoding (or failing to decode) pixels."""
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", size[0], size[1], 8, 0, 0, 0, 0)  # 8-bit grey
    idat = b"IDAT"  # an empty data chunk: PIL opens it, and decoding it would fail
    return b"\x89PNG\r\n\x1a\n" + b"".join(
        struct.pack(">I", len(c) - 4) + c + struct.pack(">I", zlib.crc32(c)) for c in (ihdr, idat)
    )


def _palette_with_transparency() -> bytes:
    grey = np.where(SEL, 255, 0).astype(np.uint8)
    grey[0, 0] = 200  # white-ish but transparent: kept
    img = Image.fromarray(grey).convert("P")
    return _encode(img, transparency=img.getpixel((0, 0)))


MASKS = {
    "png": _encode(_grey()),
    "black": _encode(_grey(np.zeros_like(SEL))),
    "lab-tiff": _encode(_lab(), "TIFF"),
    "cmyk-tiff": _encode(_grey().convert("RGB").convert("CMYK"), "TIFF"),
    "png-16bit": _encode(Image.fromarray(SEL.astype(np.uint16) * 257)),
    "tiff-float": _encode(Image.fromarray(SEL.astype(np.float32)), "TIFF"),
    "1-bit": _encode(_grey().convert("1")),
    "palette-transparent": _palette_with_transparency(),
    "rgba-opaque": _encode(_grey().convert("RGBA")),
    "gif": _encode(_grey(), "GIF"),
    "bmp": _encode(_grey(), "BMP"),
    "rgba-alpha-only": _rgba(0, np.where(SEL, 255, 0)),
    "rgba-hole": _rgba(180, np.where(SEL, 0, 255)),
    "white-on-transparent": _rgba(255, np.where(SEL, 255, 0)),
    "la-alpha-only": _encode(Image.merge("LA", [Image.new("L", SIZE, 0), _grey()])),
}


def inv(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "template": "street",
        "mask": MASKS["black"],
        "prompt": "a red door",
        "seed": 1,
        "steps": 1,
    }
    body.update(changes)
    return {k: v for k, v in body.items() if v is not None}


def inv_body(**changes: Any) -> bytes:
    return pack(inv(**changes))


_SPEC, _IMAGES = read_spec_file(EXAMPLES / f"{FUNCTION}.toml")


def spec_doc(**changes: Any) -> dict[str, Any]:
    doc = _SPEC.to_dict()
    doc["name"] = "bad-spec"
    doc.update(changes)
    return doc


def deploy(spec_: Any = None, images_: Any = None, **changes: Any) -> dict[str, Any]:
    """A deploy body: the example spec with ``changes`` (or ``spec_``) and its images (or
    ``images_``, the uploaded ``templates`` map)."""
    return {
        "spec": spec_doc(**changes) if spec_ is None else spec_,
        "templates": dict(_IMAGES) if images_ is None else images_,
    }


def deploy_body(spec_: Any = None, images_: Any = None, **changes: Any) -> bytes:
    return pack(deploy(spec_, images_, **changes))


def _template(**changes: Any) -> dict[str, Any]:
    return {"templates": {**_SPEC.to_dict()["templates"], "street": {"prompt": "p", **changes}}}


def _deep_json(depth: int) -> bytes:
    return b'{"spec": ' + b"[" * depth + b"]" * depth + b"}"


# ---- the corpus ------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    method: str
    path: str
    status: int
    code: str | None = None  # None: a documented non-error answer
    field: str | None = None
    body: bytes | None = None
    headers: dict[str, str] = default(default_factory=dict)
    target: str = "gateway"  # or "executor", or "metrics" (the gateway's metrics listener)
    check: Callable[[httpx.Response], None] | None = None


def _result(expect_ratio: float, path: str | None = None) -> Callable[[httpx.Response], None]:
    """A documented 200 for an unusual mask: it selected exactly the pixels it encodes."""

    def check(resp: httpx.Response) -> None:
        result = InvokeResult.from_wire(unpack(resp.content))
        assert abs(result.mask_ratio - expect_ratio) < 1e-9, result.mask_ratio
        assert (result.width, result.height) == SIZE
        if path is not None:
            assert result.path == path

    return check


def _allow(*methods: str) -> Callable[[httpx.Response], None]:
    def check(resp: httpx.Response) -> None:
        allowed = {m.strip() for m in resp.headers["allow"].split(",")}
        assert set(methods) <= allowed, allowed

    return check


def _mentions(text: str) -> Callable[[httpx.Response], None]:
    def check(resp: httpx.Response) -> None:
        assert text in _body(resp)["error"]["message"]

    return check


INV = f"/v1/functions/{FUNCTION}/invoke"
FN = f"/v1/functions/{FUNCTION}"
PUT = "/v1/functions/bad-spec"
G = {**MSGPACK, **INVOKE}  # an invocation's headers
A = {**MSGPACK, **ADMIN}  # a deploy's headers
AJ = {**JSON, **ADMIN}  # a deploy's headers, JSON


def _routes() -> list[Case]:
    return [
        Case("route-unknown", "GET", "/nope", 404, "route_not_found"),
        Case("route-v1-root", "GET", "/v1", 404, "route_not_found"),
        Case("route-encoded-slash", "GET", "/v1/functions/tiny%2Fsd", 404, "route_not_found", headers=INVOKE),
        Case("route-too-deep", "GET", f"{INV}/more", 404, "route_not_found", headers=INVOKE),
        Case("route-unknown-msgpack", "GET", "/nope", 404, "route_not_found", headers={"accept": "application/msgpack"}),
        Case("route-unknown-post", "POST", "/v1/invoke", 404, "route_not_found", body=inv_body(), headers=G),
        Case("route-trailing-slash-redirects", "GET", "/healthz/", 307),
        Case("method-get-invoke", "GET", INV, 405, "method_not_allowed", headers=INVOKE, check=_allow("POST")),
        Case("method-post-healthz", "POST", "/healthz", 405, "method_not_allowed", check=_allow("GET")),
        Case("method-delete-readyz", "DELETE", "/readyz", 405, "method_not_allowed"),
        Case("route-metrics-not-on-the-api", "GET", "/metrics", 404, "route_not_found"),
        Case("route-metrics-not-on-the-api-admin", "GET", "/metrics", 404, "route_not_found", headers=ADMIN),
        Case("metrics-port-put", "PUT", "/metrics", 405, "method_not_allowed", body=b"x", target="metrics", check=_allow("GET", "HEAD")),
        Case("metrics-port-serves-no-api", "GET", "/v1/functions", 404, "route_not_found", headers=INVOKE, target="metrics"),
        Case("metrics-port-serves-no-probe", "GET", "/healthz", 404, "route_not_found", target="metrics"),
        Case("method-post-functions", "POST", "/v1/functions", 405, "method_not_allowed", body=b"{}", headers={**JSON, **ADMIN}),
        Case("method-patch-function", "PATCH", FN, 405, "method_not_allowed", headers=ADMIN, check=_allow("GET", "PUT", "DELETE")),
        Case("method-post-function", "POST", FN, 405, "method_not_allowed", headers=ADMIN, check=_allow("GET", "PUT", "DELETE")),
        Case("method-post-executors", "POST", "/v1/executors", 405, "method_not_allowed", headers=INVOKE),
        Case("method-options", "OPTIONS", "/v1/functions", 405, "method_not_allowed"),
        Case("method-head-healthz", "HEAD", "/healthz", 200),
    ]  # fmt: skip


def _auth() -> list[Case]:
    wrong = {"authorization": "Bearer not-a-token"}
    basic = {"authorization": "Basic YWRtaW46c2VjcmV0"}
    return [
        Case("auth-list-missing", "GET", "/v1/functions", 401, "missing_token"),
        Case("auth-list-wrong", "GET", "/v1/functions", 401, "invalid_token", headers=wrong),
        Case("auth-list-basic", "GET", "/v1/functions", 401, "missing_token", headers=basic),
        Case("auth-list-bearer-empty", "GET", "/v1/functions", 401, "missing_token", headers={"authorization": "Bearer"}),
        Case("auth-list-token-no-scheme", "GET", "/v1/functions", 401, "missing_token", headers={"authorization": "invoke-secret-token"}),
        Case("auth-list-lowercase-scheme", "GET", "/v1/functions", 200, headers={"authorization": "bearer invoke-secret-token"}),
        Case("auth-get-missing", "GET", FN, 401, "missing_token"),
        Case("auth-get-wrong", "GET", FN, 401, "invalid_token", headers=wrong),
        Case("auth-executors-missing", "GET", "/v1/executors", 401, "missing_token"),
        Case("auth-executors-wrong", "GET", "/v1/executors", 401, "invalid_token", headers=wrong),
        Case("auth-invoke-missing", "POST", INV, 401, "missing_token", body=inv_body(), headers=MSGPACK),
        Case("auth-invoke-wrong", "POST", INV, 401, "invalid_token", body=inv_body(), headers={**MSGPACK, **wrong}),
        Case("auth-invoke-basic", "POST", INV, 401, "missing_token", body=inv_body(), headers={**MSGPACK, **basic}),
        Case("auth-put-missing", "PUT", PUT, 401, "missing_token", body=deploy_body(), headers=MSGPACK),
        Case("auth-put-wrong", "PUT", PUT, 401, "invalid_token", body=deploy_body(), headers={**MSGPACK, **wrong}),
        Case("auth-put-invoke-token", "PUT", PUT, 403, "insufficient_scope", body=deploy_body(), headers=G),
        Case("auth-delete-missing", "DELETE", FN, 401, "missing_token"),
        Case("auth-delete-invoke-token", "DELETE", FN, 403, "insufficient_scope", headers=INVOKE),
        Case("auth-healthz-needs-none", "GET", "/healthz", 200, headers=wrong),
        Case("auth-readyz-needs-none", "GET", "/readyz", 200, headers=wrong),
        Case("auth-metrics-needs-none", "GET", "/metrics", 200, target="metrics"),
    ]  # fmt: skip


def _bodies() -> list[Case]:
    deep = b"\x91" * 5000 + b"\x01"
    return [
        Case("body-garbage", "POST", INV, 400, "malformed_body", body=b"\xc1\xff\x00garbage", headers=G),
        Case("body-truncated", "POST", INV, 400, "malformed_body", body=inv_body()[:40], headers=G),
        Case("body-empty", "POST", INV, 400, "malformed_body", body=b"", headers=G),
        Case("body-extra-data", "POST", INV, 400, "malformed_body", body=inv_body() + b"\x01", headers=G),
        Case("body-list", "POST", INV, 400, "malformed_body", body=pack([1, 2]), headers=G),
        Case("body-int", "POST", INV, 400, "malformed_body", body=pack(7), headers=G),
        Case("body-string", "POST", INV, 400, "malformed_body", body=pack("mask"), headers=G),
        Case("body-nil", "POST", INV, 400, "malformed_body", body=b"\xc0", headers=G),
        Case("body-deep-msgpack", "POST", INV, 400, "malformed_body", body=deep, headers=G),
        Case("body-bytes-keys", "POST", INV, 400, "malformed_body", "template", body=pack({b"template": "street"}), headers=G),
        Case("body-duplicate-key", "POST", INV, 400, "duplicate_key", "prompt", body=packp(Pairs([*inv().items(), ("prompt", "x")])), headers=G),
        Case("body-invalid-utf8", "POST", INV, 400, "malformed_body", body=b"\x81\xa8template\xa2\xff\xfe", headers=G),
        Case("body-json-empty-on-invoke", "POST", INV, 400, "missing_field", "template", body=b"{}", headers={**JSON, **INVOKE}),
        Case("body-json-mask-not-base64", "POST", INV, 400, "invalid_field", "mask", body=b'{"template": "street", "mask": "@@", "prompt": "p"}', headers={**JSON, **INVOKE}),
        Case("body-json-mask-data-uri-not-base64", "POST", INV, 400, "invalid_field", "mask", body=b'{"template": "street", "mask": "data:image/png,abc", "prompt": "p"}', headers={**JSON, **INVOKE}),
        Case("body-json-mask-not-an-image", "POST", INV, 400, "undecodable_image", "mask", body=b'{"template": "street", "mask": "aGVsbG8=", "prompt": "p"}', headers={**JSON, **INVOKE}),
        Case("body-json-unknown-field", "POST", INV, 400, "unknown_field", "stregth", body=b'{"template": "street", "mask": "aGVsbG8=", "prompt": "p", "stregth": 0.5}', headers={**JSON, **INVOKE}),
        Case("body-json-invoke-nan", "POST", INV, 400, "malformed_body", body=b'{"template": "street", "mask": "aGVsbG8=", "prompt": "p", "strength": NaN}', headers={**JSON, **INVOKE}),
        Case("body-json-mask-url-not-fetched", "POST", INV, 400, "fetch_disabled", "mask", body=b'{"template": "street", "mask": "http://127.0.0.1:9/mask.png", "prompt": "p"}', headers={**JSON, **INVOKE}),
        Case("body-json-on-jobs", "POST", f"/v1/functions/{FUNCTION}/jobs", 400, "missing_field", "template", body=b'{"webhook_events": ["completed"]}', headers={**JSON, **INVOKE}),
        Case("body-text-on-invoke", "POST", INV, 415, "unsupported_media_type", body=b"hi", headers={"content-type": "text/plain", **INVOKE}),
        Case("body-no-content-type", "POST", INV, 400, "malformed_body", body=b"\xc1", headers=INVOKE),
        Case("body-text-on-put", "PUT", PUT, 415, "unsupported_media_type", body=b"hi", headers={"content-type": "text/plain", **ADMIN}),
        Case("body-json-garbage", "PUT", PUT, 400, "malformed_body", body=b"{nope", headers={**JSON, **ADMIN}),
        Case("body-json-deep", "PUT", PUT, 400, "malformed_body", body=_deep_json(100_000), headers={**JSON, **ADMIN}),
        Case("body-json-huge-int", "PUT", PUT, 400, "malformed_body", body=b'{"spec": {"steps": ' + b"9" * 5000 + b"}}", headers={**JSON, **ADMIN}),
        Case("body-json-nan", "PUT", PUT, 400, "malformed_body", body=b'{"spec": {"guidance": NaN}}', headers={**JSON, **ADMIN}),
        Case("body-json-list", "PUT", PUT, 400, "malformed_body", body=b"[1, 2]", headers={**JSON, **ADMIN}),
        Case("body-json-not-utf8", "PUT", PUT, 400, "malformed_body", body=b'{"a": "\xff"}', headers={**JSON, **ADMIN}),
        Case("body-msgpack-deep-put", "PUT", PUT, 400, "malformed_body", body=deep, headers=A),
        Case("body-msgpack-not-map-put", "PUT", PUT, 400, "malformed_body", body=pack([deploy()]), headers=A),
    ]  # fmt: skip


def _fields() -> list[Case]:
    def bad(name: str, code: str, fld: str, **changes: Any) -> Case:
        return Case(
            f"field-{name}", "POST", INV, 400, code, fld, body=inv_body(**changes), headers=G
        )

    return [
        bad("missing-template", "missing_field", "template", template=None),
        bad("missing-mask", "missing_field", "mask", mask=None),
        bad("missing-prompt", "missing_field", "prompt", prompt=None),
        bad("template-int", "invalid_field", "template", template=3),
        bad("template-list", "invalid_field", "template", template=["street"]),
        bad("mask-string-not-base64", "invalid_field", "mask", mask="iVBORw0KGgo=!"),
        bad("strength-zero", "invalid_field", "strength", strength=0),
        bad("strength-over-1", "invalid_field", "strength", strength=1.01),
        bad("strength-string", "invalid_field", "strength", strength="0.5"),
        bad("strength-keeps-no-step", "invalid_field", "strength", strength=0.5),  # of 1 step
        bad("scheduler-not-allowed", "invalid_field", "scheduler", scheduler="euler"),
        bad("scheduler-int", "invalid_field", "scheduler", scheduler=3),
        bad("padding-negative", "invalid_field", "padding_mask_crop", padding_mask_crop=-4),
        bad("padding-huge", "invalid_field", "padding_mask_crop", padding_mask_crop=10**6),
        bad("negative-prompt-list", "invalid_field", "negative_prompt", negative_prompt=["x"]),
        bad("both-steps-names", "invalid_field", "num_inference_steps", steps=2, num_inference_steps=2),
        bad("invoke-unknown-field", "unknown_field", "num_steps", num_steps=2),
        bad("mask-int", "invalid_field", "mask", mask=0),
        bad("prompt-list", "invalid_field", "prompt", prompt=["a"]),
        bad("prompt-too-long", "invalid_field", "prompt", prompt="x" * 4097),
        bad("seed-string", "invalid_field", "seed", seed="7"),
        bad("seed-bool", "invalid_field", "seed", seed=True),
        bad("seed-float", "invalid_field", "seed", seed=1.5),
        bad("seed-negative", "invalid_field", "seed", seed=-1),
        bad("seed-2^63", "invalid_field", "seed", seed=2**63),
        bad("seed-ext-type", "invalid_field", "seed", seed=msgpack.ExtType(5, b"x")),
        bad("steps-zero", "invalid_field", "steps", steps=0),
        bad("steps-201", "invalid_field", "steps", steps=201),
        bad("steps-bool", "invalid_field", "steps", steps=True),
        bad("steps-float", "invalid_field", "steps", steps=2.5),
        bad("guidance-negative", "invalid_field", "guidance", guidance=-0.5),
        bad("guidance-51", "invalid_field", "guidance", guidance=51),
        bad("guidance-nan", "invalid_field", "guidance", guidance=float("nan")),
        bad("guidance-inf", "invalid_field", "guidance", guidance=float("inf")),
        bad("guidance-bool", "invalid_field", "guidance", guidance=False),
        bad("guidance-string", "invalid_field", "guidance", guidance="7"),
        bad("format-gif", "invalid_field", "format", format="gif"),
        bad("format-int", "invalid_field", "format", format=1),
        Case("field-unknown-template", "POST", INV, 404, "template_not_found", "template", body=inv_body(template="nope"), headers=G),
        Case("field-template-newline", "POST", INV, 404, "template_not_found", "template", body=inv_body(template="street\n"), headers=G),
        Case("field-unknown-function", "POST", "/v1/functions/nope/invoke", 404, "function_not_found", "name", body=inv_body(), headers=G),
    ]  # fmt: skip


def _images() -> list[Case]:
    def bad(name: str, code: str, mask: bytes) -> Case:
        return Case(
            f"image-{name}", "POST", INV, 400, code, "mask", body=inv_body(mask=mask), headers=G
        )

    def ok(name: str, mask: bytes, ratio: float = RATIO, path: str | None = None) -> Case:
        return Case(
            f"image-{name}",
            "POST",
            INV,
            200,
            body=inv_body(mask=mask),
            headers=G,
            check=_result(ratio, path),
        )

    png = MASKS["png"]
    return [
        bad("not-an-image", "undecodable_image", b"this is not an image"),
        bad("empty", "undecodable_image", b""),
        bad("truncated-png", "undecodable_image", png[: len(png) // 2]),
        bad("png-signature-only", "undecodable_image", b"\x89PNG\r\n\x1a\n"),
        bad("bare-tiff-header", "undecodable_image", b"II*\x00" + b"\x00" * 20),
        bad("eps", "undecodable_image", b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 128 128\n"),
        bad("huge-declared", "image_too_large", _header_only((8000, 8000))),
        bad("bomb-declared", "image_too_large", _header_only((60000, 60000))),
        bad("header-only", "undecodable_image", _header_only((256, 256))),
        bad("rgba-alpha-only", "mask_in_alpha", MASKS["rgba-alpha-only"]),
        bad("rgba-transparent-hole", "mask_in_alpha", MASKS["rgba-hole"]),
        bad("white-on-transparent", "mask_in_alpha", MASKS["white-on-transparent"]),
        bad("la-alpha-only", "mask_in_alpha", MASKS["la-alpha-only"]),
        ok("black-is-the-template", MASKS["black"], 0.0, "template"),
        ok("other-size-small-black", _encode(Image.new("L", (64, 64))), 0.0, "template"),
        ok("twice-the-size", _encode(_grey().resize((256, 256), Image.NEAREST))),  # resized
        ok("lab-tiff", MASKS["lab-tiff"]),
        ok("cmyk-tiff", MASKS["cmyk-tiff"]),
        ok("png-16bit", MASKS["png-16bit"]),
        ok("tiff-float", MASKS["tiff-float"]),
        ok("1-bit", MASKS["1-bit"]),
        ok("palette-transparent", MASKS["palette-transparent"]),
        ok("rgba-opaque", MASKS["rgba-opaque"]),
        ok("gif", MASKS["gif"]),
        ok("bmp", MASKS["bmp"]),
    ]  # fmt: skip


def _names() -> list[Case]:
    def get(name: str, path: str) -> Case:
        return Case(
            f"name-get-{name}",
            "GET",
            f"/v1/functions/{path}",
            404,
            "function_not_found",
            "name",
            headers=INVOKE,
        )

    def put(name: str, path: str) -> Case:
        body = deploy_body(spec_={k: v for k, v in spec_doc().items() if k != "name"})
        return Case(
            f"name-put-{name}",
            "PUT",
            f"/v1/functions/{path}",
            422,
            "invalid_spec",
            "name",
            body=body,
            headers=A,
        )

    return [
        get("uppercase", "TINY-SD"),
        get("trailing-newline", "tiny-sd%0A"),
        get("too-long", "a" * 200),
        get("unicode", "t%C3%AFny-sd"),
        get("nul", "tiny-sd%00"),
        get("invalid-utf8", "%FF%FE"),
        put("uppercase", "Bad-Spec"),
        put("trailing-newline", "bad-spec%0A"),
        put("too-long", "a" * 64),
        put("unicode", "b%C3%A4d-spec"),
        put("leading-dash", "-bad"),
        put("space", "bad%20spec"),
        Case("name-put-mismatch", "PUT", PUT, 422, "invalid_spec", "name", body=deploy_body(name="other"), headers=A),
        Case("name-delete-unknown", "DELETE", "/v1/functions/nope", 404, "function_not_found", "name", headers=ADMIN),
        Case("name-delete-uppercase", "DELETE", "/v1/functions/TINY-SD", 404, "function_not_found", "name", headers=ADMIN),
        Case("name-invoke-newline", "POST", "/v1/functions/tiny-sd%0A/invoke", 404, "function_not_found", "name", body=inv_body(), headers=G),
    ]  # fmt: skip


def _specs() -> list[Case]:
    def bad(
        name: str,
        fld: str | None,
        body: bytes,
        code: str = "invalid_spec",
        status: int = 422,
        check: Any = None,
        headers: dict[str, str] = A,
    ) -> Case:
        return Case(
            f"spec-{name}", "PUT", PUT, status, code, fld, body=body, headers=headers, check=check
        )

    street = _SPEC.to_dict()["templates"]["street"]
    dup_spec = Pairs([(k, v) for k, v in spec_doc().items() if k != "templates"])
    dup_spec.append(("templates", Pairs([("street", street), ("street", street)])))
    lab_template = _encode(_lab().resize((64, 64)), "TIFF")
    return [
        bad("unknown-modell", "modell", deploy_body(modell="x"), check=_mentions("did you mean 'model'?")),
        bad("unknown-step", "step", deploy_body(step=5), check=_mentions("did you mean 'steps'?")),
        bad("unknown-top", "colour", deploy_body(colour="red")),
        bad("unknown-template-field", "templates.street.promt", deploy_body(**_template(promt="x")), check=_mentions("did you mean 'prompt'?")),
        bad("unknown-scaling-field", "scaling.max_executor", deploy_body(scaling={"max_executor": 2})),
        bad("unknown-slo-field", "slo.latency", deploy_body(slo={"latency": 10.0})),
        bad("duplicate-template-msgpack", "spec.templates.street", packp({"spec": dup_spec, "templates": _IMAGES}), "duplicate_key", 400),
        bad("duplicate-template-json", "spec.templates.street", b'{"spec": {"templates": {"street": {}, "street": {}}}}', "duplicate_key", 400, headers=AJ),
        bad("duplicate-image-upload", "templates.street", packp({"spec": spec_doc(), "templates": Pairs([*_IMAGES.items(), ("street", _IMAGES["street"])])}), "duplicate_key", 400),
        bad("bytes-keys-in-spec", "spec.model", pack({"spec": {**spec_doc(), b"model": "x"}, "templates": _IMAGES}), "malformed_body", 400),
        bad("template-prompt-too-long", "templates.street.prompt", deploy_body(**_template(prompt="x" * 4097))),
        bad("template-id-newline", "templates.street\n", deploy_body(templates={"street\n": street})),
        bad("template-id-too-long", "templates." + "t" * 129, deploy_body(templates={"t" * 129: street})),
        bad("template-id-unicode", "templates.strëet", deploy_body(templates={"strëet": street})),
        bad("template-seed-negative", "templates.street.seed", deploy_body(**_template(seed=-1))),
        bad("template-not-table", "templates.street", deploy_body(templates={"street": "x"})),
        bad("resolution-100", "resolution", deploy_body(resolution=100)),
        bad("resolution-one-element", "resolution", deploy_body(resolution=[128])),
        bad("resolution-8192", "resolution", deploy_body(resolution=8192)),
        bad("resolution-string", "resolution", deploy_body(resolution="128")),
        bad("resolution-bool", "resolution", deploy_body(resolution=True)),
        bad("steps-zero", "steps", deploy_body(steps=0)),
        bad("steps-bool", "steps", deploy_body(steps=True)),
        bad("guidance-51", "guidance", deploy_body(guidance=51.0)),
        bad("full-steps-negative", "full_steps", deploy_body(full_steps=-1)),
        bad("family-unknown", "family", deploy_body(family="gan")),
        bad("model-unknown", "model", deploy_body(model="retouch:huge")),
        bad("scheduler-other-family", "scheduler", deploy_body(scheduler="flow-euler")),
        bad("scaling-min-above-max", "scaling.min_executors", deploy_body(scaling={"min_executors": 3, "max_executors": 1})),
        bad("slo-zero", "slo.latency_ms", deploy_body(slo={"latency_ms": 0})),
        bad("examples-not-a-list", "examples", deploy_body(examples="a red balloon")),
        bad("examples-too-many", "examples[16]", deploy_body(examples=["a red balloon"] * 17)),
        bad("examples-too-long", "examples[1]", deploy_body(examples=["a", "x" * 201])),
        bad("examples-not-strings", "examples[0]", deploy_body(examples=[3])),
        bad("schedulers-not-a-list", "schedulers", deploy_body(schedulers="euler")),
        bad("schedulers-other-family", "schedulers[1]", deploy_body(schedulers=["euler", "flow-euler"])),
        bad("schedulers-twice", "schedulers[1]", deploy_body(schedulers=["dpm++", "dpm++"])),
        bad("examples-json-null", "examples[1]", b'{"spec": ' + _json(spec_doc(examples=["a", None])) + b"}", headers=AJ),
        bad("spec-missing", None, pack({"templates": _IMAGES})),
        bad("spec-a-list", None, deploy_body(spec_=[1])),
        bad("templates-body-missing", "templates", pack({"spec": spec_doc()})),
        bad("template-image-missing", "templates.street.image", deploy_body(images_={"poster": _IMAGES["poster"]})),
        bad("template-image-int", "templates.street.image", deploy_body(images_={**_IMAGES, "street": 5}), "invalid_field"),
        bad("template-image-undecodable", "templates.street.image", deploy_body(images_={**_IMAGES, "street": b"nope"}), "undecodable_image"),
        bad("template-image-huge", "templates.street.image", deploy_body(images_={**_IMAGES, "street": _header_only((9000, 9000))}), "image_too_large"),
        bad("template-image-wrong-size-lab", "templates.street.image", deploy_body(images_={**_IMAGES, "street": lab_template})),
        bad("template-image-undeclared", "templates.extra", deploy_body(images_={**_IMAGES, "extra": _IMAGES["street"]})),
        bad("json-unknown-field", "modell", b'{"spec": {"name": "bad-spec", "modell": "x"}}', check=_mentions("did you mean 'model'?"), headers=AJ),
        bad("json-base64-not-valid", "templates.street.image", b'{"spec": ' + _json(spec_doc()) + b', "templates": {"street": "!!", "poster": "!!"}}', "invalid_field", headers=AJ),
    ]  # fmt: skip


def _json(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def _executor() -> list[Case]:
    def ex(
        name: str,
        method: str,
        path: str,
        status: int,
        code: str | None,
        fld: str | None = None,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        check: Any = None,
    ) -> Case:
        return Case(
            f"executor-{name}",
            method,
            path,
            status,
            code,
            fld,
            body,
            {**MSGPACK, **EXEC} if headers is None else headers,
            "executor",
            check,
        )

    mask = RawArray.of(SEL.astype(np.uint8)).to_wire()
    invoke = {
        "function": "nope",
        "template": "street",
        "mask": mask,
        "prompt": "p",
        "seed": 1,
        "steps": 1,
        "guidance": 7.5,
        "format": "png",
    }
    spec = _SPEC.to_dict()
    images = dict(_IMAGES)
    # A valid deploy as the gateway sends it ("generation": its sequence number of control
    # operations on the name), so each case below breaks exactly one thing.
    put = {"spec": spec, "templates": images, "generation": 1}
    return [
        ex("route-unknown", "GET", "/nope", 404, "route_not_found"),
        ex("route-unknown-no-token", "GET", "/v1/functions", 404, "route_not_found", headers={}),
        ex("method-post-state", "POST", "/state", 405, "method_not_allowed", check=_allow("GET")),
        ex("method-get-invoke", "GET", "/invoke", 405, "method_not_allowed", check=_allow("POST")),
        ex("method-patch-function", "PATCH", "/functions/x", 405, "method_not_allowed", check=_allow("PUT", "DELETE")),
        ex("method-post-healthz", "POST", "/healthz", 405, "method_not_allowed"),
        ex("auth-healthz-open", "GET", "/healthz", 200, None, headers={}),  # liveness probes
        ex("auth-state-wrong", "GET", "/state", 401, "unauthorized", headers={"authorization": "Bearer nope"}),
        ex("auth-state-gateway-admin-token", "GET", "/state", 401, "unauthorized", headers=ADMIN),
        ex("auth-invoke-basic", "POST", "/invoke", 401, "unauthorized", body=pack(invoke), headers={**MSGPACK, "authorization": "Basic eDp5"}),
        ex("auth-put-missing", "PUT", "/functions/x", 401, "unauthorized", body=pack({"spec": spec}), headers=MSGPACK),
        ex("auth-delete-missing", "DELETE", "/functions/x", 401, "unauthorized", headers={}),
        ex("put-garbage", "PUT", "/functions/tiny-sd", 400, "malformed_body", body=b"\xc1garbage"),
        ex("put-json", "PUT", "/functions/tiny-sd", 415, "unsupported_media_type", body=b"{}", headers={**JSON, **EXEC}),
        ex("put-deep", "PUT", "/functions/tiny-sd", 400, "malformed_body", body=b"\x91" * 5000 + b"\x01"),
        ex("put-not-map", "PUT", "/functions/tiny-sd", 400, "malformed_body", body=pack([spec])),
        ex("put-duplicate-key", "PUT", "/functions/tiny-sd", 400, "duplicate_key", "spec.model", body=packp({**put, "spec": Pairs([*spec.items(), ("model", "x")])})),
        ex("put-bytes-keys", "PUT", "/functions/tiny-sd", 400, "malformed_body", "spec.templates.street", body=pack({**put, "spec": {**spec, "templates": {b"street": {}}}})),
        ex("put-unknown-field", "PUT", "/functions/tiny-sd", 422, "invalid_spec", "step", body=pack({**put, "spec": {**spec, "step": 5}})),
        ex("put-name-newline", "PUT", "/functions/tiny-sd", 422, "invalid_spec", "name", body=pack({**put, "spec": {**spec, "name": "tiny-sd\n"}})),
        ex("put-template-undecodable", "PUT", "/functions/tiny-sd", 400, "undecodable_image", "templates.street", body=pack({**put, "templates": {**images, "street": b"nope"}})),
        ex("invoke-garbage", "POST", "/invoke", 400, "malformed_body", body=b"\x93\x01"),
        ex("invoke-missing-function", "POST", "/invoke", 400, "missing_field", "function", body=pack({k: v for k, v in invoke.items() if k != "function"})),
        ex("invoke-mask-not-array", "POST", "/invoke", 400, "invalid_field", "mask", body=pack({**invoke, "mask": {"dtype": "u1"}})),
        ex("invoke-mask-wrong-shape", "POST", "/invoke", 400, "invalid_field", "mask", body=pack({**invoke, "mask": {**mask, "shape": [3, 3]}})),
        ex("invoke-mask-bad-dtype", "POST", "/invoke", 400, "invalid_field", "mask", body=pack({**invoke, "mask": {**mask, "dtype": "nope"}})),
        ex("invoke-seed-bool", "POST", "/invoke", 400, "invalid_field", "seed", body=pack({**invoke, "seed": True})),
        ex("invoke-duplicate-key", "POST", "/invoke", 400, "duplicate_key", "seed", body=packp(Pairs([*invoke.items(), ("seed", 2)]))),
        ex("invoke-unknown-function", "POST", "/invoke", 404, "function_not_found", "function", body=pack(invoke)),
        ex("state-ok", "GET", "/state", 200, None),
        ex("changes-after-not-int", "GET", "/changes?after=x", 400, "invalid_field", "after"),
        ex("changes-after-negative", "GET", "/changes?after=-1", 400, "invalid_field", "after"),
        ex("changes-timeout-too-long", "GET", "/changes?timeout=3600", 400, "invalid_field", "timeout"),
        ex("changes-no-token", "GET", "/changes", 401, "unauthorized", headers={}),
        ex("changes-ok", "GET", "/changes?after=0&timeout=0", 200, None),
    ]  # fmt: skip


CASES = [
    *_routes(),
    *_auth(),
    *_bodies(),
    *_fields(),
    *_images(),
    *_names(),
    *_specs(),
    *_executor(),
]
assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


# ---- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(server: ServerProcess, tokens: dict[str, str]) -> Iterator[httpx.Client]:
    """One keep-alive client for the module, with the function the cases invoke deployed."""
    assert ADMIN["authorization"] == f"Bearer {tokens['RETOUCH_ADMIN_TOKEN']}"
    assert INVOKE["authorization"] == f"Bearer {tokens['RETOUCH_INVOKE_TOKEN']}"
    with Client(server.url, tokens["RETOUCH_ADMIN_TOKEN"]) as admin:
        assert admin.deploy_file(EXAMPLES / f"{FUNCTION}.toml")["status"] == "ready"
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def metrics(server: ServerProcess) -> Iterator[httpx.Client]:
    """A client of the gateway's metrics listener (``--metrics-port``)."""
    with httpx.Client(base_url=server.metrics_url.removesuffix("/metrics"), timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def executor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A standalone executor (real process, real app) with a token of our own."""
    data = tmp_path_factory.mktemp("executor")
    port_file = data / "exec.port"
    env = {**os.environ, EXEC_TOKEN_ENV: EXEC_TOKEN}
    cmd = [sys.executable, "-m", "retouch.runtime.executor", "--name", "bad-input",
           "--data-dir", str(data), "--port-file", str(port_file)]  # fmt: skip
    with (data / "executor.log").open("ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:

        def healthy() -> httpx.Client | None:
            assert proc.poll() is None, (data / "executor.log").read_text()[-3000:]
            if not port_file.exists():
                return None
            candidate = httpx.Client(base_url=f"http://127.0.0.1:{port_file.read_text()}")
            try:
                if candidate.get("/healthz", headers=EXEC).status_code == 200:
                    return candidate
            except httpx.TransportError:
                pass
            candidate.close()
            return None

        client = wait_for("the executor healthy", healthy, 180)
        try:
            yield client
        finally:
            client.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _body(resp: httpx.Response) -> Any:
    ctype = resp.headers.get("content-type", "")
    return unpack(resp.content) if ctype.startswith("application/msgpack") else resp.json()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, request: pytest.FixtureRequest) -> None:
    client: httpx.Client = request.getfixturevalue(case.target)
    if case.target != "gateway":
        request.getfixturevalue("gateway")  # the gateway's health is checked after each case
    resp = client.request(case.method, case.path, content=case.body, headers=case.headers)
    assert resp.status_code == case.status, (resp.status_code, resp.content[:500])
    if case.code is not None:
        error = _body(resp)["error"]
        assert set(error) == {"code", "message", "field"}, error
        assert (error["code"], error["field"]) == (case.code, case.field), error
        assert isinstance(error["message"], str) and error["message"]
    if case.check is not None:
        case.check(resp)
    gateway: httpx.Client = request.getfixturevalue("gateway")
    assert gateway.get("/healthz").status_code == 200
    if case.target == "executor":
        assert client.get("/healthz", headers=EXEC).status_code == 200


def test_a_huge_mask_is_refused_from_its_header(
    gateway: httpx.Client, server: ServerProcess
) -> None:
    """A mask above the pixel limit is answered from its header: its pixels are never
    decoded (the gateway's decode counter does not move)."""
    mask = _encode(Image.new("L", (4097, 4096)))  # compresses to ~50 KB, decodes to 16 MB
    before = decodes_run(server.metrics_url)
    resp = gateway.post(INV, content=inv_body(mask=mask), headers=G)
    assert resp.status_code == 400 and _body(resp)["error"]["code"] == "image_too_large"
    assert decodes_run(server.metrics_url) == before


def test_a_valid_deploy_with_a_lab_template_is_accepted(gateway: httpx.Client) -> None:
    """A template in an unusual mode (LAB TIFF) used to fail its conversion with a 500; now
    it is converted to RGB and the deploy is accepted (then removed again)."""
    body = deploy_body(name="lab-template", images_={**_IMAGES, "street": _encode(_lab(), "TIFF")})
    resp = gateway.put("/v1/functions/lab-template", content=body, headers=A)
    assert resp.status_code == 202, resp.content[:500]
    assert _body(resp)["templates"]["street"]["width"] == SIZE[0]
    assert gateway.delete("/v1/functions/lab-template", headers=ADMIN).status_code == 200


def test_no_error_was_a_500(gateway: httpx.Client, metrics: httpx.Client) -> None:
    """Runs last: the gateway counted no 5xx for the whole corpus, and it still serves."""
    text = metrics.get("/metrics").text
    fives = [line for line in text.splitlines() if 'status="5' in line and "_total" in line]
    assert all(line.rstrip().endswith(" 0.0") for line in fives), fives
    assert gateway.get("/readyz").status_code == 200
    listed = gateway.get("/v1/functions", headers=INVOKE).json()["functions"]
    assert [f["name"] for f in listed] == [FUNCTION]
