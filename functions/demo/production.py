"""Production-shaped pipelines for benchmarks: the real denoiser configs, random weights.

Benchmarks of the GPU data path need the shapes users serve (FLUX.1-dev's 19 + 38 blocks at
3072 wide, and FLUX.1-Fill-dev's on 384 input channels, SD3-medium's 24 MMDiT blocks,
Z-Image's 30 single-stream blocks at 3840 wide, the SD2- and SDXL-inpainting UNets), not the small demo models, whose steps are launch-bound.
No weights can be downloaded, and an fp32 CPU init of
12 B parameters followed by a save and a load would take minutes, so these pipelines are
built in memory, directly on the target device in the compute dtype (random init there
takes seconds) and never written to disk.

Text encoders are one layer deep: only their output shapes matter to the denoiser (CLIP's
77 tokens and pooled width, T5's 512 tokens for Flux and 256 for SD3 at 4096 wide; FLUX.2
[klein] reads Qwen3's layers 9, 18 and 27, so its Qwen3 has 28 narrow-MLP layers). The VAE
has the real configuration, so an edit's encode and decode cost what they cost in
production. ``scale`` (0 < scale ≤ 1) keeps every class and block type but shrinks widths
and depths, for CPU tests of the same code path.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    ConfigMixin,
    DDIMScheduler,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinInpaintPipeline,
    Flux2Transformer2DModel,
    FluxFillPipeline,
    FluxInpaintPipeline,
    FluxKontextInpaintPipeline,
    FluxTransformer2DModel,
    ModelMixin,
    QwenImageEditInpaintPipeline,
    QwenImageInpaintPipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3InpaintPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionXLInpaintPipeline,
    UNet2DConditionModel,
    ZImageInpaintPipeline,
    ZImageTransformer2DModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
)

from retouch.functions.demo.builders import sdxl_scheduler
from retouch.functions.demo.qwen_image import (
    PROMPT_TEMPLATES,
    qwen_image_scheduler,
    qwen_image_text_encoder,
    qwen_image_tokenizer,
)
from retouch.functions.demo.tokenizer import qwen_tokenizer, save_tokenizer, vocabulary
from retouch.functions.qwenvl import ImageTextProcessor, new_image_processor

CLIP_TOKENS = 77


@dataclass(frozen=True)
class Shape:
    """One production shape: what it stands for and how to build it at a ``scale``."""

    name: str
    family: str
    resolution: int  # the square image size it is served at
    dtype: torch.dtype  # the compute dtype it runs in
    stands_for: str  # the real model whose denoiser config this is
    build: Callable[[float, Path], DiffusionPipeline]


def _width(full: int, scale: float, multiple: int) -> int:
    """``full * scale`` rounded to a positive multiple of ``multiple``."""
    return max(multiple, round(full * scale / multiple) * multiple)


def _depth(full: int, scale: float) -> int:
    return max(1, round(full * scale))


def _clip(hidden: int, projection: bool = False) -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=len(vocabulary()),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=1,
        num_attention_heads=max(1, hidden // 64),
        max_position_embeddings=CLIP_TOKENS,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        projection_dim=hidden,
    )
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def _t5(hidden: int) -> T5EncoderModel:
    return T5EncoderModel(
        T5Config(
            vocab_size=len(vocabulary()),
            d_model=hidden,
            d_kv=64,
            d_ff=256,
            num_layers=1,
            num_heads=2,
            decoder_start_token_id=0,
            pad_token_id=1,
            eos_token_id=1,
        )
    )


def _vae(latent_channels: int, scale: float, **extra: float) -> AutoencoderKL:
    """The SD/SDXL/Flux VAE layout (4 levels, factor 8); full widths at scale 1."""
    channels = tuple(_width(c, scale, 32) for c in (128, 256, 512, 512))
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=channels,
        layers_per_block=2 if scale >= 1 else 1,
        latent_channels=latent_channels,
        norm_num_groups=32,
        **extra,
    )


def _shifting_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """FLUX's flow-matching Euler with the resolution-dependent shift (``mu``) it ships."""
    return FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def _tokenizer(folder: Path, name: str, length: int) -> CLIPTokenizer:
    return save_tokenizer(folder / name, length)


