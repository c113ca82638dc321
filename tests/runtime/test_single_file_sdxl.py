"""SDXL inpainting single-file checkpoints as users have them: the SGM layout of
``sd_xl_base_1.0_inpainting_0.1.safetensors`` (UNet, VAE, CLIP-L and OpenCLIP ViT-bigG in
one file), with ``config`` naming the diffusers folder. Diffusers reads such a file as SDXL
inpainting, a deploy accepts it, and the executor's loader gives the images of the folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.loaders.single_file_utils import infer_diffusers_model_type
from safetensors.torch import load_file, save_file

from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.errors import InvalidSpec
from retouch.functions.modelcheck import ModelKind, check_model
from retouch.functions.modelsource import ModelSource
from retouch.functions.spec import parse_spec
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.models import ModelCache
from tests.singlefile import sgm_checkpoint

FAMILY = "sdxl-inpaint"
SIZE, STEPS, GUIDANCE = 128, 2, 5.0
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(models_dir: Path) -> Path:
    return ensure_demo_model("retouch:tiny-sdxl", models_dir)


@pytest.fixture(scope="module")
def cache(models_dir: Path) -> ModelCache:
    return ModelCache(models_dir, CPU)


@pytest.fixture(scope="module")
def checkpoint(cache: ModelCache, folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder's weights in one file, as Stability and the community ship SDXL."""
    path = tmp_path_factory.mktemp("sdxl") / "sd_xl_inpainting.safetensors"
    save_file(sgm_checkpoint(cache.get(ModelSource(str(folder)).key, FAMILY).pipe), str(path))
    return path


def _stock(cache: ModelCache, source: ModelSource) -> np.ndarray:
    mask = np.zeros((SIZE, SIZE), dtype=bool)
    mask[20:70, 30:90] = True
    request = EditRequest(
        template_image((SIZE, SIZE), 4), mask, "the red door", 9, STEPS, GUIDANCE, "a street", 3
    )
    pipe = cache.get(source.key, FAMILY).pipe
    return MaskAwareEditor(pipe, FAMILY, CPU).stock_edit(request, "np")


def test_sdxl_single_file_gives_the_images_of_its_folder(
    cache: ModelCache, folder: Path, checkpoint: Path
) -> None:
    tensors = load_file(checkpoint)
    assert infer_diffusers_model_type(tensors) == "xl_inpaint"  # diffusers' own reading
    assert "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight" in tensors
    plain, single = ModelSource(str(folder)), ModelSource(str(checkpoint), config=str(folder))
    assert np.array_equal(_stock(cache, single), _stock(cache, plain))
    assert cache.get(single.key, FAMILY).fingerprint != cache.get(plain.key, FAMILY).fingerprint


def test_sdxl_single_file_is_servable_at_deploy(
    checkpoint: Path, folder: Path, models_dir: Path
) -> None:
    doc = {"name": "f", "family": FAMILY, "resolution": SIZE, "templates": {"t": {}}}
    spec = parse_spec({**doc, "model": str(checkpoint), "config": str(folder)})
    files = check_model(spec.source, spec.family)
    assert files.kind is ModelKind.SINGLE_FILE and files.checkpoint == checkpoint
    assert files.pipeline == "StableDiffusionXLInpaintPipeline" and files.folder == folder
    sd_folder = str(ensure_demo_model("retouch:tiny-sd", models_dir))
    with pytest.raises(InvalidSpec, match="cannot serve sdxl-inpaint") as wrong:
        check_model(ModelSource(str(checkpoint), config=sd_folder), FAMILY)
    assert wrong.value.field == "family" and wrong.value.status == 422
