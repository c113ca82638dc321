"""What the control plane knows of each model family, as plain data (no torch).

The gateway validates specs and checks model folders against this table without importing
torch or diffusers; the runtime family modules (``retouch.runtime.families``) name their row
here, so a family's spec-side facts are written once.
"""

from __future__ import annotations

from dataclasses import dataclass

SD_SCHEDULERS = ("ddim", "euler", "euler-a", "dpm++", "pndm")
FLOW = ("flow-euler",)


@dataclass(frozen=True)
class FamilySpec:
    """One family: the pipeline class it loads, its schedulers (the first is the default),
    its default steps and guidance, the default ``halo`` of its mask-aware edits and its
    default compute dtype on CUDA."""

    name: str
    pipeline: str  # the diffusers pipeline class a model of this family is loaded with
    schedulers: tuple[str, ...]
    steps: int
    guidance: float
    also: tuple[str, ...] = ()  # more pipeline classes whose folders this family can load
    # Latent pixels around the mask computed fresh in a mask-aware edit. A UNet's
    # convolutions carry the edit into the unmasked tokens next to the mask; reusing the
    # template's activations there leaves a seam (docs/maskaware.md, "Halo"). DiT families
    # blend the unmasked latents back to the template every step and need none.
    halo: int = 0
    # The compute dtype of ``dtype = "auto"`` on CUDA (on a CPU: fp32, which it runs fastest).
    cuda_dtype: str = "fp16"

    @property
    def scheduler(self) -> str:
        return self.schedulers[0]

    @property
    def compatible(self) -> tuple[str, ...]:
        """Pipeline classes in a ``model_index.json`` that this family can load: its own,
        the text-to-image pipeline of the same components, and ``also``."""
        return (self.pipeline, self.pipeline.replace("Inpaint", ""), *self.also)


FAMILY_SPECS: dict[str, FamilySpec] = {
    f.name: f
    for f in (
        FamilySpec("sd-inpaint", "StableDiffusionInpaintPipeline", SD_SCHEDULERS, 20, 7.5, halo=2),
        FamilySpec(
            "flux-inpaint",
            "FluxInpaintPipeline",
            FLOW,
            20,
            3.5,
            ("FluxImg2ImgPipeline",),
            cuda_dtype="bf16",
        ),
        FamilySpec(
            "sd3-inpaint", "StableDiffusion3InpaintPipeline", FLOW, 28, 7.0, cuda_dtype="bf16"
        ),
        FamilySpec("flux-fill", "FluxFillPipeline", FLOW, 50, 30.0, cuda_dtype="bf16"),
        FamilySpec(
            "sdxl-inpaint",
            "StableDiffusionXLInpaintPipeline",
            ("euler", "ddim", "euler-a", "dpm++", "pndm"),  # SDXL ships Euler
            20,
            7.5,
            halo=2,
        ),
    )
}


def family_spec(name: str) -> FamilySpec:
    """The family named ``name``; ``KeyError`` if there is none."""
    return FAMILY_SPECS[name]
