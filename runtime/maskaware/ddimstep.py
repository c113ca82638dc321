"""The DDIM step of a whole batch in one set of ops (the SD family's usual scheduler).

Continuous batching runs requests at different steps, each with its own scheduler, and
diffusers' ``DDIMScheduler.step`` dispatches a dozen ops per request (coefficients read
and raised to ½ as 0-dim tensors, then the update): host time on a GPU that grows with the
batch. With ``eta = 0`` the step is deterministic and elementwise, with four coefficients
per request (``√ᾱ_t``, ``√(1 − ᾱ_t)``, ``√ᾱ_prev``, ``√(1 − ᾱ_prev)``), so the batch takes
it with those as ``[B, 1, ...]`` tensors. They are computed as the scheduler computes them
(by torch, on 0-dim float32 tensors: its roots are not always numpy's), once per pair of
alphas in the process, and applied in the scheduler's order, so float32 latents come out
bit for bit as the per-request calls make them; half-precision latents take each scalar in
float32 and round after each op (how CUDA applies a 0-dim operand). The scheduler's own
state is untouched: DDIM keeps none between steps.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from diffusers import DDIMScheduler

from retouch.runtime.maskaware.flowstep import per_request
from retouch.runtime.maskaware.request import RequestState

PREDICTIONS = ("epsilon", "v_prediction")


def batchable(states: Sequence[RequestState]) -> bool:
    """Whether every request steps with a deterministic DDIM scheduler of one kind (same
    prediction type and clipping, no dynamic thresholding)."""
    kinds = set()
    for s in states:
        scheduler = s.scheduler
        if type(scheduler) is not DDIMScheduler or scheduler.num_inference_steps is None:
            return False
        config = scheduler.config
        kwargs = s.inputs.extra_step_kwargs
        if config.thresholding or config.prediction_type not in PREDICTIONS:
            return False
        if kwargs.get("eta", 0.0) != 0.0 or kwargs.get("variance_noise") is not None:
            return False
        kinds.add((config.prediction_type, config.clip_sample, config.clip_sample_range))
    return len(kinds) == 1


def step(states: Sequence[RequestState], output: torch.Tensor) -> torch.Tensor:
    """Every request's previous-timestep latents ``[B, ...]`` from its guided model output
    ``[B, ...]`` (``DDIMScheduler.step`` with ``eta = 0``, row by row)."""
    coefficients = np.array([_coefficients(s.scheduler, int(s.timestep_value)) for s in states])
    sqrt_a, sqrt_b, sqrt_prev, direction = (
        per_request(list(coefficients[:, i]), output) for i in range(4)
    )
    sample = torch.cat([s.latents for s in states])
    config = states[0].scheduler.config
    if config.prediction_type == "epsilon":
        original = _over(sample - _times(sqrt_b, output), sqrt_a)
        epsilon = output
    else:  # v_prediction
        original = _times(sqrt_a, sample) - _times(sqrt_b, output)
        epsilon = _times(sqrt_a, output) + _times(sqrt_b, sample)
    if config.clip_sample:
        limit = config.clip_sample_range
        original = original.clamp(-limit, limit)
    return _times(sqrt_prev, original) + _times(direction, epsilon)


_ALPHAS: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()


def _coefficients(scheduler: DDIMScheduler, timestep: int) -> tuple[np.float32, ...]:
    """``(√ᾱ_t, √(1 − ᾱ_t), √ᾱ_prev, √(1 − ᾱ_prev − 0))`` as the scheduler computes them."""
    alphas = _ALPHAS.get(scheduler)
    if alphas is None:
        alphas = scheduler.alphas_cumprod.detach().cpu().to(torch.float32).numpy()
        _ALPHAS[scheduler] = alphas
    previous = timestep - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    alpha = alphas[timestep]
    alpha_prev = (
        alphas[previous] if previous >= 0 else np.float32(float(scheduler.final_alpha_cumprod))
    )
    return _roots(float(alpha), float(alpha_prev))


@functools.lru_cache(maxsize=4096)
def _roots(alpha: float, alpha_prev: float) -> tuple[np.float32, ...]:
    """The four roots computed by torch on 0-dim float32 tensors, as the scheduler does:
    torch's square root of a 0-dim CPU tensor is not always the correctly rounded one
    (√0.84018368 came out one ulp above ``np.sqrt``'s), so the host computes them with the
    same ops, once per pair of alphas in the process (a template's bake computes its
    schedule's first: the requests that follow share it)."""
    a, a_prev = (
        torch.tensor(alpha, dtype=torch.float32),
        torch.tensor(alpha_prev, dtype=torch.float32),
    )
    std = 0.0 * torch.tensor(0.0, dtype=torch.float32)  # eta · √variance, eta = 0
    roots = (a**0.5, (1 - a) ** 0.5, a_prev**0.5, (1 - a_prev - std**2) ** 0.5)
    return tuple(np.float32(r.item()) for r in roots)


def _times(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``scale · x`` with a float32 ``[B, 1, ...]`` scale, in float32, rounded to x's dtype."""
    if x.dtype == torch.float32:
        return scale * x
    return (scale * x.to(torch.float32)).to(x.dtype)


def _over(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return x / scale
    return (x.to(torch.float32) / scale).to(x.dtype)
