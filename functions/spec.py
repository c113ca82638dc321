"""Function specs: what a user deploys, parsed from TOML and validated field by field.

A spec names a model, its family, the generation settings and the templates (image,
prompt, seed) the function edits. Template *images* travel separately as bytes (the CLI
reads the paths in the TOML file and uploads the files); the spec document itself is plain
data, stored by the registry and sent to executors.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retouch.functions.adapters import AdapterSpec, adapter_set_id, parse_adapters
from retouch.functions.errors import BadRequest, InvalidSpec, unknown_field_message
from retouch.functions.families import FAMILY_SPECS
from retouch.functions.modelsource import OPTIONS, ModelSource, parse_source
from retouch.functions.wire.executor import template_variant
from retouch.functions.wire.invoke import MAX_PROMPT_CHARS

FAMILIES = tuple(FAMILY_SPECS)
SCHEDULERS: dict[str, tuple[str, ...]] = {n: f.schedulers for n, f in FAMILY_SPECS.items()}
DEFAULTS: dict[str, dict[str, Any]] = {
    n: {"steps": f.steps, "guidance": f.guidance, "scheduler": f.scheduler}
    for n, f in FAMILY_SPECS.items()
}
# Used with fullmatch: ``$`` would also accept a trailing newline.
NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
TEMPLATE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# The fields of each table: anything else is refused (a misspelt ``step = 5`` must not
# deploy silently with 20 steps).
FIELDS = (
    "name",
    "model",
    *OPTIONS,  # how the model loads: dtype, variant, revision, config
    "family",
    "resolution",
    "steps",
    "guidance",
    "scheduler",
    "schedulers",
    "full_steps",
    "halo",
    "composite",
    "feather_px",
    "templates",
    "scaling",
    "slo",
    "placement",
    "uploads",
    "storage",
    "examples",
    "adapters",
)
TEMPLATE_FIELDS = ("image", "prompt", "seed")  # image: a path, in TOML files only
SCALING_SECONDS = (
    "target_s",
    "upscale_delay_s",
    "stable_window_s",
    "downscale_delay_s",
    "downscale_to_zero_delay_s",
    "upscale_hold_s",
)
SCALING_FIELDS = (
    "min_executors",
    "max_executors",
    *SCALING_SECONDS,
    "target_utilisation",
    "headroom_sigmas",
    "rise_cap",
    "downscale_margin",
)
SLO_FIELDS = ("latency_ms",)
# The placement policies a function may ask for (the gateway's ``platform/control/placement.py``
# implements each; a test keeps the two lists equal).
# How a bake's rows rest in the activation store (``runtime/maskaware/rowformat.RowFormat``):
# the model's compute dtype, or attention keys and values in fp8 (half the bytes).
STORAGES = ("native", "fp8")
PLACEMENTS = (
    "maskaware",
    "adapter-blind",
    "least-requests",
    "round-robin",
    "least-masked-tokens",
    "template-hash",
)
UPLOADS_FIELDS = ("max_images", "max_bytes", "prompt", "seed")
SIZE_MULTIPLE = 16  # Flux packs 2x2 latents on top of the VAE factor (8); SD needs 8
# Example prompts: a menu on the web page, so a short list of short lines.
MAX_EXAMPLES = 16
MAX_EXAMPLE_CHARS = 200
# Schedulers a request may choose besides the spec's: each is another trajectory, so
# another bake per template it is used on (a short list bounds what one function can fill).
MAX_SCHEDULERS = 8


@dataclass(frozen=True)
class TemplateSpec:
    prompt: str
    seed: int
    image: str | None = None  # path in the TOML file; absent once uploaded


@dataclass(frozen=True)
class ScalingSpec:
    """How the autoscaler (``retouch serve --autoscale``) sizes the pool for this function.

    ``target_s`` is the predicted seconds of work (running + queued) one executor should
    hold, ``target_utilisation`` the share of an executor's capacity the arriving work may
    fill (the demand signal, which sees a rise before the work piles up); scale-up follows the mean over the last ``upscale_delay_s`` (Knative's panic
    window), scale-down the mean over ``stable_window_s`` and then the highest
    recommendation of the last ``downscale_delay_s`` (a scale-up's count held at least
    ``upscale_hold_s``), plus ``downscale_margin`` of it; a rise of the arrivals' demand is
    followed at most to ``rise_cap`` times its level before; the last executor goes after
    ``downscale_to_zero_delay_s`` without work. The defaults suit GPU executors that take
    minutes to start."""

    min_executors: int = 0
    max_executors: int = 1
    target_s: float = 30.0
    upscale_delay_s: float = 6.0
    stable_window_s: float = 60.0
    downscale_delay_s: float = 600.0
    downscale_to_zero_delay_s: float = 300.0
    target_utilisation: float = 0.8  # the share of an executor's capacity arrivals may fill
    headroom_sigmas: float = 0.0  # + this x sqrt(demand) executors: room for bursts
    upscale_hold_s: float = 0.0  # a scale-up's count holds at least this long
    rise_cap: float = 2.0  # a demand rise is followed at most to this x its level before
    downscale_margin: float = 0.0  # a scale-down keeps this share above the held count (rounded)


@dataclass(frozen=True)
class UploadsSpec:
    """Edits of uploaded images (``image`` instead of ``template``): each distinct image
    becomes an ad-hoc template of the function, baked with ``prompt`` and ``seed`` after
    its first edit. ``max_images`` ad-hoc templates (0: uploads refused) and ``max_bytes``
    of their baked activations are kept per executor; beyond either, the least recently
    used one is dropped (its bake deleted)."""

    max_images: int = 16
    max_bytes: int = 4 << 30
    prompt: str = ""
    seed: int = 0


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    model: str
    family: str
    width: int
    height: int
    steps: int
    guidance: float
    scheduler: str
    templates: dict[str, TemplateSpec]
    scaling: ScalingSpec = field(default_factory=ScalingSpec)
    slo_ms: float | None = None
    full_steps: int = 0  # first denoising steps computed over every token (quality warm-up)
    uploads: UploadsSpec = field(default_factory=UploadsSpec)
    placement: str | None = None  # its own placement policy (None: the server's)
    # Paste the edit into the template so unmasked pixels stay the template's own (the VAE
    # round trip changes them slightly otherwise), with a ``feather_px`` soft edge outside
    # the mask. Off by default: the output then equals the stock diffusers pipeline's.
    composite: bool = False
    feather_px: int = 3
    halo: int | None = None  # latent pixels around the mask computed fresh (None: the family's)
    storage: str = "native"  # how its bakes' rows rest in the store (one of STORAGES)
    dtype: str = "auto"  # the compute dtype (auto: the family's on the device)
    variant: str | None = None  # weight files' variant (``diffusion_pytorch_model.fp16.*``)
    revision: str | None = None  # of a hub id
    config: str | None = None  # a single-file checkpoint's diffusers folder or hub id
    # Prompts that mean something to the model (what it was trained to draw): the web page
    # offers them, so a first edit need not guess the model's vocabulary.
    examples: tuple[str, ...] = ()
    # Schedulers of the family an invocation may choose (``scheduler``) besides ``scheduler``.
    schedulers: tuple[str, ...] = ()
    # LoRA adapters applied to the base model (functions/adapters.py); none: the bare model.
    adapters: tuple[AdapterSpec, ...] = ()

    @property
    def adapter_set(self) -> str:
        """The id of this function's adapter set ("" for none): what batches, residency,
        placement and bakes are keyed by besides the model."""
        return adapter_set_id(self.adapters)

    @property
    def allowed_schedulers(self) -> tuple[str, ...]:
        """The schedulers an edit may run with: the spec's own first."""
        return (self.scheduler, *(s for s in self.schedulers if s != self.scheduler))

    def template_variant(self, template: str, strength: float, scheduler: str) -> str:
        """The id of ``template`` as edits of this function's steps at ``strength`` with
        ``scheduler`` see it (another trajectory, another bake): the template itself at
        strength 1 with the spec's own scheduler. The one rule the gateway (placement) and
        the executor (the variant it serves and bakes) both follow."""
        skipped = FAMILY_SPECS[self.family].skipped_steps(self.steps, strength)
        other = "" if scheduler == self.scheduler else scheduler
        return template_variant(template, skipped, other)

    def request_scheduler(self, name: str | None) -> str:
        """The scheduler an invocation asking for ``name`` (None: none) runs with; a name
        the function does not allow is refused, naming the ones it does."""
        if name is None or name == self.scheduler:
            return self.scheduler
        if name not in self.schedulers:
            raise BadRequest(
                f"scheduler {name!r} is not allowed by {self.name!r}: "
                f"one of {', '.join(self.allowed_schedulers)}",
                field="scheduler",
                code="invalid_field",
            )
        return name

    @property
    def source(self) -> ModelSource:
        """The model and how it loads (functions with equal sources share a loaded copy)."""
        return ModelSource(self.model, self.dtype, self.variant, self.revision, self.config)

    def __post_init__(self) -> None:
        if self.halo is None:
            object.__setattr__(self, "halo", FAMILY_SPECS[self.family].halo)

    def to_dict(self) -> dict[str, Any]:
        """The spec document in the same shape as the TOML file (what :func:`parse_spec`
        reads back), template image paths dropped: images travel as bytes."""
        doc: dict[str, Any] = {
            "name": self.name,
            "model": self.model,
            **self.source.options(),
            "family": self.family,
            "resolution": [self.width, self.height],
            "steps": self.steps,
            "guidance": self.guidance,
            "scheduler": self.scheduler,
            "schedulers": list(self.schedulers),
            "full_steps": self.full_steps,
            "halo": self.halo,
            "composite": self.composite,
            "feather_px": self.feather_px,
            "storage": self.storage,
            "examples": list(self.examples),
            "adapters": [a.to_dict() for a in self.adapters],
            "templates": {
                tid: {"prompt": t.prompt, "seed": t.seed} for tid, t in self.templates.items()
            },
            "scaling": asdict(self.scaling),
            "uploads": asdict(self.uploads),
        }
        if self.slo_ms is not None:
            doc["slo"] = {"latency_ms": self.slo_ms}
        if self.placement is not None:
            doc["placement"] = self.placement
        return doc


