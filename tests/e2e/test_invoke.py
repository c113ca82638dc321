"""Invocation semantics over HTTP: empty and full masks, formats, metrics and probes."""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.errors import RetouchError
from retouch.functions.imaging import encode_mask
from retouch.functions.wire.executor import template_variant
from retouch.functions.wire.invoke import InvokeResult
from retouch.platform.api.client import Client, read_spec_file
from retouch.platform.api.server import ServerProcess
from retouch.platform.lab.bench.load import wait_baked
from tests.e2e.conftest import ADMIN
from tests.modelfolders import build_sd_folder, into_hub_cache


def test_empty_mask_returns_template_and_full_mask_repaints(admin: Client, examples: Path) -> None:
    spec, images = read_spec_file(examples / "tiny-flux.toml")
    assert admin.deploy(spec, images)["status"] == "ready"
    template = np.asarray(Image.open(io.BytesIO(images["shirt"])).convert("RGB"))

    empty = admin.invoke("tiny-flux", "shirt", np.zeros((128, 128), bool), "anything", format="raw")
    assert empty.path == "template" and empty.mask_ratio == 0.0
    assert np.array_equal(np.frombuffer(empty.image, np.uint8).reshape(128, 128, 3), template)

    full = admin.invoke(
        "tiny-flux", "shirt", np.ones((128, 128), bool), "anything", steps=2, format="raw"
    )
    assert full.path in ("stock", "maskaware") and full.mask_ratio == 1.0
    assert not np.array_equal(np.frombuffer(full.image, np.uint8).reshape(128, 128, 3), template)


def test_same_seed_same_image(admin: Client, examples: Path) -> None:
    admin.deploy_file(examples / "tiny-sd.toml")
    mask = np.zeros((128, 128), bool)
    mask[20:70, 30:90] = True
    a = admin.invoke("tiny-sd", "poster", mask, "a cat", seed=7, steps=2, format="raw")
    b = admin.invoke("tiny-sd", "poster", mask, "a cat", seed=7, steps=2, format="raw")
    c = admin.invoke("tiny-sd", "poster", mask, "a cat", seed=8, steps=2, format="raw")
    assert a.image == b.image
    assert a.image != c.image


