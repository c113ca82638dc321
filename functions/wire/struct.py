"""Messages declared once: a :class:`Struct`'s fields (type, range, default, wire names)
give its decoding, validation, encoding and the error that names the field.

Two strictnesses, one mechanism: a :class:`Struct` is what a caller sends (strict: every
field checked, an unknown one refused), a :class:`Message` what another retouch process
answers (lenient: an executor one version older or newer is still read, see its
docstring).

Built on pydantic in strict mode, so a number is never read from a string or a bool, and
every failure becomes the API's one error shape (:class:`BadRequest`: ``missing_field``,
``unknown_field`` with the closest known name, ``invalid_field``), naming the field as the
caller wrote it (an alias, when that is what was sent). A ``null`` is an absent field, as
everywhere on retouch's wire.
"""

from __future__ import annotations

import functools
from enum import StrEnum
from typing import Annotated, Any, Self, TypeVar

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainSerializer,
    ValidationError,
    ValidationInfo,
)

from retouch.functions.errors import BadRequest, unknown_field_message
from retouch.functions.wire.codec import RawArray, as_map, decode_bytes, enum_or, parse_size

E = TypeVar("E", bound=StrEnum)


class Struct(BaseModel):
    """A wire message; subclasses declare fields, ``from_wire``/``to_wire`` do the rest."""

    model_config = ConfigDict(
        strict=True, extra="forbid", frozen=True, populate_by_name=True, defer_build=True
    )

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        body = as_map(obj)
        if None in body.values():
            body = {k: v for k, v in body.items() if v is not None}
        cls._refuse_two_names(body)
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise cls._bad_request(exc) from None

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)

    @classmethod
    @functools.cache
    def wire_names(cls) -> dict[str, tuple[str, ...]]:
        """Each field's wire name and every name it is read under (aliases after it)."""
        out: dict[str, tuple[str, ...]] = {}
        for name, info in cls.model_fields.items():
            choices = info.validation_alias
            names = tuple(choices.choices) if isinstance(choices, AliasChoices) else (name,)
            out[info.serialization_alias or names[0]] = tuple(str(n) for n in names)
        return out

    @classmethod
    @functools.cache
    def _aliased(cls) -> tuple[tuple[str, ...], ...]:
        return tuple(names for names in cls.wire_names().values() if len(names) > 1)

    @classmethod
    def _refuse_two_names(cls, body: dict[str, Any]) -> None:
        for names in cls._aliased():
            if sum(n in body for n in names) < 2:
                continue
            sent = [n for n in body if n in names]
            if len(sent) > 1:
                raise BadRequest(
                    f"send {sent[0]!r} or its alias {sent[1]!r}, not both",
                    field=sent[1],
                    code="invalid_field",
                )

    @classmethod
    def _bad_request(cls, exc: ValidationError) -> BadRequest:
        error = exc.errors(include_url=False)[0]
        name = str(error["loc"][0]) if error["loc"] else None
        if error["type"] == "missing":
            return BadRequest(f"field '{name}' is required", field=name, code="missing_field")
        if error["type"] == "extra_forbidden" and name is not None:
            message = unknown_field_message(name, sorted(cls.wire_names()))
            return BadRequest(message, field=name, code="unknown_field")
        text = str(error["msg"])
        return BadRequest(f"{name}: {text[:1].lower()}{text[1:]}", field=name, code="invalid_field")


class Message(BaseModel):
    """An answer or frame from another retouch process (an executor's result, state or
    stream frames), read leniently on purpose: a field the reader does not know is
    ignored, a missing one takes its default, numbers are coerced (an ``int`` where a
    ``float`` is declared) and an unknown enum value falls back (:func:`lenient`), so a
    gateway and its executors need not be upgraded at once. A message that still cannot be
    read is a :class:`BadRequest` naming the field."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, defer_build=True)

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        try:
            return cls.model_validate(as_map(obj))
        except ValidationError as exc:
            raise Struct._bad_request(exc) from None

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True)


def lenient(kind: type[E], default: E) -> Any:
    """``kind``, read as ``default`` when the value is not one of its members."""
    return Annotated[kind, BeforeValidator(lambda v: enum_or(kind, v, default))]


def _null_as_empty(value: Any) -> Any:
    return {} if value is None else value


# On a nested message's field: ``null`` reads as the message's defaults, as absence does.
NULL_AS_DEFAULTS = BeforeValidator(_null_as_empty)


def _bytes(value: Any, info: ValidationInfo) -> Any:
    return decode_bytes(value, str(info.field_name))


def _size(value: Any, info: ValidationInfo) -> Any:
    return parse_size(value, str(info.field_name)) if isinstance(value, str) else value


def _array(value: Any, info: ValidationInfo) -> Any:
    return RawArray.from_wire(value, str(info.field_name)) if isinstance(value, dict) else value


# Field types with their wire form: bytes (msgpack bin, or base64 / a ``data:`` URI in JSON),
# a ``WIDTHxHEIGHT`` size, and a raw array.
WireBytes = Annotated[bytes, BeforeValidator(_bytes)]
WireSize = Annotated[
    tuple[int, int], BeforeValidator(_size), PlainSerializer(lambda s: f"{s[0]}x{s[1]}")
]
WireArray = Annotated[RawArray, BeforeValidator(_array), PlainSerializer(RawArray.to_wire)]
