"""Strict maps for the body decoders (msgpack in :mod:`retouch.functions.wire`, JSON in
:mod:`retouch.runtime.asgi`).

Both decoders silently keep the last of duplicate keys, and msgpack also accepts bytes
keys that later code compares with strings (a ``TypeError``, so a 500). Decoding through
:class:`StrictMaps` refuses both as a 400 whose ``field`` is the dotted path of the key
(``spec.templates.shirt``). The check is a per-map hook; the path is worked out only once a
bad map was seen, so a clean body pays for one ``dict()`` per map and nothing else.
"""

from __future__ import annotations

from typing import Any

from retouch.functions.errors import BadRequest


class _Flagged(dict):
    """A decoded map that held a bad key; found again by identity to name its path."""

    bad_key: Any = None
    duplicate: bool = False


class StrictMaps:
    """One decode's map hook (``object_pairs_hook``) and the check that follows it."""

    def __init__(self) -> None:
        self.flagged = False

    def hook(self, pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
        out = dict(pairs)
        if len(out) == len(pairs) and all(type(k) is str for k in out):
            return out
        flagged = _Flagged(out)
        seen: set[Any] = set()
        for key, _ in pairs:
            if type(key) is not str:
                flagged.bad_key = key
                break
            if key in seen:
                flagged.bad_key, flagged.duplicate = key, True
                break
            seen.add(key)
        self.flagged = True
        return flagged

    def check(self, doc: Any) -> None:
        """Raise the 400 for the first bad map in document order, if the hook saw one."""
        if not self.flagged:
            return
        stack: list[tuple[Any, str]] = [(doc, "")]
        while stack:  # iterative: the document may nest as deep as the decoder allows
            node, path = stack.pop()
            if isinstance(node, _Flagged):
                key = _key_text(node.bad_key)
                where = f"{path}.{key}" if path else key
                if node.duplicate:
                    raise BadRequest(
                        f"duplicate key {key!r} in a map (at {where!r})",
                        field=where,
                        code="duplicate_key",
                    )
                raise BadRequest(
                    f"map keys must be strings; {where!r} is {type(node.bad_key).__name__}",
                    field=where,
                    code="malformed_body",
                )
            if isinstance(node, dict):
                children = [(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()]
            elif isinstance(node, list):
                children = [(v, f"{path}[{i}]") for i, v in enumerate(node)]
            else:
                continue
            stack.extend(reversed(children))


def _key_text(key: Any) -> str:
    if isinstance(key, bytes | bytearray):
        return bytes(key).decode("utf-8", errors="replace")
    return str(key)
