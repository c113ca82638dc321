"""Diffusers pipelines' weights written back in the original key layouts of single-file
checkpoints (as A1111, ComfyUI and the model authors ship them): the inverse of diffusers'
``single_file_utils`` conversions, so the loading tests can build such files offline.

* :func:`ldm_checkpoint`: Stable Diffusion (UNet, VAE, CLIP text encoder), LDM layout.
* :func:`sgm_checkpoint`: SDXL inpainting (UNet with its ``label_emb``, VAE, CLIP-L and
  OpenCLIP ViT-bigG in its own layout), the SGM layout of ``sd_xl_base_1.0_inpainting_0.1``.
"""

from __future__ import annotations

import torch
from diffusers import StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline

UNET_RESNET = (
    ("norm1", "in_layers.0"),
    ("conv1", "in_layers.2"),
    ("norm2", "out_layers.0"),
    ("conv2", "out_layers.3"),
    ("time_emb_proj", "emb_layers.1"),
    ("conv_shortcut", "skip_connection"),
)
UNET_TOP = (
    ("time_embedding.linear_1", "time_embed.0"),
    ("time_embedding.linear_2", "time_embed.2"),
    ("conv_in", "input_blocks.0.0"),
    ("conv_norm_out", "out.0"),
    ("conv_out", "out.2"),
)
VAE_ATTENTION = (
    ("group_norm", "norm"),
    ("to_q", "q"),
    ("to_k", "k"),
    ("to_v", "v"),
    ("to_out.0", "proj_out"),
)


