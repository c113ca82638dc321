"""Per-position randomness of an edit: the template's in the unmasked region, the request's in the masked one.

Two random tensors shape an inpainting run: the initial latent noise and the noise with
which the VAE samples its posterior when it encodes an image. Both are drawn per seed from
one CPU generator (noise first, then VAE noise), so a seed gives the same tensors on every
device (Qwen-Image-Edit's pipeline draws them the other way round, and so does its family).
An edit composes them position-wise with the latent mask: the unmasked region keeps
the template's (its bake follows exactly that trajectory, so the cached rows stay valid),
the masked region takes the request's. With the template's own seed nothing changes; with
mask ratio 1.0 everything comes from the request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.utils.torch_utils import randn_tensor


@dataclass(frozen=True)
class SeedNoise:
    """The random tensors one seed contributes, both shaped like the latents."""

    latents: torch.Tensor  # initial noise
    vae: torch.Tensor  # VAE posterior sampling noise

    @classmethod
    def draw(
        cls, seed: int, shape: tuple[int, ...], dtype: torch.dtype, *, vae_first: bool = False
    ) -> SeedNoise:
        """Both tensors of ``seed``: the initial noise first, then the VAE noise, or the
        other way round (``vae_first``: a pipeline that encodes its image with the
        generator before it draws the noise, as Qwen-Image-Edit's does)."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        first = randn_tensor(shape, generator=generator, dtype=dtype)
        second = randn_tensor(shape, generator=generator, dtype=dtype)
        return cls(second, first) if vae_first else cls(first, second)

    def compose(self, request: SeedNoise, latent_mask: torch.Tensor) -> SeedNoise:
        """This (template) noise outside ``latent_mask``, ``request``'s inside it."""
        return SeedNoise(
            compose(self.latents, request.latents, latent_mask),
            compose(self.vae, request.vae, latent_mask),
        )


def compose(
    template: torch.Tensor, request: torch.Tensor, latent_mask: torch.Tensor
) -> torch.Tensor:
    """Position-wise choice; ``latent_mask`` ``[h, w]`` (bool) broadcasts over channels."""
    return torch.where(latent_mask.to(template.device), request, template)


def vae_sample(vae: torch.nn.Module, image: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The VAE posterior sample ``mean + std * eps`` (the pipelines' ``latent_dist.sample``)."""
    dist = vae.encode(image).latent_dist
    return dist.mean + dist.std * eps.to(device=dist.mean.device, dtype=dist.mean.dtype)