def test_num_images_per_prompt_gives_image_i_the_seed_plus_i(
    server: ServerProcess, admin: Client, examples: Path
) -> None:
    """N images of one request in one answer (JSON, as a curl user sends it), image i the
    same as a request for seed + i alone (up to batched-vs-solo rounding); a job refuses N."""
    admin.deploy_file(examples / "tiny-sd.toml")
    mask = np.zeros((128, 128), bool)
    mask[20:70, 30:90] = True
    body = {"template": "poster", "prompt": "a cat", "seed": 2**63 - 2, "steps": 2}
    body |= {"mask": base64.b64encode(encode_mask(mask)).decode(), "format": "raw"}
    headers = {"authorization": f"Bearer {ADMIN}"}
    url = f"{server.url}/v1/functions/tiny-sd/invoke"
    answer = httpx.post(
        url, json={**body, "num_images_per_prompt": 3}, headers=headers, timeout=300
    )
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert [r["seed"] for r in results] == [2**63 - 2, 2**63 - 1, 0]  # wraps at 2^63
    images = [np.frombuffer(base64.b64decode(r["image"]), np.uint8) for r in results]
    assert len({i.tobytes() for i in images}) == 3
    for seed, image in zip((2**63 - 2, 2**63 - 1, 0), images, strict=True):
        alone = admin.invoke("tiny-sd", "poster", mask, "a cat", seed=seed, steps=2, format="raw")
        diff = np.abs(np.frombuffer(alone.image, np.uint8).astype(int) - image.astype(int))
        assert diff.max() <= 3, (seed, diff.max())
    listed = admin.invoke_images("tiny-sd", "poster", mask, "a cat", 9, 2, steps=2)
    assert [r.seed for r in listed] == [9, 10]

    for n, code in ((0, "invalid_field"), (11, "invalid_field"), ("2", "invalid_field")):
        bad = httpx.post(url, json={**body, "num_images_per_prompt": n}, headers=headers)
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["field"] == "num_images_per_prompt"
        assert bad.json()["error"]["code"] == code
    jobs = url.removesuffix("/invoke") + "/jobs"
    bad = httpx.post(jobs, json={**body, "num_images_per_prompt": 2}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "unsupported_field"
    bad = httpx.post(
        f"{server.url}/v1/predictions",
        json={"version": "tiny-sd", "input": {**body, "num_images_per_prompt": 2}},
        headers=headers,
    )
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["field"] == "input.num_images_per_prompt"


def test_metrics_and_probes(server: ServerProcess, admin: Client, examples: Path) -> None:
    admin.deploy_file(examples / "tiny-flux.toml")
    admin.invoke("tiny-flux", "mug", np.ones((128, 128), bool), "x", steps=1)
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{server.url}/readyz")
    assert ready.status_code == 200 and ready.json()["executors"] >= 1
    text = httpx.get(server.metrics_url).text
    assert 'retouch_invocations_total{function="tiny-flux",path=' in text
    for name in (
        "retouch_invocation_seconds_bucket",
        "retouch_gateway_overhead_seconds_count",
        "retouch_executors_healthy 1.0",
    ):
        assert name in text
    assert httpx.get(f"{server.url}/metrics").status_code == 404  # not on the API port
    doc = admin.executors()
    executors = doc["executors"]
    assert executors[0]["healthy"] and "tiny-flux" in executors[0]["functions"]
    # the web page's dashboard reads the latency from the API, not the metrics listener
    latency = doc["latency"]
    assert latency["invocations"] >= 1 and 0 < latency["p50_s"] <= latency["p95_s"]


def test_warmup_steps_reach_the_executor(admin: Client, examples: Path) -> None:
    """``full_steps`` in a spec survives the registry and changes mask-aware edits: with
    every step warm the edit is the stock pipeline's, not the template-cached one."""
    spec, images = read_spec_file(examples / "tiny-sd.toml")
    cached = dataclasses.replace(spec, name="sd-cached", steps=3)
    warm = dataclasses.replace(spec, name="sd-warm", steps=3, full_steps=3)
    for fn in (cached, warm):
        admin.deploy(fn, images)
    assert admin.get("sd-warm")["full_steps"] == 3 and admin.get("sd-cached")["full_steps"] == 0
    for name in ("sd-cached", "sd-warm"):
        wait_baked(admin, name, timeout=300)
    mask = np.zeros((128, 128), bool)
    mask[30:80, 20:70] = True
    a, b = (admin.invoke(n, "street", mask, "a cat", seed=3) for n in ("sd-cached", "sd-warm"))
    assert a.path == b.path == "maskaware"
    assert a.image != b.image


def test_composite_keeps_the_template_outside_the_mask(admin: Client, examples: Path) -> None:
    """With ``composite``, unmasked pixels beyond the feather are the template's own and
    masked pixels are the model's (the same as without composite, same seed)."""
    spec, images = read_spec_file(examples / "tiny-sd.toml")
    plain = dataclasses.replace(spec, name="sd-plain", steps=2)
    pasted = dataclasses.replace(spec, name="sd-pasted", steps=2, composite=True, feather_px=3)
    for fn in (plain, pasted):
        admin.deploy(fn, images)
    assert admin.get("sd-pasted")["composite"] is True
    for name in ("sd-plain", "sd-pasted"):  # both mask-aware: the same edit
        wait_baked(admin, name, timeout=300)
    template = np.asarray(Image.open(io.BytesIO(images["poster"])).convert("RGB"))
    mask = np.zeros((128, 128), bool)
    mask[40:90, 20:60] = True
    a, b = (
        admin.invoke(n, "poster", mask, "a cat", seed=5, format="raw")
        for n in ("sd-plain", "sd-pasted")
    )
    assert a.path == b.path == "maskaware"
    generated = np.frombuffer(a.image, np.uint8).reshape(128, 128, 3)
    edited = np.frombuffer(b.image, np.uint8).reshape(128, 128, 3)
    far = np.ones((128, 128), bool)
    far[40 - 4 : 90 + 4, 20 - 4 : 60 + 4] = False
    assert np.array_equal(edited[far], template[far])
    assert not np.array_equal(generated[far], template[far])  # the VAE round trip moved them
    assert np.array_equal(edited[mask], generated[mask])


@pytest.mark.slow  # its model is new to the session: the executor profiles it at deploy
def test_a_hub_model_deploys_by_id_from_the_cache_in_bf16(
    admin: Client, examples: Path, models_dir: Path, tmp_path: Path
) -> None:
    """A hub-layout folder (fp16 variant, sharded UNet, CLIP BPE tokenizer) in the local
    Hugging Face cache (``HF_HUB_CACHE``, set for the server by ``tests/conftest.py``)
    deploys by its hub id and serves bf16 edits on a CPU; a copy missing a file is refused
    at deploy with a 4xx naming the file."""
    folder = build_sd_folder(tmp_path / "sd", models_dir)
    into_hub_cache(folder, Path(os.environ["HF_HUB_CACHE"]), "retouch-tests/e2e-sd")
    spec, images = read_spec_file(examples / "tiny-sd.toml")
    hub = dataclasses.replace(
        spec, name="sd-hub", model="retouch-tests/e2e-sd", variant="fp16", dtype="bf16", steps=2
    )
    assert admin.deploy(hub, images)["status"] == "ready"
    listed = {f["name"]: f for f in admin.list()}["sd-hub"]
    assert (listed["model"], listed["dtype"], listed["variant"]) == (hub.model, "bf16", "fp16")
    mask = np.zeros((128, 128), bool)
    mask[20:70, 30:90] = True
    edit = admin.invoke("sd-hub", "street", mask, "a red door", seed=4, format="raw")
    template = np.asarray(Image.open(io.BytesIO(images["street"])).convert("RGB"))
    assert not np.array_equal(np.frombuffer(edit.image, np.uint8).reshape(128, 128, 3), template)

    broken = Path(shutil.copytree(folder, tmp_path / "broken"))
    (broken / "tokenizer" / "merges.txt").unlink()
    with pytest.raises(RetouchError) as refused:
        admin.deploy(dataclasses.replace(hub, name="sd-broken", model=str(broken)), images)
    assert refused.value.status == 422 and refused.value.field == "model"
    assert "tokenizer/merges.txt" in refused.value.message
    assert "sd-broken" not in {f["name"] for f in admin.list()}


def test_deploy_and_invoke_a_flux_fill_function(admin: Client, examples: Path) -> None:
    """FLUX.1-Fill end to end: a spec naming retouch:tiny-flux-fill deploys, its first edit
    runs before or after the bake, and once baked the edit is mask-aware."""
    spec, images = read_spec_file(examples / "tiny-flux.toml")
    fill = dataclasses.replace(
        spec, name="fill", model="retouch:tiny-flux-fill", family="flux-fill", steps=2
    )
    assert admin.deploy(fill, images)["status"] == "ready"
    assert admin.get("fill")["family"] == "flux-fill"
    template = np.asarray(Image.open(io.BytesIO(images["mug"])).convert("RGB"))
    mask = np.zeros((128, 128), bool)
    mask[32:80, 40:96] = True

    first = admin.invoke("fill", "mug", mask, "a red mug", seed=4, format="raw")
    assert first.path in ("stock", "maskaware") and first.mask_ratio > 0
    wait_baked(admin, "fill", timeout=300)  # templates are baked in the background
    edit = admin.invoke("fill", "mug", mask, "a red mug", seed=4, format="raw")
    assert edit.path == "maskaware" and (edit.width, edit.height) == (128, 128)
    assert not np.array_equal(np.frombuffer(edit.image, np.uint8).reshape(128, 128, 3), template)


def _serve_folder_edits(
    server: ServerProcess,
    admin: Client,
    examples: Path,
    models_dir: Path,
    model: str,
    name: str,
    *,
    refuses_negative: bool = True,
) -> tuple[InvokeResult, str, dict[str, str], dict, dict[str, bytes]]:
    """Deploy built-in ``model``'s diffusers folder as function ``name`` (its example spec,
    2 steps) and check it as a user sees it: the family is the folder's, the first edit of
    the mug runs before or after the bake, and once baked its edits are mask-aware and
    repaint, sent as msgpack (the client) and as JSON (base64, as curl sends it) alike, one
    request one image; ``refuses_negative``: a negative prompt is a 400 naming the field (a
    guidance-distilled family). Returns the baked edit, the JSON route, its headers and
    body, and the spec's images."""
    folder = ensure_demo_model(f"retouch:{model}", models_dir)
    spec, images = read_spec_file(examples / f"{model}.toml")
    spec = dataclasses.replace(spec, name=name, model=str(folder), steps=2)
    assert admin.deploy(spec, images)["status"] == "ready"
    assert admin.get(name)["family"] == spec.family
    template = np.asarray(Image.open(io.BytesIO(images["mug"])).convert("RGB"))
    mask = np.zeros((128, 128), bool)
    mask[32:80, 40:96] = True

    first = admin.invoke(name, "mug", mask, "a red mug", seed=4, format="raw")
    assert first.path in ("stock", "maskaware") and first.mask_ratio > 0
    wait_baked(admin, name, timeout=300)  # templates are baked in the background
    edit = admin.invoke(name, "mug", mask, "a red mug", seed=4, format="raw")
    assert edit.path == "maskaware" and (edit.width, edit.height) == (128, 128)
    assert not np.array_equal(np.frombuffer(edit.image, np.uint8).reshape(128, 128, 3), template)

    url, headers = f"{server.url}/v1/functions/{name}/invoke", {"authorization": f"Bearer {ADMIN}"}
    body = {"template": "mug", "prompt": "a red mug", "seed": 4, "format": "raw"}
    body["mask"] = base64.b64encode(encode_mask(mask)).decode()
    answer = httpx.post(url, json=body, headers=headers, timeout=300)
    assert answer.status_code == 200, answer.text
    assert answer.json()["path"] == "maskaware"
    assert base64.b64decode(answer.json()["image"]) == edit.image  # one request, one image
    if refuses_negative:
        refused = httpx.post(url, json={**body, "negative_prompt": "blurry"}, headers=headers)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["field"] == "negative_prompt"
    return edit, url, headers, body, images


def test_deploy_and_invoke_a_flux_kontext_folder(
    server: ServerProcess, admin: Client, examples: Path, models_dir: Path
) -> None:
    """FLUX.1 Kontext from a diffusers folder (as FluxKontextInpaintPipeline saves it): it
    deploys as flux-kontext, its first edit runs before or after the bake, and once baked
    its edits are mask-aware, sent as msgpack (the client) and as JSON (base64, as curl
    sends it) alike; a negative prompt, for which the guidance-distilled model has no
    branch, is a 400 naming the field. An edit with its own ``image_reference`` computes
    every token; one that is not an image is a 400 naming the field."""
    edit, url, headers, body, images = _serve_folder_edits(
        server, admin, examples, models_dir, "tiny-flux-kontext", "kontext"
    )

    # another reference image (any size: read at the template's): every token computed
    shirt = base64.b64encode(images["shirt"]).decode()
    answer = httpx.post(url, json={**body, "image_reference": shirt}, headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["path"] == "stock" and "reference" in answer.json()["path_reason"]
    assert base64.b64decode(answer.json()["image"]) != edit.image
    not_an_image = base64.b64encode(b"not an image").decode()
    refused = httpx.post(url, json={**body, "image_reference": not_an_image}, headers=headers)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["field"] == "image_reference"


def test_deploy_and_invoke_a_flux2_klein_folder(
    server: ServerProcess, admin: Client, examples: Path, models_dir: Path
) -> None:
    """FLUX.2 [klein] from a diffusers folder (as Flux2KleinInpaintPipeline saves it): it
    deploys as flux2-klein, and once baked its edits are mask-aware over msgpack and JSON
    alike (``_serve_folder_edits``); the distilled model's missing negative branch and the
    reference image this family does not read are 400s naming the field."""
    _, url, headers, body, images = _serve_folder_edits(
        server, admin, examples, models_dir, "tiny-flux2-klein", "klein"
    )
    _refuses_a_reference(url, headers, body, images)


def test_deploy_and_invoke_a_qwen_image_folder(
    server: ServerProcess, admin: Client, examples: Path, models_dir: Path, tmp_path: Path
) -> None:
    """Qwen-Image (an MMDiT with true classifier-free guidance) from a diffusers folder:
    once baked its edits are mask-aware over msgpack and JSON alike; a negative prompt and
    a guidance of the request's own reach the image; a reference image, which the pipeline
    does not read, is a 400 naming the field. A Qwen-Image folder without its VAE weights
    is a 422 naming the file, before anything loads."""
    edit, url, headers, body, images = _serve_folder_edits(
        server, admin, examples, models_dir, "tiny-qwen-image", "qwen", refuses_negative=False
    )
    for change in ({"negative_prompt": "blurry"}, {"guidance_scale": 1.0}):
        answer = httpx.post(url, json={**body, **change}, headers=headers, timeout=300)
        assert answer.status_code == 200, answer.text
        assert base64.b64decode(answer.json()["image"]) != edit.image, change
    _refuses_a_reference(url, headers, body, images)

    spec, _ = read_spec_file(examples / "tiny-qwen-image.toml")
    folder = ensure_demo_model("retouch:tiny-qwen-image", models_dir)
    broken = Path(shutil.copytree(folder, tmp_path / "broken"))
    (broken / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(RetouchError) as bad:
        admin.deploy(dataclasses.replace(spec, name="qwen-broken", model=str(broken)), images)
    assert bad.value.status == 422 and bad.value.field == "model"
    assert "vae/diffusion_pytorch_model.safetensors" in bad.value.message


def test_deploy_and_invoke_a_qwen_image_edit_folder(
    server: ServerProcess, admin: Client, examples: Path, models_dir: Path
) -> None:
    """Qwen-Image-Edit from a diffusers folder (its processor folder as published): once
    baked its edits are mask-aware over msgpack and JSON alike, at the template's size; a
    negative prompt reaches the image; a reference image (the pipeline reads the template
    itself) is a 400 naming the field."""
    edit, url, headers, body, images = _serve_folder_edits(
        server, admin, examples, models_dir, "tiny-qwen-image-edit", "qwen-edit",
        refuses_negative=False,
    )  # fmt: skip
    answer = httpx.post(url, json={**body, "negative_prompt": "blurry"}, headers=headers,
                        timeout=300)  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert base64.b64decode(answer.json()["image"]) != edit.image
    _refuses_a_reference(url, headers, body, images)


def _refuses_a_reference(url: str, headers: dict, body: dict, images: dict[str, bytes]) -> None:
    """A family that reads no reference image refuses one: a 400 naming the field."""
    shirt = base64.b64encode(images["shirt"]).decode()
    refused = httpx.post(url, json={**body, "image_reference": shirt}, headers=headers)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["field"] == "image_reference"
    assert refused.json()["error"]["code"] == "unsupported_field"


def test_deploy_and_invoke_a_z_image_folder(
    server: ServerProcess, admin: Client, examples: Path, models_dir: Path
) -> None:
    """Z-Image from a diffusers folder (as ZImageInpaintPipeline saves it: a Qwen3 text
    encoder, a Qwen tokenizer with its chat template): it deploys as z-image, its first
    edit runs before or after the bake, and once baked its edits are mask-aware, with a
    negative prompt too, sent as msgpack (the client) and as JSON (base64, as curl sends
    it) alike; guidance 0 (Z-Image-Turbo's: no guidance) serves another image. The
    pipeline's ``cfg_normalization``, which retouch does not serve, and an
    ``image_reference``, which Z-Image does not read, are 400s naming the field."""
    folder = ensure_demo_model("retouch:tiny-z-image", models_dir)
    spec, images = read_spec_file(examples / "tiny-z-image.toml")
    spec = dataclasses.replace(spec, name="zimage", model=str(folder), steps=2)
    assert admin.deploy(spec, images)["status"] == "ready"
    assert admin.get("zimage")["family"] == "z-image"
    template = np.asarray(Image.open(io.BytesIO(images["mug"])).convert("RGB"))
    mask = np.zeros((128, 128), bool)
    mask[32:80, 40:96] = True

    first = admin.invoke("zimage", "mug", mask, "a red mug", seed=4, format="raw")
    assert first.path in ("stock", "maskaware") and first.mask_ratio > 0
    wait_baked(admin, "zimage", timeout=300)  # templates are baked in the background
    edit = admin.invoke(
        "zimage", "mug", mask, "a red mug", seed=4, negative_prompt="blurry", format="raw"
    )
    assert edit.path == "maskaware" and (edit.width, edit.height) == (128, 128)
    assert not np.array_equal(np.frombuffer(edit.image, np.uint8).reshape(128, 128, 3), template)

    url, headers = f"{server.url}/v1/functions/zimage/invoke", {"authorization": f"Bearer {ADMIN}"}
    body = {"template": "mug", "prompt": "a red mug", "seed": 4, "format": "raw"}
    body["mask"] = base64.b64encode(encode_mask(mask)).decode()
    body["negative_prompt"] = "blurry"
    answer = httpx.post(url, json=body, headers=headers, timeout=300)
    assert answer.status_code == 200, answer.text
    assert answer.json()["path"] == "maskaware"
    assert base64.b64decode(answer.json()["image"]) == edit.image  # one request, one image
    turbo = httpx.post(url, json={**body, "guidance_scale": 0}, headers=headers, timeout=300)
    assert turbo.status_code == 200, turbo.text
    assert base64.b64decode(turbo.json()["image"]) != edit.image
    for field, value in (("cfg_normalization", True), ("image_reference", body["mask"])):
        refused = httpx.post(url, json={**body, field: value}, headers=headers)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["field"] == field


@pytest.mark.parametrize(
    ("example", "template", "family"),
    [("tiny-sd3", "mug", "sd3-inpaint"), ("tiny-sdxl", "street", "sdxl-inpaint")],
)
def test_deploy_and_invoke_a_function_of_each_newer_family(
    admin: Client, examples: Path, example: str, template: str, family: str
) -> None:
    """SD3 (MMDiT, three text encoders) and SDXL (two text encoders, pooled embeddings and
    time ids) functions: served stock before their bake, mask-aware after it, over HTTP."""
    spec, images = read_spec_file(examples / f"{example}.toml")
    assert spec.family == family
    spec = dataclasses.replace(spec, steps=2)  # the suite's time
    assert admin.deploy(spec, images)["status"] == "ready"
    pixels = np.asarray(Image.open(io.BytesIO(images[template])).convert("RGB"))
    mask = np.zeros((128, 128), bool)
    mask[32:80, 40:96] = True

    first = admin.invoke(example, template, mask, "a red car", seed=4, format="raw")
    assert first.path in ("stock", "maskaware") and first.mask_ratio > 0
    assert not np.array_equal(np.frombuffer(first.image, np.uint8).reshape(128, 128, 3), pixels)

    wait_baked(admin, example, timeout=300)  # templates are baked in the background
    edit = admin.invoke(example, template, mask, "a red car", seed=4, format="raw")
    assert edit.path == "maskaware"
    assert (edit.width, edit.height) == (128, 128)
    assert not np.array_equal(np.frombuffer(edit.image, np.uint8).reshape(128, 128, 3), pixels)
    other = admin.invoke(example, template, mask, "a blue door", seed=4, format="raw")
    assert other.path == "maskaware" and other.image != edit.image  # the prompt reaches it


def _variant_baked(admin: Client, function: str, variant: str, timeout: float = 300) -> None:
    """Until an executor reports the strength variant ``variant`` of a template baked."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for executor in admin.executors()["executors"]:
            states = executor["state"]["templates"].get(function, {})
            if states.get(variant, {}).get("state") == "baked":
                return
        time.sleep(0.3)
    raise AssertionError(f"{variant} of {function} not baked after {timeout:.0f} s")


@pytest.fixture(scope="module")
def sd_strength(server: ServerProcess, tokens: dict[str, str], examples: Path) -> str:
    """tiny-sd at 5 steps whose requests may also choose DPM++ (its own: DDIM), the
    templates' own bakes done."""
    spec, images = read_spec_file(examples / "tiny-sd.toml")
    spec = dataclasses.replace(spec, name="sd-strength", steps=5, schedulers=("dpm++",))
    with Client(server.url, tokens["RETOUCH_ADMIN_TOKEN"]) as admin:
        admin.deploy(spec, images)
        wait_baked(admin, spec.name, timeout=300)  # strength 1's, with DDIM
    return spec.name


def _poster_mask() -> np.ndarray:
    mask = np.zeros((128, 128), bool)
    mask[30:80, 20:70] = True
    return mask


def _edit_poster(admin: Client, function: str, **options: object) -> InvokeResult:
    return admin.invoke(function, "poster", _poster_mask(), "a cat", seed=3, **options)


def test_strength_runs_its_steps_and_is_maskaware_from_its_second_edit(
    admin: Client, examples: Path, sd_strength: str
) -> None:
    """strength 0.6 of 5 steps runs 3: the first edit of a template at that strength runs
    the stock path and bakes that trajectory in the background, the second is mask-aware
    (strength 1's bake does not serve it); a negative prompt changes the edit, and a
    guidance-distilled family refuses one."""

    def edit(**options: object) -> InvokeResult:
        return _edit_poster(admin, sd_strength, **options)

    first = edit(strength=0.6)
    assert (first.path, first.engine.steps, first.template) == ("stock", 3, "poster")
    _variant_baked(admin, sd_strength, template_variant("poster", 2))
    second = edit(strength=0.6)
    assert (second.path, second.engine.steps) == ("maskaware", 3)
    whole = edit()
    assert (whole.path, whole.engine.steps) == ("maskaware", 5) and whole.image != second.image
    negative = edit(strength=0.6, negative_prompt="blurry")
    assert negative.path == "maskaware" and negative.image != second.image

    admin.deploy_file(examples / "tiny-flux.toml")
    with pytest.raises(RetouchError) as refused:
        admin.invoke("tiny-flux", "mug", _poster_mask(), "x", negative_prompt="blurry")
    assert (refused.value.status, refused.value.field) == (400, "negative_prompt")


def test_a_chosen_scheduler_is_maskaware_from_its_second_edit(
    admin: Client, sd_strength: str
) -> None:
    """A scheduler the function allows besides its own is another trajectory: its first
    edit of a template runs stock and bakes that trajectory, the second is mask-aware (the
    DDIM bake does not serve it); naming the function's own is its own bake; one it does
    not allow is a 400 naming ``scheduler`` and the allowed ones."""
    assert admin.get(sd_strength)["schedulers"] == ["dpm++"]
    first = _edit_poster(admin, sd_strength, scheduler="dpm++")
    assert (first.path, first.engine.steps, first.template) == ("stock", 5, "poster")
    _variant_baked(admin, sd_strength, template_variant("poster", 0, "dpm++"))
    second = _edit_poster(admin, sd_strength, scheduler="dpm++")
    own = _edit_poster(admin, sd_strength)
    assert (second.path, own.path) == ("maskaware", "maskaware")
    assert own.image != second.image  # DPM++ ran, not DDIM
    named = _edit_poster(admin, sd_strength, scheduler="ddim")
    assert named.path == "maskaware" and named.image == own.image
    for refused in ("euler", "DPM++"):
        with pytest.raises(RetouchError) as err:
            _edit_poster(admin, sd_strength, scheduler=refused)
        assert (err.value.status, err.value.field) == (400, "scheduler")
        assert "ddim" in err.value.message and "dpm++" in err.value.message
