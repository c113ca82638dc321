"""The ``z-image`` family against the stock ZImageInpaintPipeline.

The other families' checks (``test_flux_kontext.py`` beside it): an exact cache (baked with
the edit's own mask, prompt and seed) reproduces the stock pipeline run with the same
composed noise, also at mask 1.0, with classifier-free guidance and without (``g = 0``);
plans mixing full and sparse blocks and the row loader change nothing; a request inside a
batch gives its solo result; a worker's pipeline without the transformer encodes and
decodes the same; the analytic FLOPs equal what torch counts. Z-Image's own: the
retouch forward (the model's from its submodules) is the model's own; an image whose
tokens are no multiple of 32 (the model pads them) and a strength below 1 are exact too;
a negative prompt reaches the model; an edit whose prompt differs in length from its
bake's turns the cached keys to its own positions; a Z-Image folder is told apart from
the other families, a missing file is named, and a single file of its transformer loads
(another model's is refused); a LoRA of its transformer serves what
diffusers' ``load_lora_weights`` gives.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.errors import InvalidSpec
from retouch.functions.modelcheck import check_model, model_family
from retouch.functions.modelsource import ModelSource
from retouch.runtime.maskaware import zimage_blocks
from retouch.runtime.maskaware.context import ForwardContext, Mode, Slot
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.quality import psnr
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.maskaware.templatelayout import recorded_tensors
from retouch.runtime.models import load_pipeline
from tests.runtime.families.cases import CPU, Case
from tests.runtime.families.cases import close as _close

FAMILY = "z-image"
CASE = Case(FAMILY, guidance=3.0)
SIZE, STEPS = CASE.size, CASE.steps
_rect, _request, _exact = CASE.rect, CASE.request, CASE.exact
TOKENS = (SIZE // 8) ** 2  # 128 px, factor-4 VAE, 2x2 patches: 16 x 16 tokens
BOUND = 1e-5  # the acceptance bound, fp32 pixels


@pytest.fixture(scope="module")
def folder(models_dir: Path) -> Path:
    return ensure_demo_model("retouch:tiny-z-image", models_dir)


@pytest.fixture(scope="module")
def pipe(folder: Path):
    return load_pipeline(folder, FAMILY, CPU)


@pytest.fixture(scope="module")
def baked(pipe) -> MemoryActivations:
    return CASE.baked(MaskAwareEditor(pipe, FAMILY, CPU))


def test_the_retouch_forward_is_the_models_own(pipe) -> None:
    """Rows with captions of different lengths (a key mask) and an image of 240 tokens
    (padded to 256): the forward retouch runs is ``ZImageTransformer2DModel.forward``."""
    model = pipe.transformer
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(3, 16, 30, 32, generator=generator)
    captions = [torch.randn(n, 32, generator=generator) for n in (20, 40, 5)]
    timestep = torch.tensor([0.3, 0.3, 0.7])
    stock = model([x[:, None] for x in latents], timestep, captions, return_dict=False)[0]
    padded = torch.zeros(3, 40, 32)
    for row, caption in enumerate(captions):
        padded[row, : len(caption)] = caption
    batch = zimage_blocks.ZImageBatch(latents, timestep, padded, (20, 40, 5), (0, 0, 0))
    ctx = ForwardContext([Slot(0)], 1, {})
    ours = zimage_blocks.forward(model, ctx, zimage_blocks.block_names(model), batch)
    assert (ours - torch.stack([x[:, 0] for x in stock])).abs().max() <= 1e-6


@pytest.mark.parametrize("guidance", [3.0, 0.0], ids=["cfg", "no-cfg"])
@pytest.mark.parametrize(
    "mask",
    [_rect(12, 20, 40, 50), _rect(70, 8, 30, 100), np.ones((SIZE, SIZE), bool)],
    ids=["door", "band", "everything"],
)
def test_exact_cache_reproduces_the_stock_pipeline(pipe, mask: np.ndarray, guidance) -> None:
    case = dataclasses.replace(CASE, guidance=guidance)
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request, store = case.exact(editor, mask)
    ours, stock = editor.edit(request, store, "np"), editor.stock_edit(request, "np")
    _close(ours, stock)
    assert np.abs(ours - stock).max() <= BOUND


def test_padded_tokens_and_a_strength_below_one_are_exact(pipe) -> None:
    """120 x 128 px is 15 x 16 = 240 tokens, padded to 256 with the model's pad token
    (rows from the bake like the unmasked tokens'); strength 0.6 starts from the template
    noised part-way down. Both equal the stock pipeline with an exact cache."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    image = template_image((128, 120), 7)
    mask = np.zeros((120, 128), bool)
    mask[20:70, 30:90] = True
    for strength in (1.0, 0.6):
        request = EditRequest(image, mask, "a red door", 11, 3, 3.0, "a red door", 11)
        request = dataclasses.replace(request, strength=strength)
        store = MemoryActivations()
        editor.bake(image, "a red door", 11, 3, 3.0, store, mask=mask, strength=strength)
        state = editor.prepare(request, store)
        (tokens,) = state.tokens.values()
        assert tokens.n_tokens == 256 and int(tokens.masked.max()) < 240
        assert set(range(240, 256)) <= set(tokens.unmasked.tolist())
        ours, stock = editor.edit(request, store, "np"), editor.stock_edit(request, "np")
        assert np.abs(ours - stock).max() <= BOUND


def test_a_negative_prompt_reaches_the_model(pipe, baked) -> None:
    """Every token computed (mask 1.0): the edit with a negative prompt is the stock
    pipeline's with it, and not the edit without one."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request = _request(np.ones((SIZE, SIZE), bool), "a red door", 5, ("a quiet street", 3))
    negative = dataclasses.replace(request, negative_prompt="blurry, dark")
    ours = editor.edit(negative, baked, "np")
    assert np.abs(ours - editor.stock_edit(negative, "np")).max() <= BOUND
    assert np.abs(ours - editor.edit(request, baked, "np")).max() > 1e-3


def test_the_cached_keys_turn_to_the_edits_caption_length(pipe, baked) -> None:
    """The bake's prompt is 33 tokens (padded to 64), the edit's 29 (32): the edit's image
    tokens sit 32 positions earlier on RoPE's first axis, and the cached keys are turned
    there with them (the negative prompts, both empty, need nothing). Without the turn the
    unmasked region drifts further from the stock edit's."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request = _request(_rect(12, 20, 40, 50), "a red door", 5, ("a quiet street", 3))
    state = editor.prepare(request, baked)
    assert state.inputs.shifts == (-32, 0)
    stock = editor.stock_edit(request, "np")
    turned = psnr(editor.edit(request, baked, "np"), stock)

    def unturned(request: EditRequest, tensors: dict, *, every: bool):
        state = assemble(request, tensors, every=every)
        state.inputs.shifts = (0, 0)
        return state

    assemble = editor.impl.assemble
    editor.impl.assemble = unturned
    try:
        left = psnr(editor.edit(request, baked, "np"), stock)
    finally:
        editor.impl.assemble = assemble
    assert turned > left


def test_mixed_plans_and_the_row_loader_change_nothing(pipe) -> None:
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request, store = _exact(editor, _rect(12, 20, 40, 50))
    blocks = editor.blocks
    assert blocks[:2] == ["noise_refiner.0", "noise_refiner.1"]
    plans = [
        {b: Mode.FULL if b == blocks[-1] else Mode.SPARSE for b in blocks},
        {b: Mode.SPARSE if b == blocks[-1] else Mode.FULL for b in blocks},
        {b: Mode.FULL if b == "layers.0" else Mode.SPARSE for b in blocks},
    ]
    CASE.assert_plans_and_the_loader_change_nothing(editor, request, store, plans)


def test_a_request_in_a_batch_gives_its_solo_result(pipe, baked) -> None:
    CASE.assert_batch_gives_solo(MaskAwareEditor(pipe, FAMILY, CPU), baked)


def test_a_worker_pipeline_without_the_transformer_encodes_and_decodes_the_same(
    pipe, folder: Path
) -> None:
    latents = torch.randn(1, 16, SIZE // 4, SIZE // 4)
    names = CASE.assert_worker_encodes_and_decodes_alike(pipe, folder, latents)
    assert {"caption", "negative_caption", "bake_lengths", "image_latents"} <= names


def test_the_template_layout_is_what_a_bake_stores(pipe, baked) -> None:
    """Two rows (prompt, negative) of every image token's K, V and Y per block and step."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    layout = {
        (step, block, name): shape
        for step, block, name, _, shape in recorded_tensors(editor, SIZE, SIZE, STEPS)
    }
    for block in editor.blocks:
        for name in ("k", "v", "y"):
            assert layout[0, block, name] == tuple(baked.get(0, block, name).shape)
    assert layout[0, "layers.0", "k"][:2] == (2, TOKENS)


def test_analytic_flops_equal_the_counted_step(pipe, baked) -> None:
    """Prompt and negative prompt both padded to 64 caption tokens (the tiny model's
    bound, what the formula counts)."""
    mask = _rect(16, 32, 64, 32)  # aligned to the 2x2 patches: ratio 0.125
    requests = [
        dataclasses.replace(
            _request(mask, "a quiet street", 2 + i, ("a quiet street", 3)),
            negative_prompt="blurry and dark",
        )
        for i in range(2)
    ]
    assert 0.05 < CASE.counted_flops_ratio(pipe, requests, baked) < 0.5


def test_a_z_image_folder_is_told_apart_and_its_files_are_checked(
    folder: Path, tmp_path: Path
) -> None:
    """A folder saved from ZImageInpaintPipeline is a z-image model; deploying it as
    another family is refused before anything loads, and so is a copy missing its
    transformer's weights or its tokenizer's (the file named)."""
    assert model_family(str(folder)) == FAMILY
    check_model(ModelSource(str(folder)), FAMILY)
    with pytest.raises(InvalidSpec, match="cannot serve flux-inpaint"):
        check_model(ModelSource(str(folder)), "flux-inpaint")
    broken = shutil.copytree(folder, tmp_path / "broken")
    (broken / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(InvalidSpec, match="transformer") as missing:
        check_model(ModelSource(str(broken)), FAMILY)
    assert missing.value.status == 422
    (broken / "transformer" / "diffusion_pytorch_model.safetensors").touch()
    (broken / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(InvalidSpec, match=r"tokenizer/vocab\.json"):
        check_model(ModelSource(str(broken)), FAMILY)


def _original_layout(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The transformer's weights as Z-Image's authors ship them (the inverse of diffusers'
    ``convert_z_image_transformer_checkpoint_to_diffusers``: fused QKV, their names)."""
    state = {k: v.contiguous() for k, v in transformer.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for key in [k for k in state if ".attention.to_q." in k]:
        fused = [state.pop(key.replace("to_q", part)) for part in ("to_q", "to_k", "to_v")]
        out[key.replace("to_q", "qkv")] = torch.cat(fused)
    renames = (
        ("all_final_layer.2-1.", "final_layer."),
        ("all_x_embedder.2-1.", "x_embedder."),
        (".attention.to_out.0.", ".attention.out."),
        (".attention.norm_k.", ".attention.k_norm."),
        (".attention.norm_q.", ".attention.q_norm."),
    )
    for key, value in state.items():
        for old, new in renames:
            key = key.replace(old, new)
        out[key] = value
    return out


def test_a_single_file_transformer_loads_and_a_foreign_one_is_named(
    pipe, folder: Path, tmp_path: Path
) -> None:
    """Z-Image's transformer alone in its original layout, with the folder as ``config``:
    the check reads its 2x2-patch input as the config's 16 channels and the loader gives
    the folder's weights; a file of another model (Flux's layout) or of other input
    channels is refused naming the model field, before anything loads."""
    weights = _original_layout(pipe.transformer)
    single = tmp_path / "z_image_turbo.safetensors"
    save_file(weights, str(single))
    check_model(ModelSource(str(single), config=str(folder)), FAMILY)
    loaded = load_pipeline(folder, FAMILY, CPU, checkpoint=single)
    ours = dict(loaded.transformer.state_dict())
    assert all(torch.equal(v, ours[k]) for k, v in pipe.transformer.state_dict().items())
    narrow = {**weights, "x_embedder.weight": torch.zeros(32, 60)}
    save_file(narrow, str(tmp_path / "narrow.safetensors"))
    with pytest.raises(InvalidSpec, match="15 input channels") as refused:
        check_model(ModelSource(str(tmp_path / "narrow.safetensors"), config=str(folder)), FAMILY)
    assert refused.value.field == "model"
    save_file({"img_in.weight": torch.zeros(32, 64)}, str(tmp_path / "flux.safetensors"))
    with pytest.raises(InvalidSpec, match=r"x_embedder\.weight"):
        check_model(ModelSource(str(tmp_path / "flux.safetensors"), config=str(folder)), FAMILY)


def test_a_lora_on_the_z_image_transformer_serves_what_diffusers_loads(
    folder: Path, models_dir: Path, tmp_path: Path
) -> None:
    """A LoRA of the transformer's attention (diffusers' layout), attached as an executor
    attaches adapters: the mask-aware edit after a bake under it is the stock pipeline's
    with ``load_lora_weights`` (exact cache), and the LoRA changes the image."""
    ours, stock, bare = CASE.lora_edit_and_stock(
        "retouch:tiny-z-image", folder, models_dir, tmp_path
    )
    assert np.abs(ours - stock).max() <= BOUND
    assert np.abs(ours - bare).max() > 0.05  # the LoRA reached the transformer
