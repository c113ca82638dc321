"""The built-in Qwen-Image models (``retouch:tiny-qwen-image``, ``small-qwen-image``, and
the edit model's ``tiny-qwen-image-edit``, ``small-qwen-image-edit``):
``QwenImageInpaintPipeline`` and ``QwenImageEditInpaintPipeline`` with random weights, their
text side built in memory (a byte-level ``Qwen2Tokenizer``, a tiny
``Qwen2_5_VLForConditionalGeneration`` and, for the edit model, Qwen2.5-VL's image processor:
nothing is downloaded).

Qwen-Image's pipelines wrap every prompt in a chat template whose system prefix they drop
by count (``prompt_template_encode_start_idx``: 34 tokens of Qwen's own BPE). The tokenizer
here has one BPE merge chain per pre-token of that prefix (each word of it one token, as in
Qwen's vocabulary), so the prefix is exactly that many tokens and the pipeline drops it and
nothing else; any other text falls back to its bytes. Its special tokens are Qwen2.5-VL's
chat and vision markers, so the edit pipeline's vision template tokenizes as the real one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditInpaintPipeline,
    QwenImageInpaintPipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from retouch.functions.demo.tokenizer import _bpe
from retouch.functions.qwenvl import (
    INDEX_ENTRY,
    MERGE,
    PATCH,
    TEMPORAL_PATCH,
    ImageTextProcessor,
    new_image_processor,
)

# Qwen2.5-VL's chat and vision markers (``<|endoftext|>`` is Qwen2Tokenizer's unk/eos/pad).
QWEN_VL_SPECIALS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# The pipelines' prompt templates (``prompt_template_encode`` of QwenImageInpaintPipeline
# and QwenImageEditInpaintPipeline, which drop their first 34 and 64 tokens).
PROMPT_TEMPLATES = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should alter "
    "or modify the image. Generate a new image that meets the user's requirements while "
    "maintaining consistency with the original input where appropriate.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n",
)


def _pieces(tokenizer: Qwen2Tokenizer, text: str) -> list[str]:
    """``text``'s pre-tokens in the byte-level alphabet (specials split off and left out)."""
    pre = tokenizer.backend_tokenizer.pre_tokenizer
    pieces: list[str] = []
    for part in tokenizer.tokenize(text):  # bytes, specials whole
        if part in QWEN_VL_SPECIALS:
            pieces.append("\0")  # a boundary
        else:
            pieces[-1:] = [pieces[-1] + part] if pieces and pieces[-1] != "\0" else [part]
    words: list[str] = []
    decoder = {v: k for k, v in bytes_to_unicode().items()}
    for piece in pieces:
        if piece == "\0":
            continue
        raw = bytes(decoder[c] for c in piece).decode()
        words += [w for w, _ in pre.pre_tokenize_str(raw)]
    return words


def _merges(words: list[str]) -> list[tuple[str, str]]:
    """BPE merges making each of ``words`` (byte-level pre-tokens) one token; a later word's
    merges rank after every earlier one, so no finished word is split differently."""
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for word in words:
        while len(symbols := _bpe(list(word), ranks)) > 1:
            pair = (symbols[0], symbols[1])
            ranks[pair] = len(merges)
            merges.append(pair)
    return merges


def _byte_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Qwen2Tokenizer:
    return Qwen2Tokenizer(
        vocab=dict(vocab),
        merges=list(merges),
        extra_special_tokens=list(QWEN_VL_SPECIALS),
        model_max_length=32768,
    )


def qwen_image_tokenizer(templates: tuple[str, ...]) -> Qwen2Tokenizer:
    """A byte-level Qwen2 BPE whose merges make every word of ``templates`` (the pipelines'
    prompt templates, ``{}`` the prompt) one token."""
    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    vocab["<|endoftext|>"] = len(vocab)
    plain = _byte_tokenizer(vocab, [])
    words = [w for t in templates for w in _pieces(plain, t.replace("{}", ""))]
    merges = _merges(words)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return _byte_tokenizer(vocab, merges)


