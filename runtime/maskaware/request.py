"""An edit request and the state it carries between denoising steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from retouch.runtime.maskaware.store import ActivationReader, ActivationWriter
from retouch.runtime.maskaware.tokens import TokenSet


@dataclass(frozen=True)
class EditRequest:
    """Paint ``mask`` (True = edit) of a template image with ``prompt``.

    ``template_prompt`` and ``template_seed`` name the bake whose activations the edit reuses;
    ``seed`` drives only the masked region.
    """

    image: Image.Image
    mask: np.ndarray
    prompt: str
    seed: int
    steps: int
    guidance: float
    template_prompt: str
    template_seed: int

    def __post_init__(self) -> None:
        if self.mask.shape != (self.image.height, self.image.width):
            raise ValueError(
                f"mask is {self.mask.shape}, image is {(self.image.height, self.image.width)}"
            )

    @property
    def mask_ratio(self) -> float:
        return float(np.asarray(self.mask, dtype=bool).mean())

    def mask_image(self) -> Image.Image:
        """The mask as the pipelines take it (white = repaint)."""
        return Image.fromarray(np.asarray(self.mask, dtype=bool).astype(np.uint8) * 255)


@dataclass
class RequestState:
    """One request between steps: latents, its own scheduler and where its cache lives.

    ``inputs`` holds the family's per-request model inputs (text embeddings, masks, ...);
    ``tokens`` the masked-token set per token grid.
    """

    request: EditRequest
    latents: torch.Tensor
    scheduler: Any
    timesteps: torch.Tensor
    inputs: Any
    tokens: dict[tuple[int, int], TokenSet]
    reader: ActivationReader | None = None
    writer: ActivationWriter | None = None
    index: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.index >= len(self.timesteps)

    @property
    def timestep(self) -> torch.Tensor:
        return self.timesteps[self.index]

    @property
    def last(self) -> bool:
        return self.index == len(self.timesteps) - 1


def check_batchable(requests: list[EditRequest]) -> EditRequest:
    """The first request, after checking that one stock pipeline call can serve them all."""
    if not requests:
        raise ValueError("no requests")
    first = requests[0]
    for request in requests[1:]:
        if request.image.size != first.image.size:
            raise ValueError("a stock batch needs one image size")
        if (request.steps, request.guidance) != (first.steps, first.guidance):
            raise ValueError("a stock batch needs one step count and guidance")
    return first