def build_flux_dev(scale: float, scratch: Path) -> FluxInpaintPipeline:
    """FLUX.1-dev's transformer (19 dual + 38 single blocks, 24 heads of 128, guidance
    embedding, 4096-wide T5 context, 768-wide pooled CLIP) in ``FluxInpaintPipeline``."""
    return _flux(FluxInpaintPipeline, 64, scale, scratch)


def build_flux_fill_dev(scale: float, scratch: Path) -> FluxFillPipeline:
    """FLUX.1-Fill-dev: FLUX.1-dev's transformer taking 384 channels per token (64 packed
    latents, 64 packed masked-image latents, 256 packed mask of the factor-8 VAE) and
    predicting 64, in ``FluxFillPipeline``."""
    return _flux(FluxFillPipeline, 384, scale, scratch)


def build_flux_kontext_dev(scale: float, scratch: Path) -> FluxKontextInpaintPipeline:
    """FLUX.1-Kontext-dev: FLUX.1-dev's transformer (the reference image's tokens follow
    the edited latents' in its sequence) in ``FluxKontextInpaintPipeline``."""
    return _flux(FluxKontextInpaintPipeline, 64, scale, scratch)


def _flux(
    pipeline: type[FluxInpaintPipeline | FluxFillPipeline | FluxKontextInpaintPipeline],
    in_channels: int,
    scale: float,
    scratch: Path,
) -> FluxInpaintPipeline | FluxFillPipeline | FluxKontextInpaintPipeline:
    """FLUX.1-dev's transformer with ``in_channels`` in ``pipeline``."""
    text, pooled = _width(4096, scale, 64), _width(768, scale, 64)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=in_channels,
        out_channels=64,
        num_layers=_depth(19, scale),
        num_single_layers=_depth(38, scale),
        attention_head_dim=128,
        num_attention_heads=_depth(24, scale),
        joint_attention_dim=text,
        pooled_projection_dim=pooled,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    )
    return pipeline(
        scheduler=_shifting_scheduler(),
        vae=_vae(16, scale, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=_clip(pooled),
        tokenizer=_tokenizer(scratch, "clip", CLIP_TOKENS),
        text_encoder_2=_t5(text),
        tokenizer_2=_tokenizer(scratch, "t5", 512),
        transformer=transformer,
    )


def build_qwen_image(scale: float, scratch: Path) -> QwenImageInpaintPipeline:
    """Qwen-Image's MMDiT (20 B: 60 blocks, 24 heads of 128, patch 2, 3584-wide Qwen2.5-VL
    context) with its VAE (a frame axis, factor 8: 64x64 tokens at 1024²); ``scratch`` is
    not needed (the tokenizer is built in memory)."""
    text = _width(3584, scale, 64)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=_depth(60, scale),
        attention_head_dim=128,
        num_attention_heads=_depth(24, scale),
        joint_attention_dim=text,
        axes_dims_rope=(16, 56, 56),
    )
    tokenizer = qwen_image_tokenizer(PROMPT_TEMPLATES)
    with torch.device("cpu"):  # the scheduler's sigmas live on the host (not on "meta")
        scheduler = qwen_image_scheduler()
    return QwenImageInpaintPipeline(
        scheduler=scheduler,
        vae=AutoencoderKLQwenImage(
            base_dim=_width(96, scale, 8), num_res_blocks=2 if scale >= 1 else 1
        ),
        text_encoder=qwen_image_text_encoder(tokenizer, text, layers=1),
        tokenizer=tokenizer,
        transformer=transformer,
    )


def build_qwen_image_edit(scale: float, scratch: Path) -> QwenImageEditInpaintPipeline:
    """Qwen-Image-Edit (20 B): Qwen-Image's MMDiT, VAE, Qwen2.5-VL and tokenizer (the same
    configs: :func:`build_qwen_image`) with Qwen2.5-VL's image processor, in
    ``QwenImageEditInpaintPipeline``."""
    qwen = build_qwen_image(scale, scratch)
    processor = ImageTextProcessor(image_processor=new_image_processor(), tokenizer=qwen.tokenizer)
    return QwenImageEditInpaintPipeline(**qwen.components, processor=processor)


