"""The wire format shared by the gateway, the executors and the client.

One msgpack codec, and the typed messages that cross process boundaries. Tensors and
images travel as raw bytes plus dtype/shape (:class:`RawArray`), never pickle. Parsing a
message validates it and raises :class:`~retouch.functions.errors.BadRequest` naming the
field, so every entry point rejects bad input the same way.
"""

from __future__ import annotations

import base64
import dataclasses
import re
import secrets
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

import httpx
import msgpack
import numpy as np

from retouch.functions.errors import BadRequest, RetouchError, unknown_field_message
from retouch.functions.strictmaps import StrictMaps

OUTPUT_FORMATS = ("png", "webp", "raw")
MAX_STEPS = 200
MAX_GUIDANCE = 50.0
MAX_PROMPT_CHARS = 4096
MAX_PADDING = 4096  # padding_mask_crop, in pixels of the input image
MAX_IMAGES_PER_PROMPT = 10  # num_images_per_prompt (and the OpenAI route's ``n``)
SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})")  # an image size on the wire: WIDTHxHEIGHT


def pack(obj: Any) -> bytes:
    """Encode with msgpack (bin type for bytes, str for text)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """Decode msgpack strictly; any malformed body becomes a ``malformed_body`` error.

    Map keys must be unique strings (a duplicate is ``duplicate_key``; a bytes key would
    only fail later, as a 500, where code compares it with strings), and nesting is bounded
    by msgpack's own stack limit.
    """
    maps = StrictMaps()
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True, object_pairs_hook=maps.hook)
    except msgpack.StackError as exc:
        raise BadRequest(
            "body is not valid msgpack: nested too deeply", code="malformed_body"
        ) from exc
    except (msgpack.ExtraData, msgpack.FormatError, ValueError) as exc:
        raise BadRequest(f"body is not valid msgpack: {exc}", code="malformed_body") from exc
    except Exception as exc:  # msgpack raises a few other types on truncated input
        raise BadRequest(f"body is not valid msgpack: {exc}", code="malformed_body") from exc
    maps.check(doc)
    return doc


@dataclass(frozen=True)
class RawArray:
    """A numpy array as raw bytes + dtype + shape: the no-pickle tensor encoding."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, array: np.ndarray) -> RawArray:
        arr = np.ascontiguousarray(array)
        return cls(arr.dtype.str, tuple(int(s) for s in arr.shape), arr.tobytes())

    def to_numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)

    def to_wire(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "data": self.data}

    @classmethod
    def from_wire(cls, obj: Any, field_name: str) -> RawArray:
        if not isinstance(obj, dict) or not {"dtype", "shape", "data"} <= obj.keys():
            raise BadRequest(
                "expected {dtype, shape, data}", field=field_name, code="invalid_field"
            )
        try:
            raw = cls(str(obj["dtype"]), tuple(int(s) for s in obj["shape"]), bytes(obj["data"]))
            expected = int(np.prod(raw.shape)) * np.dtype(raw.dtype).itemsize
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"bad array: {exc}", field=field_name, code="invalid_field") from exc
        if expected != len(raw.data):
            raise BadRequest(
                "array data does not match its shape", field=field_name, code="invalid_field"
            )
        return raw


