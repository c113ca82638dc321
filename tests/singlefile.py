"""Diffusers pipelines' weights written back in the original key layouts of single-file
checkpoints (as A1111, ComfyUI and the model authors ship them): the inverse of diffusers'
``single_file_utils`` conversions, so the loading tests can build such files offline.

* :func:`ldm_checkpoint`: Stable Diffusion (UNet, VAE, CLIP text encoder), LDM layout.
* :func:`sgm_checkpoint`: SDXL inpainting (UNet with its ``label_emb``, VAE, CLIP-L and
  OpenCLIP ViT-bigG in its own layout), the SGM layout of ``sd_xl_base_1.0_inpainting_0.1``.
* :func:`sd3_checkpoint`: Stable Diffusion 3 as Stability ships ``sd3_medium*.safetensors``
  (MMDiT and VAE; optionally its CLIP-L, CLIP-G and T5-XXL text encoders).
* :func:`leaving_out`: any of them without some components (a VAE-less merge, a UNet-only
  save).
* :func:`bfl_flux_checkpoint`: a Flux transformer alone (FLUX.1-dev, FLUX.1-Fill-dev), in
  Black Forest Labs' layout, bare or with ComfyUI's ``model.diffusion_model.`` prefix.
"""

from __future__ import annotations

import torch
from diffusers import (
    StableDiffusion3InpaintPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionXLInpaintPipeline,
)

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


def leaving_out(checkpoint: dict[str, torch.Tensor], *prefixes: str) -> dict[str, torch.Tensor]:
    """A checkpoint without the tensors under ``prefixes``: a merge saved without its VAE
    (``first_stage_model.``), a UNet-only file (all but ``model.diffusion_model.``
    left out, with the text encoders' prefixes too)."""
    return {k: v for k, v in checkpoint.items() if not k.startswith(prefixes)}


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


# -- Stable Diffusion 3 -----------------------------------------------------------------------

SD3_TOP = (  # (diffusers, original) outside the joint blocks
    ("pos_embed.pos_embed", "pos_embed"),
    ("pos_embed.proj.", "x_embedder.proj."),
    ("time_text_embed.timestep_embedder.linear_1.", "t_embedder.mlp.0."),
    ("time_text_embed.timestep_embedder.linear_2.", "t_embedder.mlp.2."),
    ("time_text_embed.text_embedder.linear_1.", "y_embedder.mlp.0."),
    ("time_text_embed.text_embedder.linear_2.", "y_embedder.mlp.2."),
    ("context_embedder.", "context_embedder."),
    ("proj_out.", "final_layer.linear."),
    ("norm_out.linear.", "final_layer.adaLN_modulation.1."),
)
SD3_BLOCK = (  # (diffusers, original) inside joint block i
    ("attn.to_out.0.", "x_block.attn.proj."),
    ("attn.to_add_out.", "context_block.attn.proj."),
    ("attn.norm_q.", "x_block.attn.ln_q."),
    ("attn.norm_k.", "x_block.attn.ln_k."),
    ("attn.norm_added_q.", "context_block.attn.ln_q."),
    ("attn.norm_added_k.", "context_block.attn.ln_k."),
    ("attn2.to_out.0.", "x_block.attn2.proj."),
    ("attn2.norm_q.", "x_block.attn2.ln_q."),
    ("attn2.norm_k.", "x_block.attn2.ln_k."),
    ("norm1.linear.", "x_block.adaLN_modulation.1."),
    ("norm1_context.linear.", "context_block.adaLN_modulation.1."),
    ("ff.net.0.proj.", "x_block.mlp.fc1."),
    ("ff.net.2.", "x_block.mlp.fc2."),
    ("ff_context.net.0.proj.", "context_block.mlp.fc1."),
    ("ff_context.net.2.", "context_block.mlp.fc2."),
)
SD3_QKV = (  # diffusers' separate projections, fused into one original qkv
    ("attn.to_{}.", "x_block.attn.qkv."),
    ("attn.add_{}_proj.", "context_block.attn.qkv."),
    ("attn2.to_{}.", "x_block.attn2.qkv."),
)
# The text encoders' names in the original file, in the pipeline's order (CLIP-L, CLIP-G, T5).
SD3_TEXT = ("clip_l", "clip_g", "t5xxl")


def _swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """The original AdaLN-continuous order (shift, scale) of diffusers' (scale, shift): the
    swap diffusers' SD3 and Flux conversions undo."""
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first])


def _mmdit_block(i: int, block: dict[str, torch.Tensor], last: bool) -> dict[str, torch.Tensor]:
    """Joint block ``i`` (its keys without the ``transformer_blocks.i.`` prefix)."""
    out = {}
    for new, old in SD3_QKV:
        for kind in ("weight", "bias"):
            parts = [block.pop(new.format(x) + kind, None) for x in "qkv"]
            if parts[0] is not None:
                out[old + kind] = torch.cat(parts)
    for key, value in block.items():
        new, old = next((n, o) for n, o in SD3_BLOCK if key.startswith(n))
        if last and new == "norm1_context.linear.":  # the context stream's last norm
            value = _swap_halves(value)
        out[old + key[len(new) :]] = value
    return {f"joint_blocks.{i}.{k}": v for k, v in out.items()}


