"""Mask-aware editing on a loaded diffusers inpainting pipeline: bake once, then edit sparsely.

``MaskAwareEditor`` wraps a pipeline (wrappers are installed on the loaded modules and stay
inert outside mask-aware calls; no weight is touched, nothing is written back) and offers:

* ``bake``: one full generation of a template that records, per step and block, K, V and Y
  of every image token through a writer, plus the template's noise (step -1);
* ``edit``: a whole mask-aware edit reading those activations;
* ``stock_edit``: the stock pipeline with the same composed noise (the reference, and the
  path for templates not baked yet);
* ``prepare`` / ``step`` / ``finish``: the step-level API of the continuous-batching
  engine: ``step`` runs one denoising step for requests that may differ in mask, template
  and timestep, in one batched forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from retouch.runtime.maskaware.context import ForwardContext, Mode, Slot, activate
from retouch.runtime.maskaware.flux_inpaint import FluxInpaint
from retouch.runtime.maskaware.noise import SeedNoise
from retouch.runtime.maskaware.request import EditRequest, RequestState
from retouch.runtime.maskaware.sd_inpaint import SDInpaint
from retouch.runtime.maskaware.store import TEMPLATE_STEP, ActivationReader, ActivationWriter
from retouch.runtime.maskaware.tokens import TokenBatch

__all__ = ["EditRequest", "MaskAwareEditor", "RequestState", "all_sparse"]

log = logging.getLogger(__name__)

TEMPLATE_BLOCK = "template"  # block name of the per-template tensors (step -1)
FAMILIES: dict[str, type[SDInpaint] | type[FluxInpaint]] = {
    SDInpaint.family: SDInpaint,
    FluxInpaint.family: FluxInpaint,
}

Plan = Callable[[list[RequestState], list[str]], dict[str, Mode]]


def all_sparse(states: list[RequestState], blocks: list[str]) -> dict[str, Mode]:
    """Every block sparse in every step (the bubble-free plan replaces this later)."""
    return dict.fromkeys(blocks, Mode.SPARSE)


class MaskAwareEditor:
    """Bake templates and run mask-aware edits on one loaded pipeline."""

    def __init__(
        self,
        pipe: DiffusionPipeline,
        family: str,
        device: torch.device | str,
        *,
        packed: bool = True,
        plan: Plan = all_sparse,
    ) -> None:
        try:
            impl = FAMILIES[family]
        except KeyError:
            raise ValueError(f"no mask-aware implementation for family {family!r}") from None
        self.family = family
        self.device = torch.device(device)
        self.impl = impl(pipe, self.device)
        self.packed = packed
        self.plan = plan

    @property
    def blocks(self) -> list[str]:
        """The block names activations are recorded under, in execution order."""
        return list(self.impl.blocks)

    # -- bake -----------------------------------------------------------------------------

    @torch.inference_mode()
    def bake(
        self,
        image: Image.Image,
        prompt: str,
        seed: int,
        steps: int,
        guidance: float,
        writer: ActivationWriter,
        mask: np.ndarray | None = None,
    ) -> None:
        """Record a template's generation: its own prompt and seed, nothing masked.

        ``mask`` exists for exactness checks (a bake with an edit's own mask, prompt and seed
        makes the mask-aware edit reproduce the stock pipeline).
        """
        if mask is None:
            mask = np.zeros((image.height, image.width), dtype=bool)
        request = EditRequest(image, mask, prompt, seed, steps, guidance, prompt, seed)
        noise = SeedNoise.draw(
            seed, self.impl.noise_shape(image.height, image.width), torch.float32
        )
        writer.put(TEMPLATE_STEP, TEMPLATE_BLOCK, "noise", noise.latents)
        writer.put(TEMPLATE_STEP, TEMPLATE_BLOCK, "vae_noise", noise.vae)
        extra = []
        if isinstance(self.impl, FluxInpaint):
            latents = self.impl.image_latents(image, noise.vae)
            writer.put(TEMPLATE_STEP, TEMPLATE_BLOCK, "image_latents", latents.float().cpu())
            extra = [latents]
        state = self.impl.prepare(request, noise, noise, *extra)
        state.writer = writer
        while not state.done:
            ctx = ForwardContext([Slot(state.index, writer=writer)], self.impl.rows_per_request, {})
            self._run(ctx, [state])
        log.info("baked %s template in %d steps", self.family, steps)

    # -- edits ----------------------------------------------------------------------------

    @torch.inference_mode()
    def edit(
        self, request: EditRequest, reader: ActivationReader, output_type: str = "pil"
    ) -> Image.Image | np.ndarray:
        """A whole mask-aware edit against a baked template."""
        state = self.prepare(request, reader)
        while not state.done:
            self.step([state])
        return self.finish(state, output_type)

    @torch.inference_mode()
    def stock_edit(
        self, request: EditRequest, output_type: str = "pil"
    ) -> Image.Image | np.ndarray:
        """The stock diffusers pipeline with the edit's composed noise (no cache needed)."""
        return self.stock_edits([request], output_type)[0]

    @torch.inference_mode()
    def stock_edits(
        self, requests: list[EditRequest], output_type: str = "pil"
    ) -> list[Image.Image] | np.ndarray:
        """:meth:`stock_edit` for several requests in one pipeline call (same size, steps and
        guidance): the batched stock baseline."""
        noises = [self._noises(r) for r in requests]
        if isinstance(self.impl, FluxInpaint):
            latents = [
                self.impl.image_latents(r.image, t.vae)
                for r, (t, _) in zip(requests, noises, strict=True)
            ]
            return self.impl.stock(requests, noises, latents, output_type)
        return self.impl.stock(requests, noises, output_type)

    # -- step-level API -------------------------------------------------------------------

    @torch.inference_mode()
    def prepare(self, request: EditRequest, reader: ActivationReader) -> RequestState:
        """Pre-processing: text and mask encodings, composed noise, scheduler, token sets."""
        template = SeedNoise(
            reader.get(TEMPLATE_STEP, TEMPLATE_BLOCK, "noise"),
            reader.get(TEMPLATE_STEP, TEMPLATE_BLOCK, "vae_noise"),
        )
        own = SeedNoise.draw(request.seed, tuple(template.latents.shape), torch.float32)
        extra = []
        if isinstance(self.impl, FluxInpaint):
            extra = [reader.get(TEMPLATE_STEP, TEMPLATE_BLOCK, "image_latents")]
        state = self.impl.prepare(request, template, own, *extra)
        state.reader = reader
        return state

    @torch.inference_mode()
    def step(self, states: list[RequestState], modes: dict[str, Mode] | None = None) -> None:
        """One denoising step for every state (each at its own timestep), one batched forward.

        ``modes`` is the step's plan (block -> sparse/full); the engine passes the plan it
        chose, other callers get ``self.plan``."""
        if not states:
            return
        if any(s.done for s in states):
            raise ValueError("a finished request cannot take another step")
        sizes = set(states[0].tokens)
        if any(set(s.tokens) != sizes for s in states):
            raise ValueError("requests in one step must share the resolution")
        per = self.impl.rows_per_request
        grids = {
            size: TokenBatch(tuple(s.tokens[size] for s in states), per, self.packed, self.device)
            for size in sizes
        }
        slots = [Slot(s.index, reader=s.reader) for s in states]
        plan = modes if modes is not None else self.plan(states, self.blocks)
        ctx = ForwardContext(slots, per, plan, grids)
        self._run(ctx, states)

    @torch.inference_mode()
    def finish(self, state: RequestState, output_type: str = "pil") -> Image.Image | np.ndarray:
        """Post-processing: VAE decode of the final latents (``output_type`` "pil" or "np")."""
        if not state.done:
            raise ValueError("the request has steps left")
        return self.impl.decode(state, output_type)

    # -- internals ------------------------------------------------------------------------

    def _run(self, ctx: ForwardContext, states: list[RequestState]) -> None:
        with activate(ctx):
            predictions = self.impl.forward(states, ctx)
        for state, prediction in zip(states, predictions, strict=True):
            self.impl.advance(state, prediction)
            state.index += 1

    def _noises(self, request: EditRequest) -> tuple[SeedNoise, SeedNoise]:
        shape = self.impl.noise_shape(request.image.height, request.image.width)
        return (
            SeedNoise.draw(request.template_seed, shape, torch.float32),
            SeedNoise.draw(request.seed, shape, torch.float32),
        )
