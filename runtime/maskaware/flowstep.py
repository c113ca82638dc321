"""The flow-matching Euler step, guidance and inpaint blend of a whole batch in one set of ops.

Continuous batching runs requests at different steps, each with its own scheduler. A step
per request (diffusers' ``FlowMatchEulerDiscreteScheduler.step``, then the pipelines' blend
with ``scale_noise``) dispatches some 25 ops, host time on a GPU that grows with the batch
and sits outside the captured denoiser call. For that scheduler (Flux, Fill and SD3 use it)
every piece is elementwise with one sigma per request:

* guidance: ``uncond + g · (text − uncond)``
* the step: ``x + (σ_next − σ) · v``, in float32, back to the prediction's dtype
* the blend: ``(1 − m) · (σ' · noise + (1 − σ') · template) + m · x`` (σ' of the next
  timestep; the last step blends the template as it is: σ' = 0 gives exactly that)

so the batch takes them with the sigmas as a ``[B, 1, ...]`` tensor, computed with the same
dtype rules as the per-request calls (a scalar operand is applied in float32, then rounded
to the tensor's dtype), which gives the per-request result bit for bit. Each scheduler's
step index still advances: the state stays the scheduler's.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from retouch.runtime.maskaware.request import RequestState


def batchable(states: Sequence[RequestState]) -> bool:
    """Whether every request steps with a deterministic flow-matching Euler scheduler."""
    return all(
        type(s.scheduler) is FlowMatchEulerDiscreteScheduler
        and not s.scheduler.config.stochastic_sampling
        for s in states
    )


def step(states: Sequence[RequestState], velocity: torch.Tensor) -> torch.Tensor:
    """Every request's next latents ``[B, ...]`` from its velocity ``[B, ...]`` (each
    scheduler's step index advances, as its ``step`` would)."""
    deltas = []
    for state in states:
        scheduler = state.scheduler
        if scheduler.step_index is None:
            scheduler._init_step_index(state.timestep)
        sigmas, index = _sigmas(scheduler), scheduler.step_index
        deltas.append(sigmas[index + 1] - sigmas[index])
        scheduler._step_index += 1
    sample = torch.cat([s.latents for s in states]).to(torch.float32)
    delta = per_request(deltas, velocity)
    moved = (velocity.to(torch.float32) * delta).to(velocity.dtype)
    return (sample + moved).to(velocity.dtype)


def guide(states: Sequence[RequestState], pairs: torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance of ``[B, 2, ...]`` ``[uncond ; text]`` predictions."""
    uncond, text = pairs[:, 0], pairs[:, 1]
    scale = per_request([np.float32(s.request.guidance) for s in states], text)
    return uncond + ((text - uncond).to(torch.float32) * scale).to(text.dtype)


@dataclass
class BlendInputs:
    """The batch's blend tensors, stacked once while its requests stay the same."""

    sources: tuple[torch.Tensor, ...]  # every request's (mask, template, noise), in order
    keep: torch.Tensor  # 1 − mask
    mask: torch.Tensor
    template: torch.Tensor
    noise: torch.Tensor

    @classmethod
    def of(cls, states: Sequence[RequestState], memo: BlendInputs | None) -> BlendInputs:
        sources = tuple(
            t for s in states for t in (s.inputs.mask, s.inputs.image_latents, s.inputs.noise)
        )
        if (
            memo is not None
            and len(memo.sources) == len(sources)
            and all(a is b for a, b in zip(memo.sources, sources, strict=True))
        ):
            return memo
        mask = torch.cat(sources[0::3])
        return cls(sources, 1 - mask, mask, torch.cat(sources[1::3]), torch.cat(sources[2::3]))


def blend(
    states: Sequence[RequestState], latents: torch.Tensor, inputs: BlendInputs
) -> torch.Tensor:
    """The inpaint blend after the step (call after :func:`step`: the step indices point
    at the next timestep): unmasked latents from the template re-noised to it."""
    sigmas = [
        np.float32(0.0) if s.last else _sigmas(s.scheduler)[s.scheduler.step_index] for s in states
    ]
    sigma = per_request(sigmas, latents).to(inputs.template.dtype)
    template = sigma * inputs.noise + (1.0 - sigma) * inputs.template
    return inputs.keep * template + inputs.mask * latents


def advance(
    states: Sequence[RequestState], velocity: torch.Tensor, memo: BlendInputs | None
) -> BlendInputs:
    """:func:`step` then :func:`blend`, each request's latents replaced by its row; the
    blend's stacked tensors, for the next call to re-use while the batch stays the same."""
    inputs = BlendInputs.of(states, memo)
    latents = blend(states, step(states, velocity), inputs)
    for state, row in zip(states, latents.split(1), strict=True):
        state.latents = row
    return inputs


_SIGMAS: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()


def _sigmas(scheduler: Any) -> np.ndarray:
    """The scheduler's sigmas as float32 host values, read once per scheduler (indexing its
    tensor dispatches ops every step)."""
    sigmas = _SIGMAS.get(scheduler)
    if sigmas is None:
        sigmas = _SIGMAS[scheduler] = scheduler.sigmas.detach().cpu().to(torch.float32).numpy()
    return sigmas


def per_request(values: list[np.float32], like: torch.Tensor) -> torch.Tensor:
    """``[B, 1, ...]`` float32 values on ``like``'s device, broadcasting over its rows."""
    shape = (len(values),) + (1,) * (like.dim() - 1)
    return torch.from_numpy(np.array(values, dtype=np.float32)).to(like.device).view(shape)