def _mmdit(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An ``SD3Transformer2DModel`` state dict in the original MMDiT key layout."""
    blocks: dict[int, dict[str, torch.Tensor]] = {}
    out = {}
    for key, value in state.items():
        if key.startswith("transformer_blocks."):
            _, i, rest = key.split(".", 2)
            blocks.setdefault(int(i), {})[rest] = value
            continue
        new, old = next((n, o) for n, o in SD3_TOP if key.startswith(n))
        out[old + key[len(new) :]] = (
            _swap_halves(value) if old.startswith("final_layer.ada") else value
        )
    for i, block in blocks.items():
        out |= _mmdit_block(i, block, last=i == max(blocks))
    return out


def sd3_checkpoint(
    pipe: StableDiffusion3InpaintPipeline, text_encoders: bool = False
) -> dict[str, torch.Tensor]:
    """The pipeline's MMDiT and VAE in the layout of Stability's ``sd3_medium.safetensors``;
    with ``text_encoders``, its CLIP-L, CLIP-G and T5 as in
    ``sd3_medium_incl_clips_t5xxlfp16.safetensors``. CLIP-L is written without its text
    projection: the original has none, and diffusers loads it as the identity."""
    levels = len(pipe.vae.config.block_out_channels)
    out = {
        "model.diffusion_model." + k: v for k, v in _mmdit(pipe.transformer.state_dict()).items()
    }
    out |= {_vae_key(k, levels): v for k, v in pipe.vae.state_dict().items()}
    encoders = ("text_encoder", "text_encoder_2", "text_encoder_3") if text_encoders else ()
    for name, encoder in zip(SD3_TEXT, encoders, strict=False):
        state = getattr(pipe, encoder).state_dict()
        if name == "clip_l":
            state.pop("text_projection.weight")
        out |= {f"text_encoders.{name}.transformer.{k}": v for k, v in state.items()}
    return {k: v.contiguous().clone() for k, v in out.items()}  # T5's tied embeddings: twice


# -- Flux: the transformer alone, in Black Forest Labs' layout -------------------------------

FLUX_TOP = (
    ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
    ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
    ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
    ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
    ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
    ("context_embedder", "txt_in"),
    ("x_embedder", "img_in"),
    ("proj_out", "final_layer.linear"),
)
FLUX_DOUBLE = (  # transformer_blocks.N.<diffusers> -> double_blocks.N.<BFL>
    ("norm1.linear", "img_mod.lin"),
    ("norm1_context.linear", "txt_mod.lin"),
    ("attn.norm_q.weight", "img_attn.norm.query_norm.scale"),
    ("attn.norm_k.weight", "img_attn.norm.key_norm.scale"),
    ("attn.norm_added_q.weight", "txt_attn.norm.query_norm.scale"),
    ("attn.norm_added_k.weight", "txt_attn.norm.key_norm.scale"),
    ("attn.to_out.0", "img_attn.proj"),
    ("attn.to_add_out", "txt_attn.proj"),
    ("ff.net.0.proj", "img_mlp.0"),
    ("ff.net.2", "img_mlp.2"),
    ("ff_context.net.0.proj", "txt_mlp.0"),
    ("ff_context.net.2", "txt_mlp.2"),
)
FLUX_SINGLE = (  # single_transformer_blocks.N.<diffusers> -> single_blocks.N.<BFL>
    ("norm.linear", "modulation.lin"),
    ("attn.norm_q.weight", "norm.query_norm.scale"),
    ("attn.norm_k.weight", "norm.key_norm.scale"),
    ("proj_out", "linear2"),
)
# Fused projections: BFL's name, then the diffusers parts concatenated (in that order).
FLUX_FUSED = {
    "transformer_blocks": (
        ("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
        ("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
    ),
    "single_transformer_blocks": (
        ("linear1", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")),
    ),
}
FLUX_BLOCKS = {"transformer_blocks": "double_blocks", "single_transformer_blocks": "single_blocks"}
COMFY_PREFIX = "model.diffusion_model."  # ComfyUI's re-saves keep the LDM wrapper's prefix


def _flux_block_key(key: str) -> str:
    """``transformer_blocks.3.ff.net.2.bias`` -> ``double_blocks.3.img_mlp.2.bias``."""
    blocks, n, rest = key.split(".", 2)
    pairs = FLUX_DOUBLE if blocks == "transformer_blocks" else FLUX_SINGLE
    for new, old in pairs:
        if rest == new or rest.startswith(new + "."):
            return f"{FLUX_BLOCKS[blocks]}.{n}.{old}{rest[len(new) :]}"
    raise KeyError(key)


def _flux_key(key: str) -> str:
    if key.split(".", 1)[0] in FLUX_BLOCKS:
        return _flux_block_key(key)
    for new, old in FLUX_TOP:
        if key.startswith(new + "."):
            return old + key[len(new) :]
    raise KeyError(key)


def bfl_flux_checkpoint(
    transformer: dict[str, torch.Tensor], prefix: str = ""
) -> dict[str, torch.Tensor]:
    """A Flux transformer's state dict as BFL ship ``flux1-*.safetensors`` (fused q/k/v,
    the single blocks' fused ``linear1``, ``final_layer.adaLN_modulation`` in (shift, scale)
    order); ``prefix``: :data:`COMFY_PREFIX` for ComfyUI's re-saves."""
    state = dict(transformer)
    out = {}
    for blocks, fused in FLUX_FUSED.items():
        for n in sorted({int(k.split(".")[1]) for k in state if k.startswith(blocks + ".")}):
            for name, parts in fused:
                for suffix in ("weight", "bias"):
                    keys = [f"{blocks}.{n}.{part}.{suffix}" for part in parts]
                    out[f"{FLUX_BLOCKS[blocks]}.{n}.{name}.{suffix}"] = torch.cat(
                        [state.pop(k) for k in keys]
                    )
    for suffix in ("weight", "bias"):
        modulation = _swap_halves(state.pop(f"norm_out.linear.{suffix}"))
        out[f"final_layer.adaLN_modulation.1.{suffix}"] = modulation
    out |= {_flux_key(k): v for k, v in state.items()}
    return {prefix + k: v.contiguous() for k, v in out.items()}