def require(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """The value of a required field of the given type(s), or a ``missing_field`` error."""
    if name not in body or body[name] is None:
        raise BadRequest(f"field '{name}' is required", field=name, code="missing_field")
    return expect(body, name, kind)


def expect(
    body: dict[str, Any],
    name: str,
    kind: type | tuple[type, ...],
    sent: dict[str, str] | None = None,
) -> Any:
    value = body[name]
    name = (sent or {}).get(name, name)  # the name the caller wrote
    # bool is an int in Python; it is never a valid number here.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise BadRequest(f"field '{name}' has the wrong type", field=name, code="invalid_field")
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise BadRequest(f"field '{name}' must be {names}", field=name, code="invalid_field")
    return value


def optional(
    body: dict[str, Any],
    name: str,
    kind: type | tuple[type, ...],
    default: Any,
    sent: dict[str, str] | None = None,
) -> Any:
    if body.get(name) is None:
        return default
    return expect(body, name, kind, sent)


def as_map(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise BadRequest("body must be a map", code="malformed_body")
    return obj


@dataclass(frozen=True)
class InvokeRequest:
    """A public invocation, validated. ``mask`` is still the encoded image the user sent.

    It edits either one of the function's templates (``template``) or an uploaded image
    (``image``: encoded bytes, decoded by the gateway), never both. Fields carry diffusers'
    inpainting names on the wire (``num_inference_steps``, ``guidance_scale``,
    ``negative_prompt``, ``strength``, ``padding_mask_crop``); the older ``steps`` and
    ``guidance`` are read as aliases. ``size`` (``WIDTHxHEIGHT``, as OpenAI's) is the
    result's size; without it the result has the input image's. Images and masks are bytes (msgpack) or, in JSON,
    base64 strings or ``data:`` URIs. An unknown field is refused, so a misspelt argument
    never silently falls back to its default."""

    template: str | None
    mask: bytes
    prompt: str
    seed: int
    steps: int | None = None
    guidance: float | None = None
    format: str = "png"
    image: bytes | None = None
    negative_prompt: str | None = None
    strength: float = 1.0
    padding_mask_crop: int | None = None
    size: tuple[int, int] | None = None
    scheduler: str | None = None  # one the function allows (None: the function's own)
    # Images of this one request: image i runs with seed ``seed + i`` (so each can be made
    # again alone), as its own invocation (they share denoising steps in the engine).
    num_images_per_prompt: int = 1
    # The families that read a reference image (FLUX.1 Kontext): another than the template
    # (encoded bytes, decoded by the gateway); without it the template is the reference.
    image_reference: bytes | None = None

    @classmethod
    def from_wire(cls, obj: Any) -> InvokeRequest:
        body, sent = _canonical(as_map(obj))
        image = None if body.get("image") is None else decode_bytes(body["image"], "image")
        if image is None and body.get("template") is None:
            raise BadRequest(
                "field 'template' (or 'image', an uploaded image) is required",
                field="template",
                code="missing_field",
            )
        if image is not None and body.get("template") is not None:
            raise BadRequest(
                "send either 'template' or 'image', not both", field="image", code="invalid_field"
            )
        if body.get("mask") is None:
            raise BadRequest("field 'mask' is required", field="mask", code="missing_field")
        seed = optional(body, "seed", int, None)
        req = cls(
            template=None if image is not None else require(body, "template", str),
            mask=decode_bytes(body["mask"], "mask"),
            prompt=require(body, "prompt", str),
            seed=secrets.randbelow(2**63) if seed is None else seed,
            steps=optional(body, "num_inference_steps", int, None, sent),
            guidance=optional(body, "guidance_scale", (int, float), None, sent),
            format=optional(body, "format", str, "png"),
            image=image,
            negative_prompt=optional(body, "negative_prompt", str, None),
            strength=optional(body, "strength", (int, float), 1.0),
            padding_mask_crop=optional(body, "padding_mask_crop", int, None),
            size=None if body.get("size") is None else parse_size(expect(body, "size", str)),
            scheduler=optional(body, "scheduler", str, None),
            num_images_per_prompt=optional(body, "num_images_per_prompt", int, 1),
            image_reference=None
            if body.get("image_reference") is None
            else decode_bytes(body["image_reference"], "image_reference"),
        )
        req.check(sent)
        return dataclasses.replace(req, strength=float(req.strength))  # in range: converts

    def check(self, sent: dict[str, str] | None = None) -> None:
        """Every argument in range; ``sent``: the name each was sent under (an alias)."""
        steps_field = (sent or {}).get("num_inference_steps", "num_inference_steps")
        guidance_field = (sent or {}).get("guidance_scale", "guidance_scale")
        for name, text in (("prompt", self.prompt), ("negative_prompt", self.negative_prompt)):
            if text is not None and len(text) > MAX_PROMPT_CHARS:
                raise BadRequest(
                    f"{name} longer than {MAX_PROMPT_CHARS}", field=name, code="invalid_field"
                )
        if not 0 <= self.seed < 2**63:
            raise BadRequest("seed must be in [0, 2^63)", field="seed", code="invalid_field")
        if self.steps is not None and not 1 <= self.steps <= MAX_STEPS:
            raise BadRequest(
                f"{steps_field} must be in [1, {MAX_STEPS}]",
                field=steps_field,
                code="invalid_field",
            )
        if self.guidance is not None and not 0.0 <= self.guidance <= MAX_GUIDANCE:
            raise BadRequest(
                f"{guidance_field} must be in [0, {MAX_GUIDANCE}]",
                field=guidance_field,
                code="invalid_field",
            )
        if not 0.0 < self.strength <= 1.0:  # NaN fails too
            raise BadRequest("strength must be in (0, 1]", field="strength", code="invalid_field")
        if self.padding_mask_crop is not None and not 0 <= self.padding_mask_crop <= MAX_PADDING:
            raise BadRequest(
                f"padding_mask_crop must be in [0, {MAX_PADDING}] pixels",
                field="padding_mask_crop",
                code="invalid_field",
            )
        if self.format not in OUTPUT_FORMATS:
            raise BadRequest(
                f"format must be one of {OUTPUT_FORMATS}", field="format", code="invalid_field"
            )
        if not 1 <= self.num_images_per_prompt <= MAX_IMAGES_PER_PROMPT:
            raise BadRequest(
                f"num_images_per_prompt must be in [1, {MAX_IMAGES_PER_PROMPT}]",
                field="num_images_per_prompt",
                code="invalid_field",
            )

    def images(self) -> list[InvokeRequest]:
        """One request per image asked for: image i with seed ``seed + i`` (mod 2^63)."""
        return [
            dataclasses.replace(self, seed=(self.seed + i) % 2**63, num_images_per_prompt=1)
            for i in range(self.num_images_per_prompt)
        ]

    def to_wire(self) -> dict[str, Any]:
        out = {
            "template": self.template,
            "image": self.image,
            "mask": self.mask,
            "prompt": self.prompt,
            "negative_prompt": self.negative_prompt,
            "seed": self.seed,
            "num_inference_steps": self.steps,
            "guidance_scale": self.guidance,
            "strength": self.strength,
            "padding_mask_crop": self.padding_mask_crop,
            "size": None if self.size is None else f"{self.size[0]}x{self.size[1]}",
            "scheduler": self.scheduler,
            "format": self.format,
            "num_images_per_prompt": None
            if self.num_images_per_prompt == 1
            else self.num_images_per_prompt,
            "image_reference": self.image_reference,
        }
        return {k: v for k, v in out.items() if v is not None}

    def echo(self) -> dict[str, Any]:
        """The request as its job document shows it (``input``): every argument, the image
        and mask by their size while the job holds them (a finished job keeps neither: its
        ``template`` names what it edited, an upload by its content id)."""
        out = self.to_wire()
        for name in ("image", "mask", "image_reference"):
            if out.get(name):
                out[name] = f"<{len(out[name])} bytes>"
            else:
                out.pop(name, None)
        return out


INVOKE_FIELDS = frozenset(
    (
        "template",
        "image",
        "mask",
        "prompt",
        "negative_prompt",
        "seed",
        "num_inference_steps",
        "guidance_scale",
        "strength",
        "padding_mask_crop",
        "size",
        "scheduler",
        "format",
        "num_images_per_prompt",
        "image_reference",
    )
)
ALIASES = {"steps": "num_inference_steps", "guidance": "guidance_scale"}  # retouch's older names


def _canonical(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``body`` under diffusers' names (an alias renamed; sending both names of one argument
    is refused; an unknown field is ``unknown_field``), and the name each was sent under
    (errors name the field as the caller wrote it)."""
    out: dict[str, Any] = {}
    sent: dict[str, str] = {}
    for key, value in body.items():
        name = ALIASES.get(key, key)
        if name not in INVOKE_FIELDS:
            raise BadRequest(
                unknown_field_message(key, sorted(INVOKE_FIELDS)), field=key, code="unknown_field"
            )
        if name in out:
            raise BadRequest(
                f"send {name!r} or its alias {key!r}, not both", field=key, code="invalid_field"
            )
        out[name], sent[name] = value, key
    return out, sent


def parse_size(raw: str, field: str = "size") -> tuple[int, int]:
    """``WIDTHxHEIGHT`` (ASCII digits, each side at least 1) as ``(width, height)``."""
    m = SIZE.fullmatch(raw.strip())
    if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise BadRequest(
            f"{field} must be WIDTHxHEIGHT (e.g. 512x512)", field=field, code="invalid_field"
        )
    return int(m.group(1)), int(m.group(2))


def decode_bytes(value: Any, field: str) -> bytes:
    """The one decoder of binary fields: msgpack bin, or in JSON a base64 string or a
    ``data:`` URI (``data:image/png;base64,...``, as browsers and OpenAI-style clients
    write images)."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, str):
        if value.startswith("data:"):
            header, sep, value = value.partition(",")
            if not sep or not header.endswith(";base64"):
                raise BadRequest(
                    "a data URI must be base64 (data:<type>;base64,<data>)",
                    field=field,
                    code="invalid_field",
                )
        try:
            return base64.b64decode(value, validate=True)
        except ValueError as exc:
            raise BadRequest(
                "expected base64 bytes or a data: URI", field=field, code="invalid_field"
            ) from exc
    raise BadRequest("expected bytes (base64 in JSON)", field=field, code="invalid_field")


@dataclass(frozen=True)
class ExecutorInvoke:
    """What the gateway forwards to an executor: the decoded mask travels as a raw array."""

    function: str
    template: str
    mask: RawArray
    prompt: str
    seed: int
    steps: int
    guidance: float
    format: str
    id: str = ""  # the gateway's invocation id: cancel and progress refer to it
    # An uploaded image (RGB8 ``[H, W, 3]``) instead of a deployed template; ``template``
    # is then its content address (``upload:<hash of the pixels>``).
    image: RawArray | None = None
    negative_prompt: str = ""  # the unconditional branch's prompt ("" as diffusers' default)
    strength: float = 1.0  # < 1: start from the image noised to this fraction of the schedule
    scheduler: str = ""  # one the function allows ("": the function's own)
    # A reference image other than the template (RGB8 ``[H, W, 3]`` at the function's size;
    # the families that read one): such an edit computes every token.
    image_reference: RawArray | None = None

    def to_wire(self) -> dict[str, Any]:
        out = {**asdict(self), "mask": self.mask.to_wire()}
        for name in ("image", "image_reference"):
            value = getattr(self, name)
            out[name] = None if value is None else value.to_wire()
        return out

    @classmethod
    def from_wire(cls, obj: Any) -> ExecutorInvoke:
        body = as_map(obj)
        return cls(
            function=require(body, "function", str),
            template=require(body, "template", str),
            mask=RawArray.from_wire(require(body, "mask", dict), "mask"),
            prompt=require(body, "prompt", str),
            seed=require(body, "seed", int),
            steps=require(body, "steps", int),
            guidance=float(require(body, "guidance", (int, float))),
            format=require(body, "format", str),
            id=optional(body, "id", str, ""),
            image=None
            if body.get("image") is None
            else RawArray.from_wire(require(body, "image", dict), "image"),
            negative_prompt=optional(body, "negative_prompt", str, ""),
            strength=float(optional(body, "strength", (int, float), 1.0)),
            scheduler=optional(body, "scheduler", str, ""),
            image_reference=None
            if body.get("image_reference") is None
            else RawArray.from_wire(require(body, "image_reference", dict), "image_reference"),
        )


@dataclass
class Timings:
    """Where an invocation's time went: pre-processing (text/VAE encode), waiting to join
    a batch, denoising, post-processing (VAE decode, image encoding), end to end; and, in
    the gateway, the time it waited there for an executor slot."""

    queue_ms: float = 0.0
    run_ms: float = 0.0
    total_ms: float = 0.0
    pre_ms: float = 0.0
    post_ms: float = 0.0
    gateway_queue_ms: float = 0.0
    # From the moment the gateway placed it to its result: predicted then, and actual.
    predicted_ms: float = 0.0
    placed_ms: float = 0.0

    @classmethod
    def from_wire(cls, obj: Any) -> Timings:
        body = obj if isinstance(obj, dict) else {}
        return cls(**{f.name: float(body.get(f.name, 0.0)) for f in fields(cls)})


# ---- the shared vocabulary ---------------------------------------------------------------


class DeployStatus(StrEnum):
    """A function's deploy as the gateway tracks it."""

    DEPLOYING = "deploying"
    READY = "ready"
    FAILED = "failed"


class BakeState(StrEnum):
    """A template's activations on an executor's host (``pending`` while its function is
    still deploying, as the gateway reports it)."""

    PENDING = "pending"
    UNBAKED = "unbaked"
    QUEUED = "queued"
    BAKING = "baking"
    BAKED = "baked"
    FAILED = "failed"


# Most advanced first: the gateway reports the best state any executor of the host has.
BAKE_PROGRESS = (
    BakeState.BAKED,
    BakeState.BAKING,
    BakeState.QUEUED,
    BakeState.UNBAKED,
    BakeState.FAILED,
)


def template_variant(template: str, skipped: int, scheduler: str = "") -> str:
    """The id under which executors bake and report ``template`` for edits that skip the
    first ``skipped`` steps of its schedule (a ``strength`` < 1) or run with ``scheduler``,
    one the function allows besides its own ("": its own). Either is another trajectory,
    so another bake, residency and placement affinity; the template's own id for neither."""
    at_scheduler = f"@{scheduler}" if scheduler else ""
    at_step = f"@step{skipped}" if skipped else ""
    return f"{template}{at_scheduler}{at_step}"


class InvokePath(StrEnum):
    """How an edit was computed."""

    MASKAWARE = "maskaware"  # masked tokens only, cached activations for the rest
    STOCK = "stock"  # every token computed (template not baked for these settings)
    TEMPLATE = "template"  # empty mask: the template itself, no model run


class CacheTier(StrEnum):
    """Where a template's activations were found when an edit joined the batch."""

    DEVICE = "device"  # resident on the executor's GPU: no load at all
    HOST = "host"
    DISK = "disk"
    NONE = "none"


class ExecutorPhase(StrEnum):
    """An executor's life as the gateway's pool sees it."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


def _enum(kind: type[StrEnum], value: Any, default: StrEnum) -> Any:
    try:
        return kind(value)
    except ValueError:
        return default


@dataclass(frozen=True)
class CacheRead:
    """Where an edit's cached activations came from and how long it waited for them.

    ``found`` is where the template was when the invocation reached its executor, before
    the prefetch that starts then: what placement chose (host = an affinity hit). ``tier``
    is where the read found it, after the prefetch had (or had not) brought it in."""

    tier: CacheTier = CacheTier.NONE
    wait_ms: float = 0.0
    found: CacheTier = CacheTier.NONE

    def to_wire(self) -> dict[str, Any]:
        return {"tier": self.tier.value, "wait_ms": self.wait_ms, "found": self.found.value}

    @classmethod
    def from_wire(cls, obj: Any) -> CacheRead:
        body = obj if isinstance(obj, dict) else {}
        tier = _enum(CacheTier, body.get("tier"), CacheTier.NONE)
        found = _enum(CacheTier, body.get("found"), tier)  # an older executor: as read
        return cls(tier, float(body.get("wait_ms", 0.0)), found)


@dataclass(frozen=True)
class RunStats:
    """An invocation's denoising: steps run, interruptions, batch size at each step."""

    steps: int = 0
    interruptions: int = 0
    batch_sizes: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "interruptions": self.interruptions,
            "batch_sizes": list(self.batch_sizes),
        }

    @classmethod
    def from_wire(cls, obj: Any) -> RunStats:
        body = obj if isinstance(obj, dict) else {}
        return cls(
            int(body.get("steps", 0)),
            int(body.get("interruptions", 0)),
            tuple(int(b) for b in body.get("batch_sizes", ())),
        )


@dataclass
class InvokeResult:
    """An invocation's answer, from the executor to the gateway and on to the client."""

    image: bytes
    format: str
    width: int
    height: int
    mask_ratio: float
    executor: str
    path: InvokePath
    timings: Timings = field(default_factory=Timings)
    cache: CacheRead = field(default_factory=CacheRead)
    engine: RunStats = field(default_factory=RunStats)
    path_reason: str = ""  # why this path: the executor's step times, or what was missing
    attempts: int = 1  # executors it was sent to (more than one after an executor was lost)
    template: str = ""  # the template edited (``upload:<hash>`` for an uploaded image)
    seed: int | None = None  # the seed it ran with (the gateway's; drawn when none was sent)

    def to_wire(self) -> dict[str, Any]:
        return {
            "template": self.template,
            "seed": self.seed,
            "image": self.image,
            "format": self.format,
            "width": self.width,
            "height": self.height,
            "mask_ratio": self.mask_ratio,
            "executor": self.executor,
            "path": self.path.value,
            "path_reason": self.path_reason,
            "timings": asdict(self.timings),
            "cache": self.cache.to_wire(),
            "engine": self.engine.to_wire(),
            "attempts": self.attempts,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> InvokeResult:
        body = as_map(obj)
        return cls(
            image=bytes(body["image"]),
            format=str(body["format"]),
            width=int(body["width"]),
            height=int(body["height"]),
            mask_ratio=float(body["mask_ratio"]),
            executor=str(body["executor"]),
            path=InvokePath(body.get("path", InvokePath.STOCK)),
            path_reason=str(body.get("path_reason", "")),
            timings=Timings.from_wire(body.get("timings")),
            cache=CacheRead.from_wire(body.get("cache")),
            engine=RunStats.from_wire(body.get("engine")),
            attempts=int(body.get("attempts", 1)),
            template=str(body.get("template", "")),
            seed=None if body.get("seed") is None else int(body["seed"]),
        )


# ---- an executor's state, as it reports it to the gateway --------------------------------


@dataclass(frozen=True)
class TemplateStatus:
    """One template on one executor: bake state, bakes done, cache key, last bake error."""

    state: BakeState
    bakes: int = 0
    key: str = ""
    error: str | None = None
    upload: bool = False  # an ad-hoc template (an uploaded image), not a deployed one
    bytes: int = 0  # its baked activations (0 until baked)
    host: bool = False  # host-resident now
    device: bool = False  # resident in the executor's device tier (GPU memory): no load at all

    def to_wire(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "bakes": self.bakes,
            "key": self.key,
            "error": self.error,
            "upload": self.upload,
            "bytes": self.bytes,
            "host": self.host,
            "device": self.device,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> TemplateStatus:
        body = obj if isinstance(obj, dict) else {}
        return cls(
            _enum(BakeState, body.get("state"), BakeState.UNBAKED),
            int(body.get("bakes", 0)),
            str(body.get("key", "")),
            body.get("error"),
            bool(body.get("upload", False)),
            int(body.get("bytes", 0)),
            bool(body.get("host", False)),
            bool(body.get("device", False)),
        )


@dataclass(frozen=True)
class EngineStats:
    """The engine's liveness, load and recent per-step figures."""

    mode: str = "continuous"
    max_batch: int = 8
    disaggregated: bool = True
    alive: bool = True
    error: str | None = None  # why the engine thread died
    preprocessing: int = 0
    ready: int = 0
    running: int = 0
    background: int = 0
    adapter_waits: int = 0  # encoded, waiting for their LoRA files to be read from disk
    steps: int = 0
    interruptions: int = 0
    bakes: int = 0
    canceled: int = 0  # invocations canceled (out of the queue, or out of the running batch)
    batch_overhead_ms_p50: float = 0.0
    step_ms_p50: float = 0.0
    load_wait_ms_p50: float = 0.0
    batch_mean: float = 0.0
    plan_sparse_blocks: int | None = None  # the last step's plan
    plan_blocks: int | None = None
    # How steps took against the plan's prediction: step = intercept_ms + slope x planned
    step_intercept_ms: float = 0.0
    step_slope: float = 1.0
    step_fit_prior: int = 0  # steps in that fit left by a previous engine (runtime/steprecords)
    # Pre/post worker processes: how many encodes (decodes) run at once, the rest queue
    # (0: pre/post run inline, or an executor that does not say).
    pre_workers: int = 0
    post_workers: int = 0
    # Mask-aware steps from graphs (runtime/maskaware/graphs, buckets), all editors told:
    # captured layouts kept, captures (those on the request path: a step that waited for
    # one; the rest at warm-up), replays, steps run eagerly (a layout's first runs, steps
    # graphs could not take, layouts the budget left uncaptured), pad slots computed by
    # bucketed layouts, and the bytes graphs hold against their budget (0: no budget).
    graph_layouts: int = 0
    graph_captures: int = 0
    graph_request_captures: int = 0
    graph_replays: int = 0
    graph_eager_steps: int = 0
    graph_over_budget: int = 0
    graph_bytes: int = 0
    graph_budget_bytes: int = 0
    padded_tokens: int = 0

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, obj: Any) -> EngineStats:
        body = obj if isinstance(obj, dict) else {}
        return cls(**{f.name: body[f.name] for f in fields(cls) if f.name in body})


@dataclass(frozen=True)
class CacheInfo:
    """The activation store as cheaply known (no disk scan): host-tier occupancy and the
    store's monotonic counters (hits, loads, bakes, evictions, ...)."""

    host_bytes: int = 0
    host_budget_bytes: int = 0
    host_templates: int = 0
    prefetches_in_flight: int = 0
    counters: dict[str, float] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            **self.counters,
            "host_bytes": self.host_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "host_templates": self.host_templates,
            "prefetches_in_flight": self.prefetches_in_flight,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> CacheInfo:
        body = dict(obj) if isinstance(obj, dict) else {}
        named = {f.name for f in fields(cls)} - {"counters"}
        return cls(
            **{k: int(body.pop(k)) for k in list(body) if k in named},
            counters={k: v for k, v in body.items() if isinstance(v, int | float)},
        )


@dataclass(frozen=True)
class DeviceMemory:
    """The executor's GPU memory in bytes (all 0 on a CPU executor): what the device holds
    in all (``total``), free to any process (``free``), and this process's torch allocator
    (``allocated`` by live tensors, ``reserved`` in its cache)."""

    total: int = 0
    free: int = 0
    allocated: int = 0
    reserved: int = 0

    def to_wire(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, obj: Any) -> DeviceMemory:
        body = obj if isinstance(obj, dict) else {}
        return cls(**{f.name: int(body.get(f.name, 0)) for f in fields(cls)})


@dataclass(frozen=True)
class AdapterStats:
    """An executor's LoRA adapter figures since it started (``runtime/adapters``): files
    read from disk (in the background) and injected into a denoiser (between steps),
    changes of the adapter set a step runs with, steps whose rows ran their own sets' updates
    (mixed batching), sets
    evicted for the byte budget, and the milliseconds each took in all."""

    reads: int = 0
    loads: int = 0
    swaps: int = 0
    mixed_steps: int = 0
    evictions: int = 0
    read_ms: float = 0.0
    inject_ms: float = 0.0
    swap_ms: float = 0.0

    @property
    def mean_load_ms(self) -> float:
        """A file's load as measured here: read and built, then attached (0: none yet).
        Placement's load cost of a set this executor does not hold."""
        if not self.reads or not self.loads:
            return 0.0
        return self.read_ms / self.reads + self.inject_ms / self.loads

    @property
    def mean_swap_ms(self) -> float:
        """A change of the active set between steps as measured here (0: none yet)."""
        return self.swap_ms / self.swaps if self.swaps else 0.0

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, obj: Any) -> AdapterStats:
        body = obj if isinstance(obj, dict) else {}
        return cls(**{f.name: body[f.name] for f in fields(cls) if f.name in body})


@dataclass(frozen=True)
class ExecutorState:
    """What an executor reports on ``GET /state``: the gateway's typed view of it."""

    name: str
    pid: int
    device: str
    maskaware: bool = True
    deterministic: bool = False  # runs in deterministic mode (ExecutorOptions.deterministic)
    # batches mix adapter sets, each row its own LoRA updates (no swaps between sets)
    mixed_adapters: bool = False
    models: tuple[str, ...] = ()  # loaded
    loading: tuple[str, ...] = ()  # being loaded or profiled
    functions: tuple[str, ...] = ()
    generations: dict[str, int] = field(default_factory=dict)  # of each function's deploy
    queued: int = 0  # accepted and not answered
    completed: int = 0
    failed: int = 0
    engine: EngineStats = field(default_factory=EngineStats)
    templates: dict[str, dict[str, TemplateStatus]] = field(default_factory=dict)
    cost_models: dict[str, dict[str, Any]] = field(default_factory=dict)  # CostModel.to_dict
    cache: CacheInfo = field(default_factory=CacheInfo)
    workers: dict[str, int] = field(default_factory=dict)  # pre/post worker processes (pid)
    gpu_memory: DeviceMemory = field(default_factory=DeviceMemory)
    # Adapter sets (``FunctionSpec.adapter_set``) whose weights are resident on the device,
    # least recently used first: placement adds no load cost for these.
    adapters: tuple[str, ...] = ()
    adapter_stats: AdapterStats = field(default_factory=AdapterStats)

    def template(self, function: str, template: str) -> TemplateStatus | None:
        return self.templates.get(function, {}).get(template)

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pid": self.pid,
            "device": self.device,
            "maskaware": self.maskaware,
            "deterministic": self.deterministic,
            "mixed_adapters": self.mixed_adapters,
            "models": list(self.models),
            "loading": list(self.loading),
            "functions": list(self.functions),
            "generations": self.generations,
            "queued": self.queued,
            "completed": self.completed,
            "failed": self.failed,
            "engine": self.engine.to_wire(),
            "templates": {
                fn: {tid: t.to_wire() for tid, t in tpls.items()}
                for fn, tpls in self.templates.items()
            },
            "cost_models": self.cost_models,
            "cache": self.cache.to_wire(),
            "workers": self.workers,
            "gpu_memory": self.gpu_memory.to_wire(),
            "adapters": list(self.adapters),
            "adapter_stats": self.adapter_stats.to_wire(),
        }

    @classmethod
    def from_wire(cls, obj: Any) -> ExecutorState:
        body = as_map(obj)
        return cls(
            name=str(body["name"]),
            pid=int(body["pid"]),
            device=str(body["device"]),
            maskaware=bool(body.get("maskaware", True)),
            deterministic=bool(body.get("deterministic", False)),
            mixed_adapters=bool(body.get("mixed_adapters", False)),
            models=tuple(body.get("models", ())),
            loading=tuple(body.get("loading", ())),
            functions=tuple(body.get("functions", ())),
            generations={str(k): int(v) for k, v in (body.get("generations") or {}).items()},
            queued=int(body.get("queued", 0)),
            completed=int(body.get("completed", 0)),
            failed=int(body.get("failed", 0)),
            engine=EngineStats.from_wire(body.get("engine")),
            templates={
                fn: {tid: TemplateStatus.from_wire(t) for tid, t in tpls.items()}
                for fn, tpls in (body.get("templates") or {}).items()
            },
            cost_models=dict(body.get("cost_models") or {}),
            cache=CacheInfo.from_wire(body.get("cache")),
            workers={str(k): int(v) for k, v in (body.get("workers") or {}).items()},
            gpu_memory=DeviceMemory.from_wire(body.get("gpu_memory")),
            adapters=tuple(str(a) for a in body.get("adapters") or ()),
            adapter_stats=AdapterStats.from_wire(body.get("adapter_stats")),
        )


