"""Mask-aware editing on a loaded diffusers inpainting pipeline: bake once, then edit sparsely.

``MaskAwareEditor`` wraps a pipeline (wrappers are installed on the loaded modules and stay
inert outside mask-aware calls; no weight is touched, nothing is written back) and offers:

* ``bake``: one full generation of a template that records, per step and block, K, V and Y
  of every image token through a writer, plus the template's noise (step -1);
* ``edit``: a whole mask-aware edit reading those activations;
* ``stock_edit``: the stock pipeline with the same composed noise (the reference, and the
  path for templates not baked yet);
* the step-level API of the continuous-batching engine, split so that only ``step`` and
  two light calls run on the engine thread:

  - ``encode`` (pre worker): text encoding and VAE encodes into an :class:`Encoded` of host
    tensors; it needs no denoiser and no cache, so it runs on a pipeline loaded without
    its UNet/transformer in another process;
  - ``assemble`` (engine thread): composed noise against the template's cached noise,
    scheduler, token sets, tensors onto the device; without a cache every token is
    computed, which is the stock pipeline's result;
  - ``step`` (engine thread): one denoising step for requests that may differ in mask,
    template and timestep, in one batched forward;
  - ``final_latents`` (engine thread) then ``decode`` (post worker): VAE decode.

  ``prepare`` (= encode + assemble) and ``finish`` (= final_latents + decode) run them in
  process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from retouch.runtime import families
from retouch.runtime.families import Family, FamilyModel
from retouch.runtime.maskaware.buckets import Buckets
from retouch.runtime.maskaware.context import ForwardContext, Mode, Slot, activate
from retouch.runtime.maskaware.graphs import MAX_GRAPHS, StepGraphs, Weights, no_adapters
from retouch.runtime.maskaware.layouts import StepLayouts
from retouch.runtime.maskaware.loader import LoadMode
from retouch.runtime.maskaware.noise import SeedNoise, compose
from retouch.runtime.maskaware.request import (
    EditRequest,
    Encoded,
    ImageSize,
    OutputSize,
    RequestState,
)
from retouch.runtime.maskaware.store import TEMPLATE_STEP, ActivationReader, ActivationWriter
from retouch.runtime.planner import Planner
from retouch.runtime.replaytimes import ReplayTimes

if TYPE_CHECKING:
    from retouch.runtime.maskaware.loader import RowLoader

__all__ = [
    "BakeCancelled",
    "EditRequest",
    "Encoded",
    "MaskAwareEditor",
    "OutputSize",
    "RequestState",
    "all_sparse",
]

log = logging.getLogger(__name__)

TEMPLATE_BLOCK = "template"  # block name of the per-template tensors (step -1)

Plan = Callable[[list[RequestState], list[str]], dict[str, Mode]]
# ``encoder(request, template_latents)``: pre-processing done elsewhere (a pre worker)
Encoder = Callable[[EditRequest, torch.Tensor | None], Encoded]


class BakeCancelled(RuntimeError):
    """A bake stopped between two steps because its executor is stopping: nothing was
    stored (a store's bake commits only when it completes), the next executor re-bakes."""


def all_sparse(states: list[RequestState], blocks: list[str]) -> dict[str, Mode]:
    """Every block sparse in every step (the bubble-free plan replaces this later)."""
    return dict.fromkeys(blocks, Mode.SPARSE)


class MaskAwareEditor:
    """Bake templates and run mask-aware edits on one loaded pipeline.

    What differs between model families is the family's (``retouch.runtime.families``):
    ``model_family`` is that object and ``impl`` the family bound to this pipeline. A row
    loader and a planner are declared on the editor (``set_row_loader``, ``set_planner``).
    """

    def __init__(
        self,
        pipe: DiffusionPipeline,
        family: str,
        device: torch.device | str,
        *,
        packed: bool = True,
        plan: Plan = all_sparse,
    ) -> None:
        self.model_family: Family = families.family(family)
        self.family = family
        self.device = torch.device(device)
        self.impl: FamilyModel = self.model_family.bind(pipe, self.device)
        self.packed = packed
        self._plan = plan
        self._row_loader: RowLoader | None = None
        self._encoder: Encoder | None = None
        self._graphs: StepGraphs | None = None
        self._layouts = StepLayouts(self.device)
        self.ungraphed_steps = 0  # steps with graphs on that could not use them (host rows)
        self._replays: ReplayTimes | None = None
        # the replay time warm-up measured for the layout of the step just run (None when
        # it ran eagerly or nothing was measured): what the engine's step fit compares
        self.last_expected_s: float | None = None

    @property
    def plan(self) -> Plan:
        """The per-step plan: ``plan(states, blocks) -> {block: Mode}``."""
        return self._plan

    def set_planner(self, plan: Plan) -> None:
        """Declare the planner of every later step (e.g. ``runtime.planner.make_planner``)."""
        self._plan = plan

    def set_replay_times(self, replays: ReplayTimes | None) -> None:
        """Declare the step times warm-up measured per layout (``runtime/replaytimes``)."""
        self._replays = replays

    def set_encoder(self, encoder: Encoder | None) -> None:
        """Declare where :meth:`encode` (and a bake's encode) runs when this pipeline was
        loaded without its text encoders: an executor hands them to its pre workers, so
        each text encoder sits on the device once. ``None``: in this process."""
        self._encoder = encoder

    @property
    def row_loader(self) -> RowLoader | None:
        return self._row_loader

    def set_row_loader(self, loader: RowLoader | None) -> None:
        """Declare the loader that stages cached rows for mask-aware steps (``None``: the
        blocks gather their rows synchronously). Bakes and stock calls never use it."""
        self._row_loader = loader

    @property
    def graphs(self) -> StepGraphs | None:
        return self._graphs

    def set_graphs(
        self,
        enabled: bool,
        weights: Weights = no_adapters,
        limit: int = MAX_GRAPHS,
        budget_bytes: int | None = None,
    ) -> None:
        """Run mask-aware steps whose cached rows are all on the GPU from CUDA graphs
        (``maskaware.graphs``): one capture per batch layout, replayed. Off by default.
        ``weights()`` names what the denoiser computes with (its active LoRA adapters):
        a capture replays only under the weights it was made with; ``limit``: layouts
        kept (with buckets: (levels + 1) × batch sizes); ``budget_bytes``: what they may hold."""
        if self._graphs is not None:
            self._graphs.close()
        self._graphs = StepGraphs(self.device, limit, weights, budget_bytes) if enabled else None

    @property
    def buckets(self) -> Buckets | None:
        return self._layouts.buckets

    @property
    def padded_tokens(self) -> int:
        """Pad slots computed by bucketed steps, all told."""
        return self._layouts.padded_tokens

    def set_buckets(self, buckets: Buckets | None) -> None:
        """Pad every request's masked tokens up to a bucket of ``buckets`` in later steps
        (``maskaware.buckets``): a step's shapes then depend on the bucket, not the mask,
        so one captured graph serves every mask of it. ``None``: exact layouts (no padded
        compute; a graph per set of masks)."""
        self._layouts.set_buckets(buckets)

    @property
    def blocks(self) -> list[str]:
        """The block names activations are recorded under, in execution order."""
        return list(self.impl.blocks)

    @property
    def has_denoiser(self) -> bool:
        """False on a pre/post worker's pipeline (loaded without its UNet/transformer)."""
        return self.impl.has_denoiser

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
        encoded: Encoded | None = None,
        cancelled: Callable[[], bool] | None = None,
        strength: float = 1.0,
    ) -> None:
        """Record a template's generation: its own prompt and seed, nothing masked.

        ``mask`` exists for exactness checks (a bake with an edit's own mask, prompt and seed
        makes the mask-aware edit reproduce the stock pipeline). ``encoded``: the bake
        request's pre-processing done beforehand (:meth:`bake_request`, e.g. by a pre
        worker, so the engine thread never waits for it); else it is done here.
        ``cancelled``: asked before each step; True raises :class:`BakeCancelled` (a stopping
        executor does not finish a bake nobody waits for). ``strength`` < 1: the trajectory
        of edits with that strength (it starts from the template's latents part-way down
        the schedule: another trajectory, so another bake).
        """
        require_denoiser(self)
        request = self.bake_request(image, prompt, seed, steps, guidance, mask, strength)
        noise = draw(self.impl, seed, image.height, image.width)
        writer.put(TEMPLATE_STEP, TEMPLATE_BLOCK, "noise", noise.latents)
        writer.put(TEMPLATE_STEP, TEMPLATE_BLOCK, "vae_noise", noise.vae)
        if encoded is None:  # its own seed is the template's: both noises are ``noise``
            encoded = self.encode(request)
        for name in self.impl.template_tensors:
            writer.put(TEMPLATE_STEP, TEMPLATE_BLOCK, name, encoded.tensors[name].float())
        state = self.assemble(request, encoded, None)
        state.writer = writer
        while not state.done:
            if cancelled is not None and cancelled():
                raise BakeCancelled(f"{self.family} bake stopped at step {state.index}")
            ctx = ForwardContext([Slot(state.index, writer=writer)], self.impl.rows_per_request, {})
            self._run(ctx, [state])
        log.info("baked %s template in %d steps", self.family, steps)

    @staticmethod
    def bake_request(
        image: Image.Image,
        prompt: str,
        seed: int,
        steps: int,
        guidance: float,
        mask: np.ndarray | None = None,
        strength: float = 1.0,
    ) -> EditRequest:
        """The request a bake runs: the template's own prompt and seed, nothing masked."""
        if mask is None:
            mask = np.zeros((image.height, image.width), dtype=bool)
        return EditRequest(
            image, mask, prompt, seed, steps, guidance, prompt, seed, strength=strength
        )

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
        return self.impl.stock(requests, [seed_noises(self.impl, r) for r in requests], output_type)

    # -- step-level API -------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, request: EditRequest, template_latents: torch.Tensor | None = None) -> Encoded:
        """Heavy pre-processing (pre worker): text encoding, VAE encodes, composed noise.

        It needs no cache and no denoiser: the template's noise is drawn from
        ``request.template_seed``, as its bake drew it. ``template_latents`` (Flux: the
        template's image latents, e.g. from its cache) spare a VAE encode; without them Flux
        encodes the template image with the template's VAE noise, which is what a request
        needs when its template has no cache yet.
        """
        if self._encoder is not None:
            return self._encoder(request, template_latents)
        template, own = seed_noises(self.impl, request)
        tensors = self.impl.encode(request, template, own, template_latents)
        return Encoded(self.family, request.height, request.width, tensors)

    @torch.inference_mode()
    def assemble(
        self, request: EditRequest, encoded: Encoded, reader: ActivationReader | None
    ) -> RequestState:
        """Light pre-processing (engine thread): scheduler, timesteps, token sets, device copies.

        With a ``reader`` the template's cached per-template tensors are used (and the
        encoded noise is checked against its noise). ``reader=None`` (template not baked
        yet): every token is computed and no row is read, so :meth:`step` gives the stock
        pipeline's result while it batches with mask-aware requests. A request with its own
        reference image reads nothing either: the bake's reference tokens are the template's.
        """
        require_denoiser(self)
        if request.reference is not None:
            reader = None
        if (encoded.family, encoded.height, encoded.width) != (
            self.family,
            request.height,
            request.width,
        ):
            raise ValueError(
                f"encoded for {encoded.family} at {encoded.width}x{encoded.height}, not for "
                f"this {self.family} request at {request.width}x{request.height}"
            )
        tensors = dict(encoded.tensors)
        if reader is not None:
            tensors.update(template_tensors(self.impl, reader, encoded))
        state = self.impl.assemble(request, tensors, every=reader is None)
        state.reader = reader
        return state

    @torch.inference_mode()
    def prepare(self, request: EditRequest, reader: ActivationReader | None) -> RequestState:
        """:meth:`encode` then :meth:`assemble`, in this process."""
        return self.assemble(
            request, self.encode(request, cached_latents(self.impl, reader)), reader
        )

    @torch.inference_mode()
    def step(
        self,
        states: list[RequestState],
        modes: dict[str, Mode] | None = None,
        *,
        packed: bool = True,
    ) -> None:
        """One denoising step for every state (each at its own timestep), one batched forward.

        ``modes`` (per block) defaults to the editor's plan for these states. ``packed``:
        False keeps every layer's input in the batch's model rows (the padded layout, where
        the family would pack the masked tokens of every request into one row): what a
        computation per row needs (``runtime/mixedlora``).
        """
        if not states:
            return
        require_denoiser(self)
        if any(s.done for s in states):
            raise ValueError("a finished request cannot take another step")
        sizes = set(states[0].tokens)
        if any(set(s.tokens) != sizes for s in states):
            raise ValueError("requests in one step must share the resolution")
        run = self._layouts.padded_batch(states)
        step_tokens = {size: tuple(s.step_tokens[size] for s in run) for size in sizes}
        per = self.impl.rows_per_request
        packed = packed and self.packed and self.impl.packs
        grids = self._layouts.grids(step_tokens, per, packed)
        slots = [Slot(s.index, reader=s.step_reader) for s in run]
        ctx = ForwardContext(slots, per, {}, grids)
        graphed = (
            self._graphs is not None
            and graphable(self._row_loader)
            and StepGraphs.usable(ctx, self.device)
        )
        ctx.modes = self._plan_step(run, graphed) if modes is None else modes
        if graphed:
            ctx.runner = self._graphs
        elif self._graphs is not None:
            self.ungraphed_steps += 1
        self.last_expected_s = replayed_s(self._replays, states) if graphed else None
        self._run(ctx, states, run)

    def _plan_step(self, states: list[RequestState], graphed: bool) -> dict[str, Mode]:
        """The planner's modes. A graphed step's rows are all copied into its static
        buffers a step ahead, none loaded during its blocks: it is planned as resident, so
        a template streaming from pinned host memory replays the resident layout's graph
        instead of capturing one of its own on the request path."""
        if graphed and isinstance(self._plan, Planner):
            return self._plan(states, self.blocks, resident=True)
        return self._plan(states, self.blocks)

    def final_latents(self, state: RequestState) -> torch.Tensor:
        """The finished request's latents as a host tensor (what a post worker decodes)."""
        if not state.done:
            raise ValueError("the request has steps left")
        return state.latents.detach().cpu()

    @torch.inference_mode()
    def decode(
        self, latents: torch.Tensor, request_meta: ImageSize, output_type: str = "pil"
    ) -> Image.Image | np.ndarray:
        """Post-processing (post worker): VAE decode of :meth:`final_latents` and the
        pipeline's postprocess; ``request_meta`` gives the output height and width (an
        :class:`EditRequest` or an :class:`OutputSize`). ``output_type`` "pil" or "np"."""
        size = OutputSize(request_meta.height, request_meta.width)
        return self.impl.decode(latents, size, output_type)

    @torch.inference_mode()
    def finish(self, state: RequestState, output_type: str = "pil") -> Image.Image | np.ndarray:
        """:meth:`final_latents` then :meth:`decode`, in this process."""
        return self.decode(self.final_latents(state), state.request, output_type)

    # -- internals ------------------------------------------------------------------------

    def _run(
        self,
        ctx: ForwardContext,
        states: list[RequestState],
        run: list[RequestState] | None = None,
    ) -> None:
        """The forward of ``run`` (``states``, padded), then ``states`` advance."""
        run = states if run is None else run
        loader = self._row_loader
        with activate(ctx):
            if loader is None or not ctx.grids or ctx.recording or ctx.runner is not None:
                predictions = self.impl.forward(run, ctx)
            else:
                with loader.session(ctx):
                    predictions = self.impl.forward(run, ctx)
        self.impl.advance_all(states, predictions[: len(states)])
        for state in states:
            state.index += 1


