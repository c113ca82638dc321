"""``retouch plan-capacity``: the disk, host and device memory a function's templates and
weights take, before anything is deployed.

A template's entries come from the model's shapes
(:func:`~retouch.runtime.maskaware.templatelayout.template_entries`: a pipeline built on
the ``meta`` device, no weights read) and its bytes from the store's own accounting
(:func:`~retouch.cachestore.footprint.template_bytes`), so the plan is what the store
will count: disk payload per template, the host buffer of each resident template, the
device tier's copy. Per executor: its weights on the device, ``resident`` templates in
its host tier (and as many in its device tier). Per node: ``executors`` executors, each
baking every one of ``templates`` templates into its own store.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from retouch.cachestore.footprint import TemplateBytes, template_bytes
from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.demo.production import SHAPES, build_shape
from retouch.functions.families import FAMILY_SPECS
from retouch.functions.models import is_builtin
from retouch.functions.spec import FunctionSpec
from retouch.runtime.maskaware.editor import MaskAwareEditor
from retouch.runtime.maskaware.rowformat import RowFormat
from retouch.runtime.maskaware.templatelayout import template_entries
from retouch.runtime.models import load_pipeline


@dataclass(frozen=True)
class Sizing:
    """What one node serves: templates per executor, executors per node, and how many
    templates each executor keeps resident (host tier, and the same in its device tier)."""

    templates: int = 1
    executors: int = 1
    resident: int = 1


@dataclass(frozen=True)
class Workload:
    """One function's shape: what a template of it is baked at."""

    width: int
    height: int
    steps: int
    storage: RowFormat = RowFormat.NATIVE


@dataclass(frozen=True)
class CapacityPlan:
    """One function's bytes: per template, and per executor and node under a sizing."""

    name: str
    family: str
    dtype: str
    workload: Workload
    template: TemplateBytes
    weights: int  # the denoiser's parameters and buffers (text encoders and VAE: besides)
    sizing: Sizing

    @property
    def host_per_executor(self) -> int:
        return self.sizing.resident * self.template.host

    @property
    def device_per_executor(self) -> int:
        return self.weights + self.sizing.resident * self.template.device

    @property
    def disk_per_node(self) -> int:
        return self.sizing.executors * self.sizing.templates * self.template.disk

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "family": self.family,
            "dtype": self.dtype,
            **asdict(self.workload),
            "storage": self.workload.storage.value,
            "template": asdict(self.template),
            "weights_bytes": self.weights,
            **asdict(self.sizing),
            "host_per_executor_bytes": self.host_per_executor,
            "device_per_executor_bytes": self.device_per_executor,
            "disk_per_node_bytes": self.disk_per_node,
        }


def plan(editor: MaskAwareEditor, name: str, workload: Workload, sizing: Sizing) -> CapacityPlan:
    """The plan of a function on ``editor``'s model (built on any device, ``meta`` too)."""
    entries = template_entries(
        editor, workload.height, workload.width, workload.steps, workload.storage
    )
    denoiser = getattr(editor.impl.pipe, editor.impl.denoiser)
    tensors = [*denoiser.parameters(), *denoiser.buffers()]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    return CapacityPlan(
        name,
        editor.family,
        str(editor.impl.dtype).removeprefix("torch."),
        workload,
        template_bytes(entries),
        weights,
        sizing,
    )


def shape_editor(shape: str) -> MaskAwareEditor:
    """A production shape (``functions/demo/production.py``) on the meta device, in its
    compute dtype: its real layers and widths, no memory."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (one of {', '.join(sorted(SHAPES))})")
    built, pipe = build_shape(shape, "meta")
    return MaskAwareEditor(pipe, built.family, "meta")


def shape_workload(shape: str, size: int | None, steps: int | None, storage: RowFormat) -> Workload:
    """A shape's workload: its resolution (or ``size``), and the steps a spec of its family
    runs when it names none (or ``steps``)."""
    built = SHAPES[shape]
    side = size or built.resolution
    return Workload(side, side, steps or FAMILY_SPECS[built.family].steps, storage)


def spec_editor(spec: FunctionSpec, models_dir: Path) -> MaskAwareEditor:
    """A spec's built-in model, built (once) and loaded on the CPU in the spec's dtype.
    Other models: plan their architecture's shape instead (``--shape``)."""
    if not is_builtin(spec.model):
        raise ValueError(
            f"{spec.model} is not a built-in model: name the shape it has (--shape, one of "
            f"{', '.join(sorted(SHAPES))}) to plan it from the spec's size and steps"
        )
    folder = ensure_demo_model(spec.model, models_dir)
    pipe = load_pipeline(folder, spec.family, torch.device("cpu"), dtype=spec.dtype)
    return MaskAwareEditor(pipe, spec.family, "cpu")


def spec_workload(spec: FunctionSpec) -> Workload:
    return Workload(spec.width, spec.height, spec.steps, RowFormat(spec.storage))
