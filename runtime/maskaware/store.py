"""Where a bake's activations go and where an edit reads them from.

The bake writes one tensor per (step, block, name): ``k``/``v`` (self-attention keys and
values of every image token, both CFG halves) and ``y`` (the block output) per denoising
step, and per-template tensors at step ``-1`` (the bake noise, the VAE sampling noise and,
for Flux, the template's image latents). Tensors are host tensors shaped
``[..., tokens, channels]`` so that a reader can gather the rows an edit needs along dim -2.

The protocols below are all the editor relies on; ``retouch.cachestore`` implements them
on LMDB and a host-RAM tier, :class:`MemoryActivations` in a dict.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from retouch.cachestore.devicetier import same_device
from retouch.runtime.maskaware.rowformat import (
    RowFormat,
    decode,
    decode_into,
    encode,
    encodes,
)

TEMPLATE_STEP = -1  # the step index of per-template tensors


class ActivationWriter(Protocol):
    """What a bake records into."""

    def put(self, step: int, block: str, name: str, tensor: torch.Tensor) -> None: ...


class ActivationReader(Protocol):
    """What an edit reads cached activations from."""

    def get(self, step: int, block: str, name: str) -> torch.Tensor: ...


@runtime_checkable
class RowReader(Protocol):
    """A reader that can gather rows itself (it avoids materialising whole tensors)."""

    def read_rows(
        self, step: int, block: str, name: str, rows: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class ResidentReader(Protocol):
    """A reader that may hold whole tensors on a compute device (the device tier)."""

    def resident(
        self, step: int, block: str, name: str, device: torch.device
    ) -> torch.Tensor | None: ...


def all_resident(reader: ActivationReader, device: torch.device) -> bool:
    """Whether ``reader`` holds every step's rows on ``device`` (so a step can read them
    without any copy from the host)."""
    holds_on = getattr(reader, "holds_on", None)
    return holds_on is not None and holds_on(device)


def copy_resident(
    reader: ActivationReader, step: int, block: str, name: str, out: torch.Tensor
) -> bool:
    """Copy the whole cached tensor into ``out`` when ``reader`` holds it on ``out``'s device
    (decoding fp8 rows there); False when it does not."""
    stored = device_resident(reader, step, block, name, out.device)
    if stored is None:
        return False
    scale_of = getattr(reader, "scale", None)
    scale = None if scale_of is None else scale_of(step, block, name, out.device)
    decode_into(out, stored, scale)
    return True


def device_resident(
    reader: ActivationReader, step: int, block: str, name: str, device: torch.device
) -> torch.Tensor | None:
    """The whole cached tensor when ``reader`` holds it on ``device`` (else ``None``):
    a block then copies it whole and overwrites the masked rows, with no gather at all.
    On a CPU only a reader explicitly placed there counts (a bake's host store is gathered
    from, as the host tier is)."""
    if not isinstance(reader, ResidentReader):
        return None
    if device.type == "cpu" and not all_resident(reader, device):
        return None
    return reader.resident(step, block, name, device)


def fetch_rows(
    reader: ActivationReader,
    step: int,
    block: str,
    name: str,
    rows: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Fill ``out`` (any device) with rows ``rows`` (dim -2) of one cached tensor.

    ``read_rows`` is used where the reader offers it (the cachestore gathers straight from
    its host buffers, staging through pinned memory for a CUDA ``out``); otherwise the
    whole tensor is fetched with ``get`` and gathered here.
    """
    if isinstance(reader, RowReader):
        return reader.read_rows(step, block, name, rows, out)
    return out.copy_(reader.get(step, block, name).index_select(-2, rows))


