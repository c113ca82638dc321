"""The batch's DDIM step in one set of ops equals each request's own ``scheduler.step``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler

from retouch.runtime.maskaware import ddimstep
from retouch.runtime.maskaware.request import RequestState

SHAPE = (1, 4, 8, 8)


def _states(prediction_type: str, clip: bool, indices: list[int], dtype=torch.float32):
    """Requests with their own DDIM schedulers (10 steps) at different timesteps."""
    states = []
    for i, index in enumerate(indices):
        scheduler = DDIMScheduler(
            beta_schedule="scaled_linear",
            beta_start=0.00085,
            beta_end=0.012,
            clip_sample=clip,
            clip_sample_range=0.5,
            set_alpha_to_one=i % 2 == 0,
            steps_offset=1,
            prediction_type=prediction_type,
        )
        scheduler.set_timesteps(10)
        latents = torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(dtype)
        state = SimpleNamespace(
            scheduler=scheduler,
            timesteps=scheduler.timesteps,
            index=index,
            latents=latents,
            inputs=SimpleNamespace(extra_step_kwargs={"eta": 0.0}),
        )
        state.timestep_value = RequestState.timestep_value.fget(
            SimpleNamespace(_host_timesteps=None, timesteps=state.timesteps, index=index)
        )
        state.timestep = state.timesteps[index]
        states.append(state)
    return states


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("clip", [False, True])
def test_the_batched_step_is_each_requests_own_step(prediction_type: str, clip: bool) -> None:
    # the first and the last step (its previous timestep is below 0: the final alpha)
    states = _states(prediction_type, clip, [0, 3, 9, 9])
    output = torch.randn((len(states), *SHAPE[1:]), generator=torch.Generator().manual_seed(9))
    assert ddimstep.batchable(states)
    batched = ddimstep.step(states, output)
    for state, row, got in zip(states, output.split(1), batched.split(1), strict=True):
        want = state.scheduler.step(row, state.timestep, state.latents, eta=0.0).prev_sample
        # elementwise IEEE float32 ops with the same operands in the same order: no BLAS
        # and no reduction is involved, so the bits are the same on every CPU
        assert torch.equal(got, want)


def test_half_precision_latents_round_like_a_scalar_applied_in_float32() -> None:
    """bf16 keeps the dtype and agrees within bf16 rounding: each op rounds, and the
    difference ``sample − c·ε`` cancels, so the bound is ulps of the inputs' magnitude
    (values up to ~4: one ulp is 2⁻⁵), not a relative one."""
    states = _states("epsilon", False, [2, 5], torch.bfloat16)
    generator = torch.Generator().manual_seed(11)
    output = torch.randn((2, *SHAPE[1:]), generator=generator).to(torch.bfloat16)
    batched = ddimstep.step(states, output)
    assert batched.dtype == torch.bfloat16
    for state, row, got in zip(states, output.split(1), batched.split(1), strict=True):
        want = state.scheduler.step(row, state.timestep, state.latents, eta=0.0).prev_sample
        torch.testing.assert_close(got, want, rtol=0, atol=2**-4)  # two ulps at 2-4


def test_what_the_batched_step_does_not_cover_steps_one_by_one() -> None:
    states = _states("epsilon", False, [1, 2])
    assert not ddimstep.batchable(_states("epsilon", False, [1]) + _states("epsilon", True, [1]))
    states[0].inputs.extra_step_kwargs = {"eta": 0.3}  # stochastic: a noise draw per request
    assert not ddimstep.batchable(states)
    euler = SimpleNamespace(scheduler=EulerDiscreteScheduler(), inputs=states[1].inputs)
    assert not ddimstep.batchable([states[1], euler])
