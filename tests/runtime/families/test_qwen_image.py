"""The ``qwen-image`` family against the stock QwenImageInpaintPipeline.

The other families' checks (``test_flux_kontext.py`` beside it): an exact cache (baked with
the edit's own mask, prompt and seed) reproduces the stock pipeline run with the same noise,
also at mask 1.0, with classifier-free guidance and without it; plans mixing full and
sparse blocks and the row loader change nothing; a request inside a batch gives its solo
result; a worker's pipeline without the transformer encodes and decodes the same; the
analytic FLOPs equal what torch counts. Qwen-Image's own: prompts of a batch pad to the
longest under a text mask; an edit without a cache is the stock pipeline's with the
composed noise; the tokenizer drops the template's prefix and nothing else; a Qwen-Image
folder is told apart from other families' and a missing file is named; a LoRA of its
transformer serves what diffusers' ``load_lora_weights`` gives.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.demo.qwen_image import PROMPT_TEMPLATES
from retouch.functions.errors import InvalidSpec
from retouch.functions.modelcheck import check_model, model_family
from retouch.functions.modelsource import ModelSource
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.editor import MaskAwareEditor
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.maskaware.templatelayout import recorded_tensors
from retouch.runtime.models import load_pipeline
from tests.runtime.families.cases import CPU, Case
from tests.runtime.families.cases import close as _close

FAMILY = "qwen-image"
CASE = Case(FAMILY, guidance=4.0)
SIZE, STEPS = CASE.size, CASE.steps
_rect, _request, _exact = CASE.rect, CASE.request, CASE.exact
TOKENS = (SIZE // 8) ** 2  # 128 px, factor-4 VAE, 2x2 packing: 16 x 16 tokens


@pytest.fixture(scope="module")
def folder(models_dir: Path) -> Path:
    return ensure_demo_model("retouch:tiny-qwen-image", models_dir)


@pytest.fixture(scope="module")
def pipe(folder: Path):
    return load_pipeline(folder, FAMILY, CPU)


@pytest.fixture(scope="module")
def baked(pipe) -> MemoryActivations:
    return CASE.baked(MaskAwareEditor(pipe, FAMILY, CPU))


@pytest.mark.parametrize(
    ("mask", "guidance"),
    [
        (_rect(12, 20, 40, 50), 4.0),
        (_rect(70, 8, 30, 100), 3.0),
        (np.ones((SIZE, SIZE), bool), 4.0),
        (_rect(12, 20, 40, 50), 1.0),
        (np.ones((SIZE, SIZE), bool), 1.0),
    ],
    ids=["door", "band", "everything", "door-no-cfg", "everything-no-cfg"],
)
def test_exact_cache_reproduces_the_stock_pipeline(pipe, mask: np.ndarray, guidance: float) -> None:
    """With true CFG (``guidance`` as ``true_cfg_scale``, the bake's negative prompt "")
    and without it (1.0: the pipeline's prompt-only call)."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request = dataclasses.replace(CASE, guidance=guidance).request(
        mask, "a red door", 11, ("a red door", 11)
    )
    store = MemoryActivations()
    editor.bake(request.image, "a red door", 11, STEPS, guidance, store, mask=mask)
    ours, stock = editor.edit(request, store, "np"), editor.stock_edit(request, "np")
    _close(ours, stock)
    assert np.abs(ours - stock).max() <= 1e-5  # the acceptance bound, fp32


def test_a_negative_prompt_is_the_pipelines(pipe, baked) -> None:
    """An edit's own negative prompt (the bake's is ""), longer than its prompt: the
    prompt's row is padded to it under the text mask. Computed over every token (mask
    1.0: no unconditional row of the bake's is read) the edit is the stock pipeline's
    with that ``negative_prompt``, and the negative prompt changes it (the pipeline guides:
    without guidance it would not)."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request = _request(np.ones((SIZE, SIZE), bool), "a red door", 11, ("a quiet street", 3))
    request = dataclasses.replace(request, negative_prompt="blurry, dark, out of focus")
    state = editor.prepare(request, baked)
    assert not state.inputs.prompt_mask[1].all()  # the prompt's row is padded
    ours, stock = editor.edit(request, baked, "np"), editor.stock_edit(request, "np")
    _close(ours, stock)
    assert np.abs(ours - stock).max() <= 1e-5
    plain = editor.stock_edit(dataclasses.replace(request, negative_prompt=""), "np")
    assert np.abs(ours - plain).max() > 1e-3


def test_the_masked_tokens_alone_are_computed_against_the_bakes_rows(pipe, baked) -> None:
    """Two rows per request (the guidance halves) of 2x2-packed tokens; the bake stores K/V/Y
    of every token for both, as the template layout (capacity planning) says."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request = _request(_rect(32, 32, 48, 48), "a red door", 9, ("a quiet street", 3))
    state = editor.prepare(request, baked)
    (tokens,) = state.tokens.values()
    assert tokens.n_tokens == TOKENS and tokens.count == 36  # 6 x 6 packed tokens
    first = editor.blocks[0]
    assert tuple(baked.get(0, first, "k").shape[:2]) == (2, TOKENS)
    layout = {
        (step, block, name): shape
        for step, block, name, _, shape in recorded_tensors(editor, SIZE, SIZE, STEPS)
    }
    for name in ("k", "v", "y"):
        assert layout[0, first, name] == tuple(baked.get(0, first, name).shape)


def test_an_edit_without_a_cache_is_the_stock_pipelines_with_the_composed_noise(pipe) -> None:
    """A template not baked yet: every token computed, the template's noise outside the
    mask and the request's inside, as the stock reference is given it (the pipeline takes
    no ``latents``: :func:`given_noise`)."""
    CASE.assert_uncached_edit_gives_the_stock_edit(pipe)


def test_mixed_plans_and_the_row_loader_change_nothing(pipe) -> None:
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request, store = _exact(editor, _rect(12, 20, 40, 50))
    last = editor.blocks[-1]
    plans = [
        {b: Mode.FULL if b == last else Mode.SPARSE for b in editor.blocks},
        {b: Mode.SPARSE if b == last else Mode.FULL for b in editor.blocks},
    ]
    CASE.assert_plans_and_the_loader_change_nothing(editor, request, store, plans)


def test_a_request_in_a_batch_gives_its_solo_result(pipe, baked) -> None:
    CASE.assert_batch_gives_solo(MaskAwareEditor(pipe, FAMILY, CPU), baked)


def test_prompts_of_a_batch_pad_to_the_longest_under_a_text_mask(pipe, baked) -> None:
    """A short and a long prompt (and negative prompts of their own lengths) step in one
    batch: the shorter rows are padded and masked, and each ends where it ends alone."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    short = _request(_rect(12, 20, 40, 50), "a cat", 5, ("a quiet street", 3))
    long = _request(_rect(60, 60, 20, 30), "a tall green wooden gate, open", 6,
                    ("a quiet street", 3))  # fmt: skip
    long = dataclasses.replace(long, negative_prompt="blurry")
    states = [editor.prepare(r, baked) for r in (short, long)]
    lengths = [s.inputs.prompt_embeds.shape[1] for s in states]
    assert lengths[0] < lengths[1] and not states[1].inputs.prompt_mask.all()
    solo = [editor.edit(r, baked, "np") for r in (short, long)]
    while not states[0].done:
        editor.step(states)
    for state, alone in zip(states, solo, strict=True):
        assert np.abs(editor.finish(state, "np") - alone).max() <= 1e-4


def test_a_worker_pipeline_without_the_transformer_encodes_and_decodes_the_same(
    pipe, folder: Path
) -> None:
    names = CASE.assert_worker_encodes_and_decodes_alike(pipe, folder, torch.randn(1, TOKENS, 64))
    assert {"prompt_embeds", "prompt_mask", "image_latents"} <= names


def test_analytic_flops_equal_the_counted_step(pipe, baked) -> None:
    """One step of two requests counts the family's formula at their text length (prompts
    vary in length: the formula takes the padded one), mask-aware and with every block
    full; the mask-aware step costs a fraction of the full one."""
    mask = _rect(16, 32, 64, 32)  # aligned to the 2x2-packed tokens: ratio 0.125
    assert 0.05 < CASE.assert_counted_flops_at_the_padded_text(pipe, baked, mask) < 0.5


def test_the_tokenizer_drops_the_templates_prefix_and_nothing_else(pipe) -> None:
    """The built-in tokenizer makes the pipeline's system prefix exactly the tokens it
    drops (``prompt_template_encode_start_idx``), as Qwen's own does."""
    assert pipe.prompt_template_encode == PROMPT_TEMPLATES[0]
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx
    embeds, _ = pipe.encode_prompt("a red door", device=CPU)
    suffix = len(pipe.tokenizer(pipe.prompt_template_encode.split("{}")[1]).input_ids)
    assert embeds.shape[1] == len(pipe.tokenizer("a red door").input_ids) + suffix