def require_denoiser(editor: MaskAwareEditor) -> None:
    """Refuse denoising work on a pre/post worker's pipeline (loaded without its denoiser)."""
    if not editor.has_denoiser:
        raise RuntimeError(
            f"this {editor.family} editor was loaded without its denoiser (a pre/post "
            "worker's pipeline): it can encode and decode, not denoise"
        )


def graphable(loader: RowLoader | None) -> bool:
    """Graphs replay no Python: not with a loader that times or preloads blocks."""
    return loader is None or (
        not loader.hooks and loader.mode in (LoadMode.SYNC, LoadMode.OVERLAPPED)
    )


def replayed_s(replays: ReplayTimes | None, states: list[RequestState]) -> float | None:
    """The measured replay time of a step's layout: stock when no request reads cached
    rows, else the bucket of its largest mask on the finest grid (None: none measured)."""
    if replays is None:
        return None
    if all(s.step_reader is None for s in states):
        return replays.stock_step_s(len(states))
    finest = max(states[0].step_tokens, key=lambda size: size[0] * size[1])
    fraction = max(s.step_tokens[finest].ratio for s in states)
    return replays.step_s(len(states), fraction)


def seed_noises(impl: FamilyModel, request: EditRequest) -> tuple[SeedNoise, SeedNoise]:
    """The template's and the request's noises at the request's image size."""
    height, width = request.image.height, request.image.width
    return draw(impl, request.template_seed, height, width), draw(impl, request.seed, height, width)