# ---- the executor's invocation stream (POST /invoke/stream) ------------------------------


@dataclass(frozen=True)
class StepProgress:
    """One denoising step of an invocation done, as the executor's engine reports it."""

    step: int  # steps done, 1..total
    total: int

    def to_wire(self) -> dict[str, Any]:
        return {"progress": {"step": self.step, "total": self.total}}


class ChangeKind(StrEnum):
    """What changed on an executor that the gateway's cluster view must learn."""

    BAKED = "baked"  # a template's bake committed (it is in the store, usually host memory)
    BAKE_FAILED = "bake_failed"
    HOST_TIER = "host_tier"  # a template was loaded into host memory (others may have left)
    LOST = "lost"  # a template's activations were not found (it will be baked again)
    ADAPTERS = "adapters"  # an adapter set became resident on the device, or was evicted


@dataclass(frozen=True)
class ExecutorChange:
    """One numbered event of an executor's change feed."""

    version: int
    kind: ChangeKind
    function: str = ""
    template: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "kind": self.kind.value,
            "function": self.function,
            "template": self.template,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> ExecutorChange:
        body = as_map(obj)
        return cls(
            int(body["version"]),
            ChangeKind(body["kind"]),
            str(body.get("function", "")),
            str(body.get("template", "")),
        )