class MemoryActivations:
    """An in-memory activation store: a dict keyed by (step, block, name).

    It plays both roles (``writer()`` and ``reader()`` return itself), which is what tests
    and a single-process executor without a disk tier need.
    """

    def __init__(self) -> None:
        self.tensors: dict[tuple[int, str, str], torch.Tensor] = {}
        self.scales: dict[tuple[int, str, str], torch.Tensor] = {}  # fp8 rows' scales
        self.dtypes: dict[tuple[int, str, str], torch.dtype] = {}  # fp8 rows' compute dtype
        self.placement: torch.device | None = None  # where ``placed`` put every step's rows
        self.pinned = False  # ``placed`` in pinned host memory
        self.format = RowFormat.NATIVE

    def writer(self) -> MemoryActivations:
        return self

    def reader(self) -> MemoryActivations:
        return self

    def put(self, step: int, block: str, name: str, tensor: torch.Tensor) -> None:
        self.tensors[(step, block, name)] = tensor

    def get(self, step: int, block: str, name: str) -> torch.Tensor:
        """The cached tensor as the blocks compute with it (fp8 rows decoded)."""
        codes, scale = self.encoded(step, block, name)
        return decode(codes, scale, self.dtypes.get((step, block, name), codes.dtype))

    def encoded(self, step: int, block: str, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tensor as stored, and its scales when the rows rest in fp8."""
        key = (step, block, name)
        try:
            return self.tensors[key], self.scales.get(key)
        except KeyError:
            raise KeyError(f"no cached tensor for step {step}, block {block!r}, {name!r}") from None

    def describe(self, step: int, block: str, name: str) -> tuple[torch.Size, torch.dtype]:
        """Shape and compute dtype of a cached tensor, without decoding it."""
        codes, _ = self.encoded(step, block, name)
        return codes.shape, self.dtypes.get((step, block, name), codes.dtype)

    def read_rows(
        self, step: int, block: str, name: str, rows: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        src = self.get(step, block, name)
        rows = rows.to(src.device, non_blocking=True)
        if out.device == src.device and out.is_contiguous() and out.dtype == src.dtype:
            return torch.index_select(src, -2, rows, out=out)
        return out.copy_(src.index_select(-2, rows), non_blocking=True)

    def resident(
        self, step: int, block: str, name: str, device: torch.device
    ) -> torch.Tensor | None:
        """The stored tensor when it lives on ``device`` (fp8 codes for fp8 rows: see
        :meth:`scale` and :func:`copy_resident`)."""
        src = self.tensors.get((step, block, name))
        return src if src is not None and same_device(src.device, device) else None

    def scale(self, step: int, block: str, name: str, device: torch.device) -> torch.Tensor | None:
        """The fp8 rows' scales on ``device`` (``None`` for rows in the compute dtype)."""
        scale = self.scales.get((step, block, name))
        if scale is None or same_device(scale.device, device):
            return scale
        key = (step, block, name, str(device))
        moved = self._moved_scales.get(key)
        if moved is None:
            moved = self._moved_scales[key] = scale.to(device)
        return moved

    @property
    def _moved_scales(self) -> dict[tuple, torch.Tensor]:
        return self.__dict__.setdefault("_scales_on", {})

    def placed(
        self,
        device: torch.device | str,
        *,
        pin: bool = False,
        fmt: RowFormat | str = RowFormat.NATIVE,
        encode_on: torch.device | str | None = None,
    ) -> MemoryActivations:
        """A copy with every step's tensors on ``device`` (a device tier), or in pinned host
        memory (``pin``: the host tier a CUDA loader streams from by DMA), in format
        ``fmt`` (fp8 codes computed on ``encode_on``, default ``device``: a GPU encodes a
        host tier's rows much faster than its CPU). Per-template tensors stay on the host as
        they are: the host side of an edit (``prepare``) reads them."""
        out = MemoryActivations()
        out.format = RowFormat(fmt)
        for key, tensor in self.tensors.items():
            if key[0] == TEMPLATE_STEP:
                out.tensors[key] = tensor
                continue
            tensor = self.get(*key)
            if encodes(out.format, key[2]):
                out.dtypes[key] = tensor.dtype
                tensor, scale = encode(key[2], tensor.to(encode_on or device))
                scale = scale.to(device)
                out.scales[key] = (
                    scale.pin_memory() if pin and scale.device.type == "cpu" else scale
                )
            moved = tensor.to(device)
            out.tensors[key] = moved.pin_memory() if pin and moved.device.type == "cpu" else moved
        out.placement = torch.device(device)
        out.pinned = pin and out.placement.type == "cpu"
        return out

    def streams_to(self, device: torch.device) -> bool:
        """Whether its rows sit whole in pinned host memory that ``device`` (a GPU) can
        copy by DMA."""
        return device.type == "cuda" and self.pinned

    def holds_on(self, device: torch.device) -> bool:
        """Whether every step's rows are resident on ``device`` (a device tier)."""
        return self.placement is not None and same_device(self.placement, device)

    @property
    def nbytes(self) -> int:
        stored = [*self.tensors.values(), *self.scales.values()]
        return sum(t.numel() * t.element_size() for t in stored)

    def __len__(self) -> int:
        return len(self.tensors)
