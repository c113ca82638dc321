"""Text-encoder LoRAs: a function's prompt is encoded with its adapters' text-encoder part,
as diffusers' pipeline would encode it after ``load_lora_weights`` at the same scale, in
this process and in a pre worker alike; a LoRA that does not fit is the spec's error."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from retouch.functions.adapters import AdapterSpec
from retouch.functions.demo.images import mask_of_ratio, template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.errors import InvalidSpec
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.models import load_pipeline
from retouch.runtime.textadapters import TextAdapters
from retouch.runtime.workers import PrePostPool
from tests.lorafiles import wider_text_lora, write_lora

MODEL, FAMILY = "retouch:tiny-sd", "sd-inpaint"
PROMPT = "a red ball"
SCALE = 0.8


@pytest.fixture(scope="module")
def lora(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("lora")
    return write_lora(MODEL, models_dir, target, text_encoder=True, seed=3, std=0.2)


def _pipe(models_dir: Path):
    torch.set_num_threads(1)
    return load_pipeline(ensure_demo_model(MODEL, models_dir), FAMILY, torch.device("cpu"))


def _embeddings(pipe) -> torch.Tensor:
    positive, _ = pipe.encode_prompt(PROMPT, torch.device("cpu"), 1, True)
    return positive


def _merged_reference(pipe, lora: Path, scale: float) -> torch.Tensor:
    """The pipeline's ``encode_prompt`` with each adapted projection's weight replaced by
    W + scale · B·A (alpha = rank: the file's convention): LoRA's definition, computed
    without peft."""
    tensors = load_file(str(lora))
    merged = copy.deepcopy(pipe.text_encoder)
    modules = dict(merged.named_modules())
    for key, a in tensors.items():
        if not key.startswith("text_encoder.") or ".lora_A." not in key:
            continue
        module = key.removeprefix("text_encoder.").split(".lora_A.")[0]
        b = tensors[key.replace("lora_A", "lora_B")]
        with torch.no_grad():
            modules[module].weight += scale * (b @ a)
    reference = copy.copy(pipe)
    reference.text_encoder = merged
    return _embeddings(reference)


def test_a_text_lora_encodes_as_its_merged_weights_and_differs_from_the_base(
    models_dir: Path, lora: Path
) -> None:
    pipe = _pipe(models_dir)
    base = _embeddings(pipe)
    expected = _merged_reference(pipe, lora, SCALE)
    negative = _merged_reference(pipe, lora, -1.5)  # before peft wraps the projections
    text = TextAdapters(pipe)
    adapter = AdapterSpec(str(lora), SCALE, "style")
    with text.encoding((adapter,)):
        got = _embeddings(pipe)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (got - base).abs().max() > 1e-2  # the LoRA changes the prompt's encoding
    with text.encoding(()):  # a function without adapters on the same encoders: the base
        torch.testing.assert_close(_embeddings(pipe), base, atol=0, rtol=0)
    with text.encoding((AdapterSpec(str(lora), -1.5, "other"),)):  # same file, other scale
        torch.testing.assert_close(_embeddings(pipe), negative, atol=1e-5, rtol=1e-5)
    assert text.adapts((adapter,))


def test_the_pre_worker_encodes_with_the_functions_text_lora(models_dir: Path, lora: Path) -> None:
    pipe = _pipe(models_dir)
    editor = MaskAwareEditor(pipe, FAMILY, "cpu")
    image = template_image((128, 128), 0)
    request = EditRequest(image, mask_of_ratio((128, 128), 0.4), PROMPT, 1, 3, 7.5, "", 0)
    adapters = (AdapterSpec(str(lora), SCALE, "style"),)
    text = TextAdapters(pipe)
    with text.encoding(adapters):
        here = editor.encode(request).tensors["prompt_embeds"]
    base = editor.encode(request).tensors["prompt_embeds"]
    with PrePostPool(models_dir, "cpu", threads=1) as pool:
        there = pool.encode(MODEL, FAMILY, "ddim", request, None, adapters).result(timeout=180)
        plain = pool.encode(MODEL, FAMILY, "ddim", request).result(timeout=180)
    torch.testing.assert_close(torch.as_tensor(np.asarray(there.tensors["prompt_embeds"])), here)
    torch.testing.assert_close(torch.as_tensor(np.asarray(plain.tensors["prompt_embeds"])), base)
    assert (here - base).abs().max() > 1e-2


def test_a_text_lora_for_another_base_model_is_the_specs_error(
    models_dir: Path, lora: Path, tmp_path: Path
) -> None:
    other = wider_text_lora(lora, tmp_path / "wide.safetensors", 64)
    text = TextAdapters(_pipe(models_dir))
    with pytest.raises(InvalidSpec) as caught:
        text.load((AdapterSpec(str(lora), 1.0, "a"), AdapterSpec(str(other), 1.0, "b")))
    assert caught.value.field == "adapters[1].path"
    assert "another base model" in caught.value.message
    with pytest.raises(InvalidSpec) as caught:
        text.load((AdapterSpec(str(tmp_path / "absent.safetensors"), 1.0, "a"),))
    assert caught.value.field == "adapters[0].path"
    with text.encoding((AdapterSpec(str(lora), 1.0, "a"),)):  # the one that fits still does
        pass


def test_a_file_one_encoder_refuses_leaves_no_layers_in_the_other(
    models_dir: Path, tmp_path: Path
) -> None:
    """A two-encoder model (tiny-sdxl): a file whose ``text_encoder`` part fits and whose
    ``text_encoder_2`` part does not is refused, and the first encoder is left exactly as
    it was: no LoRA of it active in later encodes (a bare function's included)."""
    fits = write_lora("retouch:tiny-sdxl", models_dir, tmp_path / "fits", text_encoder=True)
    tensors = load_file(str(fits))
    for key in [k for k in tensors if k.startswith("text_encoder.")]:  # 2's modules, 1's widths
        wide = tensors[key].shape[1] * 3 if ".lora_A." in key else tensors[key].shape[0] * 3
        shape = (
            (tensors[key].shape[0], wide) if ".lora_A." in key else (wide, tensors[key].shape[1])
        )
        tensors["text_encoder_2." + key.removeprefix("text_encoder.")] = torch.ones(shape)
    broken = tmp_path / "broken.safetensors"
    save_file(tensors, str(broken))
    folder = ensure_demo_model("retouch:tiny-sdxl", models_dir)
    pipe = load_pipeline(folder, "sdxl-inpaint", torch.device("cpu"))
    before = pipe.encode_prompt(PROMPT, device=torch.device("cpu"))[0]
    text = TextAdapters(pipe)
    with pytest.raises(InvalidSpec) as caught:
        text.load((AdapterSpec(str(broken), 1.0, "broken"),))
    assert caught.value.field == "adapters[0].path"
    assert not any(len(getattr(m, "lora_A", ())) for m in pipe.text_encoder.modules())
    with text.encoding(()):
        assert torch.equal(pipe.encode_prompt(PROMPT, device=torch.device("cpu"))[0], before)
