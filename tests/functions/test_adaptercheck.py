"""The deploy check of LoRA files: each bad file is a 422 naming its entry, read from
safetensors headers only (the gateway's check imports no torch)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from retouch.functions.adaptercheck import check_adapters
from retouch.functions.adapters import AdapterSpec
from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.errors import InvalidSpec
from retouch.functions.modelcheck import check_model
from retouch.functions.modelsource import ModelSource
from retouch.functions.spec import load_spec_file
from tests.lorafiles import wider_text_lora, write_lora

MODEL = "retouch:tiny-sd"


@pytest.fixture(scope="module")
def lora(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_lora(MODEL, models_dir, tmp_path_factory.mktemp("lora"), text_encoder=True)


def _check(path: Path | str, model: str, family: str, models_dir: Path):
    folder = ensure_demo_model(model, models_dir)
    files = check_model(ModelSource(str(folder)), family)
    return check_adapters((AdapterSpec(str(path), 0.5, "x"),), family, model, files)


def _refusal(path: Path | str, models_dir: Path, model: str = MODEL, family: str = "sd-inpaint"):
    with pytest.raises(InvalidSpec) as caught:
        _check(path, model, family, models_dir)
    assert caught.value.field == "adapters[0].path"
    assert caught.value.status == 422
    return caught.value.message


def _safetensors(path: Path, tensors: dict[str, list[int]]) -> Path:
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return path


def test_a_lora_for_the_model_passes_and_says_what_it_adapts(lora: Path, models_dir: Path):
    (checked,) = _check(lora, MODEL, "sd-inpaint", models_dir)
    assert checked.components == ("unet", "text_encoder")
    assert checked.text_components == ("text_encoder",)


def test_each_bad_file_is_a_422_naming_the_entry(lora: Path, models_dir: Path, tmp_path: Path):
    assert "no such LoRA file" in _refusal(tmp_path / "absent.safetensors", models_dir)
    assert "must be absolute" in _refusal("style.safetensors", models_dir)
    (tmp_path / "notes.safetensors").write_text("not a tensor file")
    assert "not a safetensors file" in _refusal(tmp_path / "notes.safetensors", models_dir)
    plain = _safetensors(tmp_path / "plain.safetensors", {"unet.conv_in.weight": [4, 4]})
    assert "holds no LoRA weights" in _refusal(plain, models_dir)


def test_a_lora_for_another_family_or_width_is_refused(
    lora: Path, models_dir: Path, tmp_path: Path
) -> None:
    assert "another model family" in _refusal(lora, models_dir, "retouch:tiny-flux", "flux-inpaint")
    assert "does not have" in _refusal(lora, models_dir, "retouch:tiny-sdxl", "sdxl-inpaint")
    wide = wider_text_lora(lora, tmp_path / "wide.safetensors", 64)
    message = _refusal(wide, models_dir)
    assert "another base model" in message and "x64" in message
    unknown = _safetensors(
        tmp_path / "unknown.safetensors",
        {"unet.nowhere.to_q.lora_A.weight": [4, 32], "unet.nowhere.to_q.lora_B.weight": [32, 4]},
    )
    assert "unet.nowhere.to_q" in _refusal(unknown, models_dir)


def test_kohya_text_encoder_keys_name_their_component(models_dir: Path, tmp_path: Path) -> None:
    kohya = _safetensors(
        tmp_path / "kohya.safetensors",
        {"lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": [4, 32]},
    )
    assert "adapts text_encoder_2" in _refusal(kohya, models_dir)


def test_a_spec_files_relative_adapter_path_is_its_folders(tmp_path: Path) -> None:
    spec = tmp_path / "f.toml"
    spec.write_text(
        'name = "f"\nmodel = "retouch:tiny-sd"\nfamily = "sd-inpaint"\nresolution = 128\n'
        'adapters = [{ path = "loras/style.safetensors", scale = 0.8 }]\n'
        '[templates.t]\nimage = "t.png"\nprompt = "p"\n'
    )
    parsed, _ = load_spec_file(spec)
    assert parsed.adapters[0].path == str(tmp_path / "loras" / "style.safetensors")
    assert parsed.adapters[0].name == "style"


def test_each_familys_lora_modules_are_its_pipelines() -> None:
    from retouch.functions.families import FAMILY_SPECS
    from retouch.runtime.families import family

    for name, spec in FAMILY_SPECS.items():
        assert spec.lora_modules == tuple(family(name).pipeline._lora_loadable_modules), name


def test_a_lora_of_a_convolution_a_dora_or_a_biased_file_is_refused(
    models_dir: Path, tmp_path: Path
) -> None:
    """The served steps apply plain LoRA of linear layers only (mask-aware steps on token
    rows; mixed batches as stacked matrices without bias, where a convolution's file would
    fail every mixed step of the model's copy, and a bias would be left out silently):
    refused at deploy, naming the module, not at the first step."""
    proj_in = "unet.down_blocks.0.attentions.0.proj_in"
    conv = _safetensors(
        tmp_path / "conv.safetensors",
        {f"{proj_in}.lora_A.weight": [4, 32, 1, 1], f"{proj_in}.lora_B.weight": [32, 4, 1, 1]},
    )
    message = _refusal(conv, models_dir)
    assert proj_in in message and "convolution" in message
    kohya = _safetensors(
        tmp_path / "kohya.safetensors",
        {"lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight": [4, 32, 3, 3]},
    )
    assert "adapts lora_unet_down_blocks_0_resnets_0_conv1," in _refusal(kohya, models_dir)
    to_q = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    dora = _safetensors(
        tmp_path / "dora.safetensors",
        {
            f"{to_q}.lora_A.weight": [4, 32],
            f"{to_q}.lora_B.weight": [32, 4],
            f"{to_q}.lora_magnitude_vector": [32, 1],
        },
    )
    assert "DoRA" in _refusal(dora, models_dir)
    biased = _safetensors(
        tmp_path / "bias.safetensors",
        {f"{to_q}.lora_A.weight": [4, 32], f"{to_q}.lora_B.weight": [32, 4],
         f"{to_q}.lora_B.bias": [32]},
    )  # fmt: skip
    assert "LoRA bias" in _refusal(biased, models_dir)
