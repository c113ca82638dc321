"""Loading diffusion models onto an executor's device.

A model is a :class:`~retouch.functions.modelsource.ModelSource`: a ``retouch:<demo>``
(built once into the data directory, then loaded like any folder), a local diffusers folder
or cached hub id (with its ``variant``; sharded weights load through their index), or a
single-file checkpoint with its ``config`` folder; in its ``dtype``. Every function with
the same source on an executor shares one loaded copy. Nothing is ever downloaded: the
model check (:func:`~retouch.functions.modelcheck.check_model`) finds every file locally
first, and diffusers is told ``local_files_only``.
"""

from __future__ import annotations

import hashlib
import importlib
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

from retouch.functions.demo.models import BUILD_SEED, ensure_demo_model
from retouch.functions.demo.production import build_shape
from retouch.functions.errors import InvalidSpec
from retouch.functions.families import family_spec
from retouch.functions.modelcheck import (
    LIBRARIES,
    ModelFiles,
    ModelKind,
    check_model,
    model_index,
)
from retouch.functions.models import builtin_model
from retouch.functions.modelsource import ModelSource, from_key
from retouch.runtime.families import family as family_of
from retouch.runtime.fingerprint import model_fingerprint
from retouch.runtime.startup import StartupReport

log = logging.getLogger(__name__)

SCHEDULERS: dict[str, type] = {
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "euler-a": EulerAncestralDiscreteScheduler,
    "dpm++": DPMSolverMultistepScheduler,
    "pndm": PNDMScheduler,
    "flow-euler": FlowMatchEulerDiscreteScheduler,
}


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def model_files(source: ModelSource, family: str, models_dir: Path) -> ModelFiles:
    """Where ``source``'s files are, once the model check passed; a built-in model is
    built into ``models_dir`` on first use."""
    files = check_model(source, family)
    if files.kind is ModelKind.BUILTIN:
        return ModelFiles(files.kind, files.pipeline, ensure_demo_model(source.model, models_dir))
    return files


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


def compute_dtype(dtype: str, family: str, device: torch.device) -> torch.dtype:
    """A spec's ``dtype`` on ``device``; ``auto`` is the family's CUDA dtype on CUDA and
    float32 elsewhere (a CPU runs half precision slower, not faster)."""
    if dtype == "auto":
        dtype = family_spec(family).cuda_dtype if device.type == "cuda" else "fp32"
    return DTYPES[dtype]


def load_pipeline(
    folder: Path,
    family: str,
    device: torch.device,
    *,
    without: tuple[str, ...] = (),
    dtype: str = "auto",
    variant: str | None = None,
    checkpoint: Path | None = None,
    from_config: tuple[str, ...] = (),
) -> DiffusionPipeline:
    """The one pipeline loader (executor, pre/post workers, benches): ``family``'s pipeline
    class and load arguments, in ``dtype`` (:func:`compute_dtype`), components ``without``
    left out, in eval mode without gradients or progress bars. ``folder`` is a diffusers
    folder (its ``variant`` weights), or the configs of a single-file ``checkpoint``: the
    whole pipeline's (but for the text encoders and VAE it lacks, ``from_config``, from the
    model check), or the one component the family's files hold alone (its ``single_file``
    with ``alone``), the other components then loaded from ``folder``."""
    model_family = family_of(family)
    kwargs = {
        **model_family.load_kwargs,
        **dict.fromkeys(without),
        "dtype": compute_dtype(dtype, family, device),
        "local_files_only": True,
    }
    denoiser = model_family.spec.single_file
    if checkpoint is not None and denoiser.alone and denoiser.component not in without:
        name = denoiser.component
        kwargs[name] = component_from_file(checkpoint, folder, name, kwargs["dtype"])
    if checkpoint is None or denoiser.alone:
        own = model_family.own_components(folder, tuple(kwargs))
        pipe = model_family.pipeline.from_pretrained(folder, variant=variant, **kwargs, **own)
    else:
        lacking = {
            n: _component(folder, n, kwargs["dtype"]) for n in from_config if n not in kwargs
        }
        pipe = model_family.pipeline.from_single_file(
            checkpoint, config=str(folder), **kwargs, **lacking
        )
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)
    return pipe


def component_class(folder: Path, name: str) -> type:
    """The class ``folder``'s ``model_index.json`` names for component ``name``, imported
    only from the libraries the model check allows (it refused any other at deploy)."""
    library, cls = model_index(folder, "config")[name]
    if library not in LIBRARIES:
        raise InvalidSpec(f"{name} comes from {library!r}, not a model library", field="config")
    found = getattr(importlib.import_module(library), str(cls), None)
    if not isinstance(found, type):
        raise InvalidSpec(f"{library} has no class {cls} (component {name})", field="config")
    return found


def _component(folder: Path, name: str, dtype: torch.dtype) -> torch.nn.Module:
    """A component from a diffusers folder's own weights, for a single file that lacks it:
    ``from_single_file`` looks there only for diffusers' weight names, never for the
    ``model.safetensors`` a transformers text encoder is saved as."""
    return component_class(folder, name).from_pretrained(
        folder, subfolder=name, dtype=dtype, local_files_only=True
    )