def _rename(key: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for new, old in pairs:
        key = key.replace(f".{new}.", f".{old}.")
    return key


def _unet_prefixes(config: dict) -> list[tuple[str, str]]:
    """(diffusers prefix, LDM prefix) of every UNet block, as ``convert_ldm_unet_checkpoint``
    numbers them: ``layers_per_block + 1`` input blocks per level, one more output block."""
    per, levels = config["layers_per_block"], len(config["block_out_channels"])
    pairs = []
    for b in range(levels):
        for j in range(per):
            n = b * (per + 1) + j + 1
            pairs += [
                (f"down_blocks.{b}.resnets.{j}", f"input_blocks.{n}.0"),
                (f"down_blocks.{b}.attentions.{j}", f"input_blocks.{n}.1"),
            ]
        pairs.append(
            (f"down_blocks.{b}.downsamplers.0.conv", f"input_blocks.{(b + 1) * (per + 1)}.0.op")
        )
        for j in range(per + 1):
            n = b * (per + 1) + j
            pairs += [
                (f"up_blocks.{b}.resnets.{j}", f"output_blocks.{n}.0"),
                (f"up_blocks.{b}.attentions.{j}", f"output_blocks.{n}.1"),
            ]
        pairs.append(
            (f"up_blocks.{b}.upsamplers.0.conv", f"output_blocks.{b * (per + 1) + per}.2.conv")
        )
    pairs += [
        ("mid_block.resnets.0", "middle_block.0"),
        ("mid_block.attentions.0", "middle_block.1"),
        ("mid_block.resnets.1", "middle_block.2"),
    ]
    return pairs


def _unet_key(key: str, prefixes: list[tuple[str, str]]) -> str:
    for new, old in UNET_TOP:
        if key.startswith(new + "."):
            return old + key[len(new) :]
    for new, old in prefixes:
        if key.startswith(new + "."):
            rest = key[len(new) :]
            return old + (_rename(rest, UNET_RESNET) if ".resnets." in new else rest)
    raise KeyError(key)


def _vae_key(key: str, levels: int) -> str:
    half, _, rest = key.partition(".")
    rest = "." + rest
    for b in range(levels):
        rest = rest.replace(f".down_blocks.{b}.resnets.", f".down.{b}.block.")
        rest = rest.replace(f".down_blocks.{b}.downsamplers.0.", f".down.{b}.downsample.")
        rest = rest.replace(f".up_blocks.{b}.resnets.", f".up.{levels - 1 - b}.block.")
        rest = rest.replace(f".up_blocks.{b}.upsamplers.0.", f".up.{levels - 1 - b}.upsample.")
    rest = rest.replace(".mid_block.resnets.0.", ".mid.block_1.")
    rest = rest.replace(".mid_block.resnets.1.", ".mid.block_2.")
    if ".mid_block.attentions.0." in rest:
        rest = _rename(rest.replace(".mid_block.attentions.0.", ".mid.attn_1."), VAE_ATTENTION)
    rest = rest.replace(".conv_shortcut.", ".nin_shortcut.").replace(
        ".conv_norm_out.", ".norm_out."
    )
    return (
        f"first_stage_model.{half}{rest}"
        if half in ("encoder", "decoder")
        else f"first_stage_model.{key}"
    )


def ldm_checkpoint(pipe: StableDiffusionInpaintPipeline) -> dict[str, torch.Tensor]:
    """The pipeline's UNet, VAE and CLIP text encoder in the original SD checkpoint layout."""
    prefixes = _unet_prefixes(dict(pipe.unet.config))
    levels = len(pipe.vae.config.block_out_channels)
    out = {
        "model.diffusion_model." + _unet_key(k, prefixes): v
        for k, v in pipe.unet.state_dict().items()
    }
    out |= {_vae_key(k, levels): v for k, v in pipe.vae.state_dict().items()}
    text = pipe.text_encoder.state_dict()  # transformers 5 names them without text_model.
    prefix = "cond_stage_model.transformer.text_model."
    out |= {prefix + k.removeprefix("text_model."): v for k, v in text.items()}
    return {k: v.contiguous() for k, v in out.items()}


# -- SDXL inpainting: the SGM layout --------------------------------------------------------

SGM_CLIP_L = "conditioner.embedders.0.transformer.text_model."
SGM_OPEN_CLIP = "conditioner.embedders.1.model."
# SDXL's pooled-text and time-id embedding: ``label_emb.0`` is a Linear, SiLU, Linear.
UNET_ADDITION = [
    ("add_embedding.linear_1", "label_emb.0.0"),
    ("add_embedding.linear_2", "label_emb.0.2"),
]
OPEN_CLIP_TOP = {
    "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
    "text_model.embeddings.position_embedding.weight": "positional_embedding",
    "text_model.final_layer_norm.weight": "ln_final.weight",
    "text_model.final_layer_norm.bias": "ln_final.bias",
}
OPEN_CLIP_LAYER = (
    ("layer_norm1", "ln_1"),
    ("layer_norm2", "ln_2"),
    ("mlp.fc1", "mlp.c_fc"),
    ("mlp.fc2", "mlp.c_proj"),
    ("self_attn.out_proj", "attn.out_proj"),
)
VAE_ATTENTION_WEIGHTS = tuple(f".mid.attn_1.{name}.weight" for name in ("q", "k", "v", "proj_out"))


def _sgm_vae(pipe: StableDiffusionXLInpaintPipeline) -> dict[str, torch.Tensor]:
    """The VAE in the SD layout, its mid attention's projections the 1x1 convolutions the
    original ``AttnBlock`` has (diffusers flattens them back to linear weights)."""
    levels = len(pipe.vae.config.block_out_channels)
    out = {_vae_key(k, levels): v for k, v in pipe.vae.state_dict().items()}
    return {
        k: v[..., None, None] if k.endswith(VAE_ATTENTION_WEIGHTS) else v for k, v in out.items()
    }


def _open_clip(text_encoder_2: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CLIP-G as OpenCLIP names it: fused ``attn.in_proj_*`` (q, k, v stacked), ``mlp.c_fc``,
    ``ln_final``, and ``text_projection`` as the matrix text features are multiplied by
    (the transpose of the Linear weight)."""
    state = text_encoder_2.state_dict()
    out = {SGM_OPEN_CLIP + "text_projection": state.pop("text_projection.weight").T}
    out |= {SGM_OPEN_CLIP + new: state.pop(old) for old, new in OPEN_CLIP_TOP.items()}
    for layer in range(text_encoder_2.config.num_hidden_layers):
        old = f"text_model.encoder.layers.{layer}."
        new = f"{SGM_OPEN_CLIP}transformer.resblocks.{layer}."
        for kind in ("weight", "bias"):
            qkv = [state.pop(f"{old}self_attn.{p}_proj.{kind}") for p in "qkv"]
            out[f"{new}attn.in_proj_{kind}"] = torch.cat(qkv)
        for key in [k for k in state if k.startswith(old)]:
            out[new + _rename("." + key.removeprefix(old), OPEN_CLIP_LAYER)[1:]] = state.pop(key)
    if state:
        raise KeyError(f"CLIP-G weights with no OpenCLIP name: {sorted(state)}")
    return out


def sgm_checkpoint(pipe: StableDiffusionXLInpaintPipeline) -> dict[str, torch.Tensor]:
    """The pipeline's UNet, VAE and both text encoders in the original SDXL checkpoint
    layout (Stability's ``sgm``), as ``sd_xl_base_1.0_inpainting_0.1.safetensors`` and the
    community SDXL inpainting files have it."""
    prefixes = _unet_prefixes(dict(pipe.unet.config)) + UNET_ADDITION
    out = {
        "model.diffusion_model." + _unet_key(k, prefixes): v
        for k, v in pipe.unet.state_dict().items()
    }
    out |= _sgm_vae(pipe)
    clip_l = pipe.text_encoder.state_dict()  # transformers 5 names them without text_model.
    out |= {SGM_CLIP_L + k.removeprefix("text_model."): v for k, v in clip_l.items()}
    out |= _open_clip(pipe.text_encoder_2)
    return {k: v.contiguous() for k, v in out.items()}
