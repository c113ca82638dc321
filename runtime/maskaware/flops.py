"""Analytic FLOPs of one denoising step, full and mask-aware, from a model's config.

The count is what the two paths compute: every convolution and every matmul (2 FLOPs per
multiply-add) and attention's QKᵀ and AV; norms, activations and elementwise ops are left
out, as ``torch.utils.flop_counter`` leaves them out. A mask-aware step computes the
token-wise matmuls of the ``m·N`` masked tokens of each grid, their queries against all
``N`` keys, and everything else (UNet convolutions, text tokens, timestep embeddings) in
full. The ratio of the two is the ideal that measured speed-ups are held against, and an
input of the cost model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flops:
    """FLOPs split into dense work (convs, token-wise matmuls) and attention (QKᵀ, AV)."""

    dense: float = 0.0
    attention: float = 0.0

    @property
    def total(self) -> float:
        return self.dense + self.attention

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.dense + other.dense, self.attention + other.attention)

    def __mul__(self, factor: float) -> Flops:
        return Flops(self.dense * factor, self.attention * factor)


@dataclass(frozen=True)
class StepFlops:
    """One step of a batch, both ways."""

    full: Flops
    maskaware: Flops

    @property
    def ratio(self) -> float:
        return self.maskaware.total / self.full.total


def step_flops(
    family: str,
    config: Mapping[str, Any],
    mask_ratio: float,
    batch: int,
    *,
    latent_size: tuple[int, int],
    text_len: int,
) -> tuple[float, float]:
    """(full, mask-aware) FLOPs of one step for ``batch`` requests at ``mask_ratio``.

    ``config`` is the denoiser's config (``unet.config`` or ``transformer.config``),
    ``latent_size`` the VAE latent grid and ``text_len`` the prompt length in tokens.
    """
    flops = step_flop_breakdown(
        family, config, mask_ratio, batch, latent_size=latent_size, text_len=text_len
    )
    return flops.full.total, flops.maskaware.total


def step_flop_breakdown(
    family: str,
    config: Mapping[str, Any],
    mask_ratio: float,
    batch: int,
    *,
    latent_size: tuple[int, int],
    text_len: int,
) -> StepFlops:
    """:func:`step_flops` with the dense / attention split."""
    if not 0.0 <= mask_ratio <= 1.0:
        raise ValueError(f"mask ratio {mask_ratio} is not in [0, 1]")
    if family == "sd-inpaint":
        full = unet_flops(config, latent_size, text_len, 1.0)
        sparse = unet_flops(config, latent_size, text_len, mask_ratio)
        rows = 2 * batch  # classifier-free guidance halves
    elif family == "flux-inpaint":
        full = flux_flops(config, latent_size, text_len, 1.0)
        sparse = flux_flops(config, latent_size, text_len, mask_ratio)
        rows = batch
    else:
        raise ValueError(f"no FLOP model for family {family!r}")
    return StepFlops(full * rows, sparse * rows)


def pipeline_step_flops(
    pipe: Any, family: str, height: int, width: int, mask_ratio: float, batch: int
) -> StepFlops:
    """:func:`step_flop_breakdown` for a loaded pipeline at an image size."""
    factor = pipe.vae_scale_factor
    if family == "flux-inpaint":
        config = pipe.transformer.config
        text_len = pipe.tokenizer_2.model_max_length
        latent = (2 * (height // (factor * 2)), 2 * (width // (factor * 2)))
    else:
        config = pipe.unet.config
        text_len = pipe.tokenizer.model_max_length
        latent = (height // factor, width // factor)
    return step_flop_breakdown(
        family, config, mask_ratio, batch, latent_size=latent, text_len=text_len
    )


def _linear(tokens: float, fan_in: int, fan_out: int) -> float:
    return 2.0 * tokens * fan_in * fan_out


def _conv(pixels: float, fan_in: int, fan_out: int, kernel: int = 3) -> float:
    return 2.0 * pixels * fan_in * fan_out * kernel * kernel


# -- UNet ---------------------------------------------------------------------------------


def unet_flops(
    config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
) -> Flops:
    """One row of a ``UNet2DConditionModel`` with cross-attention blocks at mask ratio ``ratio``."""
    channels = list(config["block_out_channels"])
    levels = len(channels)
    sizes = [latent_size]
    for _ in range(levels - 1):
        h, w = sizes[-1]
        sizes.append(((h + 1) // 2, (w + 1) // 2))
    pixels = [h * w for h, w in sizes]
    per_block = _per_level(config.get("transformer_layers_per_block", 1), levels)
    temb = channels[0] * 4
    layers = config["layers_per_block"]
    text_dim = config["cross_attention_dim"]

    def resnet(level: int, cin: int, cout: int) -> Flops:
        n = pixels[level]
        dense = _conv(n, cin, cout) + _conv(n, cout, cout) + _linear(1, temb, cout)
        if cin != cout:
            dense += _conv(n, cin, cout, kernel=1)
        return Flops(dense)

    def transformer(level: int, width: int) -> Flops:
        return _unet_transformer(pixels[level], width, per_block[level], text_len, text_dim, ratio)

    total = Flops(_conv(pixels[0], config["in_channels"], channels[0]))
    total += Flops(_linear(1, channels[0], temb) + _linear(1, temb, temb))  # timestep MLP
    for i, out in enumerate(channels):  # down path
        for j in range(layers):
            total += resnet(i, channels[max(i - 1, 0)] if j == 0 else out, out)
            total += transformer(i, out)
        if i < levels - 1:
            total += Flops(_conv(pixels[i + 1], out, out))  # stride-2 downsampler
    deepest = channels[-1]
    total += resnet(levels - 1, deepest, deepest) + transformer(levels - 1, deepest)
    total += resnet(levels - 1, deepest, deepest)
    reversed_channels = channels[::-1]
    output = reversed_channels[0]
    for i in range(levels):  # up path
        level = levels - 1 - i
        previous, output = output, reversed_channels[i]
        skip_in = reversed_channels[min(i + 1, levels - 1)]
        for j in range(layers + 1):
            skip = skip_in if j == layers else output
            total += resnet(level, (previous if j == 0 else output) + skip, output)
            total += transformer(level, output)
        if level > 0:
            total += Flops(_conv(pixels[level - 1], output, output))  # upsampler conv
    return total + Flops(_conv(pixels[0], channels[0], config["out_channels"]))


def _per_level(value: int | list[int] | tuple[int, ...], levels: int) -> list[int]:
    return [value] * levels if isinstance(value, int) else list(value)


def _unet_transformer(
    n_tokens: int, width: int, depth: int, text_len: int, text_dim: int, ratio: float
) -> Flops:
    """A Transformer2DModel: proj_in/out, then ``depth`` BasicTransformerBlocks (GEGLU FFN)."""
    masked = ratio * n_tokens
    dense = 2 * _linear(masked, width, width)  # proj_in, proj_out
    attention = 0.0
    for _ in range(depth):
        dense += 4 * _linear(masked, width, width)  # attn1 q, k, v, out
        dense += 2 * _linear(masked, width, width) + 2 * _linear(text_len, text_dim, width)  # attn2
        dense += _linear(masked, width, 8 * width) + _linear(masked, 4 * width, width)  # GEGLU FFN
        attention += 2 * 2.0 * masked * n_tokens * width  # self-attention QKᵀ, AV
        attention += 2 * 2.0 * masked * text_len * width  # cross-attention
    return Flops(dense, attention)


# -- Flux ---------------------------------------------------------------------------------


def flux_flops(
    config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
) -> Flops:
    """One row of a ``FluxTransformer2DModel`` at mask ratio ``ratio`` (2×2-packed tokens)."""
    n_tokens = (latent_size[0] // 2) * (latent_size[1] // 2)
    masked = ratio * n_tokens
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    cin = config["in_channels"]
    cout = config.get("out_channels") or cin
    queries, keys = text_len + masked, text_len + n_tokens
    embed = 2 * (_linear(1, 256, dim) + _linear(1, dim, dim))  # timestep, guidance
    embed += _linear(1, config["pooled_projection_dim"], dim) + _linear(1, dim, dim)
    if not config.get("guidance_embeds", False):
        embed -= _linear(1, 256, dim) + _linear(1, dim, dim)
    dense = (
        embed + _linear(masked, cin, dim) + _linear(text_len, config["joint_attention_dim"], dim)
    )
    attention = 0.0
    for _ in range(config["num_layers"]):  # dual-stream blocks
        dense += 2 * _linear(1, dim, 6 * dim)  # adaLN of both streams
        for tokens in (masked, text_len):
            dense += 4 * _linear(tokens, dim, dim) + 2 * _linear(tokens, dim, 4 * dim)
        attention += 2 * 2.0 * queries * keys * dim
    for _ in range(config["num_single_layers"]):  # single-stream blocks
        dense += _linear(1, dim, 3 * dim)
        dense += 3 * _linear(queries, dim, dim) + _linear(queries, dim, 4 * dim)
        dense += _linear(queries, 5 * dim, dim)
        attention += 2 * 2.0 * queries * keys * dim
    dense += _linear(1, dim, 2 * dim) + _linear(masked, dim, cout)  # norm_out, proj_out
    return Flops(dense, attention)