@dataclass(frozen=True)
class ExecutorChanges:
    """The answer to ``GET /changes?after=N``: the events after N, the feed's version, and
    ``reset`` when some were missed (the feed dropped them, or the executor restarted and
    counts from 0 again): the reader then re-reads the whole state."""

    version: int
    changes: tuple[ExecutorChange, ...] = ()
    reset: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "changes": [c.to_wire() for c in self.changes],
            "reset": self.reset,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> ExecutorChanges:
        body = as_map(obj)
        return cls(
            int(body["version"]),
            tuple(ExecutorChange.from_wire(c) for c in body.get("changes", ())),
            bool(body.get("reset", False)),
        )


Frame = StepProgress | InvokeResult | RetouchError


def result_frame(result: InvokeResult) -> dict[str, Any]:
    return {"result": result.to_wire()}


def error_frame(exc: RetouchError) -> dict[str, Any]:
    return {**exc.to_wire(), "status": exc.status}


def parse_frame(obj: Any) -> Frame:
    """A frame of the executor's stream: step progress, then one result or one error."""
    body = as_map(obj)
    if "progress" in body:
        p = as_map(body["progress"])
        return StepProgress(int(p["step"]), int(p["total"]))
    if "result" in body:
        return InvokeResult.from_wire(body["result"])
    if "error" in body:
        return RetouchError.from_wire(int(body.get("status", 500)), body)
    raise BadRequest("unknown frame in the invocation stream", code="malformed_body")