def qwen_image_text_encoder(
    tokenizer: Qwen2Tokenizer, hidden: int, layers: int = 2
) -> Qwen2_5_VLForConditionalGeneration:
    """A Qwen2.5-VL with a text model ``hidden`` wide and ``layers`` deep (a small vision
    tower) over ``tokenizer``'s vocabulary; Qwen-Image reads its last hidden states."""
    ids = tokenizer.convert_tokens_to_ids
    heads = max(2, hidden // 128)  # Qwen2.5-VL-7B: 28 heads of 128
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "max_position_embeddings": 2048,
            "rope_scaling": {"mrope_section": _mrope(hidden // heads), "rope_type": "default"},
            "rope_theta": 1000000.0,
            "bos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": hidden,
            "fullatt_block_indexes": [0],
            # the image processor's patch geometry (``functions/qwenvl``)
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL_PATCH,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _mrope(head_dim: int) -> list[int]:
    """Qwen2.5-VL's multimodal RoPE sections (temporal, height, width) of a head: 1/4, 3/8,
    3/8 of its rotary pairs, as Qwen2.5-VL-7B's [16, 24, 24] of 64."""
    pairs = head_dim // 2
    t = pairs // 4
    h = (pairs - t) // 2
    return [t, h, pairs - t - h]


@dataclass(frozen=True)
class QwenImageSize:
    """A demo size of Qwen-Image: the MMDiT's heads, head width and blocks, the text
    encoder's width (the DiT's ``joint_attention_dim``), the VAE's base width and its 2x
    stages (Qwen-Image's VAE has three: 8x)."""

    heads: int
    head_dim: int
    layers: int
    text_hidden: int
    vae_base: int
    vae_stages: int = 2


# The VAE's causal 3D convolutions cost a CPU much more than a 2D VAE of the same widths:
# its base stays narrow (8 wide: 0.5 s to encode 128 px on a 2-core VM, 16 wide: 2.8 s).
TINY_QWEN_IMAGE = QwenImageSize(heads=2, head_dim=16, layers=2, text_hidden=16, vae_base=8)
# At 512 px: 128x128 latents, 64x64 = 4096 tokens (Qwen-Image's grid at 1024 px).
SMALL_QWEN_IMAGE = QwenImageSize(heads=6, head_dim=64, layers=3, text_hidden=64, vae_base=4)
# The edit pipeline edits at about 1024x1024 whatever the image's size (the served family
# edits at the template's: ``runtime/families/qwen_image_edit``), so its tiny model keeps
# a 1024x1024 edit affordable on a CPU: the real VAE's three stages (8x: 64x64 tokens per
# image) at a base width of 4 (5 s to encode 1024x1024, 8 s to decode, on a 2-core VM; at 2
# its 2-channel RMS norms magnify float rounding 50x), a 2-block MMDiT.
TINY_QWEN_IMAGE_EDIT = QwenImageSize(
    heads=2, head_dim=16, layers=2, text_hidden=16, vae_base=4, vae_stages=3
)
SMALL_QWEN_IMAGE_EDIT = QwenImageSize(
    heads=6, head_dim=64, layers=3, text_hidden=64, vae_base=8, vae_stages=3
)
LATENT_CHANNELS = 16  # Qwen-Image's VAE: 64 channels once packed 2x2


def qwen_image_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """The scheduler Qwen-Image ships (dynamic exponential shift, a 0.02 terminal)."""
    return FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        shift_terminal=0.02,
        use_dynamic_shifting=True,
        time_shift_type="exponential",
    )


def qwen_image_vae(base: int, stages: int = 2) -> AutoencoderKLQwenImage:
    """Qwen-Image's video-style VAE (a frame axis) with ``stages`` 2x stages (the real one's
    widths and time downsampling, cut to them) and latent statistics away from (0, 1), so
    that a missing normalisation shows."""
    return AutoencoderKLQwenImage(
        base_dim=base,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 2, 4, 4][: stages + 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True][:stages],
        latents_mean=torch.empty(LATENT_CHANNELS).uniform_(-0.5, 0.5).tolist(),
        latents_std=torch.empty(LATENT_CHANNELS).uniform_(0.5, 2.0).tolist(),
    )


def qwen_image_transformer(size: QwenImageSize) -> QwenImageTransformer2DModel:
    """Qwen-Image's MMDiT at a demo size."""
    head = size.head_dim
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_layers=size.layers,
        attention_head_dim=head,
        num_attention_heads=size.heads,
        joint_attention_dim=size.text_hidden,
        axes_dims_rope=(head // 4, 3 * head // 8, 3 * head // 8),
    )


def build_qwen_image(folder: Path, size: QwenImageSize) -> None:
    """Qwen-Image (an MMDiT over 2x2-packed latents reading a Qwen2.5-VL's last hidden
    states) in QwenImageInpaintPipeline, saved to ``folder``."""
    transformer = qwen_image_transformer(size)  # first: the built-in's weights stay its own
    tokenizer = qwen_image_tokenizer(PROMPT_TEMPLATES)
    QwenImageInpaintPipeline(
        scheduler=qwen_image_scheduler(),
        vae=qwen_image_vae(size.vae_base, size.vae_stages),
        text_encoder=qwen_image_text_encoder(tokenizer, size.text_hidden),
        tokenizer=tokenizer,
        transformer=transformer,
    ).save_pretrained(folder, safe_serialization=True)


def qwen_image_edit_pipeline(
    transformer: QwenImageTransformer2DModel,
    vae: AutoencoderKLQwenImage,
    text_hidden: int,
    text_layers: int = 2,
) -> QwenImageEditInpaintPipeline:
    """Qwen-Image-Edit's pipeline around ``transformer`` and ``vae``: Qwen-Image's tokenizer
    (its merges cover the edit template's prefix too), a Qwen2.5-VL ``text_hidden`` wide
    whose vision tower reads what Qwen2.5-VL's image processor makes of the image."""
    tokenizer = qwen_image_tokenizer(PROMPT_TEMPLATES)
    return QwenImageEditInpaintPipeline(
        scheduler=qwen_image_scheduler(),
        vae=vae,
        text_encoder=qwen_image_text_encoder(tokenizer, text_hidden, text_layers),
        tokenizer=tokenizer,
        processor=ImageTextProcessor(image_processor=new_image_processor(), tokenizer=tokenizer),
        transformer=transformer,
    )


def build_qwen_image_edit(folder: Path, size: QwenImageSize) -> None:
    """Qwen-Image-Edit (Qwen-Image's MMDiT reading the image's latents after the edited
    ones, and its Qwen2.5-VL reading the image with the prompt) in
    QwenImageEditInpaintPipeline, saved to ``folder`` with the published layout: its
    ``model_index.json`` names transformers' ``Qwen2VLProcessor``, whose ``processor``
    folder holds the image processor's ``preprocessor_config.json`` and the tokenizer."""
    vae = qwen_image_vae(size.vae_base, size.vae_stages)
    pipe = qwen_image_edit_pipeline(qwen_image_transformer(size), vae, size.text_hidden)
    pipe.save_pretrained(folder, safe_serialization=True)
    shutil.rmtree(folder / "processor")
    pipe.processor.save(folder / "processor")
    index = json.loads((folder / "model_index.json").read_text())
    index["processor"] = INDEX_ENTRY
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