def test_a_qwen_image_folder_is_told_apart_and_its_missing_files_named(
    folder: Path, models_dir: Path, tmp_path: Path
) -> None:
    """A folder saved from QwenImageInpaintPipeline is a qwen-image model; deploying it as
    another family, or another family's folder as qwen-image, is refused before anything
    loads; a folder missing a file is refused naming that file."""
    assert model_family(str(folder)) == FAMILY
    check_model(ModelSource(str(folder)), FAMILY)
    with pytest.raises(InvalidSpec, match="cannot serve flux-inpaint"):
        check_model(ModelSource(str(folder)), "flux-inpaint")
    kontext = ensure_demo_model("retouch:tiny-flux-kontext", models_dir)
    with pytest.raises(InvalidSpec, match="cannot serve qwen-image"):
        check_model(ModelSource(str(kontext)), FAMILY)
    broken = Path(shutil.copytree(folder, tmp_path / "broken"))
    (broken / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(InvalidSpec, match=r"vae/diffusion_pytorch_model\.safetensors"):
        check_model(ModelSource(str(broken)), FAMILY)
    (broken / "text_encoder" / "config.json").unlink()
    with pytest.raises(InvalidSpec, match=r"text_encoder/config\.json"):
        check_model(ModelSource(str(broken)), FAMILY)


def test_a_lora_on_the_qwen_image_transformer_serves_what_diffusers_loads(
    folder: Path, models_dir: Path, tmp_path: Path
) -> None:
    """A LoRA of the transformer's attention (diffusers' layout), attached as an executor
    attaches adapters: the mask-aware edit after a bake under it is the stock pipeline's
    with ``load_lora_weights`` (exact cache), and the LoRA changes the image (10x more than
    the two paths differ: the random model moves little)."""
    ours, stock, bare = CASE.lora_edit_and_stock(
        "retouch:tiny-qwen-image", folder, models_dir, tmp_path
    )
    _close(ours, stock)
    assert np.abs(ours - bare).max() > 1e-3  # the LoRA reached the transformer
