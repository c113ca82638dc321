"""The ``qwen-image-edit`` family against the stock QwenImageEditInpaintPipeline.

At the pipeline's own size (1024x1024 for a square template) the served edit is the
unmodified pipeline's, called as a user calls it; at the test size (128 px) the stock
reference is the pipeline with its size rule answering the template's size
(``edit_size``). Against it: an exact cache (baked with the edit's own mask, prompt and
seed) reproduces the stock edit, at a small mask and at mask 1.0; an edit without a cache
is the stock edit with the composed noise. The family's own: the reference tokens follow the
edited ones and come from the bake; the text is Qwen2.5-VL's reading of the template; the
analytic FLOPs equal what torch counts; a Qwen-Image-Edit folder is told apart and a missing
file (the processor's too) is named.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_inpaint as edit_pipeline

from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.errors import InvalidSpec
from retouch.functions.modelcheck import check_model, model_family
from retouch.functions.modelsource import ModelSource
from retouch.functions.qwenvl import image_tokens
from retouch.runtime.families.qwen_image_edit import edit_size
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.templatelayout import recorded_tensors
from tests.runtime.families.cases import CPU, Case
from tests.runtime.families.cases import close as _close

FAMILY = "qwen-image-edit"
CASE = Case(FAMILY, guidance=4.0)
SIZE, STEPS = CASE.size, CASE.steps
_rect, _request = CASE.rect, CASE.request
TOKENS = (SIZE // 16) ** 2  # 128 px, factor-8 VAE, 2x2 packing: 8 x 8 edited tokens

folder, pipe, baked = CASE.fixtures("retouch:tiny-qwen-image-edit")


@pytest.mark.parametrize(
    "mask", [_rect(12, 20, 40, 50), np.ones((SIZE, SIZE), bool)], ids=["door", "everything"]
)
def test_exact_cache_reproduces_the_stock_pipeline(pipe, mask: np.ndarray) -> None:
    """With true CFG (the bake's negative prompt ""): max |d| <= 1e-5 in pixels, fp32."""
    CASE.assert_exact_cache_gives_the_stock_edit(pipe, mask)


def test_at_the_pipelines_own_size_the_edit_is_the_unmodified_pipelines(pipe) -> None:
    """A 1024x1024 template is what the pipeline edits at for a square: nothing of it is
    replaced, and it is called as a user calls it (a generator on the seed; the
    ``masked_image_latents`` it never reads given, sparing a VAE encode). The served edit
    without a cache (every token computed: the engine's stock path) ends on its latents
    (the decode is compared at 128 px, above)."""
    size = 1024
    assert edit_pipeline.calculate_dimensions(1024 * 1024, 1.0)[:2] == (size, size)
    image, mask = template_image((size, size), 7), np.ones((size, size), bool)
    request = EditRequest(image, mask, "a red door", 11, STEPS, 4.0, "a red door", 11)
    stock = pipe(
        prompt="a red door",
        negative_prompt="",
        image=image,
        mask_image=request.mask_image(),
        masked_image_latents=torch.zeros(1, 16, size // 8, size // 8),
        num_inference_steps=STEPS,
        true_cfg_scale=4.0,
        generator=torch.Generator().manual_seed(11),
        output_type="latent",
    ).images
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    state = editor.prepare(request, None)
    while not state.done:
        editor.step([state])
    assert state.latents.shape == stock.shape == (1, (size // 16) ** 2, 64)
    assert (state.latents - stock).abs().max() <= 1e-5


def test_the_stock_reference_edits_at_the_templates_size() -> None:
    """Away from the pipeline's size its size rule answers the template's, within the
    call only; at the pipeline's size nothing is replaced."""
    original = edit_pipeline.calculate_dimensions
    with edit_size(128, 96):
        assert edit_pipeline.calculate_dimensions(1024 * 1024, 128 / 96) == (128, 96, None)
    assert edit_pipeline.calculate_dimensions is original
    with edit_size(1184, 896):
        assert edit_pipeline.calculate_dimensions is original


def test_an_edit_without_a_cache_is_the_stock_pipelines_with_the_composed_noise(pipe) -> None:
    """Another seed than the template's: the template's noise outside the mask and the
    request's inside, as the stock reference is given it (the pipeline samples the
    template's VAE with the template's seed, first, then takes the composed noise)."""
    CASE.assert_uncached_edit_gives_the_stock_edit(pipe)


def test_the_reference_tokens_follow_the_edited_ones_and_come_from_the_bake(pipe, baked) -> None:
    """The grid holds the edited tokens then the reference's, none of those masked; the
    bake stores K/V/Y rows of both for both guidance rows, as the template layout says; the
    text is the prompt's with the template's vision tokens (Qwen2.5-VL reads the image)."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request = _request(_rect(32, 32, 48, 48), "a red door", 9, ("a quiet street", 3))
    state = editor.prepare(request, baked)
    (tokens,) = state.tokens.values()
    assert tokens.n_tokens == 2 * TOKENS
    assert tokens.count == 9 and int(tokens.masked.max()) < TOKENS  # 3 x 3 packed tokens
    first = editor.blocks[0]
    assert tuple(baked.get(0, first, "k").shape[:2]) == (2, 2 * TOKENS)
    layout = {
        (step, block, name): shape
        for step, block, name, _, shape in recorded_tensors(editor, SIZE, SIZE, STEPS)
    }
    for name in ("k", "v", "y"):
        assert layout[0, first, name] == tuple(baked.get(0, first, name).shape)
    template = pipe.prompt_template_encode.format("a red door")
    kept = len(pipe.tokenizer(template).input_ids) - pipe.prompt_template_encode_start_idx
    vision = image_tokens(pipe.processor.image_processor, SIZE, SIZE)
    assert vision == 25  # 128 px -> 140 px (multiples of 28) -> 5 x 5 merged 2x2 patches
    assert state.inputs.prompt_embeds.shape[1] == kept - 1 + vision  # <|image_pad|> expanded


def test_a_worker_pipeline_without_the_transformer_encodes_and_decodes_the_same(
    pipe, folder: Path
) -> None:
    """A pre/post worker's pipeline (its processor read as the executor's is) encodes the
    prompts with the image, the template's latents and the noise as the whole one does."""
    names = CASE.assert_worker_encodes_and_decodes_alike(pipe, folder, torch.randn(1, TOKENS, 64))
    assert {"prompt_embeds", "prompt_mask", "image_latents"} <= names


def test_analytic_flops_equal_the_counted_step(pipe, baked) -> None:
    """One step of two requests counts the family's formula (a sequence of twice the edited
    tokens; the text at the padded length), mask-aware and with every block full: the
    reference's tokens are keys, never queries."""
    mask = _rect(16, 32, 64, 32)  # aligned to the 16 px tokens: ratio 0.125
    assert 0.05 < CASE.assert_counted_flops_at_the_padded_text(pipe, baked, mask) < 0.5


def test_a_qwen_image_edit_folder_is_told_apart_and_its_missing_files_named(
    folder: Path, models_dir: Path, tmp_path: Path
) -> None:
    """A folder saved from QwenImageEditInpaintPipeline (its processor as published) is a
    qwen-image-edit model; deploying it as qwen-image, or a qwen-image folder as
    qwen-image-edit, is refused before anything loads; a folder missing a file, the
    processor's included, is refused naming that file, and so is a processor that cuts other
    patches than the text encoder's vision tower reads."""
    assert model_family(str(folder)) == FAMILY
    check_model(ModelSource(str(folder)), FAMILY)
    with pytest.raises(InvalidSpec, match=r"cannot serve qwen-image$"):
        check_model(ModelSource(str(folder)), "qwen-image")
    qwen = ensure_demo_model("retouch:tiny-qwen-image", models_dir)
    with pytest.raises(InvalidSpec, match="cannot serve qwen-image-edit"):
        check_model(ModelSource(str(qwen)), FAMILY)
    broken = Path(shutil.copytree(folder, tmp_path / "broken"))
    for missing in (
        "processor/preprocessor_config.json",
        "processor/tokenizer.json",
        "vae/diffusion_pytorch_model.safetensors",
    ):
        (broken / missing).unlink()
        named = "processor/vocab.json" if missing == "processor/tokenizer.json" else missing
        with pytest.raises(InvalidSpec, match=named.replace(".", r"\.")) as refused:
            check_model(ModelSource(str(broken)), FAMILY)
        assert refused.value.field == "model"
        shutil.copy(folder / missing, broken / missing)
    check_model(ModelSource(str(broken)), FAMILY)
    images = broken / "processor" / "preprocessor_config.json"
    images.write_text(images.read_text().replace('"patch_size": 14', '"patch_size": 16'))
    with pytest.raises(InvalidSpec, match=r"patch_size 16.*vision_config says patch_size 14"):
        check_model(ModelSource(str(broken)), FAMILY)


def test_a_lora_on_the_transformer_serves_what_diffusers_loads(
    folder: Path, models_dir: Path, tmp_path: Path
) -> None:
    """A LoRA of the transformer's attention (diffusers' layout), attached as an executor
    attaches adapters: the mask-aware edit after a bake under it is the stock pipeline's
    with ``load_lora_weights`` (exact cache), and the LoRA changes the image."""
    ours, stock, bare = CASE.lora_edit_and_stock(
        "retouch:tiny-qwen-image-edit", folder, models_dir, tmp_path
    )
    _close(ours, stock)
    assert np.abs(ours - bare).max() > 1e-3  # the LoRA reached the transformer
