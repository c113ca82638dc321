"""Model families: the one place that knows what differs between diffusers pipelines.

Each family is one module here exposing ``FAMILY``, an object of the :class:`Family`
protocol: which pipeline class it loads and how, which components a pre/post worker leaves
out, how it binds to a loaded pipeline (a :class:`FamilyModel`: the prepare / step / decode
split and the block wrappers, attached as declared attention processors and hooks), the row
layout of its cached tensors, its FLOP formulas and its token grid. Everything else asks the
family object; nothing outside this package compares family names or pipeline classes.

Adding a family: write ``<family>.py`` with its ``FAMILY``, add its torch-free row to
``retouch.functions.families`` and its module name to :data:`MODULES` below.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline
    from PIL import Image

    from retouch.functions.families import FamilySpec
    from retouch.runtime.maskaware.context import ForwardContext
    from retouch.runtime.maskaware.flops import Flops
    from retouch.runtime.maskaware.loader import FamilyRows
    from retouch.runtime.maskaware.noise import SeedNoise
    from retouch.runtime.maskaware.request import EditRequest, ImageSize, RequestState

# Registrations: the modules of this package that define a family (``FAMILY``).
MODULES = ("sd_inpaint", "flux_inpaint", "sd3_inpaint")


class FamilyModel(Protocol):
    """A family bound to one loaded pipeline: what ``MaskAwareEditor`` drives."""

    pipe: DiffusionPipeline
    blocks: list[str]  # block names activations are recorded under, in execution order
    has_denoiser: bool  # False on a pre/post worker's pipeline
    rows_per_request: int  # model rows per request (2 with classifier-free guidance halves)
    packs: bool  # whether its blocks run the packed layout (else always padded)
    template_tensors: tuple[str, ...]  # per-template tensors a bake stores besides noise

    def noise_shape(self, height: int, width: int) -> tuple[int, ...]: ...

    def encode(
        self,
        request: EditRequest,
        template_noise: SeedNoise,
        request_noise: SeedNoise,
        template_latents: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]: ...

    def assemble(
        self, request: EditRequest, tensors: dict[str, torch.Tensor], *, every: bool
    ) -> RequestState: ...

    def forward(self, states: list[RequestState], ctx: ForwardContext) -> list[torch.Tensor]: ...

    def advance(self, state: RequestState, prediction: torch.Tensor) -> None: ...

    def decode(
        self, latents: torch.Tensor, size: ImageSize, output_type: str = "pil"
    ) -> Image.Image | np.ndarray: ...

    def stock(
        self,
        requests: list[EditRequest],
        noises: list[tuple[SeedNoise, SeedNoise]],
        output_type: str = "pil",
    ) -> list[Image.Image] | np.ndarray: ...


class Family(Protocol):
    """A model family: loading, worker components, binding, row layout, FLOPs, token grid."""

    name: str
    spec: FamilySpec  # the torch-free facts (schedulers, defaults, compatible folders)
    pipeline: type[DiffusionPipeline]
    load_kwargs: Mapping[str, Any]  # extra ``from_pretrained`` arguments
    denoisers: tuple[str, ...]  # components a pre/post worker loads without
    text_components: tuple[str, ...]  # components a post worker also loads without
    rows_per_request: int

    def bind(self, pipe: DiffusionPipeline, device: torch.device) -> FamilyModel: ...

    def rows(self, model: FamilyModel) -> FamilyRows:
        """Which cached rows each block reads, by plan (the loader's jobs)."""
        ...

    def step_flops(
        self, config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
    ) -> Flops:
        """One model row of one step at mask ratio ``ratio``."""
        ...

    def flop_shape(
        self, pipe: DiffusionPipeline, height: int, width: int
    ) -> tuple[Mapping[str, Any], tuple[int, int], int]:
        """(denoiser config, latent size, text length) of a pipeline at an image size."""
        ...

    def token_cell(self, pipe: DiffusionPipeline) -> int:
        """Pixels per token of the coarsest token grid."""
        ...


@functools.cache
def _registry() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for module in MODULES:
        family = importlib.import_module(f"{__name__}.{module}").FAMILY
        found[family.name] = family
    return found


def family(name: str) -> Family:
    """The family named ``name``; ``ValueError`` if none is registered."""
    try:
        return _registry()[name]
    except KeyError:
        raise ValueError(f"no runtime family {name!r}; registered: {names()}") from None


def names() -> Sequence[str]:
    return tuple(_registry())
