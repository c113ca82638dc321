"""Deploying functions with LoRA adapters through a real gateway and executor: each bad
adapter is a structured refusal naming its entry, from the gateway when its files show it
(a torch-free header check) and from the executor when only the loaded model does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from retouch.functions.adapters import AdapterSpec
from retouch.functions.errors import RetouchError
from retouch.platform.api.client import Call, Client, read_spec_file
from tests.lorafiles import write_lora


@pytest.fixture(scope="module")
def sd_lora(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_lora("retouch:tiny-sd", models_dir, tmp_path_factory.mktemp("sd-lora"))


def _refused(admin: Client, spec, images) -> RetouchError:
    with pytest.raises(RetouchError) as caught:
        admin.deploy(spec, images)
    return caught.value


def test_bad_adapters_are_refused_at_deploy_naming_the_entry(
    admin: Client, examples: Path, sd_lora: Path, tmp_path: Path
) -> None:
    spec, images = read_spec_file(examples / "tiny-sd.toml")
    spec = dataclasses.replace(spec, name="lora-refusals")

    missing = AdapterSpec(str(tmp_path / "none.safetensors"), 0.8, "none")
    err = _refused(admin, dataclasses.replace(spec, adapters=(missing,)), images)
    assert (err.status, err.field) == (
        422,
        "adapters[0].path",
    ) and "none.safetensors" in err.message

    not_lora = tmp_path / "not-a-lora.safetensors"
    not_lora.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    fine = AdapterSpec(str(sd_lora), 0.8, "fine")
    adapters = (fine, AdapterSpec(str(not_lora), 1.0, "bad"))
    err = _refused(admin, dataclasses.replace(spec, adapters=adapters), images)
    assert (err.status, err.field) == (422, "adapters[1].path")

    doc = {**spec.to_dict(), "adapters": [{"path": str(sd_lora), "scale": 4.5}]}
    err = _refused_raw(admin, doc, images)
    assert (err.status, err.field) == (422, "adapters[0].scale")

    # A LoRA for another family: the file's own components show it at the gateway.
    flux, flux_images = read_spec_file(examples / "tiny-flux.toml")
    flux = dataclasses.replace(flux, name="lora-on-flux", adapters=(fine,))
    err = _refused(admin, flux, flux_images)
    assert (err.status, err.field) == (422, "adapters[0].path")
    assert "lora-on-flux" not in [f["name"] for f in admin.list()]


def test_a_lora_for_another_base_model_fails_the_deploy_on_the_executor(
    admin: Client, examples: Path, sd_lora: Path
) -> None:
    """small-sd has tiny-sd's layout at other widths: only the built model shows the misfit,
    so the executor refuses it and the function says why, naming the entry."""
    spec, images = read_spec_file(examples / "tiny-sd.toml")
    spec = dataclasses.replace(
        spec, name="lora-on-small", model="retouch:small-sd", adapters=(AdapterSpec(str(sd_lora)),)
    )
    doc = admin.deploy(spec, images)
    assert doc["status"] == "failed", doc
    assert doc["error_field"] == "adapters[0].path" and doc["error_code"] == "invalid_spec"
    assert "pytorch_lora_weights" in doc["error"]


def _refused_raw(admin: Client, spec_doc: dict, images: dict[str, bytes]) -> RetouchError:
    """A spec document the client's own types would refuse to build, sent as is."""
    body = {"spec": spec_doc, "templates": images}
    with pytest.raises(RetouchError) as caught:
        admin.call(Call("PUT", f"/v1/functions/{spec_doc['name']}", body))
    return caught.value


def test_a_kohya_lora_that_does_not_fit_fails_the_deploy_on_the_executor(
    admin: Client, examples: Path, models_dir: Path, tmp_path: Path
) -> None:
    """A kohya-layout file (the header check reads no widths from its names): small-sd's
    LoRA on tiny-sd fails when the executor builds its layers at deploy, naming the entry,
    rather than failing every invocation later."""
    peft_file = write_lora("retouch:small-sd", models_dir, tmp_path / "small")
    tensors = load_file(str(peft_file))
    kohya: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        module, _, kind = key.removeprefix("unet.").rpartition(".lora_")
        name = "lora_unet_" + module.replace(".", "_")
        kohya[f"{name}.lora_{'down' if kind.startswith('A') else 'up'}.weight"] = value
        kohya[f"{name}.alpha"] = torch.tensor(float(min(value.shape)))
    path = tmp_path / "kohya.safetensors"
    save_file(kohya, str(path))
    spec, images = read_spec_file(examples / "tiny-sd.toml")
    spec = dataclasses.replace(spec, name="kohya-misfit", adapters=(AdapterSpec(str(path)),))
    doc = admin.deploy(spec, images)
    assert doc["status"] == "failed", doc
    assert doc["error_field"] == "adapters[0].path", doc
    assert "kohya.safetensors" in doc["error"]
