"""Built-in demo models: real diffusers pipelines with random weights, built from configs.

Weights cannot be downloaded, so ``retouch:<name>`` models are built deterministically
(fixed seed; the builders are in ``builders.py``, this is their catalogue), put in eval
mode, written once with ``save_pretrained`` into the data directory and then always loaded
with ``from_pretrained`` — the same code path as a user's own local diffusers folder.
``tiny-*`` models serve tests and the demo; ``small-*`` models are the CPU benchmark
sizes.

``shapes-sd`` is the exception: a *trained* model (``retouch train-demo`` on the procedural
shapes set, ``functions/demo/train.py``) shipped inside the package in fp16 safetensors
(``functions/demo/weights/shapes-sd``). Its "build" loads that folder with
``from_pretrained`` and saves it in float32 into the data directory, so every loader gets
the same dtype rule as the other demo models.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from retouch.functions.demo.builders import (
    SDXLSize,
    build_flux,
    build_flux2_klein,
    build_sd,
    build_sd3,
    build_sdxl,
    build_z_image,
    copy_trained,
)
from retouch.functions.demo.qwen_image import (
    SMALL_QWEN_IMAGE,
    SMALL_QWEN_IMAGE_EDIT,
    TINY_QWEN_IMAGE,
    TINY_QWEN_IMAGE_EDIT,
    build_qwen_image,
    build_qwen_image_edit,
)
from retouch.functions.models import BUILTIN_MODELS

log = logging.getLogger(__name__)

PREFIX = "retouch:"
BUILD_SEED = 20261121


@dataclass(frozen=True)
class DemoModel:
    """How to build one built-in model; its family and native resolution are the torch-free
    catalogue's (``functions/models.py``), so the gateway and the builders cannot disagree."""

    name: str
    build: Callable[[Path], None]
    source: Path | None = None  # shipped trained weights (None: built with random weights)

    @property
    def family(self) -> str:
        return BUILTIN_MODELS[self.name].family

    @property
    def resolution(self) -> int:
        return BUILTIN_MODELS[self.name].resolution


TINY_SDXL = SDXLSize((32, 64, 64), (1, 1, 2), head_dim=16, text_hidden=(32, 48))
# At 512 px its 128² latents have SDXL's token grids at 1024² (no attention at 128², then
# 64² and 32²), at about small-sd's cost per step.
SMALL_SDXL = SDXLSize((96, 192, 384), (1, 2, 10), head_dim=64, text_hidden=(64, 96))

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
SHAPES_SD = WEIGHTS_DIR / "shapes-sd"

# The SD (UNet) and SD3 (MMDiT) sizes.
TINY_SD: dict[str, Any] = {
    "unet_channels": (32, 64),
    "vae_channels": (16, 32, 32),
    "resolution": 128,
    "head_dim": 8,
    "text_hidden": 32,
}
SMALL_SD: dict[str, Any] = {
    "unet_channels": (320, 640),
    "vae_channels": (16, 32, 32, 32),
    "resolution": 512,
    "head_dim": 64,
    "text_hidden": 64,
}
TINY_SD3: dict[str, Any] = {
    "heads": 2,
    "head_dim": 16,
    "layers": 2,
    "vae_channels": (16, 32, 32),
    "resolution": 128,
    "text_hidden": 32,
}
SMALL_SD3: dict[str, Any] = {  # factor-4 VAE: 128x128 latents = 64x64 = 4096 tokens
    "heads": 6,
    "head_dim": 64,
    "layers": 4,
    "vae_channels": (16, 32, 32),
    "resolution": 512,
    "text_hidden": 64,
}
# The Flux DiT sizes, shared by flux-inpaint and flux-fill models.
TINY_FLUX: dict[str, Any] = {
    "hidden_heads": 2,
    "head_dim": 16,
    "layers": 1,
    "single_layers": 2,
    "vae_channels": (16, 32, 32),
    "text_hidden": 32,
}
SMALL_FLUX: dict[str, Any] = {  # factor-4 VAE: 128x128 latents = 64x64 = 4096 tokens at 512 px
    "hidden_heads": 6,
    "head_dim": 64,
    "layers": 2,
    "single_layers": 4,
    "vae_channels": (16, 32, 32),
    "text_hidden": 64,
}
# FLUX.2 [klein]'s sizes: Flux's, its text encoder three layers wide (factor-4 VAE, 2x2
# patches: 8 px tokens, at 512 px 4096 edited tokens and as many of the template's).
TINY_KLEIN: dict[str, Any] = {**TINY_FLUX, "text_hidden": 16}
SMALL_KLEIN: dict[str, Any] = {**SMALL_FLUX, "text_hidden": 64}
# The Z-Image DiT sizes (factor-4 VAE: small's 512 px is a 64x64 token grid).
TINY_Z_IMAGE: dict[str, Any] = {
    "dim": 32,
    "heads": 2,
    "layers": 2,
    "refiner_layers": 2,
    "vae_channels": (16, 32, 32),
    "text_hidden": 32,
}
SMALL_Z_IMAGE: dict[str, Any] = {
    "dim": 384,
    "heads": 6,
    "layers": 4,
    "refiner_layers": 2,
    "vae_channels": (16, 32, 32),
    "text_hidden": 64,
}