class FrameReader:
    """Incremental decoder of a stream of msgpack maps (the executor's invocation stream)."""

    def __init__(self) -> None:
        self._unpacker = msgpack.Unpacker(raw=False, strict_map_key=True)

    def feed(self, data: bytes) -> Iterator[Frame]:
        self._unpacker.feed(data)
        for obj in self._unpacker:
            yield parse_frame(obj)


# ---- async jobs (the public API) ---------------------------------------------------------


class JobStatus(StrEnum):
    """A job's life: ``queued`` (in the gateway queue) -> ``running`` (sent to an executor)
    -> one of the terminal states."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELED)


class JobEventKind(StrEnum):
    """The events of ``GET /v1/jobs/{id}/events`` (server-sent events)."""

    QUEUED = "queued"
    STARTED = "started"
    PROGRESS = "progress"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"


class WebhookEvent(StrEnum):
    """What a job's webhook may be told: ``completed`` covers every terminal state."""

    STARTED = "started"
    PROGRESS = "progress"
    COMPLETED = "completed"


class WebhookFormat(StrEnum):
    """What a job's webhook deliveries carry: retouch's own envelope around the job
    document, or Replicate's prediction document (a job submitted as a prediction)."""

    RETOUCH = "retouch"
    REPLICATE = "replicate"


