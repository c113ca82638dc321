"""The OpenAI Images API's edit endpoint over retouch functions.

``POST /v1/images/edits`` takes the multipart form the official clients send: ``model``
names a function, ``image`` is an uploaded image (an ad-hoc template, see
``platform/api/uploads.py``) or, as a text field (or a ``text/plain`` part, for clients that
only send files), one of the function's template ids,
``mask`` follows OpenAI's convention (transparent = edit) or the diffusers one (white =
edit), ``prompt``, ``n``, ``size`` (the result's; ``auto``: the image's, whatever the
function's resolution: ``platform/jobs/reframe.py``), ``response_format`` (``b64_json``, or
``url``: a signed link the gateway serves), ``output_format``, and the common extensions ``seed``,
``num_inference_steps``, ``guidance_scale`` and ``mask_mode``. Each of the ``n`` images is
one job (seeds ``seed``, ``seed + 1``, ...), taken in through the gateway's front door
(``platform/api/frontdoor.py``): the same checks, admission (SLO included) and queue as every
invocation.

Errors keep this API's body (``code``, ``message``, ``field``) and add OpenAI's ``type``
and ``param`` so its clients show them as they would OpenAI's own.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from retouch.functions.errors import (
    BadRequest,
    NotFound,
    RetouchError,
    UnsupportedMediaType,
)
from retouch.functions.imaging import MASK_MODES, decode_openai_mask, encode_mask
from retouch.functions.wire.codec import parse_size
from retouch.functions.wire.invoke import (
    MAX_GUIDANCE,
    MAX_IMAGES_PER_PROMPT,
    MAX_PROMPT_CHARS,
    MAX_STEPS,
    InvokeRequest,
)
from retouch.platform.api.bodybudget import BodyBudget
from retouch.platform.api.frontdoor import FrontDoor
from retouch.platform.api.imagegate import Declared
from retouch.platform.api.uploads import Upload
from retouch.platform.fleet.deployed import DeployedFunction
from retouch.runtime import requestparams
from retouch.runtime.asgi import read_raw_body

PATH_PREFIX = "/v1/images/"
MAX_N = MAX_IMAGES_PER_PROMPT
URL_TTL_S = 3600.0  # how long a ``url`` answer stays valid (OpenAI: 60 minutes)
MAX_FIELD_BYTES = 64 << 10  # a text field (a prompt is at most 4096 characters)
RESPONSE_FORMATS = ("b64_json", "url")
OUTPUT_FORMATS = {"png": "png", "webp": "webp"}
# OpenAI fields that change nothing here; accepted so stock clients work unchanged.
IGNORED = (
    "user",
    "quality",
    "background",
    "input_fidelity",
    "output_compression",
    "moderation",
    "partial_images",
    "safety_identifier",
)
FIELDS = (
    "model",
    "image",
    "mask",
    "prompt",
    "n",
    "size",
    "response_format",
    "output_format",
    "seed",
    "num_inference_steps",
    "guidance_scale",
    "mask_mode",
    "stream",
    *IGNORED,
)


@dataclass(frozen=True)
class EditForm:
    """A validated ``/v1/images/edits`` form."""

    model: str
    prompt: str
    image: bytes | None  # an uploaded image ...
    template: str | None  # ... or a template id of the function
    mask: bytes | None
    mask_mode: str = "auto"
    n: int = 1
    size: tuple[int, int] | None = None
    response_format: str = "b64_json"
    output_format: str = "png"
    seed: int | None = None
    steps: int | None = None
    guidance: float | None = None


def _int(raw: str | None, field: str, lo: int, hi: int) -> int | None:
    """An optional integer form field (surrounding whitespace allowed, as form clients pad)."""
    return None if raw is None else requestparams.integer(raw.strip(), field, lo, hi)


def _size(raw: str) -> tuple[int, int] | None:
    return None if raw.strip() == "auto" else parse_size(raw)


async def read_form(request: Request, max_body: int) -> EditForm:
    """Read the multipart body (at most ``max_body`` bytes) and validate every field."""
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        raise UnsupportedMediaType(
            f"content type {ctype!r} is not supported here; send multipart/form-data"
        )
    request._body = await read_raw_body(request, max_body)  # what request.form() parses
    try:
        form = await request.form(max_files=4, max_fields=64, max_part_size=MAX_FIELD_BYTES)
    except HTTPException as exc:
        raise BadRequest(f"malformed multipart body: {exc.detail}", code="malformed_body") from exc
    except Exception as exc:  # the parser raises a few types on truncated input
        raise BadRequest(f"malformed multipart body: {exc}", code="malformed_body") from exc
    try:
        return await _validate(form)
    finally:
        await form.close()


async def _validate(form: Any) -> EditForm:
    seen: dict[str, list[Any]] = {}
    for key, value in form.multi_items():
        name = key[:-2] if key.endswith("[]") else key
        if name not in FIELDS:
            raise BadRequest(
                f"unknown field {key!r}; known: {', '.join(FIELDS[: -len(IGNORED)])}",
                field=key,
                code="invalid_field",
            )
        seen.setdefault(name, []).append(value)

    async def file_or_text(name: str) -> bytes | str | None:
        values = seen.get(name, [])
        if len(values) > 1:
            raise BadRequest(f"one {name} only", field=name, code="invalid_field")
        if not values:
            return None
        value = values[0]
        if not isinstance(value, UploadFile):
            return value
        data = await value.read()
        if (value.content_type or "").startswith("text/plain"):  # a client that only sends
            try:  # files (the openai package) names a template as a text/plain part
                return data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise BadRequest(
                    f"{name} as text must be UTF-8", field=name, code="invalid_field"
                ) from exc
        return data

    def text(name: str, required: bool = False) -> str | None:
        values = seen.get(name, [])
        if len(values) > 1:
            raise BadRequest(f"field {name!r} given twice", field=name, code="invalid_field")
        if not values:
            if required:
                raise BadRequest(f"field {name!r} is required", field=name, code="missing_field")
            return None
        if not isinstance(values[0], str):
            raise BadRequest(
                f"field {name!r} must be text, not a file", field=name, code="invalid_field"
            )
        return values[0]

    model = text("model", required=True) or ""
    prompt = text("prompt", required=True) or ""
    if len(prompt) > MAX_PROMPT_CHARS:
        raise BadRequest(
            f"prompt longer than {MAX_PROMPT_CHARS}", field="prompt", code="invalid_field"
        )
    if (text("stream") or "false").strip().lower() not in ("false", "0"):
        raise BadRequest("streaming edits are not supported", field="stream", code="invalid_field")
    image = await file_or_text("image")
    if image is None:
        raise BadRequest(
            "field 'image' is required (an image file, or a template id as text)",
            field="image",
            code="missing_field",
        )
    mask = await file_or_text("mask")
    if isinstance(mask, str):
        raise BadRequest("mask must be an image file", field="mask", code="invalid_field")

    def choice(name: str, choices: tuple[str, ...]) -> str:
        value = (text(name) or choices[0]).strip()
        if value not in choices:
            raise BadRequest(
                f"{name} must be one of {', '.join(choices)}", field=name, code="invalid_field"
            )
        return value

    mask_mode = choice("mask_mode", MASK_MODES)
    response_format = choice("response_format", RESPONSE_FORMATS)
    output_format = choice("output_format", tuple(OUTPUT_FORMATS))
    raw = {k: text(k) for k in ("n", "size", "seed", "num_inference_steps", "guidance_scale")}
    return EditForm(
        model=model.strip(),
        prompt=prompt,
        image=image if isinstance(image, bytes) else None,
        template=image.strip() if isinstance(image, str) else None,
        mask=mask,
        mask_mode=mask_mode,
        n=_int(raw["n"], "n", 1, MAX_N) or 1,
        size=None if raw["size"] is None else _size(raw["size"]),
        response_format=response_format,
        output_format=OUTPUT_FORMATS[output_format],
        seed=_int(raw["seed"], "seed", 0, 2**63 - 1),
        steps=_int(raw["num_inference_steps"], "num_inference_steps", 1, MAX_STEPS),
        guidance=None
        if raw["guidance_scale"] is None
        else requestparams.decimal(
            raw["guidance_scale"].strip(), "guidance_scale", 0.0, MAX_GUIDANCE
        ),
    )


async def _edit_inputs(
    door: FrontDoor, fn: DeployedFunction, form: EditForm, owner: str
) -> tuple[bytes, Upload | None]:
    """The form's mask as this API's white-on-black PNG (of the size it was sent: the front
    door resizes it to the image's), and the uploaded image decoded (once, for all ``n``
    jobs); every image's header is checked before it is decoded, each decode within the
    budget."""
    spec, images, upload = fn.spec, door.images, None
    if form.image is not None:
        upload = await door.upload(fn, form.image)  # image errors first
        size = upload.size
    else:
        found = fn.sizes.get(form.template or "")
        if found is None:
            raise NotFound(
                f"function {spec.name!r} has no template {form.template!r} (send an image file "
                "to edit an uploaded image)",
                field="image",
                code="template_not_found",
            )
        size = found
    if form.mask is not None:
        mask = images.declare(form.mask, "mask")
        png = await images.decode(mask, _mask_png, form.mask, form.mask_mode, "mask")
        return png, upload
    if form.image is None:
        raise BadRequest(
            "mask is required when image names a template", field="mask", code="missing_field"
        )
    try:  # OpenAI: without a mask, the image's transparency is it
        png = await images.decode(Declared(*size), _mask_png, form.image, "alpha", "image")
        return png, upload
    except BadRequest as exc:
        raise BadRequest(
            "mask is required when the image has no transparent pixels",
            field="mask",
            code="missing_field",
        ) from exc


def _mask_png(data: bytes, mode: str, field: str) -> bytes:
    return encode_mask(decode_openai_mask(data, mode, field=field))


def openai_error(
    request: Request, exc: RetouchError, headers: dict[str, str] | None = None
) -> Response:
    """This API's error body plus OpenAI's ``type`` and ``param``: every answer under
    ``/v1/images/`` (the auth check's and the router's too) has it, so OpenAI's clients
    show them as they would OpenAI's own."""
    body = exc.to_wire()
    body["error"]["type"] = "invalid_request_error" if exc.status < 500 else "server_error"
    body["error"]["param"] = exc.field
    return Response(json.dumps(body), exc.status, headers, media_type="application/json")


