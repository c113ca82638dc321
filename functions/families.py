"""What the control plane knows of each model family, as plain data (no torch).

The gateway validates specs and checks model folders against this table without importing
torch or diffusers; the runtime family modules (``retouch.runtime.families``) name their row
here, so a family's spec-side facts are written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from retouch.functions.errors import BadRequest

SD_SCHEDULERS = ("ddim", "euler", "euler-a", "dpm++", "pndm")
FLOW = ("flow-euler",)


class StrengthRule(StrEnum):
    """How a family's diffusers pipeline counts the steps a ``strength`` < 1 keeps (its
    ``get_timesteps``): the two conventions differ by one step where ``steps * strength``
    is not a whole number (or is one only up to rounding: ``10 * 0.7``)."""

    KEEP_FLOOR = "keep-floor"  # SD, SDXL: int(steps * strength) steps kept
    SKIP_FLOOR = "skip-floor"  # SD3, Flux: int(steps - steps * strength) steps skipped


# The key prefix of a denoiser in LDM-style files (SD's, SDXL's and SD3's whole-pipeline
# files, and ComfyUI's re-saves of any model): diffusers' ``LDM_UNET_KEY``.
LDM_PREFIX = "model.diffusion_model."


@dataclass(frozen=True)
class DenoiserFile:
    """Where a family's denoiser is in a single-file checkpoint in its original layout, so
    that the model check can tell from the header alone that the file holds the model its
    ``config`` describes: the ``component``; the key of its input projection's weight
    (``[out, in_channels, ...]``); a key (or key ending) of a weight ``[out, width, ...]``
    that reads the text conditioning, and the config entry giving that width; the key
    prefixes the file may put before them. ``alone``: the family's files hold this
    component alone, the others coming from ``config`` (Black Forest Labs ship the Flux
    transformer without its VAE and text encoders); otherwise a file is the whole pipeline,
    maybe lacking what ``config``'s weights then supply."""

    component: str
    input_weight: str
    context_weight: str
    context_config: str
    prefixes: tuple[str, ...] = (LDM_PREFIX,)
    alone: bool = False
    # Input channels per config ``in_channels`` (Z-Image embeds 2x2 patches of latents)
    input_factor: int = 1


# SD's, SDXL's: ``conv_in``, and any cross-attention's key projection.
UNET_FILE = DenoiserFile(
    "unet", "input_blocks.0.0.weight", "attn2.to_k.weight", "cross_attention_dim"
)
# SD3's MMDiT, bare or in the LDM wrapper (diffusers reads both).
SD3_TRANSFORMER_FILE = DenoiserFile(
    "transformer",
    "x_embedder.proj.weight",
    "context_embedder.weight",
    "joint_attention_dim",
    prefixes=("", LDM_PREFIX),
)
FLUX_TRANSFORMER_FILE = DenoiserFile(
    "transformer",
    "img_in.weight",
    "txt_in.weight",
    "joint_attention_dim",
    prefixes=("", LDM_PREFIX),
    alone=True,
)
# Z-Image's single-stream DiT, bare or in the LDM wrapper (``x_embedder`` takes 2x2 patches).
Z_IMAGE_TRANSFORMER_FILE = DenoiserFile(
    "transformer",
    "x_embedder.weight",
    "cap_embedder.1.weight",
    "cap_feat_dim",
    prefixes=("", LDM_PREFIX),
    alone=True,
    input_factor=4,
)

# Qwen-Image's MMDiT keeps diffusers' key names in its original files (ComfyUI's re-saves
# put them under the LDM prefix): the same input and text projections as Flux's.
QWEN_IMAGE_TRANSFORMER_FILE = FLUX_TRANSFORMER_FILE