def draw(impl: FamilyModel, seed: int, height: int, width: int) -> SeedNoise:
    """A seed's noises at an image size, in the family's order of draws."""
    shape = impl.noise_shape(height, width)
    return SeedNoise.draw(seed, shape, torch.float32, vae_first=impl.vae_noise_first)


def cached_latents(impl: FamilyModel, reader: ActivationReader | None) -> torch.Tensor | None:
    """The template's image latents from its cache, for a family that stores them
    (spares encoding them)."""
    if reader is None or "image_latents" not in impl.template_tensors:
        return None
    return reader.get(TEMPLATE_STEP, TEMPLATE_BLOCK, "image_latents")


def template_tensors(
    impl: FamilyModel, reader: ActivationReader, encoded: Encoded
) -> dict[str, torch.Tensor]:
    """The cached per-template tensors that replace encoded ones (the cache is the truth).

    The encoded noise drew the template's part from ``template_seed``; a bake with
    another seed would leave the unmasked region (and SD's masked-image latents)
    inconsistent with the cached rows, so that is refused.
    """
    noise = encoded.tensors["noise"]
    baked = reader.get(TEMPLATE_STEP, TEMPLATE_BLOCK, "noise").to(noise.dtype)
    if not torch.equal(compose(baked, noise, encoded.latent_mask), noise):
        raise ValueError("the request's template_seed is not the seed its template was baked with")
    cached = cached_latents(impl, reader)
    return {} if cached is None else {"image_latents": cached}
