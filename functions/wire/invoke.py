"""The invocation on the wire: the public request, what the gateway forwards to an
executor, and the answer that comes back.

The two requests are declared :class:`~retouch.functions.wire.struct.Struct` s: each field
is written once, with its type, range, default and wire names, and that one declaration
decodes, validates, encodes and names the field in an error. ``docs/api.md``'s field table
is checked against :class:`InvokeRequest` by a test.
"""

from __future__ import annotations

import secrets
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, ConfigDict, Field, model_validator

from retouch.functions.errors import BadRequest
from retouch.functions.wire.struct import (
    NULL_AS_DEFAULTS,
    Message,
    Struct,
    WireArray,
    WireBytes,
    WireSize,
    lenient,
)

OUTPUT_FORMATS = ("png", "webp", "raw")
OutputFormat = Literal["png", "webp", "raw"]
MAX_STEPS = 200
MAX_GUIDANCE = 50.0
MAX_PROMPT_CHARS = 4096
MAX_PADDING = 4096  # padding_mask_crop, in pixels of the input image
MAX_IMAGES_PER_PROMPT = 10  # num_images_per_prompt (and the OpenAI route's ``n``)

Text = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


def _random_seed() -> int:
    return secrets.randbelow(2**63)


class InvokeRequest(Struct):
    """A public invocation, validated. ``mask`` is still the encoded image the user sent.

    It edits either one of the function's templates (``template``) or an uploaded image
    (``image``: encoded bytes, decoded by the gateway), never both. Fields carry diffusers'
    inpainting names on the wire (``num_inference_steps``, ``guidance_scale``,
    ``negative_prompt``, ``strength``, ``padding_mask_crop``); the older ``steps`` and
    ``guidance`` are read as aliases. ``size`` (``WIDTHxHEIGHT``, as OpenAI's) is the
    result's size; without it the result has the input image's. Images and masks are bytes
    (msgpack) or, in JSON, base64 strings or ``data:`` URIs. An unknown field is refused, so
    a misspelt argument never silently falls back to its default."""

    template: str | None = None
    image: WireBytes | None = None
    mask: WireBytes
    prompt: Text
    negative_prompt: Text | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] = Field(default_factory=_random_seed)
    steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] | None = Field(
        None,
        validation_alias=AliasChoices("num_inference_steps", "steps"),
        serialization_alias="num_inference_steps",
    )
    guidance: Annotated[float, Field(ge=0.0, le=MAX_GUIDANCE, allow_inf_nan=False)] | None = Field(
        None,
        validation_alias=AliasChoices("guidance_scale", "guidance"),
        serialization_alias="guidance_scale",
    )
    strength: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    scheduler: str | None = None  # one the function allows (None: the function's own)
    padding_mask_crop: Annotated[int, Field(ge=0, le=MAX_PADDING)] | None = None
    # The families that read a reference image (FLUX.1 Kontext): another than the template
    # (encoded bytes, decoded by the gateway); without it the template is the reference.
    image_reference: WireBytes | None = None
    size: WireSize | None = None
    format: OutputFormat = "png"
    # Images of this one request: image i runs with seed ``seed + i`` (so each can be made
    # again alone), as its own invocation (they share denoising steps in the engine).
    num_images_per_prompt: Annotated[int, Field(ge=1, le=MAX_IMAGES_PER_PROMPT)] = 1

    @model_validator(mode="before")
    @classmethod
    def _one_input(cls, data: Any) -> Any:
        """A template or an uploaded image, never both: checked first, so an empty body
        is told the request's first field."""
        if isinstance(data, dict):
            template, image = data.get("template"), data.get("image")
            if image is None and template is None:
                raise BadRequest(
                    "field 'template' (or 'image', an uploaded image) is required",
                    field="template",
                    code="missing_field",
                )
            if image is not None and template is not None:
                raise BadRequest(
                    "send either 'template' or 'image', not both",
                    field="image",
                    code="invalid_field",
                )
        return data

    def images(self) -> list[InvokeRequest]:
        """One request per image asked for: image i with seed ``seed + i`` (mod 2^63)."""
        return [
            self.model_copy(update={"seed": (self.seed + i) % 2**63, "num_images_per_prompt": 1})
            for i in range(self.num_images_per_prompt)
        ]

    def echo(self) -> dict[str, Any]:
        """The request as its job document shows it (``input``): every argument, the image
        and mask by their size while the job holds them (a finished job keeps neither: its
        ``template`` names what it edited, an upload by its content id)."""
        out = self.to_wire()
        for name in ("image", "mask", "image_reference"):
            if out.get(name):
                out[name] = f"<{len(out[name])} bytes>"
            else:
                out.pop(name, None)
        return out


