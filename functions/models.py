"""What a spec's ``model`` may name, checked without loading anything.

A model is a built-in ``retouch:<name>`` (built or shipped by ``functions/demo``) or the
path of a local diffusers folder. The gateway checks a deploy against this before it stores
anything; it must not import torch or diffusers to do so (the control plane stays light),
so the catalogue of built-in models lives here as plain data and ``functions/demo/models.py``
attaches a builder to each entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from retouch.functions.errors import InvalidSpec
from retouch.functions.families import FAMILY_SPECS

PREFIX = "retouch:"


@dataclass(frozen=True)
class BuiltinModel:
    """A built-in model: its family and native resolution; ``trained`` ones ship real
    weights (the others are random, for tests and benchmarks)."""

    name: str
    family: str
    resolution: int
    trained: bool = False


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel("tiny-sd", "sd-inpaint", 128),
        BuiltinModel("tiny-flux", "flux-inpaint", 128),
        BuiltinModel("small-sd", "sd-inpaint", 512),
        BuiltinModel("small-flux", "flux-inpaint", 512),
        BuiltinModel("tiny-sd3", "sd3-inpaint", 128),
        BuiltinModel("small-sd3", "sd3-inpaint", 512),
        BuiltinModel("tiny-sdxl", "sdxl-inpaint", 128),
        BuiltinModel("small-sdxl", "sdxl-inpaint", 512),
        BuiltinModel("shapes-sd", "sd-inpaint", 128, trained=True),  # functions/demo/weights
    )
}

# Pipeline classes found in a folder's model_index.json that a family can load.
COMPATIBLE: dict[str, tuple[str, ...]] = {n: f.compatible for n, f in FAMILY_SPECS.items()}


def is_builtin(model: str) -> bool:
    return model.startswith(PREFIX)


def builtin_model(model: str) -> BuiltinModel:
    """The built-in model named ``retouch:<name>``; ``KeyError`` if there is none."""
    return BUILTIN_MODELS[model.removeprefix(PREFIX)]


def known_builtin(model: str) -> BuiltinModel:
    """The built-in model named ``model``; an :class:`InvalidSpec` listing them if none."""
    try:
        return builtin_model(model)
    except KeyError:
        known = ", ".join(PREFIX + n for n in sorted(BUILTIN_MODELS))
        raise InvalidSpec(
            f"unknown built-in model {model!r}; built-in models: {known}", field="model"
        ) from None


def pipeline_class(model: str) -> str:
    """The pipeline class a local diffusers folder declares (its ``model_index.json``)."""
    index = Path(model).expanduser() / "model_index.json"
    try:
        return json.loads(index.read_text()).get("_class_name", "")
    except (OSError, ValueError, AttributeError):
        raise InvalidSpec(
            f"{model!r} is not a diffusers folder (no readable model_index.json)", field="model"
        ) from None


def model_family(model: str) -> str:
    """The family of a built-in model, or of a diffusers folder by its pipeline class."""
    if is_builtin(model):
        return known_builtin(model).family
    cls = pipeline_class(model)
    for family, classes in COMPATIBLE.items():
        if cls in classes:
            return family
    raise InvalidSpec(f"{model} holds a {cls}, which no family serves", field="model")


def check_model(model: str, family: str) -> None:
    """Reject a model that cannot serve ``family`` before anything is stored or loaded."""
    if is_builtin(model):
        native = known_builtin(model).family
        if native != family:
            raise InvalidSpec(f"{model} is a {native} model, not {family}", field="family")
        return
    cls = pipeline_class(model)
    if cls not in COMPATIBLE[family]:
        raise InvalidSpec(f"{model} holds a {cls}, which cannot serve {family}", field="family")
