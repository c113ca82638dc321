"""The model catalogue: what each model folder holds, read where the weights are, so that a
gateway without them (a Ray head, a gateway Deployment) can still check a deploy.

``retouch models catalogue DIR... -o catalogue.json`` runs the deploy-time model check
(:func:`~retouch.functions.modelcheck.check_model`) on a machine that has the weights and
records, per model, what the check read: its family, pipeline class, components, dtype,
bytes and :func:`~retouch.runtime.fingerprint.model_fingerprint`. A gateway started with
``--model-catalogue FILE`` checks a deploy of a catalogued model against its entry; any
other model goes through the local check, so a model in neither the catalogue nor the
gateway's disk is refused (422, field ``model``) rather than accepted blind. Executors
run the full check again before they load, against the files they will read.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retouch.functions import hubcache
from retouch.functions.errors import InvalidSpec
from retouch.functions.families import FAMILY_SPECS
from retouch.functions.modelcheck import (
    ModelFiles,
    ModelKind,
    check_model,
    check_pipeline,
    components,
    model_family,
    safetensors_header,
)
from retouch.functions.modelsource import ModelSource
from retouch.runtime.fingerprint import model_fingerprint

CATALOGUE_FORMAT = 1
# safetensors dtype names -> the names specs and torch use
DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


@dataclass(frozen=True)
class CatalogueEntry:
    """One model folder as the check read it on a machine with its weights."""

    model: str  # how specs name it: an absolute folder path or a hub id
    name: str  # the folder's name
    family: str
    pipeline: str
    components: dict[str, str]  # component -> class
    dtype: str  # the dtype most of its weight bytes are stored in
    bytes: int  # every file of the folder
    fingerprint: str  # runtime/fingerprint.py:model_fingerprint
    variant: str | None = None  # the weight variant it was checked with

    @classmethod
    def from_dict(cls, doc: Any) -> CatalogueEntry:
        if not isinstance(doc, dict):
            raise ValueError("a catalogue entry must be an object")
        return cls(**doc)


def model_key(model: str) -> str:
    """How the catalogue knows a model: a hub id as written, a folder by its absolute path
    (symbolic links not followed: ``/models/x`` stays ``/models/x``)."""
    if hubcache.is_hub_id(model):
        return model
    return os.path.abspath(os.path.expanduser(model))


def catalogue_entry(model: str, variant: str | None = None) -> CatalogueEntry:
    """The entry of a model folder (or cached hub id): the deploy check's reading of it,
    with its fingerprint; an :class:`InvalidSpec` when the check refuses it."""
    family = model_family(model)
    files = check_model(ModelSource(model, variant=variant), family)
    if files.folder is None or files.kind is not ModelKind.FOLDER:
        raise InvalidSpec(f"{model}: the catalogue lists diffusers folders", field="model")
    folder = files.folder
    paths = sorted(p for p in folder.rglob("*") if p.is_file())
    return CatalogueEntry(
        model=model_key(model),
        name=folder.name if not hubcache.is_hub_id(model) else model,
        family=family,
        pipeline=files.pipeline,
        components=components(folder),
        dtype=_dominant_dtype(paths),
        bytes=sum(p.stat().st_size for p in paths),
        fingerprint=model_fingerprint(folder),
        variant=variant,
    )


def _dominant_dtype(paths: list[Path]) -> str:
    """The dtype that holds most weight bytes across the folder's safetensors files."""
    weights: Counter[str] = Counter()
    for path in paths:
        if path.suffix != ".safetensors":
            continue
        for tensor in safetensors_header(path, "model").values():
            start, end = tensor["data_offsets"]
            weights[str(tensor["dtype"])] += int(end) - int(start)
    if not weights:
        return "unknown"
    dtype = weights.most_common(1)[0][0]
    return DTYPES.get(dtype, dtype.lower())


@dataclass(frozen=True)
class ModelCatalogue:
    """The models a gateway knows without their files (empty: every deploy is checked
    against the gateway's own disk, as on one machine)."""

    entries: dict[str, CatalogueEntry] = field(default_factory=dict)
    source: Path | None = None  # the file it was read from

    @classmethod
    def load(cls, path: Path | None) -> ModelCatalogue:
        """The catalogue in ``path`` (None: an empty one); ``ValueError`` naming the file
        when it is not one (the gateway refuses to start on it)."""
        if path is None:
            return cls()
        try:
            doc = json.loads(path.read_text())
            if doc.get("format") != CATALOGUE_FORMAT:
                raise ValueError(f"format {doc.get('format')!r} != {CATALOGUE_FORMAT}")
            entries = [CatalogueEntry.from_dict(e) for e in doc["models"]]
            for entry in entries:
                if entry.family not in FAMILY_SPECS:
                    raise ValueError(f"{entry.model}: unknown family {entry.family!r}")
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"model catalogue {path}: {exc}") from None
        return cls({e.model: e for e in entries}, path)

    def dumps(self) -> str:
        """The catalogue file's text."""
        models = [asdict(e) for _, e in sorted(self.entries.items())]
        return json.dumps({"format": CATALOGUE_FORMAT, "models": models}, indent=2) + "\n"

    def check(self, source: ModelSource, family: str) -> ModelFiles:
        """A deploy's model check: from the catalogue entry where there is one, else from
        the files on this machine (a model in neither is refused, naming the catalogue)."""
        entry = self.entries.get(model_key(source.model))
        if entry is None:
            return self._check_local(source, family)
        check_pipeline(entry.pipeline, family, entry.model)
        for option in ("revision", "config"):
            if getattr(source, option) is not None:
                raise InvalidSpec(f"a catalogued model takes no {option}", field=option)
        if source.variant != entry.variant:
            raise InvalidSpec(
                f"{entry.model} is catalogued with variant {entry.variant}, not {source.variant}",
                field="variant",
            )
        return ModelFiles(ModelKind.CATALOGUED, entry.pipeline)

    def _check_local(self, source: ModelSource, family: str) -> ModelFiles:
        try:
            return check_model(source, family)
        except InvalidSpec as exc:
            if self.source is None or exc.field != "model":
                raise
            raise InvalidSpec(
                f"{source.model} is not in the model catalogue ({self.source}) and this "
                f"gateway cannot read it: {exc.message}",
                field="model",
            ) from None
