"""The API reference's invoke field table is the request's one declaration, read back.

The fields of :class:`InvokeRequest` (names, aliases, types, required or not) are listed from
the struct itself and compared with the table under ``POST /v1/functions/{name}/invoke`` in
docs/api.md: a field added, renamed or made optional in code without the docs fails here.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

from retouch.functions.wire.invoke import InvokeRequest

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"
ROW = re.compile(r"^\| `(\w+)`(?: \(alias `(\w+)`\))? \| (\w+) \| ([^|]+) \|")
DOC_TYPES = {str: "str", int: "int", float: "float", bytes: "bytes", tuple: "str"}


def doc_table() -> dict[str, tuple[tuple[str, ...], str, str]]:
    """The invoke table's rows: wire name -> (its names, doc type, required column)."""
    text = API.read_text()
    section = text.split("### `POST /v1/functions/{name}/invoke`", 1)[1]
    table = section.split("\n\n| field |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines():
        m = ROW.match(line)
        if m:
            names = (m.group(1),) + ((m.group(2),) if m.group(2) else ())
            rows[m.group(1)] = (names, m.group(3), m.group(4).strip())
    return rows


def base_type(annotation: object) -> type:
    """The wire type under Optional/Annotated/Literal wrappers."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        elif origin is typing.Literal:
            return type(typing.get_args(annotation)[0])
        elif origin is not None:
            return origin
        else:
            return annotation  # type: ignore[return-value]


def test_the_docs_table_lists_every_invoke_field_as_declared() -> None:
    table = doc_table()
    declared = InvokeRequest.wire_names()
    assert sorted(table) == sorted(declared)
    for field_name, info in InvokeRequest.model_fields.items():
        wire_name = info.serialization_alias or field_name
        names, doc_type, required = table[wire_name]
        assert names == declared[wire_name], wire_name
        assert doc_type == DOC_TYPES[base_type(info.annotation)], wire_name
        assert (required == "yes") == info.is_required(), wire_name  # "yes, unless": not alone
