"""The deploy-time check of a function's LoRA files, torch-free (the gateway runs it).

A LoRA that cannot apply to the function's base model must be a 422 naming the entry
(``adapters[1].path``) when the function is deployed, never an error from inside diffusers
on the first invocation. This module reads only safetensors headers: each file must exist,
be a safetensors file, hold LoRA tensors, and adapt only components the family's pipeline
has, and be plain LoRA of linear layers (no convolution, no DoRA, no bias: the served
steps apply no other). Where the base model's own weights are safetensors in a diffusers
folder, each adapted module (diffusers/PEFT layout) must exist there with the widths the
LoRA was made for: a LoRA for another base model fails here. What needs the loaded model
(built-in models, which are built on the executor; single-file checkpoints; kohya-layout
files, which diffusers converts) is checked by the executor before it serves the function
(``runtime/executor/adapterhost.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from retouch.functions.adapters import AdapterSpec
from retouch.functions.errors import InvalidSpec
from retouch.functions.families import family_spec
from retouch.functions.modelcheck import ModelFiles, ModelKind, safetensors_header, weight_shapes

# Any LoRA tensor name: PEFT's ``lora_A``/``lora_B``, diffusers' older ``lora.down`` /
# ``lora_linear_layer.down`` and attention-processor ``to_q_lora.down``, kohya's ``lora_down``.
LORA_MARK = re.compile(r"(?:^|[._])lora(?:_linear_layer)?[._](?:A|B|down|up)\.")
# The diffusers/PEFT layout: ``<component>.<module>.lora_A.weight`` (shape checked).
PEFT_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")
COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
# kohya-layout prefixes of the text encoders (``lora_unet_`` is the denoiser's).
KOHYA_TEXT = {
    "lora_te_": "text_encoder",
    "lora_te1_": "text_encoder",
    "lora_te2_": "text_encoder_2",
    "lora_te3_": "text_encoder_3",
}
TEXT_ENCODER_ROOT = "text_model."  # CLIP's weight names keep it; its LoRA keys may not
# DoRA's magnitude vectors: PEFT's ``lora_magnitude_vector``, kohya's ``dora_scale``.
DORA_MARK = re.compile(r"lora_magnitude_vector|dora_scale")
# A bias on the up projection (diffusers then builds ``lora_B`` with ``bias=True``).
LORA_BIAS = re.compile(r"(?:^|[._])lora(?:_linear_layer)?[._](?:B|up)\.bias$")


@dataclass(frozen=True)
class LoraFile:
    """What a LoRA file's header says: the components it adapts and, for its tensors in the
    diffusers/PEFT layout, each adapted module's ``lora_A`` and ``lora_B`` shapes."""

    path: Path
    components: tuple[str, ...]
    halves: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # module -> A/B

    @property
    def text_components(self) -> tuple[str, ...]:
        """The text encoders it adapts: their part loads where prompts are encoded."""
        return tuple(c for c in self.components if c.startswith("text_encoder"))


def check_adapters(
    adapters: tuple[AdapterSpec, ...],
    family: str,
    model: str,
    files: ModelFiles,
    variant: str | None = None,
) -> tuple[LoraFile, ...]:
    """Each adapter's file, once it is seen to be a LoRA that ``family``'s pipeline can load
    and, where ``files`` is a diffusers folder of safetensors, that fits ``model``'s
    modules; an :class:`InvalidSpec` naming the first entry that does not."""
    loras = []
    for i, adapter in enumerate(adapters):
        where = f"adapters[{i}].path"
        lora = read_lora(Path(adapter.path), family, where)
        if files.kind is ModelKind.FOLDER and files.folder is not None:
            _check_shapes(lora, model, files.folder, variant, where)
        loras.append(lora)
    return tuple(loras)