def answers_openai(request: Request) -> bool:
    """Whether ``request`` is one of this API's (its errors OpenAI-shaped)."""
    return request.url.path.startswith(PATH_PREFIX)


class OpenAIImages:
    """The handlers of ``/v1/images/*``: edits go in through the gateway's front door like
    every other request, their images are read back from its job store."""

    def __init__(
        self,
        door: FrontDoor,
        *,
        max_body: int,
        bodies: BodyBudget,
    ) -> None:
        self.door = door
        self.max_body = max_body
        self.bodies = bodies  # a request's body is held (counted) until it is answered

    async def edits(self, request: Request) -> Response:
        with self.bodies.hold(request, self.max_body):
            return await self._edits(request, time.perf_counter())

    async def _edits(self, request: Request, received: float) -> Response:
        door = self.door
        form = await read_form(request, self.max_body)
        try:
            fn = door.servable(form.model)
        except NotFound as exc:
            exc.field = "model"
            raise
        first_seed = secrets.randbits(62) if form.seed is None else form.seed
        durable = form.response_format == "url"  # its image is served from the journal
        owner = request.state.principal.tenant
        with door.arrival(fn, received):
            mask, upload = await _edit_inputs(door, fn, form, owner)
            req = InvokeRequest(
                template=form.template,
                image=form.image,
                mask=mask,
                prompt=form.prompt,
                seed=first_seed,
                steps=form.steps,
                guidance=form.guidance,
                format=form.output_format,
                size=form.size,
                num_images_per_prompt=form.n,
            )
            jobs = await door.accept_images(fn, req, durable=durable, owner=owner, upload=upload)
        results = await door.answers(jobs)
        data = []
        width, height = results[0].width, results[0].height
        for i, (job, result) in enumerate(zip(jobs, results, strict=True)):
            item: dict[str, Any] = {"seed": (first_seed + i) % 2**63, "path": result.path.value}
            if durable:
                item["url"] = self.door.jobs.output_url(job, URL_TTL_S)
            else:
                item["b64_json"] = base64.b64encode(result.image).decode()
            data.append(item)
        body = {
            "created": int(time.time()),
            "data": data,
            "size": f"{width}x{height}",
            "output_format": form.output_format,
        }
        return Response(json.dumps(body), 200, media_type="application/json")
