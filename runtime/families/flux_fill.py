"""The ``flux-fill`` family: FluxFillPipeline (FLUX.1-Fill) split into encode / assemble /
step / decode.

FLUX.1-Fill is a Flux transformer whose image tokens carry their condition: each step's
input is [noisy latents ; masked-image latents ; mask], each packed 2x2 and concatenated on
the token's channels as ``FluxFillPipeline.__call__`` does (64 + 64 + 4·f² channels for a
VAE of factor f: 384 for FLUX.1-Fill-dev). Everything else is ``flux-inpaint``'s, which this
module subclasses: the blocks and their wrappers, the text encoding, the scheduler and the
decode.

Unlike FluxInpaintPipeline, the Fill pipeline does not blend the unmasked latents back to
the template: the model itself regenerates every token. A mask-aware edit computes the
masked tokens and takes the unmasked tokens' output from the bake: when the last block runs
sparse it also reads its own cached Y, a hook on it writes the fresh masked rows over that,
and the model's own ``norm_out``/``proj_out`` run on the whole grid. The unmasked initial
noise is the template's, so the unmasked region follows the bake's trajectory; baked with
the edit's own mask, prompt and seed, the edit is the stock pipeline's. The hook needs
diffusers' block forwards, so Fill runs the padded layout (``packs = False``).

The masked image (the template with the hole) is VAE-encoded with the template's VAE noise,
as ``flux-inpaint`` encodes its template. The stock reference draws that same noise: it
hands the pipeline a generator on the template's seed past its initial-noise draw (diffusers'
FluxFillPipeline refuses ``masked_image_latents`` beside the ``image`` it also requires).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from diffusers import FluxFillPipeline
from diffusers.utils.torch_utils import randn_tensor

from retouch.runtime.families.base import Encoding
from retouch.runtime.families.flux_inpaint import (
    FluxConditioning,
    FluxInpaint,
    FluxInpaintFamily,
    flux_flops,
)
from retouch.runtime.maskaware import flowstep, flux_blocks
from retouch.runtime.maskaware.attention import assemble
from retouch.runtime.maskaware.context import current
from retouch.runtime.maskaware.flops import Flops, linear_flops
from retouch.runtime.maskaware.loader import FamilyRows
from retouch.runtime.maskaware.noise import SeedNoise, vae_sample
from retouch.runtime.maskaware.request import EditRequest, RequestState

WHOLE_OUTPUT = "_retouch_fill_whole_output"  # marks a last block whose exit hook is installed


@dataclass
class FillInputs(FluxConditioning):
    """Per-request transformer inputs besides the latents."""

    condition: torch.Tensor  # [1, N, 64 + 4f²] packed masked-image latents, then the mask


class FluxFill(FluxInpaint):
    """Glue between the editor and a FluxFillPipeline."""

    packs = False  # the whole-grid exit hook runs on diffusers' block forwards
    template_tensors = ()  # the masked-image latents depend on the mask

    def install(self, transformer: torch.nn.Module) -> list[str]:
        """Check the Fill input layout; Flux's block wrappers and the whole-grid exit."""
        mask_channels = 4 * self.pipe.vae_scale_factor**2
        expected = 8 * self.channels + mask_channels
        if transformer.config.in_channels != expected:
            raise ValueError(
                f"a Fill transformer takes {expected} input channels (packed latents, "
                f"masked-image latents and mask), not {transformer.config.in_channels}"
            )
        names = flux_blocks.install(transformer)
        last = transformer.get_submodule(names[-1])
        if not getattr(last, WHOLE_OUTPUT, False):
            last.register_forward_hook(_whole_output(names[-1]), prepend=True)
            setattr(last, WHOLE_OUTPUT, True)
        return names

    def condition(
        self, request: EditRequest, mask_condition: torch.Tensor, vae_noise: torch.Tensor
    ) -> torch.Tensor:
        """``[1, N, 64 + 4f²]``: the pipeline's masked image (the template, zero inside the
        mask) VAE-sampled with ``vae_noise``, and the mask, packed by the pipeline's own
        ``prepare_mask_latents`` and concatenated as its ``__call__`` does."""
        pipe, image = self.pipe, request.image
        init = pipe.image_processor.preprocess(image, height=image.height, width=image.width)
        masked = (init.to(torch.float32) * (1 - mask_condition)).to(self.device, self.dtype)
        sample = vae_sample(pipe.vae, masked, vae_noise)  # latent channels: taken as encoded
        mask, latents = pipe.prepare_mask_latents(
            mask_condition, sample, 1, self.channels, 1, image.height, image.width,
            self.dtype, self.device, None,
        )  # fmt: skip
        return torch.cat((latents, mask), dim=-1)

    def encode_image(self, job: Encoding) -> dict[str, torch.Tensor]:
        """The packed condition, the masked image encoded with the template's VAE noise;
        below strength 1 also the template's latents (where the edit starts)."""
        condition = self.condition(job.request, job.condition, job.template_noise.vae)
        out = {"condition": condition.cpu()}
        if job.request.strength < 1.0:
            out["image_latents"] = self.template_image_latents(job).cpu()
        return out

    def inputs(
        self, request: EditRequest, tensors: dict[str, torch.Tensor], noise: torch.Tensor
    ) -> FillInputs:
        return FillInputs(
            **vars(self.conditioning(request, tensors)),
            condition=tensors["condition"].to(self.device, self.dtype),
        )

    def transformer_input(self, state: RequestState) -> torch.Tensor:
        """[latents ; condition] per token, as FluxFillPipeline concatenates them."""
        return torch.cat((state.latents, state.inputs.condition), dim=2)

    def advance(self, state: RequestState, prediction: torch.Tensor) -> None:
        """The request's scheduler step (Fill blends nothing back)."""
        step = state.scheduler.step(prediction, state.timestep, state.latents, return_dict=False)
        state.latents = step[0]

    def advance_all(self, states: list[RequestState], predictions: list[torch.Tensor]) -> None:
        """The batch's scheduler step in one set of ops (``maskaware.flowstep``) where
        every request steps with the flow-matching Euler scheduler."""
        if not flowstep.batchable(states):
            return super().advance_all(states, predictions)
        latents = flowstep.step(states, torch.cat(predictions))
        for state, row in zip(states, latents.split(1), strict=True):
            state.latents = row
        return None

    def stock_batch(
        self, requests: list[EditRequest], noises: list[tuple[SeedNoise, SeedNoise]]
    ) -> dict[str, Any]:
        """The template images, each request's composed initial noise (packed, as the Fill
        pipeline takes ``latents``) and a generator per request whose draw for the masked
        image's VAE encode is its template's VAE noise (so at strength 1 only: below it the
        pipeline's image encode would draw first)."""
        if requests[0].strength < 1.0:
            raise ValueError("the Fill stock reference runs at strength 1 only")
        pairs = list(zip(requests, noises, strict=True))
        latents = [self._pack(self.composed_noise(r, t, own)) for r, (t, own) in pairs]
        return {
            "image": [r.image for r in requests],
            "latents": torch.cat(latents).to(self.device, self.dtype),
            "generator": [vae_generator(r.template_seed, t.vae.shape) for r, (t, _) in pairs],
        }