# An invocation's wire names, and its older names (alias -> wire name).
INVOKE_FIELDS = frozenset(InvokeRequest.wire_names())
ALIASES = {alias: name for name, names in InvokeRequest.wire_names().items() for alias in names[1:]}


class ExecutorInvoke(Struct):
    """What the gateway forwards to an executor: the decoded mask travels as a raw array."""

    function: str
    template: str
    mask: WireArray
    prompt: str
    seed: int
    steps: int
    guidance: float
    format: str
    id: str = ""  # the gateway's invocation id: cancel and progress refer to it
    # An uploaded image (RGB8 ``[H, W, 3]``) instead of a deployed template; ``template``
    # is then its content address (``upload:<hash of the pixels>``).
    image: WireArray | None = None
    negative_prompt: str = ""  # the unconditional branch's prompt ("" as diffusers' default)
    strength: float = 1.0  # < 1: start from the image noised to this fraction of the schedule
    scheduler: str = ""  # one the function allows ("": the function's own)
    # A reference image other than the template (RGB8 ``[H, W, 3]`` at the function's size;
    # the families that read one): such an edit computes every token.
    image_reference: WireArray | None = None


class Timings(Message):
    """Where an invocation's time went: pre-processing (text/VAE encode), waiting to join
    a batch, denoising, post-processing (VAE decode, image encoding), end to end; and, in
    the gateway, the time it waited there for an executor slot."""

    queue_ms: float = 0.0
    run_ms: float = 0.0
    total_ms: float = 0.0
    pre_ms: float = 0.0
    post_ms: float = 0.0
    gateway_queue_ms: float = 0.0
    # From the moment the gateway placed it to its result: predicted then, and actual.
    predicted_ms: float = 0.0
    placed_ms: float = 0.0


class InvokePath(StrEnum):
    """How an edit was computed."""

    MASKAWARE = "maskaware"  # masked tokens only, cached activations for the rest
    STOCK = "stock"  # every token computed (template not baked for these settings)
    TEMPLATE = "template"  # empty mask: the template itself, no model run


class CacheTier(StrEnum):
    """Where a template's activations were found when an edit joined the batch."""

    DEVICE = "device"  # resident on the executor's GPU: no load at all
    HOST = "host"
    DISK = "disk"
    NONE = "none"


Tier = lenient(CacheTier, CacheTier.NONE)
HowComputed = lenient(InvokePath, InvokePath.STOCK)


class CacheRead(Message):
    """Where an edit's cached activations came from and how long it waited for them.

    ``found`` is where the template was when the invocation reached its executor, before
    the prefetch that starts then: what placement chose (host = an affinity hit). ``tier``
    is where the read found it, after the prefetch had (or had not) brought it in."""

    model_config = ConfigDict(frozen=True)

    tier: Tier = CacheTier.NONE
    wait_ms: float = 0.0
    found: Tier = CacheTier.NONE

    @model_validator(mode="before")
    @classmethod
    def _found_as_read(cls, body: Any) -> Any:
        """An older executor's answer has no ``found``: where the read found it."""
        if isinstance(body, dict) and "found" not in body and "tier" in body:
            return {**body, "found": body["tier"]}
        return body


class RunStats(Message):
    """An invocation's denoising: steps run, interruptions, batch size at each step."""

    model_config = ConfigDict(frozen=True)

    steps: int = 0
    interruptions: int = 0
    batch_sizes: tuple[int, ...] = ()


class InvokeResult(Message):
    """An invocation's answer, from the executor to the gateway and on to the client."""

    template: str = ""  # the template edited (``upload:<hash>`` for an uploaded image)
    seed: int | None = None  # the seed it ran with (the gateway's; drawn when none was sent)
    image: bytes
    format: str
    width: int
    height: int
    mask_ratio: float
    executor: str
    path: HowComputed = InvokePath.STOCK
    path_reason: str = ""  # why this path: the executor's step times, or what was missing
    timings: Annotated[Timings, NULL_AS_DEFAULTS] = Field(default_factory=Timings)
    cache: Annotated[CacheRead, NULL_AS_DEFAULTS] = Field(default_factory=CacheRead)
    engine: Annotated[RunStats, NULL_AS_DEFAULTS] = Field(default_factory=RunStats)
    attempts: int = 1  # executors it was sent to (more than one after an executor was lost)