def component_from_file(
    checkpoint: Path, folder: Path, name: str, dtype: torch.dtype
) -> torch.nn.Module:
    """Component ``name`` from a single file that holds it alone, in its original layout
    (BFL's Flux transformer): diffusers' conversion, with ``folder/name``'s config."""
    return component_class(folder, name).from_single_file(
        str(checkpoint), config=str(folder), subfolder=name, dtype=dtype, local_files_only=True
    )


@dataclass
class LoadedModel:
    """One model resident on a device, shared by every function that names it.

    ``model``: its source's key; ``folder``: its diffusers folder (a single file's config
    folder); ``fingerprint``: what keys its bakes (weights, configs, dtype, variant)."""

    model: str
    family: str
    pipe: DiffusionPipeline
    device: torch.device
    folder: Path
    fingerprint: str
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
        self,
        models_dir: Path,
        device: torch.device,
        *,
        without: tuple[str, ...] = (),
        startup: StartupReport | None = None,
    ) -> None:
        unknown = set(without) - {"denoiser", "text", "text_encoders"}
        if unknown:
            raise ValueError(f"unknown component kinds {sorted(unknown)}")
        self.models_dir = models_dir
        self.device = device
        self.without = without
        self.startup = startup or StartupReport()  # each load's ``weights`` phase
        self._models: dict[str, Future[LoadedModel]] = {}
        self._lock = threading.Lock()

    def get(self, model: str, family: str) -> LoadedModel:
        """The loaded copy of ``model`` (a source's :attr:`~ModelSource.key`)."""
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

    def resident(self) -> list[LoadedModel]:
        """The loaded models themselves (what a sleeping executor moves off its device)."""
        with self._lock:
            done = [f for f in self._models.values() if f.done() and not f.exception()]
        return [f.result() for f in done]

    def loading(self) -> list[str]:
        with self._lock:
            return [m for m, f in self._models.items() if not f.done()]

    def _load(self, model: str, family: str) -> LoadedModel:
        source = from_key(model)
        files = check_model(source, family)
        kinds = family_of(family)
        left_out = (kinds.denoisers if "denoiser" in self.without else ()) + (
            kinds.text_components
            if "text" in self.without
            else kinds.text_encoders
            if "text_encoders" in self.without
            else ()
        )
        started = time.perf_counter()
        shaped = files.kind is ModelKind.BUILTIN and builtin_model(source.model).shape
        if shaped:
            loaded = self._build_shaped(source, family, left_out)
        else:
            loaded = self._load_files(
                source, family, model_files(source, family, self.models_dir), left_out
            )
        took = time.perf_counter() - started
        self.startup.record("weights", took, model)
        log.info(
            "%s %s (%s) on %s%s in %.1f s",
            "built" if shaped else "loaded",
            model,
            family,
            self.device,
            f" without {', '.join(left_out)}" if left_out else "",
            took,
        )
        return loaded

    def _load_files(
        self, source: ModelSource, family: str, files: ModelFiles, left_out: tuple[str, ...]
    ) -> LoadedModel:
        assert files.folder is not None  # every kind loads from a folder once resolved
        pipe = load_pipeline(
            files.folder,
            family,
            self.device,
            without=left_out,
            dtype=source.dtype,
            variant=source.variant,
            checkpoint=files.checkpoint,
            from_config=files.from_config,
        )
        fingerprint = source_fingerprint(source, files, pipe)
        return LoadedModel(
            source.key,
            family,
            pipe,
            self.device,
            files.folder,
            fingerprint,
            dict(pipe.scheduler.config),
        )

    def _build_shaped(
        self, source: ModelSource, family: str, left_out: tuple[str, ...]
    ) -> LoadedModel:
        """A production-shaped built-in model, made in memory on the device (random
        weights, seeded: every process of this executor makes the same parts alike)."""
        builtin = builtin_model(source.model)
        assert builtin.shape is not None
        dtype = compute_dtype(source.dtype, family, self.device)
        _, pipe = build_shape(
            builtin.shape,
            self.device,
            scale=builtin.scale,
            dtype=dtype,
            seed=BUILD_SEED,
            without=left_out,
        )
        pipe.set_progress_bar_config(disable=True)
        # its bakes' key: what it is built from (the shape, scale, dtype and seed)
        made = f"{builtin.shape}\0{builtin.scale}\0{dtype}\0{BUILD_SEED}"
        fingerprint = hashlib.sha256(made.encode()).hexdigest()
        return LoadedModel(
            source.key,
            family,
            pipe,
            self.device,
            self.models_dir / builtin.name,  # nothing on disk: no adapters' configs either
            fingerprint,
            dict(pipe.scheduler.config),
        )


def source_fingerprint(source: ModelSource, files: ModelFiles, pipe: DiffusionPipeline) -> str:
    """The model part of a bake's cache key: the files loaded (the folder, and a single
    file's checkpoint) and how (variant, compute dtype): a bf16 copy's activations are not
    an fp32 copy's."""
    assert files.folder is not None
    parts = [model_fingerprint(files.folder)]
    if files.checkpoint is not None:
        parts.append(model_fingerprint(files.checkpoint))
    if not source.plain:  # a plain source keeps the key its bakes always had
        parts += [str(source.variant), str(pipe.dtype)]
    return "-".join(parts) if len(parts) > 1 else parts[0]