def vae_generator(seed: int, shape: torch.Size) -> torch.Generator:
    """A CPU generator whose next ``randn_tensor`` of ``shape`` is ``SeedNoise.draw(seed)``'s
    VAE noise (the initial noise, drawn first, is skipped)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    randn_tensor(tuple(shape), generator=generator, dtype=torch.float32)
    return generator


def _whole_output(name: str) -> Any:
    """Forward hook of the last block: in a sparse run, its fresh masked rows over its
    cached Y of every unmasked token, so the model's output layers predict every token."""

    def hook(block: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
        ctx = current()
        if ctx is None or ctx.grid is None or not ctx.scratch.get(flux_blocks.SPARSE_CARRY):
            return None
        text, image = output
        ctx.scratch[flux_blocks.SPARSE_CARRY] = False
        return text, assemble(ctx, ctx.grid, name, "y", ctx.grid.real_rows(image))

    return hook


def fill_flops(
    config: Mapping[str, Any], latent_size: tuple[int, int], text_len: int, ratio: float
) -> Flops:
    """One row of a Fill ``FluxTransformer2DModel`` at mask ratio ``ratio``: Flux's, plus the
    output projection of the unmasked tokens (their cached Y is projected too)."""
    n_tokens = (latent_size[0] // 2) * (latent_size[1] // 2)
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    cout = config.get("out_channels") or config["in_channels"]
    unmasked = Flops(linear_flops((1 - ratio) * n_tokens, dim, cout))
    return flux_flops(config, latent_size, text_len, ratio) + unmasked


class FluxFillFamily(FluxInpaintFamily):
    """``flux-fill``: FLUX.1-Fill (a Flux DiT whose tokens carry masked image and mask)."""

    name = "flux-fill"
    model = FluxFill
    pipeline = FluxFillPipeline
    flops = fill_flops

    def rows(self, model: FluxFill) -> FamilyRows:
        """Flux's layout; the last block, run sparse, also reads its own Y (the unmasked
        tokens' output comes from it)."""
        rows = super().rows(model)
        last = rows.order[-1]
        exit_rows = (*flux_blocks.SPARSE_ROWS, *flux_blocks.EXIT_ROWS)
        return replace(rows, sparse={**rows.sparse, last: exit_rows})


FAMILY = FluxFillFamily()