def load_spec_file(path: Path) -> tuple[FunctionSpec, dict[str, Path]]:
    """Parse a TOML spec; returns the spec and each template's image path (resolved)."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise InvalidSpec(f"cannot read {path}: {exc.strerror}", field=None) from exc
    except tomllib.TOMLDecodeError as exc:
        raise InvalidSpec(f"{path} is not valid TOML: {exc}") from exc
    spec = parse_spec(raw)
    if spec.adapters:  # a LoRA file beside the spec, wherever the deploy runs from
        spec = dataclasses.replace(spec, adapters=_resolved(spec.adapters, path.parent))
    images: dict[str, Path] = {}
    for tid, tpl in spec.templates.items():
        if tpl.image is None:
            raise InvalidSpec("template image path is required", field=f"templates.{tid}.image")
        images[tid] = (path.parent / tpl.image).resolve()
    return spec, images


def _resolved(adapters: tuple[AdapterSpec, ...], folder: Path) -> tuple[AdapterSpec, ...]:
    """Adapter paths relative to the spec file's folder made absolute, as template images'."""
    return tuple(
        dataclasses.replace(a, path=str((folder / Path(a.path).expanduser()).resolve()))
        for a in adapters
    )


def parse_spec(raw: Any) -> FunctionSpec:
    """Validate a spec document (from TOML, JSON or msgpack); errors name the field."""
    if not isinstance(raw, dict):
        raise InvalidSpec("spec must be a table/map")
    _known(raw, FIELDS)
    name = _str(raw, "name")
    if not NAME_RE.fullmatch(name):
        raise InvalidSpec("name must match [a-z0-9][a-z0-9-]{0,62}", field="name")
    model = _str(raw, "model")
    source = parse_source(raw, model)
    family = _str(raw, "family")
    if family not in FAMILIES:
        raise InvalidSpec(f"family must be one of {FAMILIES}", field="family")
    defaults = DEFAULTS[family]
    width, height = _resolution(raw)
    steps = _int(raw, "steps", defaults["steps"], 1, 200)
    guidance = _float(raw, "guidance", defaults["guidance"], 0.0, 50.0)
    full_steps = _int(raw, "full_steps", 0, 0, 200)
    scheduler = _str(raw, "scheduler", defaults["scheduler"])
    if scheduler not in SCHEDULERS[family]:
        raise InvalidSpec(
            f"scheduler for {family} must be one of {SCHEDULERS[family]}", field="scheduler"
        )
    return FunctionSpec(
        name=name,
        model=model,
        family=family,
        width=width,
        height=height,
        steps=steps,
        guidance=guidance,
        scheduler=scheduler,
        templates=_templates(raw.get("templates")),
        scaling=_scaling(raw.get("scaling", {})),
        slo_ms=_slo(raw.get("slo")),
        full_steps=full_steps,
        uploads=_uploads(raw.get("uploads", {})),
        placement=_placement(raw),
        composite=_bool(raw, "composite", False),
        halo=_int(raw, "halo", FAMILY_SPECS[family].halo, 0, 16),
        feather_px=_int(raw, "feather_px", 3, 0, 64),
        storage=_storage(raw),
        dtype=source.dtype,
        variant=source.variant,
        revision=source.revision,
        config=source.config,
        examples=_examples(raw.get("examples", [])),
        schedulers=_schedulers(raw.get("schedulers", []), family),
        adapters=parse_adapters(raw.get("adapters", [])),
    )


def _schedulers(raw: Any, family: str) -> tuple[str, ...]:
    """Errors name the entry (``schedulers[2]``); one past the limit for too many."""
    if not isinstance(raw, list):
        raise InvalidSpec("schedulers must be a list of scheduler names", field="schedulers")
    if len(raw) > MAX_SCHEDULERS:
        raise InvalidSpec(
            f"at most {MAX_SCHEDULERS} schedulers", field=f"schedulers[{MAX_SCHEDULERS}]"
        )
    for i, name in enumerate(raw):
        if name not in SCHEDULERS[family]:
            raise InvalidSpec(
                f"a scheduler for {family} is one of {SCHEDULERS[family]}", field=f"schedulers[{i}]"
            )
        if name in raw[:i]:
            raise InvalidSpec(f"{name!r} is listed twice", field=f"schedulers[{i}]")
    return tuple(raw)


def _examples(raw: Any) -> tuple[str, ...]:
    """Errors name the entry (``examples[3]``); one past the limit for too many."""
    if not isinstance(raw, list):
        raise InvalidSpec("examples must be a list of prompts", field="examples")
    if len(raw) > MAX_EXAMPLES:
        raise InvalidSpec(f"at most {MAX_EXAMPLES} examples", field=f"examples[{MAX_EXAMPLES}]")
    for i, text in enumerate(raw):
        if not isinstance(text, str) or not text.strip():
            raise InvalidSpec("an example must be a non-empty string", field=f"examples[{i}]")
        if len(text) > MAX_EXAMPLE_CHARS or "\n" in text or "\r" in text:
            raise InvalidSpec(
                f"an example is one line of at most {MAX_EXAMPLE_CHARS} characters",
                field=f"examples[{i}]",
            )
    return tuple(raw)


def _storage(raw: dict[str, Any]) -> str:
    value = _str(raw, "storage", "native")
    if value not in STORAGES:
        raise InvalidSpec(f"storage must be one of {STORAGES}", field="storage")
    return value


def _placement(raw: dict[str, Any]) -> str | None:
    if raw.get("placement") is None:
        return None
    value = _str(raw, "placement")
    if value not in PLACEMENTS:
        raise InvalidSpec(f"placement must be one of {PLACEMENTS}", field="placement")
    return value


def _resolution(raw: dict[str, Any]) -> tuple[int, int]:
    res = raw.get("resolution")
    if res is None:
        raise InvalidSpec("resolution is required (an int or [width, height])", field="resolution")
    if isinstance(res, int) and not isinstance(res, bool):
        width = height = res
    elif isinstance(res, list) and len(res) == 2 and all(type(v) is int for v in res):
        width, height = res
    else:
        raise InvalidSpec("resolution must be an int or [width, height]", field="resolution")
    for v in (width, height):
        if not 64 <= v <= 4096 or v % SIZE_MULTIPLE:
            raise InvalidSpec(
                f"resolution must be in [64, 4096] and a multiple of {SIZE_MULTIPLE}",
                field="resolution",
            )
    return width, height


def _templates(raw: Any) -> dict[str, TemplateSpec]:
    if not isinstance(raw, dict) or not raw:
        raise InvalidSpec("at least one template is required", field="templates")
    out = {}
    for tid, tpl in raw.items():
        where = f"templates.{tid}"
        if not isinstance(tid, str) or not TEMPLATE_RE.fullmatch(tid):
            raise InvalidSpec(
                "template id must match [A-Za-z0-9][A-Za-z0-9_.-]{0,127}", field=where
            )
        if not isinstance(tpl, dict):
            raise InvalidSpec("template must be a table", field=where)
        _known(tpl, TEMPLATE_FIELDS, where)
        image = tpl.get("image")
        if image is not None and not isinstance(image, str):
            raise InvalidSpec("image must be a path", field=f"{where}.image")
        prompt = _str(tpl, "prompt", "", where=where)
        if len(prompt) > MAX_PROMPT_CHARS:  # the limit of an invocation's prompt
            raise InvalidSpec(
                f"prompt longer than {MAX_PROMPT_CHARS} characters", field=f"{where}.prompt"
            )
        out[tid] = TemplateSpec(
            prompt=prompt,
            seed=_int(tpl, "seed", 0, 0, 2**63 - 1, where=where),
            image=image,
        )
    return out


def _scaling(raw: Any) -> ScalingSpec:
    if not isinstance(raw, dict):
        raise InvalidSpec("scaling must be a table", field="scaling")
    _known(raw, SCALING_FIELDS, "scaling")
    lo = _int(raw, "min_executors", 0, 0, 1024, where="scaling")
    hi = _int(raw, "max_executors", max(1, lo), 1, 1024, where="scaling")
    if lo > hi:
        raise InvalidSpec("min_executors exceeds max_executors", field="scaling.min_executors")
    default = ScalingSpec()
    seconds = {
        name: _float(raw, name, getattr(default, name), 0.0, 86_400.0, where="scaling")
        for name in SCALING_SECONDS
    }
    for name in ("target_s", "upscale_delay_s", "stable_window_s"):
        if seconds[name] <= 0:
            raise InvalidSpec(f"{name} must be positive", field=f"scaling.{name}")
    utilisation = _float(raw, "target_utilisation", default.target_utilisation, 0.0, 1.0,
                         where="scaling")  # fmt: skip
    if utilisation <= 0:
        raise InvalidSpec(
            "target_utilisation must be in (0, 1]", field="scaling.target_utilisation"
        )
    headroom = _float(raw, "headroom_sigmas", default.headroom_sigmas, 0.0, 10.0, where="scaling")
    rise_cap = _float(raw, "rise_cap", default.rise_cap, 1.0, 10.0, where="scaling")
    margin = _float(raw, "downscale_margin", default.downscale_margin, 0.0, 0.9, where="scaling")
    return ScalingSpec(
        lo,
        hi,
        **seconds,
        target_utilisation=utilisation,
        headroom_sigmas=headroom,
        rise_cap=rise_cap,
        downscale_margin=margin,
    )


def _uploads(raw: Any) -> UploadsSpec:
    if not isinstance(raw, dict):
        raise InvalidSpec("uploads must be a table", field="uploads")
    _known(raw, UPLOADS_FIELDS, "uploads")
    default = UploadsSpec()
    prompt = _str(raw, "prompt", default.prompt, where="uploads")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidSpec(
            f"prompt longer than {MAX_PROMPT_CHARS} characters", field="uploads.prompt"
        )
    return UploadsSpec(
        max_images=_int(raw, "max_images", default.max_images, 0, 4096, where="uploads"),
        max_bytes=_int(raw, "max_bytes", default.max_bytes, 0, 2**62, where="uploads"),
        prompt=prompt,
        seed=_int(raw, "seed", default.seed, 0, 2**63 - 1, where="uploads"),
    )


def _slo(raw: Any) -> float | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidSpec("slo must be a table", field="slo")
    _known(raw, SLO_FIELDS, "slo")
    return _float(raw, "latency_ms", None, 1.0, 3_600_000.0, where="slo")


def _known(raw: dict[Any, Any], allowed: tuple[str, ...], where: str | None = None) -> None:
    """Refuse the first field not in ``allowed``, suggesting the closest allowed one."""
    for key in raw:
        if key not in allowed:
            raise InvalidSpec(
                unknown_field_message(str(key), allowed), field=_path(where, str(key))
            )


def _path(where: str | None, key: str) -> str:
    return f"{where}.{key}" if where else key


def _str(
    raw: dict[str, Any], key: str, default: str | None = None, where: str | None = None
) -> str:
    value = raw.get(key, default)
    if value is None:
        raise InvalidSpec(f"{key} is required", field=_path(where, key))
    if not isinstance(value, str):
        raise InvalidSpec(f"{key} must be a string", field=_path(where, key))
    return value


def _int(
    raw: dict[str, Any], key: str, default: int, lo: int, hi: int, where: str | None = None
) -> int:
    value = raw.get(key, default)
    if type(value) is not int or not lo <= value <= hi:
        raise InvalidSpec(f"{key} must be an integer in [{lo}, {hi}]", field=_path(where, key))
    return value


def _bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise InvalidSpec(f"{key} must be true or false", field=key)
    return value


def _float(
    raw: dict[str, Any],
    key: str,
    default: float | None,
    lo: float,
    hi: float,
    where: str | None = None,
) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise InvalidSpec(f"{key} must be a number in [{lo}, {hi}]", field=_path(where, key))
    return float(value)
