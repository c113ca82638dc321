"""SD3 single-file checkpoints as Stability ships them (``sd3_medium.safetensors``: the
MMDiT and VAE; ``..._incl_clips_t5xxlfp16``: also CLIP-L, CLIP-G and T5-XXL) pass the
model check and give the images of their diffusers folder; the text encoders and VAE a
file lacks (an MMDiT-only file) load from its ``config`` folder's weights, and a
config folder without them is a 422."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import SD3Transformer2DModel
from diffusers.loaders.single_file_utils import (
    CHECKPOINT_KEY_NAMES,
    LDM_VAE_KEYS,
    convert_sd3_transformer_checkpoint_to_diffusers,
    infer_diffusers_model_type,
    is_t5_in_single_file,
)
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModelWithProjection

from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.demo.production import build_sd3_medium
from retouch.functions.errors import InvalidSpec
from retouch.functions.modelcheck import SINGLE_FILE_KEYS, ModelKind, check_model
from retouch.functions.modelsource import ModelSource
from retouch.runtime.maskaware.editor import MaskAwareEditor
from retouch.runtime.models import ModelCache, load_pipeline
from tests.kernelpaths import assert_close_across_paths, weights_differing
from tests.runtime.families.cases import CPU, Case
from tests.singlefile import leaving_out, sd3_checkpoint

FAMILY = "sd3-inpaint"
CASE = Case(FAMILY)
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
# SD3.5-medium's MMDiT beside SD3-medium's: dual attention in its first 13 blocks, qk-norm.
SD35_MEDIUM = {"pos_embed_max_size": 384, "dual_attention_layers": tuple(range(13))}
SD35_MEDIUM |= {"qk_norm": "rms_norm"}


@pytest.fixture(scope="module")
def tiny(models_dir: Path) -> Path:
    return ensure_demo_model("retouch:tiny-sd3", models_dir)


@pytest.fixture(scope="module")
def clips_folder(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-sd3 with SD3's text encoders as its single file can hold them: CLIP-L's
    projection the identity (the original has none; diffusers loads it as the identity) and
    CLIP-G of another width than CLIP-L (diffusers tells the two apart by width only)."""
    pipe = load_pipeline(tiny, FAMILY, CPU)
    width = pipe.text_encoder.config.hidden_size
    pipe.text_encoder.text_projection.weight.copy_(torch.eye(width))
    config = pipe.text_encoder_2.config.to_dict() | {"hidden_size": 24, "intermediate_size": 48}
    torch.manual_seed(5)
    pipe.text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**config)).eval()
    folder = tmp_path_factory.mktemp("sd3") / "sd3-medium-diffusers"
    pipe.save_pretrained(folder)
    return folder


def _checkpoint(folder: Path, text_encoders: bool, path: Path) -> Path:
    save_file(sd3_checkpoint(load_pipeline(folder, FAMILY, CPU), text_encoders), str(path))
    return path


def _stock(cache: ModelCache, source: ModelSource) -> np.ndarray:
    request = CASE.request(CASE.rect(20, 30, 50, 60), "a red door", 9, ("a quiet street", 3))
    return MaskAwareEditor(cache.get(source.key, FAMILY).pipe, FAMILY, CPU).stock_edit(
        request, "np"
    )


def _assert_same_model(cache: ModelCache, single: ModelSource, folder: ModelSource) -> None:
    """The folder's weights bit for bit, and its images within the cross-path tolerance
    (the copies' allocations differ, and with them the kernels MKL may pick)."""
    pipes = (cache.get(single.key, FAMILY).pipe, cache.get(folder.key, FAMILY).pipe)
    assert not weights_differing(*pipes)
    assert_close_across_paths(_stock(cache, single), _stock(cache, folder))


def test_plain_file_takes_its_text_encoders_from_config(
    cache: ModelCache, tiny: Path, tmp_path: Path
) -> None:
    checkpoint = _checkpoint(tiny, False, tmp_path / "sd3_medium.safetensors")
    single = ModelSource(str(checkpoint), config=str(tiny))
    files = check_model(single, FAMILY)
    assert files.kind is ModelKind.SINGLE_FILE and files.from_config == TEXT_ENCODERS
    _assert_same_model(cache, single, ModelSource("retouch:tiny-sd3"))