DEFAULT_WEBHOOK_EVENTS = (WebhookEvent.COMPLETED,)
JOB_ID = re.compile(r"[0-9a-f]{32}")
MAX_URL_CHARS = 2048
MAX_HOST_CHARS = 253  # a DNS name, without its trailing dot
MAX_LABEL_CHARS = 63


def check_job_id(raw: str) -> str:
    """A job id as the gateway makes them (32 lowercase hex digits), or ``invalid_field``."""
    if not JOB_ID.fullmatch(raw):
        raise BadRequest("a job id is 32 lowercase hex digits", field="id", code="invalid_field")
    return raw


def parse_target_url(raw: Any, field: str = "webhook") -> httpx.URL:
    """The one parser of URLs the gateway calls or fetches (webhooks at submission, in the
    allow-list and in the sender; remote ``image``/``mask`` inputs): an
    absolute http(s) URL with a host that is an IP literal or a DNS name (labels of 1-63
    characters, 253 in all), a valid port, no user info, and written the way it parses back
    (so no control character, space or alternative spelling can make a check and a
    connection read different hosts). Else ``invalid_field`` on ``field``."""
    if not isinstance(raw, str):
        raise BadRequest(f"{field} must be a URL string", field=field, code="invalid_field")
    if len(raw) > MAX_URL_CHARS:
        raise BadRequest(
            f"{field} longer than {MAX_URL_CHARS} characters", field=field, code="invalid_field"
        )
    try:
        url = httpx.URL(raw)
    except httpx.InvalidURL as exc:
        raise BadRequest(f"{field}: {exc}", field=field, code="invalid_field") from exc
    if url.scheme not in ("http", "https"):
        raise BadRequest(f"{field} must be an http or https URL", field=field, code="invalid_field")
    if not url.raw_host:
        raise BadRequest(f"{field} URL has no host", field=field, code="invalid_field")
    _check_host_name(url.raw_host.decode("ascii"), field)
    if url.port is not None and not 0 < url.port < 65536:
        raise BadRequest(f"{field} port {url.port} out of range", field=field, code="invalid_field")
    if url.userinfo:
        raise BadRequest(
            f"{field} URL must not carry user info (user@host)",
            field=field,
            code="invalid_field",
        )
    if str(url) != raw:
        raise BadRequest(
            f"{field} URL does not read back the same; write it as {str(url)!r}",
            field=field,
            code="invalid_field",
        )
    return url