def read_lora(path: Path, family: str, where: str) -> LoraFile:
    """A LoRA file's components and module shapes, from its safetensors header."""
    if not path.is_absolute():
        raise InvalidSpec(
            f"{path}: an adapter's path must be absolute (retouch deploy resolves a spec "
            "file's relative paths against its folder)",
            field=where,
        )
    if not path.is_file():
        raise InvalidSpec(f"no such LoRA file: {path}", field=where)
    header = safetensors_header(path, where)
    names = [k for k in header if LORA_MARK.search(k)]
    if not names:
        raise InvalidSpec(
            f"{path} holds no LoRA weights (no lora_A/lora_B or lora_down/lora_up tensors)",
            field=where,
        )
    _refuse_unservable(path, header, names, where)
    allowed = family_spec(family).lora_modules
    components = sorted({_component(k, allowed[0]) for k in names}, key=COMPONENTS.index)
    for component in components:
        if component not in allowed:
            raise InvalidSpec(
                f"{path} adapts {component}, which a {family} pipeline does not have "
                f"(it has {', '.join(allowed)}): a LoRA for another model family",
                field=where,
            )
    halves: dict[str, dict[str, list[int]]] = {}
    for name in names:
        if (match := PEFT_KEY.match(name)) and name.split(".", 1)[0] in COMPONENTS:
            shape = [int(n) for n in header[name]["shape"]]
            halves.setdefault(match["module"], {})[match["half"]] = shape
    return LoraFile(path, tuple(components), halves)


def _refuse_unservable(path: Path, header: dict, names: list[str], where: str) -> None:
    """LoRA kinds the served steps cannot apply, refused at deploy: a LoRA of a convolution
    (a 4-D tensor), a DoRA file, or one with a bias on its up projection. Mask-aware steps
    apply the denoiser's projections to token rows, and a batch of mixed adapters stacks
    every slotted file's updates as matrices without bias: a convolution's file would fail
    every mixed step on its model's copy, other tenants' too, and a bias would be left out
    silently."""
    if dora := next((k for k in header if DORA_MARK.search(k)), None):
        raise InvalidSpec(
            f"{path} is a DoRA (weight-decomposed) LoRA ({dora}): retouch serves plain LoRA",
            field=where,
        )
    if bias := next((k for k in header if LORA_BIAS.search(k)), None):
        raise InvalidSpec(
            f"{path} has a LoRA bias ({bias}): retouch serves plain LoRA (no bias)", field=where
        )
    for name in names:
        shape = header[name].get("shape", [])
        if len(shape) == 4:
            module = name[: LORA_MARK.search(name).start()]  # type: ignore[union-attr]
            raise InvalidSpec(
                f"{path} adapts {module}, a convolution (a {'x'.join(map(str, shape))} "
                "LoRA tensor): retouch serves LoRAs of linear layers only",
                field=where,
            )


def _component(key: str, denoiser: str) -> str:
    """The pipeline component a LoRA tensor adapts: its prefix in the diffusers layout, a
    kohya prefix, else the denoiser (diffusers reads unprefixed files as the denoiser's)."""
    head = key.split(".", 1)[0]
    if head in COMPONENTS:
        return head
    for prefix, component in KOHYA_TEXT.items():
        if key.startswith(prefix):
            return component
    return denoiser


def _check_shapes(
    lora: LoraFile, model: str, folder: Path, variant: str | None, where: str
) -> None:
    """Each adapted module exists in the folder's weights, as wide as the LoRA's halves."""
    weights: dict[str, dict[str, list[int]]] = {}
    for module, halves in sorted(lora.halves.items()):
        component, name = module.split(".", 1)
        if component not in weights:
            weights[component] = weight_shapes(folder / component, variant)
        if not weights[component]:
            continue  # pickled weights: the executor checks them loaded
        shape = _base_shape(weights[component], name)
        if shape is None:
            raise InvalidSpec(
                f"{lora.path} adapts {module}, which {model} does not have: a LoRA for "
                "another base model",
                field=where,
            )
        a, b = halves.get("A"), halves.get("B")
        if a is None or b is None or len(a) < 2 or len(b) < 2 or a[0] != b[1]:
            raise InvalidSpec(
                f"{lora.path}: {module} lacks a matching lora_A/lora_B pair", field=where
            )
        if a[1] != shape[1] or b[0] != shape[0]:
            raise InvalidSpec(
                f"{lora.path}: {module} is {shape[0]}x{shape[1]} in {model}, the LoRA's is "
                f"{b[0]}x{a[1]}: a LoRA for another base model",
                field=where,
            )


def _base_shape(weights: dict[str, list[int]], module: str) -> list[int] | None:
    """The base weight a LoRA module adapts (CLIP's weight names may add ``text_model.``)."""
    for name in (module, TEXT_ENCODER_ROOT + module, module.removeprefix(TEXT_ENCODER_ROOT)):
        shape = weights.get(f"{name}.weight")
        if shape is not None and len(shape) >= 2:
            return shape
    return None