def build_z_image(scale: float, scratch: Path) -> ZImageInpaintPipeline:
    """Z-Image's single-stream DiT (6 B: 30 blocks and 2 + 2 refiner blocks, 30 heads of
    128, RoPE axes 32/48/48) reading a 2560-wide Qwen3-4B caption of up to 512 tokens, with
    the FLUX.1 VAE, in ``ZImageInpaintPipeline`` (Z-Image-Turbo's scheduler)."""
    heads = _depth(30, scale)
    text = _width(2560, scale, 64)
    tokenizer = qwen_tokenizer(512)
    transformer = ZImageTransformer2DModel(
        in_channels=16,
        dim=heads * 128,
        n_layers=_depth(30, scale),
        n_refiner_layers=2,
        n_heads=heads,
        n_kv_heads=heads,
        cap_feat_dim=text,
        axes_dims=[32, 48, 48],
        axes_lens=[1024, 512, 512],
    )
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=text,
            intermediate_size=256,
            num_hidden_layers=1,  # its hidden states [-2] are then the embeddings: a shape
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=512,
            pad_token_id=tokenizer.pad_token_id,
            use_cache=False,
        )
    )
    return ZImageInpaintPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(16, scale, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


KLEIN_TEXT_TOKENS = 512  # Flux2KleinInpaintPipeline's max_sequence_length


def build_flux2_klein_4b(scale: float, scratch: Path) -> Flux2KleinInpaintPipeline:
    """FLUX.2 [klein] 4B's transformer (5 double- + 20 single-stream blocks, 24 heads of
    128, 128 patchified latent channels, no guidance embedding, Qwen3-4B's three layers
    side by side: 7680 wide) with FLUX.2's VAE (32 latent channels, BatchNorm) in the
    distilled ``Flux2KleinInpaintPipeline``; 512 text tokens."""
    text = _width(2560, scale, 64)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=128,
        num_layers=_depth(5, scale),
        num_single_layers=_depth(20, scale),
        attention_head_dim=128,
        num_attention_heads=_depth(24, scale),
        joint_attention_dim=3 * text,
        axes_dims_rope=(32, 32, 32, 32),
        guidance_embeds=False,
    )
    tokenizer = qwen_tokenizer(KLEIN_TEXT_TOKENS)
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=text,
            intermediate_size=256,
            num_hidden_layers=28,  # layer 27 is read
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            max_position_embeddings=KLEIN_TEXT_TOKENS,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    channels = tuple(_width(c, scale, 32) for c in (128, 256, 512, 512))
    vae = AutoencoderKLFlux2(
        block_out_channels=channels,
        layers_per_block=2 if scale >= 1 else 1,
        latent_channels=32,
        norm_num_groups=32,
    )
    return Flux2KleinInpaintPipeline(
        scheduler=_shifting_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=True,
    )


def build_sd3_medium(scale: float, scratch: Path) -> StableDiffusion3InpaintPipeline:
    """SD3-medium's MMDiT (24 blocks, 24 heads of 64, patch 2) with CLIP-L, CLIP-G and T5
    context shapes (2048-wide pooled, 77 + 256 text tokens at 4096 wide)."""
    heads = _depth(24, scale)
    clip_l, clip_g = _width(768, scale, 64), _width(1280, scale, 64)
    t5 = _width(4096, scale, 64)
    transformer = SD3Transformer2DModel(
        sample_size=128,
        patch_size=2,
        in_channels=16,
        num_layers=_depth(24, scale),
        attention_head_dim=64,
        num_attention_heads=heads,
        joint_attention_dim=t5,
        caption_projection_dim=heads * 64,
        pooled_projection_dim=clip_l + clip_g,
        out_channels=16,
        pos_embed_max_size=192,
    )
    return StableDiffusion3InpaintPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(16, scale, scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=_clip(clip_l, projection=True),
        tokenizer=_tokenizer(scratch, "clip", CLIP_TOKENS),
        text_encoder_2=_clip(clip_g, projection=True),
        tokenizer_2=_tokenizer(scratch, "clip", CLIP_TOKENS),
        text_encoder_3=_t5(t5),
        tokenizer_3=_tokenizer(scratch, "t5", 256),
    )


