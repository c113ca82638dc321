"""The wire format shared by the gateway, the executors and the client.

One msgpack codec, and the typed messages that cross process boundaries. Tensors and
images travel as raw bytes plus dtype/shape (:class:`RawArray`), never pickle. Parsing a
message validates it and raises :class:`~retouch.functions.errors.BadRequest` naming the
field, so every entry point rejects bad input the same way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import numpy as np

from retouch.functions.errors import BadRequest

OUTPUT_FORMATS = ("png", "webp", "raw")
MAX_STEPS = 200
MAX_GUIDANCE = 50.0
MAX_PROMPT_CHARS = 4096


def pack(obj: Any) -> bytes:
    """Encode with msgpack (bin type for bytes, str for text)."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """Decode msgpack strictly; any malformed body becomes a ``malformed_body`` error."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise BadRequest(f"body is not valid msgpack: {exc}", code="malformed_body") from exc
    except Exception as exc:  # msgpack raises a few other types on truncated input
        raise BadRequest(f"body is not valid msgpack: {exc}", code="malformed_body") from exc


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


def expect(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body[name]
    # bool is an int in Python; it is never a valid number here.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise BadRequest(f"field '{name}' has the wrong type", field=name, code="invalid_field")
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise BadRequest(f"field '{name}' must be {names}", field=name, code="invalid_field")
    return value


def optional(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    if body.get(name) is None:
        return default
    return expect(body, name, kind)


def as_map(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise BadRequest("body must be a map", code="malformed_body")
    return obj


@dataclass(frozen=True)
class InvokeRequest:
    """A public invocation, validated. ``mask`` is still the encoded image the user sent."""

    template: str
    mask: bytes
    prompt: str
    seed: int
    steps: int | None = None
    guidance: float | None = None
    format: str = "png"

    @classmethod
    def from_wire(cls, obj: Any) -> InvokeRequest:
        body = as_map(obj)
        req = cls(
            template=require(body, "template", str),
            mask=bytes(require(body, "mask", (bytes, bytearray))),
            prompt=require(body, "prompt", str),
            seed=require(body, "seed", int),
            steps=optional(body, "steps", int, None),
            guidance=optional(body, "guidance", (int, float), None),
            format=optional(body, "format", str, "png"),
        )
        req.check()
        return req

    def check(self) -> None:
        if len(self.prompt) > MAX_PROMPT_CHARS:
            raise BadRequest(
                f"prompt longer than {MAX_PROMPT_CHARS}", field="prompt", code="invalid_field"
            )
        if not 0 <= self.seed < 2**63:
            raise BadRequest("seed must be in [0, 2^63)", field="seed", code="invalid_field")
        if self.steps is not None and not 1 <= self.steps <= MAX_STEPS:
            raise BadRequest(
                f"steps must be in [1, {MAX_STEPS}]", field="steps", code="invalid_field"
            )
        if self.guidance is not None and not 0.0 <= self.guidance <= MAX_GUIDANCE:
            raise BadRequest(
                f"guidance must be in [0, {MAX_GUIDANCE}]", field="guidance", code="invalid_field"
            )
        if self.format not in OUTPUT_FORMATS:
            raise BadRequest(
                f"format must be one of {OUTPUT_FORMATS}", field="format", code="invalid_field"
            )

    def to_wire(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


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

    def to_wire(self) -> dict[str, Any]:
        return {**asdict(self), "mask": self.mask.to_wire()}

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
        )


@dataclass
class Timings:
    """Where an invocation's time went: pre-processing (text/VAE encode), waiting to join
    a batch, denoising, post-processing (VAE decode, image encoding), end to end."""

    queue_ms: float = 0.0
    run_ms: float = 0.0
    total_ms: float = 0.0
    pre_ms: float = 0.0
    post_ms: float = 0.0


@dataclass
class InvokeResult:
    """An invocation's answer, from the executor to the gateway and on to the client."""

    image: bytes
    format: str
    width: int
    height: int
    mask_ratio: float
    executor: str
    path: str  # "maskaware", "stock" or "template"
    timings: Timings = field(default_factory=Timings)
    cache: dict[str, Any] = field(default_factory=dict)  # {"tier": host|disk|none, "wait_ms"}
    engine: dict[str, Any] = field(
        default_factory=dict
    )  # {"steps", "interruptions", "batch_sizes"}

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

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
            path=str(body.get("path", "")),
            timings=Timings(**body.get("timings", {})),
            cache=dict(body.get("cache") or {}),
            engine=dict(body.get("engine") or {}),
        )
