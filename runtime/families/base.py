"""The family protocol: :class:`Family` (what a family is: its pipeline, how to load it,
its row layout, FLOPs and token grid) and :class:`FamilyModel` (a family bound to a loaded
pipeline: the encode / assemble / forward / advance / decode split, the stock reference and
the block wrappers), as base classes holding what the inpaint families share.

A family module subclasses both and fills in what differs: the methods that raise
``NotImplementedError`` here (``install``, ``text_length``, ``encode_prompt``,
``assemble``, ``forward``, ``advance``, ``token_cell``, and ``max_sequence_length`` unless
it overrides the stock call), and whichever default does not hold for it. The defaults are
those of the latent-space inpaint pipelines: latents at the VAE factor, the latent mask as
``prepare_mask_latents`` makes it, ``latents / scaling_factor`` decode, the stock call with
the template's latents (the pipelines that blend the unmasked latents back every step) and
the joint-attention row layout (a sparse block reads K/V, a full block after a sparse one
reads that one's Y).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from retouch.functions.families import FamilySpec, family_spec
from retouch.runtime.maskaware import inpaint
from retouch.runtime.maskaware.context import ForwardContext
from retouch.runtime.maskaware.flops import Flops
from retouch.runtime.maskaware.flux_blocks import EXIT_ROWS, SPARSE_ROWS
from retouch.runtime.maskaware.loader import FamilyRows
from retouch.runtime.maskaware.noise import SeedNoise
from retouch.runtime.maskaware.request import (
    EditRequest,
    ImageSize,
    RequestState,
    check_batchable,
)


@dataclass(frozen=True)
class Encoding:
    """What :meth:`FamilyModel.encode_image` may use: the request, its mask condition, its
    composed noise, the template's noise and the bake's template latents (if any)."""

    request: EditRequest
    condition: torch.Tensor
    noise: SeedNoise
    template_noise: SeedNoise
    template_latents: torch.Tensor | None


class FamilyModel:
    """A family bound to one loaded pipeline: what ``MaskAwareEditor`` drives.

    ``denoiser`` names the pipeline attribute a pre/post worker's pipeline lacks
    (``has_denoiser`` is then False); with it, :meth:`install` declares the block wrappers
    and names the blocks activations are recorded under, in execution order.
    ``rows_per_request``: model rows per request (2 with classifier-free guidance halves),
    consecutive in a batch (request ``i`` owns rows ``i * per`` onwards: mixed-adapter steps
    give those rows its LoRA set, ``runtime/mixedlora``);
    ``packs``: whether the blocks run the packed layout (else always padded);
    ``mixes_packed``: whether a mixed-adapter step may run packed too: every layer the
    packed layout reaches sees ``[1, T, C]`` while ``ForwardContext.grid`` names its grid
    (``runtime/mixedlora``; else mixed steps run padded);
    ``image_sequences``: token grids of the image's size in the denoiser's image sequence
    (2 where a reference image's tokens follow the edited latents');
    ``template_tensors``: per-template tensors a bake stores besides the noise;
    ``vae_noise_first``: a seed's VAE noise is its first draw, its initial noise the second
    (the order of the pipeline's own draws: ``SeedNoise.draw``)."""

    denoiser: ClassVar[str] = "transformer"
    rows_per_request: ClassVar[int] = 1
    packs: ClassVar[bool] = True
    mixes_packed: ClassVar[bool] = False
    image_sequences: ClassVar[int] = 1
    template_tensors: ClassVar[tuple[str, ...]] = ()
    vae_noise_first: ClassVar[bool] = False

    def __init__(self, pipe: DiffusionPipeline, device: torch.device, spec: FamilySpec) -> None:
        self.pipe, self.device, self.spec = pipe, device, spec
        denoiser = getattr(pipe, self.denoiser)
        self.has_denoiser = denoiser is not None
        self.channels = self.vae_channels(pipe.vae)
        self.blocks: list[str] = self.install(denoiser) if self.has_denoiser else []
        self.dtype = (denoiser if self.has_denoiser else pipe.vae).dtype

    @staticmethod
    def vae_channels(vae: torch.nn.Module) -> int:
        """The VAE's latent channels (Qwen-Image's calls them ``z_dim``)."""
        return vae.config.latent_channels

    def install(self, denoiser: torch.nn.Module) -> list[str]:
        """Check the denoiser, declare the mask-aware wrappers on it; its block names."""
        raise NotImplementedError

    # -- geometry ---------------------------------------------------------------------------

    @staticmethod
    def latent_grid(pipe: DiffusionPipeline, height: int, width: int) -> tuple[int, int]:
        """The latent size of an image (without a bound model: the FLOP shape needs it)."""
        factor = pipe.vae_scale_factor
        return height // factor, width // factor

    @staticmethod
    def text_length(pipe: DiffusionPipeline) -> int:
        """Text tokens the denoiser attends to."""
        raise NotImplementedError

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        return self.latent_grid(self.pipe, height, width)

    def grid_tokens(self, lh: int, lw: int) -> int:
        """Image tokens a DiT block's cached rows hold at latent size ``(lh, lw)``: Flux
        packs 2x2 latents, SD3 patches 2x2; a reference image's tokens follow (Kontext)."""
        return self.image_sequences * (lh // 2) * (lw // 2)

    def row_channels(self, block: str, name: str) -> int:
        """The width of a DiT block's cached rows ``name`` (its output Y, or its K/V)."""
        denoiser = getattr(self.pipe, self.denoiser)
        if name == "y":
            return denoiser.inner_dim
        return denoiser.get_submodule(block).attn.to_k.out_features

    def noise_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (1, self.channels, *self.latent_size(height, width))

    def masks(self, request: EditRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask condition ``[1, 1, H, W]`` and the latent mask ``[1, 1, h, w]``."""
        condition = inpaint.mask_condition(self.pipe, request)
        size = self.latent_size(request.height, request.width)
        return condition, inpaint.latent_mask(condition, size)

    def image_latents(self, image: Image.Image, vae_noise: torch.Tensor) -> torch.Tensor:
        return inpaint.template_latents(self.pipe, image, vae_noise, self.device, self.dtype)

    def new_scheduler(self) -> Any:
        """A request's own scheduler (schedulers hold per-request step state)."""
        return type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)

    # -- encode (a pre worker) ------------------------------------------------------------

    def encode(
        self,
        request: EditRequest,
        template_noise: SeedNoise,
        request_noise: SeedNoise,
        template_latents: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The heavy, cache-independent part of a request, as host tensors: the latent
        mask, the composed noise (the template's outside the mask, the request's inside),
        the text encoding (:meth:`encode_prompt`) and the image's (:meth:`encode_image`).
        ``template_latents``: the bake's, when the family keeps them per template."""
        condition, mask = self.masks(request)
        noise = template_noise.compose(request_noise, mask[0, 0] > 0.5)
        image = Encoding(request, condition, noise, template_noise, template_latents)
        return {
            "mask": mask,  # [1, 1, h, w] float32
            "noise": noise.latents,  # [1, C, h, w] float32
            **self.encode_text(request),
            **self.encode_image(image),
        }

    def encode_text(self, request: EditRequest) -> dict[str, torch.Tensor]:
        """The request's text encoding: :meth:`encode_prompt` of its prompts (a family whose
        text encoder also reads the image overrides this)."""
        return self.encode_prompt(request.prompt, request.negative_prompt)

    def encode_prompt(self, prompt: str, negative_prompt: str) -> dict[str, torch.Tensor]:
        """The text encoding; ``negative_prompt`` ("" for none) is the unconditional
        branch's prompt in the families with classifier-free guidance."""
        raise NotImplementedError

    def encode_image(self, job: Encoding) -> dict[str, torch.Tensor]:
        """By default the template's latents: the bake's, or the VAE encode of the template
        with the template's own noise."""
        return {"image_latents": self.template_image_latents(job).cpu()}  # [1, C, h, w]

    def template_image_latents(self, job: Encoding) -> torch.Tensor:
        """The bake's template latents, or the VAE encode of the template with the
        template's own noise (what the bake stored)."""
        latents = job.template_latents
        if latents is None:
            latents = self.image_latents(job.request.image, job.template_noise.vae)
        return latents

    # -- steps (the engine thread) ----------------------------------------------------------

    def assemble(
        self, request: EditRequest, tensors: dict[str, torch.Tensor], *, every: bool
    ) -> RequestState:
        """The light part: scheduler and timesteps, token sets, inputs on the device
        (``every``: compute every token, there is no cache to read)."""
        raise NotImplementedError

    def forward(self, states: list[RequestState], ctx: ForwardContext) -> list[torch.Tensor]:
        """One batched denoiser call; each request's prediction."""
        raise NotImplementedError

    def advance(self, state: RequestState, prediction: torch.Tensor) -> None:
        """The request's scheduler step (and whatever the pipeline does after it)."""
        raise NotImplementedError

    def advance_all(self, states: list[RequestState], predictions: list[torch.Tensor]) -> None:
        """Every request's :meth:`advance`; a family whose step is elementwise per request
        overrides it with one batched set of ops (``maskaware.flowstep``)."""
        for state, prediction in zip(states, predictions, strict=True):
            self.advance(state, prediction)

    # -- decode and the stock reference -----------------------------------------------------

    def decode(
        self, latents: torch.Tensor, size: ImageSize, output_type: str = "pil"
    ) -> Image.Image | np.ndarray:
        """VAE decode as the inpaint pipelines do it (``latents / scaling_factor``)."""
        return inpaint.scaled_decode(self.pipe, latents, self.device, output_type)

    def max_sequence_length(self) -> int:
        """The ``max_sequence_length`` the stock call is given."""
        raise NotImplementedError

    def stock_options(self) -> dict[str, Any]:
        """Extra arguments of the stock call."""
        return {"max_sequence_length": self.max_sequence_length()}

    def stock_inputs(
        self, request: EditRequest, template_noise: SeedNoise, request_noise: SeedNoise
    ) -> tuple[torch.Tensor, Image.Image | torch.Tensor, torch.Tensor]:
        """One request's stock-call inputs: its composed initial noise, its ``image`` and
        its ``masked_image_latents``. By default the template's latents stand for both (the
        pipelines that blend the unmasked latents back then skip their VAE encodes)."""
        noise = self.composed_noise(request, template_noise, request_noise)
        latents = self.image_latents(request.image, template_noise.vae)
        return noise, latents, latents

    def composed_noise(
        self, request: EditRequest, template_noise: SeedNoise, request_noise: SeedNoise
    ) -> torch.Tensor:
        """``[1, C, h, w]``: the template's initial noise outside the mask, the request's
        inside (what :meth:`encode` gives the engine)."""
        return template_noise.compose(request_noise, self.masks(request)[1][0, 0] > 0.5).latents

    def stock(
        self,
        requests: list[EditRequest],
        noises: list[tuple[SeedNoise, SeedNoise]],
        output_type: str = "pil",
    ) -> list[Image.Image] | np.ndarray:
        """One stock pipeline call for ``requests`` (same size, steps, guidance, strength
        and negative prompt), each with its composed noise (``noises``: the template's and
        the request's of each)."""
        first = check_batchable(requests)
        return self.pipe(
            prompt=[r.prompt for r in requests],
            **self.stock_negative(first, len(requests)),
            mask_image=[r.mask_image() for r in requests],
            height=first.image.height,
            width=first.image.width,
            strength=first.strength,
            num_inference_steps=first.steps,
            guidance_scale=first.guidance,
            output_type=output_type,
            **self.stock_batch(requests, noises),
            **self.stock_options(),
        ).images

    def stock_negative(self, request: EditRequest, batch: int) -> dict[str, Any]:
        """The stock call's ``negative_prompt`` (one per prompt): None for none (SDXL then
        zeroes the unconditional embedding, as its served path does)."""
        negative = request.negative_prompt
        return {"negative_prompt": [negative] * batch if negative else None}

    def stock_batch(
        self, requests: list[EditRequest], noises: list[tuple[SeedNoise, SeedNoise]]
    ) -> dict[str, Any]:
        """The stock call's per-request inputs (:meth:`stock_inputs` of each): ``image``,
        ``masked_image_latents`` and the composed initial noise (:meth:`stock_noise`)."""
        inputs = [
            self.stock_inputs(r, t, own) for r, (t, own) in zip(requests, noises, strict=True)
        ]
        noise, images, masked = ([row[i] for row in inputs] for i in range(3))
        return {
            "image": torch.cat(images) if isinstance(images[0], torch.Tensor) else list(images),
            "masked_image_latents": torch.cat(masked),
            **self.stock_noise(requests, noise, [own for _, own in noises]),
        }

    def stock_noise(
        self, requests: list[EditRequest], composed: list[torch.Tensor], own: list[SeedNoise]
    ) -> dict[str, Any]:
        """The composed initial noise as the stock call takes it: ``latents`` at strength 1.

        Below it the pipelines take ``latents`` as the already noised start (and the blend
        families re-noise the template with it), so the noise must be the pipeline's own
        draw: a generator on the request's seed, which draws exactly the request's noise
        (``SeedNoise.draw``; on a CPU, and with ``image`` given as latents, so that no VAE
        sample draws first). That is the composed noise only when nothing of the
        template's is in it: a mask over every latent, or the template's own seed."""
        if requests[0].strength == 1.0:
            return {"latents": torch.cat(composed).to(self.device, self.dtype)}
        for noise, seed_noise in zip(composed, own, strict=True):
            if not torch.equal(noise, seed_noise.latents):
                raise ValueError(
                    "a stock reference at strength < 1 draws its noise from the request's "
                    "seed: it needs a mask over every latent or the template's own seed"
                )
        return {"generator": [torch.Generator().manual_seed(r.seed) for r in requests]}


class Family:
    """A model family: the subclass names its pipeline class (loaded by the one loader,
    ``runtime/models.load_pipeline``, with ``load_kwargs``), its :class:`FamilyModel`, the
    components a post worker also leaves out (``text_components``; every worker leaves out
    the denoiser) and its FLOP formula (``flops``: one model row of one step)."""

    name: ClassVar[str]
    model: ClassVar[type[FamilyModel]]
    pipeline: ClassVar[type[DiffusionPipeline]]
    load_kwargs: ClassVar[Mapping[str, Any]] = {}
    text_components: ClassVar[tuple[str, ...]]
    flops: ClassVar[Callable[[Mapping[str, Any], tuple[int, int], int, float], Flops]]

    def __init__(self) -> None:
        self.spec = family_spec(self.name)
        self.denoisers = (self.model.denoiser,)  # what a pre/post worker loads without
        # what an executor whose pre workers encode loads without (tokenizers stay: the
        # engine reads text lengths from them)
        self.text_encoders = tuple(c for c in self.text_components if c.startswith("text_"))
        self.rows_per_request = self.model.rows_per_request

    def own_components(self, folder: Path, without: tuple[str, ...]) -> dict[str, Any]:
        """Components of a diffusers ``folder`` the family loads itself and hands the
        pipeline's ``from_pretrained`` (but those ``without``): none by default."""
        return {}

    def bind(self, pipe: DiffusionPipeline, device: torch.device) -> FamilyModel:
        return self.model(pipe, device, self.spec)

    def rows(self, model: FamilyModel) -> FamilyRows:
        """A sparse block reads its image K/V; a full block after a sparse one that one's Y."""
        blocks = list(model.blocks)
        return FamilyRows(
            tuple(blocks), dict.fromkeys(blocks, SPARSE_ROWS), dict.fromkeys(blocks, EXIT_ROWS)
        )

    def step_flops(
        self, config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
    ) -> Flops:
        return type(self).flops(config, latent_size, text_len, ratio)

    def flop_shape(
        self, pipe: DiffusionPipeline, height: int, width: int
    ) -> tuple[Mapping[str, Any], tuple[int, int], int]:
        denoiser = getattr(pipe, self.model.denoiser)
        latent = self.model.latent_grid(pipe, height, width)
        return denoiser.config, latent, self.model.text_length(pipe)

    def token_cell(self, pipe: DiffusionPipeline) -> int:
        """Pixels per token of the coarsest token grid."""
        raise NotImplementedError


def truncate(
    spec: FamilySpec, scheduler: Any, timesteps: torch.Tensor, request: EditRequest
) -> torch.Tensor:
    """The pipelines' ``get_timesteps`` on a request's own scheduler: the schedule
    without the steps its ``strength`` skips, the scheduler begun after them (so that
    ``add_noise`` / ``scale_noise`` at the first kept timestep find their sigma)."""
    begin = spec.skipped_steps(request.steps, request.strength) * scheduler.order
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(begin)
    return timesteps[begin:]


def guided(state: RequestState, prediction: torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance of a ``[uncond ; text]`` prediction pair."""
    uncond, text = prediction.chunk(2)
    return uncond + state.request.guidance * (text - uncond)
