"""Builders of the built-in demo models' pipelines (``models.py`` is their catalogue): each
family's diffusers pipeline with random weights at a given size, from the components they
share (CLIP and T5 text encoders, the VAE, the demo tokenizer in every tokenizer slot), and
the copy of shipped trained weights. Callers fix the seed (``models.ensure_demo_model``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    DDIMScheduler,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinInpaintPipeline,
    Flux2Transformer2DModel,
    FluxFillPipeline,
    FluxInpaintPipeline,
    FluxKontextInpaintPipeline,
    FluxTransformer2DModel,
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
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
)

from retouch.functions.demo.tokenizer import qwen_tokenizer, save_tokenizer

TEXT_LEN = 16  # prompt tokens: the hand-written character tokenizer needs few
# FLUX.2 [klein]'s prompts: its chat template costs about 20 byte tokens of them
KLEIN_TEXT_LEN = 64
KLEIN_LATENT_CHANNELS = 32  # FLUX.2's VAE (128 channels once patchified 2x2)
# Z-Image prompts go through a chat template (19 byte tokens around the prompt)
Z_IMAGE_TEXT_LEN = 64


def _clip_text(hidden: int, layers: int = 2) -> CLIPTextModel:
    return CLIPTextModel(_clip_config(hidden, layers))


def _clip_config(hidden: int, layers: int = 2) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=138,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=2,
        max_position_embeddings=TEXT_LEN,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        projection_dim=hidden,
    )


def _t5(hidden: int) -> T5EncoderModel:
    return T5EncoderModel(
        T5Config(
            vocab_size=138,
            d_model=hidden,
            d_kv=hidden // 2,
            d_ff=hidden * 2,
            num_layers=2,
            num_heads=2,
            decoder_start_token_id=0,
            pad_token_id=1,
            eos_token_id=1,
        )
    )


def _vae(
    channels: tuple[int, ...],
    latent_channels: int,
    kind: type[AutoencoderKL | AutoencoderKLFlux2] = AutoencoderKL,
    **extra: float,
) -> AutoencoderKL | AutoencoderKLFlux2:
    n = len(channels)
    return kind(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=channels,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=min(32, channels[0]),
        **extra,
    )


def _save(folder: Path, make: Callable[[Any], DiffusionPipeline]) -> None:
    """Save ``make(tokenizer)``'s pipeline into ``folder``; the demo tokenizer serves every
    tokenizer slot (written to a scratch folder first, to be loaded as a tokenizer)."""
    tokenizer = save_tokenizer(folder / "_tokenizer", TEXT_LEN)
    make(tokenizer).save_pretrained(folder, safe_serialization=True)
    shutil.rmtree(folder / "_tokenizer")


def build_sd(
    folder: Path,
    *,
    unet_channels: tuple[int, ...],
    vae_channels: tuple[int, ...],
    resolution: int,
    head_dim: int,
    text_hidden: int,
) -> None:
    n = len(unet_channels)
    latent = resolution // 2 ** (len(vae_channels) - 1)
    unet = UNet2DConditionModel(
        sample_size=latent,
        in_channels=9,  # noisy latents + mask + masked-image latents
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D",) * n,
        up_block_types=("CrossAttnUpBlock2D",) * n,
        block_out_channels=unet_channels,
        layers_per_block=1,
        cross_attention_dim=text_hidden,
        attention_head_dim=head_dim,
        norm_num_groups=min(32, unet_channels[0]),
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    _save(
        folder,
        lambda tokenizer: StableDiffusionInpaintPipeline(
            vae=_vae(vae_channels, 4),
            text_encoder=_clip_text(text_hidden),
            tokenizer=tokenizer,
            unet=unet,
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        ),
    )


def build_flux(
    folder: Path,
    *,
    hidden_heads: int,
    head_dim: int,
    layers: int,
    single_layers: int,
    vae_channels: tuple[int, ...],
    text_hidden: int,
    fill: bool = False,
    kontext: bool = False,
) -> None:
    """A Flux DiT in FluxInpaintPipeline, or (``fill``) in FluxFillPipeline with FLUX.1-Fill's
    input layout: packed latents, packed masked-image latents and the packed mask, or
    (``kontext``) in FluxKontextInpaintPipeline (FLUX.1 Kontext's: the reference image's
    tokens follow the latents' in the image sequence)."""
    rope = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)
    factor = 2 ** (len(vae_channels) - 1)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64 + (64 + 4 * factor**2 if fill else 0),  # 16 latent channels packed 2x2
        out_channels=64 if fill else None,
        num_layers=layers,
        num_single_layers=single_layers,
        attention_head_dim=head_dim,
        num_attention_heads=hidden_heads,
        joint_attention_dim=text_hidden,
        pooled_projection_dim=text_hidden,
        guidance_embeds=True,  # guidance as an embedding, like FLUX.1-dev: no CFG halves
        axes_dims_rope=rope,
    )
    t5 = _t5(text_hidden)
    pipeline = (
        FluxFillPipeline if fill else FluxKontextInpaintPipeline if kontext else FluxInpaintPipeline
    )
    _save(
        folder,
        lambda tokenizer: pipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=_vae(vae_channels, 16, scaling_factor=0.3611, shift_factor=0.1159),
            text_encoder=_clip_text(text_hidden),
            tokenizer=tokenizer,
            text_encoder_2=t5,
            tokenizer_2=tokenizer,
            transformer=transformer,
        ),
    )


