"""Flux single files as users have them: the transformer alone in Black Forest Labs' layout
(``flux1-fill-dev.safetensors``, bare or with ComfyUI's ``model.diffusion_model.`` prefix),
its VAE and text encoders from the ``config`` folder. The file written here is read by
diffusers' own conversion at FLUX.1-Fill's real size; a tiny model's file loads through the
executor's loader (``ModelCache``) and gives the images of its folder, and the model check
serves it when the folder holds every other component's weights."""

from __future__ import annotations

import json
import shutil
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.loaders import single_file_model, single_file_utils
from safetensors.torch import save_file

from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.errors import InvalidSpec
from retouch.functions.modelcheck import ModelKind, check_model
from retouch.functions.modelsource import ModelSource
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.models import ModelCache
from tests.kernelpaths import assert_close_across_paths, weights_differing
from tests.singlefile import COMFY_PREFIX, bfl_flux_checkpoint

CPU = torch.device("cpu")
SIZE, STEPS, GUIDANCE = 64, 2, 30.0
FLUX1_WIDTH = 3072  # the hidden size diffusers' Flux conversion assumes (every FLUX.1)
# FLUX.1-Fill-dev's transformer config, but for its depth (the conversion counts blocks).
FLUX1_FILL = {
    "in_channels": 384,
    "out_channels": 64,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
CASES = {  # family, its tiny built-in model, the key prefix of the file
    "fill": ("flux-fill", "retouch:tiny-flux-fill", ""),
    "fill-comfyui": ("flux-fill", "retouch:tiny-flux-fill", COMFY_PREFIX),
    "inpaint": ("flux-inpaint", "retouch:tiny-flux", ""),
}


def converter_at_width(width: int) -> Callable[..., dict[str, torch.Tensor]]:
    """diffusers' ``convert_flux_transformer_checkpoint_to_diffusers`` with FLUX.1's hidden
    size (a constant of its code, used to split the single blocks' fused ``linear1``)
    replaced by ``width``: the very conversion, for the tiny models' files."""
    convert = single_file_utils.convert_flux_transformer_checkpoint_to_diffusers
    code = convert.__code__
    if FLUX1_WIDTH not in code.co_consts:  # diffusers reads the width from the model
        return convert
    consts = tuple(width if c == FLUX1_WIDTH else c for c in code.co_consts)
    return types.FunctionType(code.replace(co_consts=consts), convert.__globals__)


@pytest.fixture(scope="module")
def files(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path
) -> Callable[[str], tuple[Path, Path]]:
    """Per case: the tiny model's transformer as a BFL-layout file, and its folder without
    the transformer's weights (what the file brings) as the ``config``."""
    made: dict[str, tuple[Path, Path]] = {}

    def make(case: str) -> tuple[Path, Path]:
        if case not in made:
            _, model, prefix = CASES[case]
            folder = ensure_demo_model(model, models_dir)
            target = tmp_path_factory.mktemp(case)
            config = Path(shutil.copytree(folder, target / "config"))
            for weights in (config / "transformer").glob("*.safetensors*"):
                weights.unlink()
            state = FluxTransformer2DModel.from_pretrained(folder / "transformer").state_dict()
            checkpoint = target / "flux1-dev.safetensors"
            save_file(bfl_flux_checkpoint(state, prefix), str(checkpoint))
            made[case] = checkpoint, config
        return made[case]

    return make


def convert_at_width_of(transformer: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' Flux conversion, as ``from_single_file`` finds it, at the hidden size of
    the transformer config in ``transformer``."""
    config = json.loads((transformer / "config.json").read_text())
    width = config["num_attention_heads"] * config["attention_head_dim"]
    mapping = single_file_model.SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"]
    monkeypatch.setitem(mapping, "checkpoint_mapping_fn", converter_at_width(width))


def _stock(cache: ModelCache, source: ModelSource, family: str) -> np.ndarray:
    mask = np.zeros((SIZE, SIZE), dtype=bool)
    mask[10:40, 16:50] = True
    image = template_image((SIZE, SIZE), 4)
    request = EditRequest(image, mask, "a red door", 9, STEPS, GUIDANCE, "a quiet street", 3)
    loaded = cache.get(source.key, family)
    return MaskAwareEditor(loaded.pipe, family, CPU).stock_edit(request, "np")


def test_bfl_layout_is_what_diffusers_reads_at_flux1_fill_size() -> None:
    with torch.device("meta"):
        shapes = FluxTransformer2DModel(**FLUX1_FILL).state_dict()
    generator = torch.Generator().manual_seed(0)  # every dimension but the first (which the
    state = {  # conversion splits, joins and swaps) narrowed to 2: 3 MB, not 4 GB
        k: torch.randn(v.shape[:1] + (2,) * (v.dim() - 1), generator=generator)
        for k, v in shapes.items()
    }
    for prefix in ("", COMFY_PREFIX):
        original = bfl_flux_checkpoint(state, prefix)
        assert original[prefix + "img_in.weight"].shape[0] == FLUX1_WIDTH
        assert original[prefix + "single_blocks.1.linear1.weight"].shape[0] == 7 * FLUX1_WIDTH
        converted = single_file_utils.convert_flux_transformer_checkpoint_to_diffusers(original)
        assert converted.keys() == state.keys()
        assert all(torch.equal(converted[k], v) for k, v in state.items())


@pytest.mark.parametrize("case", list(CASES))
def test_transformer_file_gives_the_images_of_its_folder(
    case: str,
    cache: ModelCache,
    files: Callable[[str], tuple[Path, Path]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    family, model, _ = CASES[case]
    checkpoint, config = files(case)
    convert_at_width_of(config / "transformer", monkeypatch)
    single = ModelSource(str(checkpoint), config=str(config))
    assert check_model(single, family).kind is ModelKind.SINGLE_FILE  # servable at deploy
    loaded, folder = cache.get(single.key, family), cache.get(ModelSource(model).key, family)
    assert not weights_differing(loaded.pipe, folder.pipe)
    image = _stock(cache, single, family)
    assert_close_across_paths(image, _stock(cache, ModelSource(model), family))
    assert loaded.fingerprint != folder.fingerprint


def test_transformer_file_needs_the_other_weights_in_its_config(
    files: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    checkpoint, config = files("fill")
    files_ = check_model(ModelSource(str(checkpoint), config=str(config)), "flux-fill")
    assert files_.folder == config.resolve() and files_.checkpoint == checkpoint.resolve()
    with pytest.raises(InvalidSpec, match="components but the transformer") as none:
        check_model(ModelSource(str(checkpoint)), "flux-fill")
    assert none.value.field == "config"
    partial = Path(shutil.copytree(config, tmp_path / "config"))
    (partial / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(InvalidSpec, match="missing vae/diffusion_pytorch_model") as vae:
        check_model(ModelSource(str(checkpoint), config=str(partial)), "flux-fill")
    assert vae.value.field == "config"
    with pytest.raises(
        InvalidSpec, match=r"missing text_encoder/model\.fp16\.safetensors"
    ) as variant:
        check_model(ModelSource(str(checkpoint), variant="fp16", config=str(config)), "flux-fill")
    assert variant.value.field == "config"  # a variant names the config folder's files


def test_a_file_of_another_model_is_refused_at_deploy(
    files: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    fill_config = files("fill")[1]
    flux_dev = files("inpaint")[0]  # a 64-channel transformer, not Fill's
    with pytest.raises(
        InvalidSpec, match=r"takes 64 input channels, .* says in_channels 192"
    ) as dev:
        check_model(ModelSource(str(flux_dev), config=str(fill_config)), "flux-fill")
    assert dev.value.field == "model"
    vae = tmp_path / "ae.safetensors"  # BFL's VAE file, given for the transformer
    save_file({"decoder.conv_in.weight": torch.zeros(4, 16, 3, 3)}, str(vae))
    with pytest.raises(InvalidSpec, match=r"holds no transformer .*no img_in\.weight") as ae:
        check_model(ModelSource(str(vae), config=str(fill_config)), "flux-fill")
    assert ae.value.field == "model"
