"""A single file of another model than its ``config`` describes is refused at deploy, from
the file's safetensors header alone, with a 422 on ``model`` that names the file and what
differs: its denoiser's input channels, the width of the text embeddings it reads, or no
denoiser of the family at all. Each file is written in its original layout from a tiny
built-in model (its denoiser rebuilt with another config where the mismatch needs one)."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import save_file

from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.errors import InvalidSpec
from retouch.functions.modelcheck import ModelKind, check_model
from retouch.functions.models import known_builtin
from retouch.functions.modelsource import ModelSource
from retouch.runtime.models import load_pipeline
from tests.singlefile import ldm_checkpoint, sd3_checkpoint, sgm_checkpoint

UNCONDITIONAL = {
    "down_block_types": ["DownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "UpBlock2D"],
    "mid_block_type": None,
}
WRITERS = {
    "retouch:tiny-sd": ldm_checkpoint,
    "retouch:tiny-sdxl": sgm_checkpoint,
    "retouch:tiny-sd3": sd3_checkpoint,
}
FILES: dict[str, tuple[str, dict[str, Any]]] = {  # the model written, its denoiser's changes
    "sd": ("retouch:tiny-sd", {}),
    "sdxl": ("retouch:tiny-sdxl", {}),
    "sd3": ("retouch:tiny-sd3", {}),
    # SD 2's UNet reads OpenCLIP-H's wider text embeddings (1024, SD 1's CLIP-L 768)
    "sd2": ("retouch:tiny-sd", {"cross_attention_dim": 48}),
    # a text-to-image UNet: 4 latent channels, not the inpainting UNet's 9
    "sd-txt2img": ("retouch:tiny-sd", {"in_channels": 4}),
    "sd3-other-text": ("retouch:tiny-sd3", {"joint_attention_dim": 48}),
    # an unconditional UNet (LDM's CelebA-HQ, LSUN models): no cross-attention at all
    "sd-unconditional": ("retouch:tiny-sd", UNCONDITIONAL),
}
MISMATCHES = {  # file, the built-in model whose folder is its config, what the refusal says
    "sd-file-sdxl-config": (
        "sd",
        "retouch:tiny-sdxl",
        r"sd\.safetensors: its unet takes text embeddings 32 wide, "
        r"unet/config\.json says cross_attention_dim 80 \(the checkpoint of another model\?\)",
    ),
    "sd2-file-sd-config": (
        "sd2",
        "retouch:tiny-sd",
        r"its unet takes text embeddings 48 wide, unet/config\.json says cross_attention_dim 32",
    ),
    "txt2img-file-inpainting-config": (
        "sd-txt2img",
        "retouch:tiny-sd",
        r"its unet takes 4 input channels, unet/config\.json says in_channels 9",
    ),
    "sd3-file-sdxl-config": (
        "sd3",
        "retouch:tiny-sdxl",
        r"sd3\.safetensors holds no unet in its original layout "
        r"\(no model\.diffusion_model\.input_blocks\.0\.0\.weight\)",
    ),
    "sdxl-file-sd3-config": (
        "sdxl",
        "retouch:tiny-sd3",
        r"holds no transformer in its original layout \(no x_embedder\.proj\.weight or "
        r"model\.diffusion_model\.x_embedder\.proj\.weight\)",
    ),
    "sd3-file-other-text-width": (
        "sd3-other-text",
        "retouch:tiny-sd3",
        r"its transformer takes text embeddings 48 wide, "
        r"transformer/config\.json says joint_attention_dim 64",
    ),
    "unconditional-file-sd-config": (
        "sd-unconditional",
        "retouch:tiny-sd",
        r"its unet reads no text embeddings "
        r"\(no attn2\.to_k\.weight under model\.diffusion_model\.\)",
    ),
}
CPU = torch.device("cpu")


def _with_denoiser(pipe: DiffusionPipeline, changes: dict[str, Any]) -> DiffusionPipeline:
    """The pipeline with its denoiser rebuilt (random weights) from its config + ``changes``."""
    if changes:
        name = "unet" if "unet" in pipe.components else "transformer"
        denoiser = getattr(pipe, name)
        setattr(pipe, name, type(denoiser).from_config({**denoiser.config, **changes}))
    return pipe


@pytest.fixture(scope="module")
def folder(models_dir: Path) -> Callable[[str], Path]:
    return lambda model: ensure_demo_model(model, models_dir)


@pytest.fixture(scope="module")
def single_file(
    folder: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """Each of :data:`FILES` written once, as ``<name>.safetensors``."""
    made: dict[str, Path] = {}
    target = tmp_path_factory.mktemp("single-files")

    def write(name: str) -> Path:
        if name not in made:
            model, changes = FILES[name]
            pipe = load_pipeline(folder(model), known_builtin(model).family, CPU)
            path = target / f"{name}.safetensors"
            save_file(WRITERS[model](_with_denoiser(pipe, changes)), str(path))
            made[name] = path
        return made[name]

    return write


@pytest.mark.parametrize("name", ["sd", "sdxl", "sd3"])
def test_a_file_of_the_model_its_config_describes_is_servable(
    name: str, single_file: Callable[[str], Path], folder: Callable[[str], Path]
) -> None:
    model = FILES[name][0]
    source = ModelSource(str(single_file(name)), config=str(folder(model)))
    files = check_model(source, known_builtin(model).family)
    assert files.kind is ModelKind.SINGLE_FILE and files.checkpoint == single_file(name)


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_a_file_of_another_model_is_refused_naming_the_difference(
    case: str, single_file: Callable[[str], Path], folder: Callable[[str], Path]
) -> None:
    name, config, message = MISMATCHES[case]
    source = ModelSource(str(single_file(name)), config=str(folder(config)))
    with pytest.raises(InvalidSpec, match=message) as err:
        check_model(source, known_builtin(config).family)
    assert err.value.field == "model" and err.value.status == 422


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": 5, "data_offsets": [0, 4]},  # a shape that is no list
        {"dtype": "F32", "shape": {"0": 1, "1": 1}, "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": [1, "4"], "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": [1, 1], "data_offsets": [0]},
        {"shape": [1, 1], "data_offsets": [0, 4]},
    ],
)
def test_a_malformed_header_is_a_422_naming_the_file(
    entry: dict[str, Any], folder: Callable[[str], Path], tmp_path: Path
) -> None:
    """Every header entry is checked as the format defines it before the check reads its
    shapes: a hostile or broken file is a 422, never a 500."""
    path = tmp_path / "broken.safetensors"
    header = json.dumps({"model.diffusion_model.input_blocks.0.0.weight": entry}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(InvalidSpec, match=r"broken\.safetensors is truncated or not") as err:
        check_model(ModelSource(str(path), config=str(folder("retouch:tiny-sd"))), "sd-inpaint")
    assert err.value.field == "model" and err.value.status == 422


def test_a_component_from_another_library_is_refused(
    single_file: Callable[[str], Path], folder: Callable[[str], Path], tmp_path: Path
) -> None:
    """What a file lacks is built by the class ``config``'s model_index.json names: only
    from diffusers or transformers (nothing else a folder names is imported)."""
    config = Path(shutil.copytree(folder("retouch:tiny-sd3"), tmp_path / "config"))
    index = json.loads((config / "model_index.json").read_text())
    index["text_encoder_3"] = ["os", "T5EncoderModel"]
    (config / "model_index.json").write_text(json.dumps(index))
    plain = single_file("sd3")  # the MMDiT and VAE (sd3_medium's): its encoders from config
    with pytest.raises(InvalidSpec, match=r"text_encoder_3 comes from 'os'") as err:
        check_model(ModelSource(str(plain), config=str(config)), "sd3-inpaint")
    assert err.value.field == "config" and err.value.status == 422