def build_flux2_klein(folder: Path, size: dict[str, Any]) -> None:
    """FLUX.2 [klein] (distilled) in Flux2KleinInpaintPipeline: a Flux2 DiT over 2x2-
    patchified, BatchNorm-normalised latents of FLUX.2's VAE, reading a Qwen3 text
    encoder's layers 9, 18 and 27 side by side (28 layers keep them intermediate). The
    VAE's BatchNorm statistics are set away from (0, 1), so that a missing normalisation
    shows. ``size``: a Flux size (:data:`TINY_KLEIN`)."""
    head_dim, text_hidden, vae_channels = (
        size["head_dim"],
        size["text_hidden"],
        size["vae_channels"],
    )
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * KLEIN_LATENT_CHANNELS,
        num_layers=size["layers"],
        num_single_layers=size["single_layers"],
        attention_head_dim=head_dim,
        num_attention_heads=size["hidden_heads"],
        joint_attention_dim=3 * text_hidden,
        axes_dims_rope=(head_dim // 4,) * 4,  # T, H, W, L
        guidance_embeds=False,  # distilled: neither an embedding nor CFG halves
    )
    vae = _vae(vae_channels, KLEIN_LATENT_CHANNELS, kind=AutoencoderKLFlux2)
    vae.bn.running_mean.normal_(0.0, 0.2)
    vae.bn.running_var.uniform_(0.5, 2.0)
    tokenizer = qwen_tokenizer(KLEIN_TEXT_LEN)
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=text_hidden,
            intermediate_size=2 * text_hidden,
            num_hidden_layers=28,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=text_hidden // 2,
            max_position_embeddings=2 * KLEIN_TEXT_LEN,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    Flux2KleinInpaintPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=True,
    ).save_pretrained(folder, safe_serialization=True)


def build_sd3(
    folder: Path,
    *,
    heads: int,
    head_dim: int,
    layers: int,
    vae_channels: tuple[int, ...],
    resolution: int,
    text_hidden: int,
) -> None:
    """An MMDiT with CLIP-L, CLIP-G (both with projections) and T5, like SD3-medium."""
    latent = resolution // 2 ** (len(vae_channels) - 1)
    transformer = SD3Transformer2DModel(
        sample_size=latent,
        patch_size=2,
        in_channels=16,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=2 * text_hidden,  # CLIP-L and CLIP-G side by side, T5's width
        caption_projection_dim=heads * head_dim,
        pooled_projection_dim=2 * text_hidden,
        out_channels=16,
        pos_embed_max_size=latent // 2,
    )
    _save(
        folder,
        lambda tokenizer: StableDiffusion3InpaintPipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=_vae(vae_channels, 16, scaling_factor=1.5305, shift_factor=0.0609),
            text_encoder=CLIPTextModelWithProjection(_clip_config(text_hidden)),
            tokenizer=tokenizer,
            text_encoder_2=CLIPTextModelWithProjection(_clip_config(text_hidden)),
            tokenizer_2=tokenizer,
            text_encoder_3=_t5(2 * text_hidden),
            tokenizer_3=tokenizer,
        ),
    )


@dataclass(frozen=True)
class SDXLSize:
    """A demo size of SDXL's inpainting layout (a factor-4 VAE under it)."""

    channels: tuple[int, ...]  # per UNet level; the first has no transformer blocks
    transformer_layers: tuple[int, ...]  # per level
    head_dim: int
    text_hidden: tuple[int, int]  # CLIP-L and CLIP-G widths
    # SDXL's CLIP-G has 32 blocks; diffusers tells an SGM checkpoint is SDXL by its tenth
    # (``resblocks.9``), so fewer would make the model's single files read as SD 1.x.
    clip_g_layers: int = 10


