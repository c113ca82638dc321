"""Loading diffusion models onto an executor's device.

A model is named either ``retouch:<demo>`` (built once into the data directory, then loaded
like any folder) or by the path of a local diffusers folder. Every function that uses the
same model on an executor shares one loaded copy.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
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
    PNDMScheduler,
)

from retouch.functions.demo.models import demo_model, ensure_demo_model, is_demo
from retouch.functions.errors import InvalidSpec
from retouch.runtime.families import family as family_of

log = logging.getLogger(__name__)

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


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


DEVICE_CHOICES = ("auto", "cpu", "cuda")


def pick_device(name: str) -> torch.device:
    """``auto`` (CUDA when there is one), ``cpu`` or ``cuda``; asking for CUDA on a machine
    without it is an error rather than a silent fall-back (a benchmark would mislabel)."""
    if name not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, not {name!r}")
    if name == "auto":
        return default_device()
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that a wall clock read after it covers them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_dtype(device: torch.device) -> torch.dtype:
    """The compute dtype on ``device``: float16 on CUDA, else float32."""
    return torch.float16 if device.type == "cuda" else torch.float32


def load_pipeline(
    folder: Path, family: str, device: torch.device, *, without: tuple[str, ...] = ()
) -> DiffusionPipeline:
    """The one pipeline loader (executor, pre/post workers, benches): ``family``'s pipeline
    class and load arguments, the device's dtype, components ``without`` left out, in eval
    mode without gradients or progress bars."""
    model_family = family_of(family)
    kwargs = {**model_family.load_kwargs, **dict.fromkeys(without)}
    pipe = model_family.pipeline.from_pretrained(folder, dtype=device_dtype(device), **kwargs)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)
    return pipe


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
        """A pipeline view with the function's scheduler; weights are shared, not copied.
        The pipeline's own options (SDXL's ``requires_aesthetics_score``, ...) carry over."""
        sched = SCHEDULERS[scheduler].from_config(self.base_scheduler_config)
        _, optional = DiffusionPipeline._get_signature_keys(self.pipe)
        options = {k: v for k, v in self.pipe.config.items() if k in optional}
        components = {**self.pipe.components, "scheduler": sched, **options}
        pipe = type(self.pipe)(**components)
        pipe.set_progress_bar_config(disable=True)
        return pipe


class ModelCache:
    """Loads each model once per process (the executor, and each pre/post worker).

    ``without`` leaves component kinds out of every model: ``"denoiser"`` (the family's
    denoiser: a pre/post worker's pipeline), ``"text"`` (its text encoders and
    tokenizers: a post worker's) and ``"text_encoders"`` (the encoders alone: an executor
    whose pre workers encode its prompts, so each encoder is on the device once). The lock only guards the table of per-model futures: a
    load runs outside it, so ``loaded()`` (read by ``/state``) and other models never wait
    on a ``from_pretrained``; concurrent requests for the model being loaded wait on its
    future."""

    def __init__(
        self, models_dir: Path, device: torch.device, *, without: tuple[str, ...] = ()
    ) -> None:
        unknown = set(without) - {"denoiser", "text", "text_encoders"}
        if unknown:
            raise ValueError(f"unknown component kinds {sorted(unknown)}")
        self.models_dir = models_dir
        self.device = device
        self.without = without
        self._models: dict[str, Future[LoadedModel]] = {}
        self._lock = threading.Lock()

    def get(self, model: str, family: str) -> LoadedModel:
        with self._lock:
            future = self._models.get(model)
            owner = future is None
            if owner:
                future = self._models[model] = Future()
        if not owner:
            return future.result()
        try:
            future.set_result(self._load(model, family))
        except BaseException as exc:
            with self._lock:  # a failed load is retried by the next deploy
                self._models.pop(model, None)
            future.set_exception(exc)
        return future.result()

    def loaded(self) -> list[str]:
        with self._lock:
            return [m for m, f in self._models.items() if f.done() and not f.exception()]

    def loading(self) -> list[str]:
        with self._lock:
            return [m for m, f in self._models.items() if not f.done()]

    def _load(self, model: str, family: str) -> LoadedModel:
        folder = model_folder(model, self.models_dir)
        kinds = family_of(family)
        left_out = (kinds.denoisers if "denoiser" in self.without else ()) + (
            kinds.text_components
            if "text" in self.without
            else kinds.text_encoders
            if "text_encoders" in self.without
            else ()
        )
        started = time.perf_counter()
        pipe = load_pipeline(folder, family, self.device, without=left_out)
        log.info(
            "loaded %s (%s) on %s%s in %.1f s",
            model,
            family,
            self.device,
            f" without {', '.join(left_out)}" if left_out else "",
            time.perf_counter() - started,
        )
        return LoadedModel(model, family, pipe, self.device, folder, dict(pipe.scheduler.config))