def build_sd2_inpaint(scale: float, scratch: Path) -> StableDiffusionInpaintPipeline:
    """The SD2-inpainting UNet (865 M: 320/640/1280/1280, two layers per level, linear
    projections, 1024-wide OpenCLIP context) at 512²."""
    channels = tuple(_width(c, scale, 32) for c in (320, 640, 1280, 1280))
    text = _width(1024, scale, 64)
    unet = UNet2DConditionModel(
        sample_size=64,
        in_channels=9,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        block_out_channels=channels,
        layers_per_block=2 if scale >= 1 else 1,
        attention_head_dim=tuple(max(1, c // 64) for c in channels),
        cross_attention_dim=text,
        use_linear_projection=True,
        norm_num_groups=32,
    )
    return StableDiffusionInpaintPipeline(
        vae=_vae(4, scale, scaling_factor=0.18215),
        text_encoder=_clip(text),
        tokenizer=_tokenizer(scratch, "clip", CLIP_TOKENS),
        unet=unet,
        scheduler=DDIMScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            clip_sample=False,
            set_alpha_to_one=False,
            steps_offset=1,
        ),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def build_sdxl_inpaint(scale: float, scratch: Path) -> StableDiffusionXLInpaintPipeline:
    """The SDXL-inpainting UNet (2.6 B: 320/640/1280, no transformer blocks on the first
    level, 2 and 10 transformer layers on the others, linear projections, 2048-wide
    CLIP-L + CLIP-G context, pooled CLIP-G and six time ids added to the timestep
    embedding) at 1024²."""
    channels = tuple(_width(c, scale, 32) for c in (320, 640, 1280))
    clip_l, clip_g = _width(768, scale, 64), _width(1280, scale, 64)
    time_embed = _width(256, scale, 32)
    unet = UNet2DConditionModel(
        sample_size=128,
        in_channels=9,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=channels,
        layers_per_block=2 if scale >= 1 else 1,
        transformer_layers_per_block=(1, _depth(2, scale), _depth(10, scale)),
        attention_head_dim=tuple(max(1, c // 64) for c in channels),  # heads of 64
        cross_attention_dim=clip_l + clip_g,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_embed,
        projection_class_embeddings_input_dim=6 * time_embed + clip_g,
        norm_num_groups=32,
    )
    with torch.device("cpu"):  # the scheduler's sigmas live on the host (not on "meta")
        scheduler = sdxl_scheduler()
    return StableDiffusionXLInpaintPipeline(
        vae=_vae(4, scale, scaling_factor=0.13025),
        text_encoder=_clip(clip_l),
        text_encoder_2=_clip(clip_g, projection=True),
        tokenizer=_tokenizer(scratch, "clip", CLIP_TOKENS),
        tokenizer_2=_tokenizer(scratch, "clip", CLIP_TOKENS),
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape(
            "flux-dev", "flux-inpaint", 1024, torch.bfloat16, "FLUX.1-dev (12 B)", build_flux_dev
        ),
        Shape(
            "flux-fill-dev",
            "flux-fill",
            1024,
            torch.bfloat16,
            "FLUX.1-Fill-dev (12 B)",
            build_flux_fill_dev,
        ),
        Shape(
            "flux-kontext",
            "flux-kontext",
            1024,
            torch.bfloat16,
            "FLUX.1-Kontext-dev (12 B)",
            build_flux_kontext_dev,
        ),
        Shape(
            "qwen-image",
            "qwen-image",
            1024,
            torch.bfloat16,
            "Qwen-Image (20 B)",
            build_qwen_image,
        ),
        Shape(
            "qwen-image-edit",
            "qwen-image-edit",
            1024,
            torch.bfloat16,
            "Qwen-Image-Edit (20 B)",
            build_qwen_image_edit,
        ),
        Shape(
            "z-image",
            "z-image",
            1024,
            torch.bfloat16,
            "Z-Image / Z-Image-Turbo (6 B)",
            build_z_image,
        ),
        Shape(
            "flux2-klein",
            "flux2-klein",
            1024,
            torch.bfloat16,
            "FLUX.2 [klein] 4B (4 B)",
            build_flux2_klein_4b,
        ),
        Shape(
            "sd3-medium",
            "sd3-inpaint",
            1024,
            torch.bfloat16,
            "Stable Diffusion 3 medium (2 B)",
            build_sd3_medium,
        ),
        Shape(
            "sd2-inpaint",
            "sd-inpaint",
            512,
            torch.bfloat16,
            "stable-diffusion-2-inpainting (865 M UNet)",
            build_sd2_inpaint,
        ),
        Shape(
            "sdxl-inpaint",
            "sdxl-inpaint",
            1024,
            torch.bfloat16,
            "stable-diffusion-xl-1.0-inpainting-0.1 (2.6 B UNet)",
            build_sdxl_inpaint,
        ),
    )
}


@contextlib.contextmanager
def _building_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside are allocated on ``device`` in ``dtype`` (no CPU copy)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_shape(
    name: str,
    device: torch.device | str,
    *,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    without: tuple[str, ...] = (),
) -> tuple[Shape, DiffusionPipeline]:
    """Build production shape ``name`` on ``device`` in its dtype (or ``dtype``), in eval
    mode, components ``without`` left out (None, as a pipeline loaded without them);
    ``KeyError`` for an unknown name, ``ValueError`` for a scale outside (0, 1].

    The pipeline is laid out on the meta device first (no memory; on ``meta`` that is
    the result), then each kept module is made on ``device`` from its config, its random
    init seeded by ``seed`` and its name: processes that build different parts of one
    shape (an executor its denoiser, a pre worker its text encoders) get the same weights
    for the parts they share, and a part left out never takes device memory, even for a
    moment."""
    shape = SHAPES[name]
    if not 0 < scale <= 1 or not math.isfinite(scale):
        raise ValueError(f"scale must be in (0, 1], not {scale}")
    dtype = dtype or shape.dtype
    device = torch.device(device)
    with (
        tempfile.TemporaryDirectory(prefix="retouch-shape-") as scratch,
        _building_on(torch.device("meta"), dtype),
        torch.no_grad(),
    ):
        laid_out = shape.build(scale, Path(scratch))
    components = {}
    for part, component in laid_out.components.items():
        if part in without:
            components[part] = None
        elif isinstance(component, torch.nn.Module) and device.type == "meta":
            components[part] = component.eval().requires_grad_(False)  # laid out already
        elif isinstance(component, torch.nn.Module):
            components[part] = _made_on(component, part, device, dtype, seed)
        elif isinstance(component, ConfigMixin):  # a scheduler: its tensors on the host
            components[part] = type(component).from_config(component.config)
        else:  # tokenizers, and the None of a pipeline's optional parts
            components[part] = component
    _, optional = DiffusionPipeline._get_signature_keys(laid_out)
    options = {k: v for k, v in laid_out.config.items() if k in optional and k not in components}
    return shape, type(laid_out)(**components, **options)


def _made_on(
    meta: torch.nn.Module, part: str, device: torch.device, dtype: torch.dtype, seed: int
) -> torch.nn.Module:
    """``meta``'s module class and config made on ``device``, seeded by ``part``."""
    torch.manual_seed(seed + zlib.crc32(part.encode()))
    with _building_on(device, dtype), torch.no_grad():
        if isinstance(meta, ModelMixin):  # diffusers
            made = type(meta).from_config(meta.config)
        else:  # transformers
            made = type(meta)(meta.config)
    return made.eval().requires_grad_(False)