def sdxl_scheduler() -> EulerDiscreteScheduler:
    """The scheduler SDXL ships (Euler, scaled-linear betas, leading spacing)."""
    return EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )


def build_sdxl(folder: Path, size: SDXLSize, resolution: int) -> None:
    """SDXL's inpainting layout: a 9-channel UNet whose first level has no transformer
    blocks and whose deeper levels have several layers each, conditioned on CLIP-L and
    CLIP-G (hidden states side by side) plus CLIP-G's pooled projection and the time ids."""
    vae_channels = (16, 32, 32)
    n, head_dim = len(size.channels), size.head_dim
    clip_l, clip_g = size.text_hidden
    unet = UNet2DConditionModel(
        sample_size=resolution // 2 ** (len(vae_channels) - 1),
        in_channels=9,  # noisy latents + mask + masked-image latents
        out_channels=4,
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (n - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (n - 1) + ("UpBlock2D",),
        block_out_channels=size.channels,
        layers_per_block=1,
        transformer_layers_per_block=size.transformer_layers,
        attention_head_dim=tuple(max(1, c // head_dim) for c in size.channels),  # heads
        cross_attention_dim=clip_l + clip_g,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=head_dim,  # per time id (SDXL: 256)
        projection_class_embeddings_input_dim=6 * head_dim + clip_g,
        norm_num_groups=min(32, size.channels[0]),
    )
    _save(
        folder,
        lambda tokenizer: StableDiffusionXLInpaintPipeline(
            vae=_vae(vae_channels, 4, scaling_factor=0.13025),
            text_encoder=_clip_text(clip_l),
            text_encoder_2=CLIPTextModelWithProjection(_clip_config(clip_g, size.clip_g_layers)),
            tokenizer=tokenizer,
            tokenizer_2=tokenizer,
            unet=unet,
            scheduler=sdxl_scheduler(),
            add_watermarker=False,
        ),
    )


def copy_trained(source: Path, folder: Path) -> None:
    """Load shipped fp16 weights and save them as float32 (CPU executors compute in fp32)."""
    if not (source / "model_index.json").exists():
        raise FileNotFoundError(
            f"trained weights missing: {source} (train them with `retouch train-demo`)"
        )
    pipe = StableDiffusionInpaintPipeline.from_pretrained(
        source, dtype=torch.float32, safety_checker=None, requires_safety_checker=False
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    if (source / "training.json").exists():
        shutil.copyfile(source / "training.json", folder / "training.json")


def _qwen3_text(hidden: int, pad_token_id: int, max_length: int) -> Qwen3Model:
    """A two-layer Qwen3 base model (Z-Image reads its penultimate hidden states)."""
    return Qwen3Model(
        Qwen3Config(
            vocab_size=pad_token_id + 3,  # the byte alphabet, then Qwen's three specials
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=hidden // 2,
            max_position_embeddings=max_length,
            pad_token_id=pad_token_id,
            use_cache=False,
        )
    )


def build_z_image(
    folder: Path,
    *,
    dim: int,
    heads: int,
    layers: int,
    refiner_layers: int,
    vae_channels: tuple[int, ...],
    text_hidden: int,
    grid: int,
) -> None:
    """A Z-Image single-stream DiT in ZImageInpaintPipeline: a Qwen3 text encoder with
    Qwen's byte-level tokenizer and chat template, the FLUX.1 VAE's layout (16 channels,
    its scale and shift), a flow-matching scheduler with Z-Image-Turbo's shift. The pad
    tokens are drawn at random (zeros would hide a pad token put where it does not go);
    ``grid``: the longest side of the token grid the RoPE tables cover."""
    head = dim // heads
    axes = (head // 2, head // 4, head // 4)
    tokenizer = qwen_tokenizer(Z_IMAGE_TEXT_LEN)
    transformer = ZImageTransformer2DModel(
        in_channels=16,
        dim=dim,
        n_layers=layers,
        n_refiner_layers=refiner_layers,
        n_heads=heads,
        n_kv_heads=heads,
        cap_feat_dim=text_hidden,
        axes_dims=list(axes),
        axes_lens=[2 * Z_IMAGE_TEXT_LEN, grid, grid],
    )
    with torch.no_grad():
        transformer.x_pad_token.normal_()
        transformer.cap_pad_token.normal_()
    pipe = ZImageInpaintPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(vae_channels, 16, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=_qwen3_text(text_hidden, tokenizer.pad_token_id, Z_IMAGE_TEXT_LEN),
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