DEMO_MODELS: dict[str, DemoModel] = {
    m.name: m
    for m in (
        DemoModel("tiny-sd", lambda f: build_sd(f, **TINY_SD)),
        DemoModel(
            "tiny-flux",
            lambda f: build_flux(f, **TINY_FLUX),
        ),
        DemoModel("small-sd", lambda f: build_sd(f, **SMALL_SD)),
        DemoModel(
            "small-flux",
            lambda f: build_flux(f, **SMALL_FLUX),
        ),
        DemoModel("tiny-sd3", lambda f: build_sd3(f, **TINY_SD3)),
        DemoModel("small-sd3", lambda f: build_sd3(f, **SMALL_SD3)),
        DemoModel("tiny-flux-fill", lambda f: build_flux(f, **TINY_FLUX, fill=True)),
        DemoModel("small-flux-fill", lambda f: build_flux(f, **SMALL_FLUX, fill=True)),
        DemoModel("tiny-flux-kontext", lambda f: build_flux(f, **TINY_FLUX, kontext=True)),
        DemoModel("small-flux-kontext", lambda f: build_flux(f, **SMALL_FLUX, kontext=True)),
        DemoModel("tiny-flux2-klein", lambda f: build_flux2_klein(f, TINY_KLEIN)),
        DemoModel("small-flux2-klein", lambda f: build_flux2_klein(f, SMALL_KLEIN)),
        DemoModel("tiny-qwen-image", lambda f: build_qwen_image(f, TINY_QWEN_IMAGE)),
        DemoModel("small-qwen-image", lambda f: build_qwen_image(f, SMALL_QWEN_IMAGE)),
        DemoModel("tiny-qwen-image-edit", lambda f: build_qwen_image_edit(f, TINY_QWEN_IMAGE_EDIT)),
        DemoModel(
            "small-qwen-image-edit", lambda f: build_qwen_image_edit(f, SMALL_QWEN_IMAGE_EDIT)
        ),
        DemoModel("tiny-z-image", lambda f: build_z_image(f, **TINY_Z_IMAGE, grid=64)),
        DemoModel("small-z-image", lambda f: build_z_image(f, **SMALL_Z_IMAGE, grid=128)),
        DemoModel("tiny-sdxl", lambda f: build_sdxl(f, TINY_SDXL, resolution=128)),
        DemoModel("small-sdxl", lambda f: build_sdxl(f, SMALL_SDXL, resolution=512)),
        DemoModel(
            "shapes-sd",
            lambda f: copy_trained(SHAPES_SD, f),
            source=SHAPES_SD,
        ),
    )
}


def is_demo(model: str) -> bool:
    return model.startswith(PREFIX)


def demo_model(model: str) -> DemoModel:
    """The built-in model named ``retouch:<name>``; ``KeyError`` if there is none."""
    return DEMO_MODELS[model.removeprefix(PREFIX)]


def ensure_demo_model(model: str, models_dir: Path) -> Path:
    """Build ``retouch:<name>`` into ``models_dir/<name>`` once and return the folder.

    The build writes into a temporary folder renamed into place, so a concurrent or killed
    build never leaves a half-written model that a loader would pick up.
    """
    spec = demo_model(model)
    target = models_dir / spec.name
    if (target / "model_index.json").exists() and not _stale(spec, target):
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=models_dir))
    log.info("building demo model %s into %s", model, target)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(BUILD_SEED)
        spec.build(tmp)
    if target.exists() and _stale(spec, target):  # shipped weights changed: replace the copy
        old = Path(tempfile.mkdtemp(prefix=f".{spec.name}-old-", dir=models_dir))
        with contextlib.suppress(OSError):
            os.rename(target, old / spec.name)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _stale(spec: DemoModel, target: Path) -> bool:
    """A copy of shipped weights is stale when its ``training.json`` differs from theirs."""
    if spec.source is None:
        return False
    try:
        return (spec.source / "training.json").read_bytes() != (
            target / "training.json"
        ).read_bytes()
    except OSError:
        return (spec.source / "training.json").exists()
