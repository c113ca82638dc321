"""SDXL inpainting single-file checkpoints as users have them: the SGM layout of
``sd_xl_base_1.0_inpainting_0.1.safetensors`` (UNet, VAE, CLIP-L and OpenCLIP ViT-bigG in
one file), with ``config`` naming the diffusers folder. Diffusers reads such a file as SDXL
inpainting, a deploy accepts it, and the executor's loader gives the images of the folder;
a file without the VAE (a merge saved without it, a UNet-only file) takes it, and
the text encoders it lacks, from the folder's weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
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
from tests.kernelpaths import assert_close_across_paths, weights_differing
from tests.singlefile import SGM_OPEN_CLIP, leaving_out, sgm_checkpoint

FAMILY = "sdxl-inpaint"
SIZE, STEPS, GUIDANCE = 128, 2, 5.0
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(models_dir: Path) -> Path:
    return ensure_demo_model("retouch:tiny-sdxl", models_dir)


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
    return MaskAwareEditor(_pipe(cache, source), FAMILY, CPU).stock_edit(request, "np")


def _pipe(cache: ModelCache, source: ModelSource) -> DiffusionPipeline:
    return cache.get(source.key, FAMILY).pipe


def test_sdxl_single_file_gives_the_images_of_its_folder(
    cache: ModelCache, folder: Path, checkpoint: Path
) -> None:
    tensors = load_file(checkpoint)
    assert infer_diffusers_model_type(tensors) == "xl_inpaint"  # diffusers' own reading
    assert "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight" in tensors
    plain, single = ModelSource(str(folder)), ModelSource(str(checkpoint), config=str(folder))
    assert not weights_differing(_pipe(cache, single), _pipe(cache, plain))
    assert_close_across_paths(_stock(cache, single), _stock(cache, plain))
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


# Key prefixes of the SGM layout's VAE, and of its text encoders.
SGM_VAE, SGM_TEXT = "first_stage_model.", "conditioner."
LACKING = {  # what a file leaves out: what the model check then loads from config
    "merge-without-vae": ((SGM_VAE,), ("vae",)),
    "unet-only": ((SGM_VAE, SGM_TEXT), ("text_encoder", "text_encoder_2", "vae")),
}


@pytest.mark.parametrize("case", list(LACKING))
def test_what_a_file_lacks_comes_from_config(
    case: str, cache: ModelCache, folder: Path, checkpoint: Path, tmp_path: Path
) -> None:
    left_out, from_config = LACKING[case]
    path = tmp_path / f"{case}.safetensors"
    save_file(leaving_out(load_file(checkpoint), *left_out), str(path))
    single = ModelSource(str(path), config=str(folder))
    assert check_model(single, FAMILY).from_config == from_config
    assert not weights_differing(_pipe(cache, single), _pipe(cache, ModelSource(str(folder))))
    assert_close_across_paths(_stock(cache, single), _stock(cache, ModelSource(str(folder))))


def test_a_config_without_the_vae_the_file_lacks_is_refused(
    folder: Path, checkpoint: Path, tmp_path: Path
) -> None:
    path = tmp_path / "merge-without-vae.safetensors"
    save_file(leaving_out(load_file(checkpoint), SGM_VAE), str(path))
    configs = Path(shutil.copytree(folder, tmp_path / "configs"))
    (configs / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(InvalidSpec) as err:
        check_model(ModelSource(str(path), config=str(configs)), FAMILY)
    assert err.value.field == "config" and err.value.status == 422
    assert "missing vae/diffusion_pytorch_model.safetensors" in err.value.message
    assert "merge-without-vae.safetensors holds no vae" in err.value.message
    full = check_model(ModelSource(str(checkpoint), config=str(configs)), FAMILY)
    assert full.from_config == ()  # a file with its VAE needs none in config


def test_a_file_with_one_of_its_two_clip_encoders_is_refused(
    folder: Path, checkpoint: Path, tmp_path: Path
) -> None:
    """CLIP-L without the bigG: diffusers reads such a file as SD 1 and fails to load it
    whatever config holds, so the deploy is refused naming the file."""
    path = tmp_path / "without-bigg.safetensors"
    save_file(leaving_out(load_file(checkpoint), SGM_OPEN_CLIP), str(path))
    with pytest.raises(InvalidSpec, match="holds text_encoder but not text_encoder_2") as err:
        check_model(ModelSource(str(path), config=str(folder)), FAMILY)
    assert err.value.field == "model" and err.value.status == 422
    assert "without-bigg.safetensors" in err.value.message
