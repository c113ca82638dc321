"""How a function names its model: where the files are and how to load them.

``model`` is a built-in ``retouch:<name>``, the path of a local diffusers folder, the path
of a single-file checkpoint (``.safetensors`` / ``.ckpt``, as ComfyUI and A1111 users have
them) or a hub id (``org/name``) already in the local Hugging Face cache. The options say
how to load it: ``dtype`` (``auto``: the family's default on the device), ``variant`` (the
weight files' infix, ``diffusion_pytorch_model.fp16.safetensors``), ``revision`` (of a hub
id) and ``config`` (a single file's diffusers folder or cached hub id, for its configs and
tokenizers, and the weights of the components a family's files lack: a Flux file is the
transformer alone). Two functions with the same source share one loaded copy; the source's
:attr:`ModelSource.key` names that copy wherever a plain string travels (executor caches,
worker messages), and is the bare ``model`` when every option is the default.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from retouch.functions.errors import InvalidSpec

DTYPES = ("auto", "bf16", "fp16", "fp32")
# The loading options, as spec fields.
OPTIONS = ("dtype", "variant", "revision", "config")
VARIANT_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")
REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./-]{0,127}")


@dataclass(frozen=True)
class ModelSource:
    """A model and how to load it (see the module docstring)."""

    model: str
    dtype: str = "auto"
    variant: str | None = None
    revision: str | None = None
    config: str | None = None

    @property
    def plain(self) -> bool:
        """Every loading option is the default."""
        return self == ModelSource(self.model)

    @property
    def key(self) -> str:
        """The string that names one loaded copy: ``model`` when plain, else a JSON object
        (a model name never starts with ``{``, so :func:`from_key` tells them apart)."""
        if self.plain and not self.model.startswith("{"):
            return self.model
        return json.dumps(asdict(self), sort_keys=True)

    def options(self) -> dict[str, Any]:
        """The options that are set, as spec fields (``dtype`` always is)."""
        return {k: getattr(self, k) for k in OPTIONS if getattr(self, k) is not None}


def from_key(key: str) -> ModelSource:
    """The source a :attr:`ModelSource.key` names."""
    if not key.startswith("{"):
        return ModelSource(key)
    return ModelSource(**json.loads(key))


def parse_source(raw: dict[str, Any], model: str) -> ModelSource:
    """The loading options of a spec document (``raw``) for ``model``; errors name the field."""
    dtype = raw.get("dtype", "auto")
    if dtype not in DTYPES:
        raise InvalidSpec(f"dtype must be one of {DTYPES}", field="dtype")
    variant = _optional(raw, "variant", VARIANT_RE)
    revision = _optional(raw, "revision", REVISION_RE)
    config = raw.get("config")
    if config is not None and (not isinstance(config, str) or not config):
        raise InvalidSpec("config must be a folder path or a hub id", field="config")
    return ModelSource(model, dtype, variant, revision, config)


def _optional(raw: dict[str, Any], key: str, pattern: re.Pattern[str]) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise InvalidSpec(f"{key} must match {pattern.pattern}", field=key)
    return value
