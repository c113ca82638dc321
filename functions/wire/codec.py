"""The codec shared by the gateway, the executors and the client: msgpack, raw arrays,
binary fields, sizes, and the checks the hand-written messages use.

Tensors and images travel as raw bytes plus dtype/shape (:class:`RawArray`), never pickle.
Parsing a message validates it and raises :class:`~retouch.functions.errors.BadRequest`
naming the field, so every entry point rejects bad input the same way.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgpack
import numpy as np

from retouch.functions.errors import BadRequest
from retouch.functions.strictmaps import StrictMaps

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


def enum_or(kind: type[StrEnum], value: Any, default: StrEnum) -> Any:
    try:
        return kind(value)
    except ValueError:
        return default
