"""LoRA adapters a function runs its base model with: the spec's ``adapters`` list.

A function is a base model plus, optionally, adapters of its own (``adapters = [{ path =
"style.safetensors", scale = 0.8, name = "style" }]``). Functions of one base model share
the executors' loaded copy (a model pool); what differs between them is their *adapter
set*, named by :func:`adapter_set_id`: the engine batches by it, the executor keeps sets
resident under a budget, the gateway places by it, and a template's bake is per set (the
activations depend on the weights). Torch-free: the gateway parses and checks specs.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from retouch.functions.errors import InvalidSpec

MAX_ADAPTERS = 8  # per function (diffusers' set_adapters takes any number; keep sets small)
SCALE_RANGE = (-4.0, 4.0)  # a LoRA scale outside it is almost always a typo
ADAPTER_FIELDS = ("path", "scale", "name")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA file and the scale it is applied at."""

    path: str  # a local .safetensors file (PEFT/diffusers or kohya layout)
    scale: float = 1.0
    name: str = ""  # unique within the function; default: the file's stem

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", PurePath(self.path).stem)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "scale": self.scale, "name": self.name}


def adapter_set_id(adapters: tuple[AdapterSpec, ...]) -> str:
    """The id of an adapter set ("" for the bare base model): equal for functions that run
    the same files at the same scales, whatever their order or names (diffusers sums the
    adapters' deltas, so order does not change the weights)."""
    if not adapters:
        return ""
    canon = sorted((a.path, round(a.scale, 6)) for a in adapters)
    return "lora-" + hashlib.sha256(json.dumps(canon).encode()).hexdigest()[:16]


def parse_adapters(raw: Any) -> tuple[AdapterSpec, ...]:
    """The spec's ``adapters`` list, each entry checked as data; errors name the entry
    (``adapters[1].scale``). Whether the files exist and fit the base model is the deploy's
    model check, not this parser's."""
    if not isinstance(raw, list):
        raise InvalidSpec("adapters must be a list of tables", field="adapters")
    if len(raw) > MAX_ADAPTERS:
        raise InvalidSpec(f"at most {MAX_ADAPTERS} adapters", field=f"adapters[{MAX_ADAPTERS}]")
    out: list[AdapterSpec] = []
    for i, entry in enumerate(raw):
        out.append(_adapter(entry, f"adapters[{i}]"))
    names = [a.name for a in out]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidSpec(f"adapter name {name!r} is used twice", field=f"adapters[{i}].name")
    paths = [a.path for a in out]
    for i, path in enumerate(paths):
        if path in paths[:i]:  # one file, one scale: write the sum
            raise InvalidSpec(f"adapter file {path!r} is listed twice", field=f"adapters[{i}].path")
    return tuple(out)


def _adapter(entry: Any, where: str) -> AdapterSpec:
    if not isinstance(entry, dict):
        raise InvalidSpec("an adapter is a table with path, scale and name", field=where)
    for key in entry:
        if key not in ADAPTER_FIELDS:
            raise InvalidSpec(
                f"unknown field {key!r} (an adapter has {', '.join(ADAPTER_FIELDS)})",
                field=f"{where}.{key}",
            )
    path = entry.get("path")
    if not isinstance(path, str) or not path.strip():
        raise InvalidSpec("path (a LoRA .safetensors file) is required", field=f"{where}.path")
    scale = entry.get("scale", 1.0)
    lo, hi = SCALE_RANGE
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not lo <= scale <= hi:
        raise InvalidSpec(f"scale must be a number in [{lo}, {hi}]", field=f"{where}.scale")
    name = entry.get("name", PurePath(path).stem)
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidSpec("name must match [A-Za-z0-9][A-Za-z0-9_.-]{0,63}", field=f"{where}.name")
    return AdapterSpec(path=path, scale=float(scale), name=name)