def test_an_mmdit_only_file_takes_the_vae_too_from_config(
    cache: ModelCache, tiny: Path, tmp_path: Path
) -> None:
    path = tmp_path / "sd3_medium_mmdit_only.safetensors"
    mmdit = leaving_out(sd3_checkpoint(load_pipeline(tiny, FAMILY, CPU)), "first_stage_model.")
    save_file(mmdit, str(path))
    single = ModelSource(str(path), config=str(tiny))
    assert check_model(single, FAMILY).from_config == (*TEXT_ENCODERS, "vae")
    _assert_same_model(cache, single, ModelSource("retouch:tiny-sd3"))


def test_file_with_all_three_text_encoders_gives_its_folders_images(
    cache: ModelCache, clips_folder: Path, tmp_path: Path
) -> None:
    path = tmp_path / "sd3_medium_incl_clips_t5xxlfp16.safetensors"
    single = ModelSource(str(_checkpoint(clips_folder, True, path)), config=str(clips_folder))
    assert check_model(single, FAMILY).from_config == ()  # every weight from the file
    _assert_same_model(cache, single, ModelSource(str(clips_folder)))


def test_a_config_without_the_text_encoders_the_file_lacks_is_refused(
    tiny: Path, tmp_path: Path
) -> None:
    plain = _checkpoint(tiny, False, tmp_path / "sd3_medium.safetensors")
    full = _checkpoint(tiny, True, tmp_path / "sd3_medium_incl_clips_t5xxlfp16.safetensors")
    configs = Path(shutil.copytree(tiny, tmp_path / "configs"))
    (configs / "text_encoder_3" / "model.safetensors").unlink()
    with pytest.raises(InvalidSpec, match=r"missing text_encoder_3/model\.safetensors") as err:
        check_model(ModelSource(str(plain), config=str(configs)), FAMILY)
    assert err.value.field == "config"
    assert check_model(ModelSource(str(full), config=str(configs)), FAMILY).from_config == ()


def test_diffusers_reads_the_layout_as_sd3_medium_and_sd35_medium(tmp_path: Path) -> None:
    """At production shapes (on the meta device) diffusers infers the file's model type, as
    it does to pick a default config."""
    with torch.device("meta"):
        pipe = build_sd3_medium(1.0, tmp_path)
        assert infer_diffusers_model_type(sd3_checkpoint(pipe, text_encoders=True)) == "sd3"
        config = dict(pipe.transformer.config) | SD35_MEDIUM
        pipe.transformer = SD3Transformer2DModel.from_config(config)
        assert infer_diffusers_model_type(sd3_checkpoint(pipe)) == "sd35_medium"


def test_diffusers_converts_the_layout_back_to_the_same_weights(tiny: Path) -> None:
    """Every tensor, SD3.5's dual attention and qk-norm included, round-trips through
    ``convert_sd3_transformer_checkpoint_to_diffusers``."""
    pipe = load_pipeline(tiny, FAMILY, CPU)
    config = dict(pipe.transformer.config) | SD35_MEDIUM | {"dual_attention_layers": (0,)}
    pipe.transformer = SD3Transformer2DModel.from_config(config)
    mmdit = "model.diffusion_model."
    keys = {k: v for k, v in sd3_checkpoint(pipe).items() if k.startswith(mmdit)}
    back = convert_sd3_transformer_checkpoint_to_diffusers(keys)
    state = pipe.transformer.state_dict()
    assert back.keys() == state.keys() and not keys  # every original key was read
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_the_checks_component_keys_are_diffusers_own() -> None:
    first = ("clip", "open_clip", "clip_sdxl", "clip_sd3")  # SD 1 / SD 2, SDXL's CLIP-L, SD3's
    second = ("open_clip_sdxl", "open_clip_sdxl_refiner", "open_clip_sd3")  # bigG, CLIP-G
    keys = SINGLE_FILE_KEYS
    assert set(keys["text_encoder"]) == {CHECKPOINT_KEY_NAMES[k] for k in first}
    assert set(keys["text_encoder_2"]) == {CHECKPOINT_KEY_NAMES[k] for k in second}
    assert is_t5_in_single_file(set(keys["text_encoder_3"]))
    assert set(keys["vae"]) == set(LDM_VAE_KEYS)
