"""Loading diffusion models onto an executor's device.

A model is named either ``retouch:<demo>`` (built once into the data directory, then loaded
like any folder) or by the path of a local diffusers folder. Every function that uses the
same model on an executor shares one loaded copy.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    DDIMScheduler,
    DiffusionPipeline,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxInpaintPipeline,
    PNDMScheduler,
    StableDiffusionInpaintPipeline,
)

from retouch.functions.demo.models import demo_model, ensure_demo_model, is_demo
from retouch.functions.errors import InvalidSpec

log = logging.getLogger(__name__)

PIPELINES: dict[str, type[DiffusionPipeline]] = {
    "sd-inpaint": StableDiffusionInpaintPipeline,
    "flux-inpaint": FluxInpaintPipeline,
}
# Pipeline classes found in model_index.json that a family can load.
COMPATIBLE = {
    "sd-inpaint": ("StableDiffusionInpaintPipeline", "StableDiffusionPipeline"),
    "flux-inpaint": ("FluxInpaintPipeline", "FluxPipeline", "FluxImg2ImgPipeline"),
}
SCHEDULERS: dict[str, type] = {
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "euler-a": EulerAncestralDiscreteScheduler,
    "dpm++": DPMSolverMultistepScheduler,
    "pndm": PNDMScheduler,
    "flow-euler": FlowMatchEulerDiscreteScheduler,
}


def model_folder(model: str, models_dir: Path) -> Path:
    """The folder a model loads from, building a demo model on first use."""
    if is_demo(model):
        try:
            demo_model(model)
        except KeyError:
            raise InvalidSpec(f"unknown built-in model {model!r}", field="model") from None
        return ensure_demo_model(model, models_dir)
    return Path(model).expanduser().resolve()


def check_model(model: str, family: str) -> None:
    """Reject a model that cannot serve ``family`` before anything is stored or loaded."""
    if is_demo(model):
        try:
            native = demo_model(model).family
        except KeyError:
            raise InvalidSpec(f"unknown built-in model {model!r}", field="model") from None
        if native != family:
            raise InvalidSpec(f"{model} is a {native} model, not {family}", field="family")
        return
    index = Path(model).expanduser() / "model_index.json"
    try:
        cls = json.loads(index.read_text()).get("_class_name", "")
    except (OSError, ValueError):
        raise InvalidSpec(
            f"{model!r} is not a diffusers folder (no readable model_index.json)", field="model"
        ) from None
    if cls not in COMPATIBLE[family]:
        raise InvalidSpec(f"{model} holds a {cls}, which cannot serve {family}", field="family")


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class LoadedModel:
    """One model resident on a device, shared by every function that names it."""

    model: str
    family: str
    pipe: DiffusionPipeline
    device: torch.device
    folder: Path
    base_scheduler_config: dict[str, Any] = field(default_factory=dict)

    def pipeline_for(self, scheduler: str) -> DiffusionPipeline:
        """A pipeline view with the function's scheduler; weights are shared, not copied."""
        sched = SCHEDULERS[scheduler].from_config(self.base_scheduler_config)
        components = {**self.pipe.components, "scheduler": sched}
        pipe = type(self.pipe)(**components)
        pipe.set_progress_bar_config(disable=True)
        return pipe


class ModelCache:
    """Loads each model once per executor; concurrent requests for one model wait for it."""

    def __init__(self, models_dir: Path, device: torch.device) -> None:
        self.models_dir = models_dir
        self.device = device
        self._models: dict[str, LoadedModel] = {}
        self._lock = threading.Lock()

    def get(self, model: str, family: str) -> LoadedModel:
        with self._lock:
            loaded = self._models.get(model)
            if loaded is None:
                loaded = self._load(model, family)
                self._models[model] = loaded
            return loaded

    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._models)

    def _load(self, model: str, family: str) -> LoadedModel:
        folder = model_folder(model, self.models_dir)
        dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        log.info("loading %s (%s) on %s", model, family, self.device)
        extra = (
            {"safety_checker": None, "requires_safety_checker": False}
            if family == "sd-inpaint"
            else {}
        )
        pipe = PIPELINES[family].from_pretrained(folder, torch_dtype=dtype, **extra)
        pipe.to(self.device)
        pipe.set_progress_bar_config(disable=True)
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.eval().requires_grad_(False)
        return LoadedModel(model, family, pipe, self.device, folder, dict(pipe.scheduler.config))
