"""The built-in models, as plain data.

The catalogue of built-in ``retouch:<name>`` models (built or shipped by ``functions/demo``)
as plain data: the gateway checks a deploy against it (``functions/modelcheck.py``) without
importing torch or diffusers, and ``functions/demo/models.py`` attaches a builder to each
entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from retouch.functions.errors import InvalidSpec

PREFIX = "retouch:"


@dataclass(frozen=True)
class BuiltinModel:
    """A built-in model: its family and native resolution; ``trained`` ones ship real
    weights (the others are random, for tests and benchmarks). A ``shape`` is built in
    memory on the executor's device from a production denoiser config
    (``functions/demo/production.py``, at ``scale``) and never written to disk: a
    Flux-dev-shaped copy would be 24 GB of files, for benchmarks that serve it on a GPU."""

    name: str
    family: str
    resolution: int
    trained: bool = False
    shape: str | None = None
    scale: float = 1.0


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel("tiny-sd", "sd-inpaint", 128),
        BuiltinModel("tiny-flux", "flux-inpaint", 128),
        BuiltinModel("small-sd", "sd-inpaint", 512),
        BuiltinModel("small-flux", "flux-inpaint", 512),
        BuiltinModel("tiny-sd3", "sd3-inpaint", 128),
        BuiltinModel("small-sd3", "sd3-inpaint", 512),
        BuiltinModel("tiny-flux-fill", "flux-fill", 128),
        BuiltinModel("small-flux-fill", "flux-fill", 512),
        BuiltinModel("tiny-flux-kontext", "flux-kontext", 128),
        BuiltinModel("small-flux-kontext", "flux-kontext", 512),
        BuiltinModel("tiny-flux2-klein", "flux2-klein", 128),
        BuiltinModel("small-flux2-klein", "flux2-klein", 512),
        BuiltinModel("tiny-qwen-image", "qwen-image", 128),
        BuiltinModel("small-qwen-image", "qwen-image", 512),
        BuiltinModel("tiny-qwen-image-edit", "qwen-image-edit", 128),
        BuiltinModel("small-qwen-image-edit", "qwen-image-edit", 512),
        BuiltinModel("tiny-z-image", "z-image", 128),
        BuiltinModel("small-z-image", "z-image", 512),
        BuiltinModel("tiny-sdxl", "sdxl-inpaint", 128),
        BuiltinModel("small-sdxl", "sdxl-inpaint", 512),
        BuiltinModel("shapes-sd", "sd-inpaint", 128, trained=True),  # functions/demo/weights
        BuiltinModel("flux-dev-shaped", "flux-inpaint", 1024, shape="flux-dev"),
        BuiltinModel("sd3-medium-shaped", "sd3-inpaint", 1024, shape="sd3-medium"),
        BuiltinModel("sd2-inpaint-shaped", "sd-inpaint", 512, shape="sd2-inpaint"),
    )
}


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