@dataclass(frozen=True)
class FamilySpec:
    """One family: the pipeline class it loads, its schedulers (the first is the default),
    its default steps and guidance, the default ``halo`` of its mask-aware edits, its
    default compute dtype on CUDA, whether it takes a negative prompt and how it counts
    the steps of a ``strength`` < 1."""

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
    # Classifier-free guidance: the unconditional branch encodes a negative prompt. The
    # guidance-distilled Flux models have no such branch, so no negative prompt.
    negative_prompt: bool = True
    strength_rule: StrengthRule = StrengthRule.SKIP_FLOOR
    # The components a LoRA file may adapt (diffusers' ``_lora_loadable_modules`` of the
    # pipeline): the denoiser first, then the text encoders.
    lora_modules: tuple[str, ...] = ("unet", "text_encoder")
    # Where its denoiser is in a single-file checkpoint, and whether the file holds it alone.
    single_file: DenoiserFile = field(kw_only=True)
    # Whether its pipeline reads a reference image (``image_reference``: FLUX.1 Kontext).
    image_reference: bool = field(default=False, kw_only=True)
    # ``model_index.json`` entries a folder must have (the pipeline's default when absent)
    # and why: a family serving one variant of a pipeline (FLUX.2 [klein]'s distilled
    # checkpoints, not its base ones with classifier-free guidance).
    index_entries: tuple[tuple[str, object, object, str], ...] = field(default=(), kw_only=True)

    def skipped_steps(self, steps: int, strength: float) -> int:
        """The first steps of a ``steps`` schedule that ``strength`` skips: an edit starts
        from the image noised to the timestep after them (0 at strength 1)."""
        if self.strength_rule is StrengthRule.KEEP_FLOOR:
            return max(steps - min(int(steps * strength), steps), 0)
        return int(max(steps - min(steps * strength, steps), 0))

    def steps_run(self, steps: int, strength: float) -> int:
        """The denoising steps an edit with ``strength`` actually runs."""
        return steps - self.skipped_steps(steps, strength)

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
        FamilySpec(
            "sd-inpaint",
            "StableDiffusionInpaintPipeline",
            SD_SCHEDULERS,
            20,
            7.5,
            halo=2,
            strength_rule=StrengthRule.KEEP_FLOOR,
            single_file=UNET_FILE,
        ),
        FamilySpec(
            "flux-inpaint",
            "FluxInpaintPipeline",
            FLOW,
            20,
            3.5,
            ("FluxImg2ImgPipeline",),
            cuda_dtype="bf16",
            negative_prompt=False,
            lora_modules=("transformer", "text_encoder"),
            single_file=FLUX_TRANSFORMER_FILE,
        ),
        FamilySpec(
            "sd3-inpaint",
            "StableDiffusion3InpaintPipeline",
            FLOW,
            28,
            7.0,
            cuda_dtype="bf16",
            lora_modules=("transformer", "text_encoder", "text_encoder_2"),
            single_file=SD3_TRANSFORMER_FILE,
        ),
        FamilySpec(
            "flux-fill",
            "FluxFillPipeline",
            FLOW,
            50,
            30.0,
            cuda_dtype="bf16",
            negative_prompt=False,
            lora_modules=("transformer", "text_encoder"),
            single_file=FLUX_TRANSFORMER_FILE,
        ),
        FamilySpec(
            "flux-kontext",
            "FluxKontextInpaintPipeline",
            FLOW,
            28,
            3.5,
            cuda_dtype="bf16",
            negative_prompt=False,
            lora_modules=("transformer", "text_encoder"),
            single_file=FLUX_TRANSFORMER_FILE,
            image_reference=True,
        ),
        FamilySpec(
            "flux2-klein",
            "Flux2KleinInpaintPipeline",
            FLOW,
            4,  # the distilled checkpoints' few steps
            1.0,  # distilled: no guidance (the pipeline reads none)
            cuda_dtype="bf16",
            negative_prompt=False,
            lora_modules=("transformer",),  # Flux2LoraLoaderMixin adapts the transformer only
            single_file=FLUX_TRANSFORMER_FILE,  # BFL's files name its projections as Flux's
            index_entries=(
                (
                    "is_distilled",
                    True,
                    False,
                    "flux2-klein serves the distilled checkpoints (a base one needs "
                    "classifier-free guidance)",
                ),
            ),
        ),
        FamilySpec(
            "qwen-image",
            "QwenImageInpaintPipeline",
            FLOW,
            50,
            4.0,  # true_cfg_scale: classifier-free guidance with a negative prompt
            cuda_dtype="bf16",
            lora_modules=("transformer",),
            single_file=QWEN_IMAGE_TRANSFORMER_FILE,
        ),
        FamilySpec(
            "qwen-image-edit",
            "QwenImageEditInpaintPipeline",
            FLOW,
            50,
            4.0,  # true_cfg_scale, as qwen-image
            cuda_dtype="bf16",
            lora_modules=("transformer",),  # QwenImageLoraLoaderMixin adapts the transformer
            single_file=QWEN_IMAGE_TRANSFORMER_FILE,  # the same MMDiT as Qwen-Image
        ),
        FamilySpec(
            "z-image",
            "ZImageInpaintPipeline",
            FLOW,
            28,
            4.0,  # Z-Image's; Z-Image-Turbo runs 9 steps at 0 (no guidance)
            cuda_dtype="bf16",  # its RoPE is complex64: no fp16
            lora_modules=("transformer",),  # diffusers' ZImageLoraLoaderMixin
            single_file=Z_IMAGE_TRANSFORMER_FILE,
        ),
        FamilySpec(
            "sdxl-inpaint",
            "StableDiffusionXLInpaintPipeline",
            ("euler", "ddim", "euler-a", "dpm++", "pndm"),  # SDXL ships Euler
            20,
            7.5,
            halo=2,
            strength_rule=StrengthRule.KEEP_FLOOR,
            lora_modules=("unet", "text_encoder", "text_encoder_2"),
            single_file=UNET_FILE,
        ),
    )
}


def family_spec(name: str) -> FamilySpec:
    """The family named ``name``; ``KeyError`` if there is none."""
    return FAMILY_SPECS[name]


def check_reference(family: str) -> None:
    """Refuse an ``image_reference`` for a family whose pipeline reads none (400 naming it)."""
    if not family_spec(family).image_reference:
        raise BadRequest(
            f"{family} reads no reference image: image_reference is for flux-kontext functions",
            field="image_reference",
            code="unsupported_field",
        )


def check_edit(family: str, steps: int, strength: float, negative_prompt: str) -> int:
    """The denoising steps an edit of ``family`` runs, after refusing what the family cannot
    do: a negative prompt without classifier-free guidance, or a ``strength`` that keeps no
    step of ``steps`` (diffusers refuses both alike)."""
    spec = family_spec(family)
    if negative_prompt and not spec.negative_prompt:
        raise BadRequest(
            f"{family} is guidance-distilled: it takes no negative_prompt",
            field="negative_prompt",
            code="unsupported_field",
        )
    run = spec.steps_run(steps, strength)
    if run < 1:
        raise BadRequest(
            f"strength {strength} keeps no step of {steps}: at least 1/{steps} is needed",
            field="strength",
            code="invalid_field",
        )
    return run
