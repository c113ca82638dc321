"""LoRA files as users have them, made offline for the adapter tests: :func:`write_lora`
(``runtime/demoloras``, shared with ``retouch bench adapters``) and :func:`wider_text_lora`,
a LoRA for another base model's text encoder.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from retouch.runtime.demoloras import write_lora

__all__ = ["wider_text_lora", "write_lora"]


def wider_text_lora(lora: Path, target: Path, width: int) -> Path:
    """``lora`` with its text-encoder part made for a text encoder ``width`` wide (another
    base model's): each projection's A and B redrawn at that width, the rest kept."""
    tensors = load_file(str(lora))
    generator = torch.Generator().manual_seed(width)
    for key, value in tensors.items():
        if key.startswith("text_encoder."):
            rank = min(value.shape)
            shape = (rank, width) if ".lora_A." in key else (width, rank)
            tensors[key] = torch.randn(shape, generator=generator) * 0.05
    save_file(tensors, str(target))
    return target
