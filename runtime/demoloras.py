"""Random LoRA files for the built-in demo models (tests and ``retouch bench adapters``).

:func:`write_lora` adds a randomly initialised LoRA (PEFT) to a built model's denoiser (and,
if asked, its text encoder) and saves it with the pipeline's own ``save_lora_weights``: the
diffusers layout ``pytorch_lora_weights.safetensors`` that ``load_lora_weights`` reads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.utils import get_peft_model_state_dict

from retouch.functions.demo.models import ensure_demo_model
from retouch.runtime.models import load_pipeline

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_ATTENTION = ["q_proj", "k_proj", "v_proj", "out_proj"]


def write_lora(
    model: str,
    models_dir: Path,
    target: Path,
    *,
    family: str = "sd-inpaint",
    rank: int = 4,
    seed: int = 0,
    text_encoder: bool = False,
    std: float = 0.05,
) -> Path:
    """A LoRA of ``rank`` for the built-in ``model`` (its attention projections), weights
    drawn from ``seed`` with ``std`` (large enough to change an image), saved as
    ``target/pytorch_lora_weights.safetensors``; returns that file."""
    folder = ensure_demo_model(model, models_dir)
    pipe = load_pipeline(folder, family, torch.device("cpu"))
    denoiser_name = "unet" if hasattr(pipe, "unet") and pipe.unet is not None else "transformer"
    denoiser = getattr(pipe, denoiser_name)
    generator = torch.Generator().manual_seed(seed)
    layers: dict[str, dict[str, torch.Tensor]] = {}
    denoiser.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=ATTENTION))
    layers[f"{denoiser_name}_lora_layers"] = _randomised(denoiser, generator, std)
    if text_encoder:
        # peft's own injection: transformers' ``add_adapter`` wants a newer peft than the
        # registry has (the runtime loads text-encoder LoRAs the same way).
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=TEXT_ATTENTION)
        inject_adapter_in_model(config, pipe.text_encoder)
        layers["text_encoder_lora_layers"] = _randomised(pipe.text_encoder, generator, std)
    target.mkdir(parents=True, exist_ok=True)
    type(pipe).save_lora_weights(target, safe_serialization=True, **layers)
    return target / "pytorch_lora_weights.safetensors"


def _randomised(
    module: torch.nn.Module, generator: torch.Generator, std: float
) -> dict[str, torch.Tensor]:
    """The module's LoRA state with every A and B matrix drawn at random (PEFT zeroes B, so
    a fresh LoRA would change nothing)."""
    state = get_peft_model_state_dict(module)
    return {k: torch.randn(v.shape, generator=generator) * std for k, v in state.items()}