def _check_host_name(host: str, field: str) -> None:
    """A host the resolver can look up: an IP literal, or a name whose labels are
    1-63 characters (253 in all, one trailing dot allowed), as DNS (RFC 1035) requires;
    else ``invalid_field`` on ``field`` rather than a lookup that fails at delivery."""
    if ":" in host:  # an IPv6 literal (httpx checked it); an IPv4 one passes as labels
        return
    name = host[:-1] if host.endswith(".") else host
    if len(name) > MAX_HOST_CHARS:
        raise BadRequest(
            f"{field} host name longer than {MAX_HOST_CHARS} characters",
            field=field,
            code="invalid_field",
        )
    for label in name.split("."):
        if not 0 < len(label) <= MAX_LABEL_CHARS:
            raise BadRequest(
                f"{field} host {host!r} has an empty label or one over {MAX_LABEL_CHARS} "
                "characters",
                field=field,
                code="invalid_field",
            )


@dataclass(frozen=True)
class JobRequest:
    """``POST /v1/functions/{name}/jobs``: an invocation plus where to report on it, and
    in which form (``webhook_format``; a prediction's is ``replicate``)."""

    invoke: InvokeRequest
    webhook: str | None = None
    webhook_events: tuple[WebhookEvent, ...] = DEFAULT_WEBHOOK_EVENTS
    webhook_format: WebhookFormat = WebhookFormat.RETOUCH

    def __post_init__(self) -> None:
        if self.invoke.num_images_per_prompt != 1:
            # A job is one image: one seat in the queue, one placement, one cancel, one
            # retained result, one ``output`` link (invoke fans several out into jobs).
            raise BadRequest(
                "a job makes one image: submit one job per image (seed, seed + 1, ...), "
                "or invoke with num_images_per_prompt",
                field="num_images_per_prompt",
                code="unsupported_field",
            )

    @classmethod
    def from_wire(cls, obj: Any) -> JobRequest:
        body = as_map(obj)
        webhook = None if body.get("webhook") is None else str(parse_target_url(body["webhook"]))
        events = DEFAULT_WEBHOOK_EVENTS
        if body.get("webhook_events") is not None:
            raw = body["webhook_events"]
            if not isinstance(raw, list | tuple) or not raw:
                raise BadRequest(
                    "webhook_events must be a non-empty list of started, progress, completed",
                    field="webhook_events",
                    code="invalid_field",
                )
            try:
                events = tuple(dict.fromkeys(WebhookEvent(e) for e in raw))
            except (ValueError, TypeError) as exc:
                raise BadRequest(
                    f"webhook_events: unknown event in {raw!r}; known: started, progress, completed",
                    field="webhook_events",
                    code="invalid_field",
                ) from exc
        form = WebhookFormat.RETOUCH
        if body.get("webhook_format") is not None:
            form = _choice(body["webhook_format"], WebhookFormat, "webhook_format")
        reporting = ("webhook", "webhook_events", "webhook_format")
        invoke = {k: v for k, v in body.items() if k not in reporting}
        return cls(InvokeRequest.from_wire(invoke), webhook, events, form)

    def to_wire(self) -> dict[str, Any]:
        out = self.invoke.to_wire()
        if self.webhook is not None:
            out["webhook"] = self.webhook
            out["webhook_events"] = [e.value for e in self.webhook_events]
        if self.webhook_format is not WebhookFormat.RETOUCH:
            out["webhook_format"] = self.webhook_format.value
        return out


def _choice(raw: Any, kind: type[StrEnum], name: str) -> Any:
    """One of ``kind``'s values, else ``invalid_field`` on ``name`` listing them."""
    try:
        return kind(raw)
    except (ValueError, TypeError):
        known = ", ".join(k.value for k in kind)
        raise BadRequest(
            f"{name} must be one of {known}", field=name, code="invalid_field"
        ) from None


@dataclass(frozen=True)
class JobProgress:
    """A running job's denoising progress (``eta_s`` from its own pace so far)."""

    step: int
    total: int
    eta_s: float | None = None

    @property
    def fraction(self) -> float:
        return self.step / self.total if self.total else 0.0

    def to_wire(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "total": self.total,
            "fraction": round(self.fraction, 4),
            "eta_s": None if self.eta_s is None else round(self.eta_s, 3),
        }


@dataclass(frozen=True)
class JobEvent:
    """One event of a job's stream; ``seq`` numbers a job's events from 1 (the SSE id, so a
    client reconnecting with ``Last-Event-ID`` gets only what it missed)."""

    seq: int
    kind: JobEventKind
    data: dict[str, Any]
