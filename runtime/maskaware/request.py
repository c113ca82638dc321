"""An edit request and the state it carries between denoising steps."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

from retouch.runtime.maskaware.store import ActivationReader, ActivationWriter
from retouch.runtime.maskaware.tokens import TokenSet, dilate, pool_mask

# cross a process boundary as arrays (``reference`` when there is one), the rest as plain data
ARRAY_FIELDS = ("image", "mask", "reference")
ARRAY_MODES = ("RGB", "RGBA", "L")  # image modes whose uint8 array rebuilds the same image


@dataclass(frozen=True)
class EditRequest:
    """Paint ``mask`` (True = edit) of a template image with ``prompt``.

    ``template_prompt`` and ``template_seed`` name the bake whose activations the edit reuses;
    ``seed`` drives only the masked region. ``negative_prompt``: the classifier-free
    guidance families' unconditional prompt. ``strength`` < 1 starts from the image noised
    part-way down the schedule and runs only the rest of it (diffusers' ``strength``); a
    bake for it follows that shorter trajectory. ``reference``: the families that read a
    reference image (FLUX.1 Kontext) read this one, of the image's size, instead of the
    template; such an edit computes every token.
    """

    image: Image.Image
    mask: np.ndarray
    prompt: str
    seed: int
    steps: int
    guidance: float
    template_prompt: str
    template_seed: int
    full_steps: int = 0  # the first steps compute every token (a quality warm-up)
    halo: int = 0  # latent pixels around the mask computed fresh too (conv families)
    negative_prompt: str = ""
    strength: float = 1.0
    reference: Image.Image | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.strength <= 1.0:
            raise ValueError(f"strength must be in (0, 1], not {self.strength}")
        if self.full_steps < 0:
            raise ValueError(f"full_steps must be >= 0, not {self.full_steps}")
        if self.halo < 0:
            raise ValueError(f"halo must be >= 0, not {self.halo}")
        if self.mask.shape != (self.image.height, self.image.width):
            raise ValueError(
                f"mask is {self.mask.shape}, image is {(self.image.height, self.image.width)}"
            )
        if self.reference is not None and self.reference.size != self.image.size:
            raise ValueError(f"reference is {self.reference.size}, image is {self.image.size}")

    @property
    def mask_ratio(self) -> float:
        return float(np.asarray(self.mask, dtype=bool).mean())

    @property
    def height(self) -> int:
        return self.image.height

    @property
    def width(self) -> int:
        return self.image.width

    def mask_image(self) -> Image.Image:
        """The mask as the pipelines take it (white = repaint)."""
        return Image.fromarray(np.asarray(self.mask, dtype=bool).astype(np.uint8) * 255)

    # -- the one codec for a request crossing a process boundary (pre workers) ------------

    def wire_meta(self) -> dict[str, Any]:
        """Every field but the arrays, as plain values (msgpack-able). Written from the
        dataclass's fields so that a new field cannot be dropped on the way."""
        return {
            f.name: _plain(getattr(self, f.name))
            for f in fields(self)
            if f.name not in ARRAY_FIELDS
        }

    def wire_arrays(self) -> dict[str, np.ndarray]:
        """The image (an image mode without a faithful array goes as RGB) and the mask."""
        out = {"image": _array(self.image), "mask": np.asarray(self.mask, dtype=bool)}
        if self.reference is not None:
            out["reference"] = _array(self.reference)
        return out

    @classmethod
    def from_wire(cls, meta: dict[str, Any], arrays: dict[str, Any]) -> EditRequest:
        """The request :meth:`wire_meta` and :meth:`wire_arrays` describe."""
        image = Image.fromarray(np.asarray(arrays["image"]))
        reference = arrays.get("reference")
        if reference is not None:
            reference = Image.fromarray(np.asarray(reference))
        mask = np.asarray(arrays["mask"], dtype=bool)
        return cls(image=image, mask=mask, reference=reference, **meta)


class ImageSize(Protocol):
    """What decoding needs to know of a request: the output size (an :class:`EditRequest`
    or an :class:`OutputSize` both qualify)."""

    @property
    def height(self) -> int: ...

    @property
    def width(self) -> int: ...


@dataclass(frozen=True)
class OutputSize:
    """The output size alone: what a post worker gets instead of the whole request."""

    height: int
    width: int


@dataclass(frozen=True)
class Encoded:
    """A request's heavy pre-processing, ready for the engine to assemble it.

    Only host tensors and plain metadata, so that a pre worker in another process can
    produce it (``tensors`` cross through shared memory). The keys are the family's
    (``SDInpaint.encode`` / ``FluxInpaint.encode``); every family has ``mask``, the
    ``[1, 1, h, w]`` latent mask, and ``noise``, the initial noise composed with the
    template noise drawn from the request's ``template_seed``.
    """

    family: str
    height: int
    width: int
    tensors: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        on_device = [name for name, t in self.tensors.items() if t.device.type != "cpu"]
        if on_device:
            raise ValueError(f"encoded tensors must be host tensors: {on_device}")

    @property
    def latent_mask(self) -> torch.Tensor:
        """The boolean ``[h, w]`` latent mask."""
        return self.tensors["mask"][0, 0] > 0.5


@dataclass
class RequestState:
    """One request between steps: latents, its own scheduler and where its cache lives.

    ``inputs`` holds the family's per-request model inputs (text embeddings, masks, ...);
    ``tokens`` the masked-token set per token grid. During the request's first
    ``full_steps`` steps (its warm-up) it computes every token and reads no cached row, as a
    request without a cache does: ``step_tokens`` and ``step_reader`` are what a step uses.
    """

    request: EditRequest
    latents: torch.Tensor
    scheduler: Any
    timesteps: torch.Tensor
    inputs: Any
    tokens: dict[tuple[int, int], TokenSet]
    reader: ActivationReader | None = None
    writer: ActivationWriter | None = None
    index: int = 0
    _every: dict[tuple[int, int], TokenSet] | None = field(default=None, repr=False)
    _host_timesteps: np.ndarray | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.index >= len(self.timesteps)

    @property
    def timestep(self) -> torch.Tensor:
        return self.timesteps[self.index]

    @property
    def timestep_value(self) -> np.float32:
        """This step's timestep as a host value (the schedule is read once: indexing a
        device tensor every step dispatches ops and may wait for the device)."""
        if self._host_timesteps is None:
            self._host_timesteps = self.timesteps.detach().cpu().to(torch.float32).numpy()
        return self._host_timesteps[self.index]

    @property
    def last(self) -> bool:
        return self.index == len(self.timesteps) - 1

    @property
    def warming(self) -> bool:
        """In a warm-up step: computed over every token although a cache exists.

        Why: the first steps lay out the image; with the template's stale activations there
        the unmasked region can drift (random-weight UNets especially), later steps much less.
        """
        return self.reader is not None and self.index < self.request.full_steps

    @property
    def step_tokens(self) -> dict[tuple[int, int], TokenSet]:
        """The token sets this step computes."""
        if not self.warming:
            return self.tokens
        if self._every is None:
            self._every = every_token(list(self.tokens))
        return self._every

    @property
    def step_reader(self) -> ActivationReader | None:
        """The cache this step reads rows from (none while warming up)."""
        return None if self.warming else self.reader


def batch_timesteps(
    states: list[RequestState], device: torch.device, repeat: int = 1
) -> torch.Tensor:
    """Every request's timestep (each ``repeat`` times: CFG halves) as one float32 tensor
    on ``device``, built on the host: one copy however many requests step together."""
    values = np.repeat(np.array([s.timestep_value for s in states], dtype=np.float32), repeat)
    return torch.from_numpy(values).to(device)


def _array(image: Image.Image) -> np.ndarray:
    """An image as an array that rebuilds it (a mode without one goes as RGB)."""
    return np.asarray(image if image.mode in ARRAY_MODES else image.convert("RGB"))


def _plain(value: Any) -> Any:
    """numpy scalars → Python scalars (the codec carries plain values only)."""
    return value.item() if isinstance(value, np.generic) else value


def every_token(sizes: list[tuple[int, int]]) -> dict[tuple[int, int], TokenSet]:
    """Token sets that select every token of each grid."""
    return {size: TokenSet.from_grid(torch.ones(size, dtype=torch.bool)) for size in sizes}


def token_sets(
    latent_mask: torch.Tensor,
    sizes: list[tuple[int, int]],
    *,
    every: bool = False,
    halo: int = 0,
) -> dict[tuple[int, int], TokenSet]:
    """The token set of every grid ``size``, pooled from a boolean ``[h, w]`` latent mask
    grown by ``halo`` latent pixels.

    ``every``: all tokens are computed, whatever the mask (a request without a cache reads
    no row, so it runs exactly like the stock pipeline).
    """
    if every:
        return every_token(sizes)
    grown = dilate(latent_mask.cpu(), halo)
    return {size: TokenSet.from_grid(pool_mask(grown, size)) for size in sizes}


def check_batchable(requests: list[EditRequest]) -> EditRequest:
    """The first request, after checking that one stock pipeline call can serve them all."""
    if not requests:
        raise ValueError("no requests")
    first = requests[0]
    for request in requests[1:]:
        if request.image.size != first.image.size:
            raise ValueError("a stock batch needs one image size")
        if _stock_settings(request) != _stock_settings(first):
            raise ValueError(
                "a stock batch needs one step count, guidance, strength and negative prompt"
            )
    return first


def _stock_settings(request: EditRequest) -> tuple[int, float, float, str]:
    """What one stock pipeline call takes once for its whole batch."""
    return request.steps, request.guidance, request.strength, request.negative_prompt
