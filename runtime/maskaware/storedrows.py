"""A bake's rows in the activation store, in its function's row format (``rowformat``).

The cachestore holds plain tensors; which of them are fp8 codes, where their scales rest and
what they decode to is decided here, through ``rowformat``'s functions only. An fp8 bake
stores an encoded tensor's codes under its own name and its float32 scales under
``scale_name(name)``: both are ordinary values of the same step, so the disk, host,
streaming and device tiers hold and move them together and their bytes are the encoded
bytes. The template's meta records the format and each encoded name's compute dtype.

A reader (:func:`decoded`) wraps whatever handle a tier gave and decodes: ``get`` and
``read_rows`` (rows gathered as codes and decoded after, so host reads and copies to a GPU
move the codes), ``encoded`` + ``scale`` for the row loader's pinned slabs and CUDA graph
buffers, and ``resident`` codes of the device tier, decoded on the device by
``copy_resident``. A native bake's handle is returned as it is.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from retouch.cachestore.devicetier import same_device
from retouch.cachestore.handle import TemplateHandle
from retouch.cachestore.layout import Slot
from retouch.cachestore.rows import Rows, RowSelection
from retouch.cachestore.stats import StoreCounters
from retouch.runtime.maskaware.rowformat import (
    RowFormat,
    decode,
    decode_into,
    encode,
    encodes,
)
from retouch.runtime.maskaware.store import TEMPLATE_STEP, fetch_rows

ROWS_META = "rows"  # the template's RowFormat
DTYPES_META = "row_dtypes"  # encoded name -> the compute dtype its codes decode to
SCALE_SUFFIX = ".scale"


def scale_name(name: str) -> str:
    """The stored name of the scales of tensor ``name``'s codes."""
    return name + SCALE_SUFFIX


def _encoded(fmt: RowFormat, step: int, name: str) -> bool:
    """Whether ``(step, name)`` rests as codes: per-template tensors stay as recorded, as
    in ``MemoryActivations.placed``."""
    return step != TEMPLATE_STEP and encodes(fmt, name)


class AnnotatedWriter(Protocol):
    """What a bake records into (the cachestore's ``BakeWriter``)."""

    def put(self, step: int, block: str, name: str, tensor: torch.Tensor) -> None: ...

    def annotate(self, items: dict[str, Any]) -> None: ...


class EncodingWriter:
    """Records a bake in ``fmt``: the tensors ``encodes`` names as 8-bit codes plus scales."""

    def __init__(self, inner: AnnotatedWriter, fmt: RowFormat) -> None:
        self.inner, self.format = inner, fmt
        self._dtypes: dict[str, str] = {}
        inner.annotate({ROWS_META: fmt.value})

    def put(self, step: int, block: str, name: str, tensor: torch.Tensor) -> None:
        if not _encoded(self.format, step, name):
            self.inner.put(step, block, name, tensor)
            return
        self._note_dtype(name, tensor.dtype)
        codes, scale = encode(name, tensor)
        self.inner.put(step, block, name, codes)
        self.inner.put(step, block, scale_name(name), scale)

    def _note_dtype(self, name: str, dtype: torch.dtype) -> None:
        known = self._dtypes.get(name)
        if known == str(dtype):
            return
        if known is not None:
            raise ValueError(f"{name!r} recorded as {known} and as {dtype} in one bake")
        self._dtypes[name] = str(dtype)
        self.inner.annotate({DTYPES_META: dict(self._dtypes)})


def _dtype(text: str) -> torch.dtype:
    dtype = getattr(torch, text.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown compute dtype {text!r} in a template's meta")
    return dtype


def decoded(handle: Any) -> Any:
    """The reader an edit uses for ``handle`` (any tier's): ``handle`` itself for a native
    bake, a :class:`DecodedTemplate` for an encoded one."""
    meta = getattr(handle, "meta", None) or {}
    fmt = RowFormat(meta.get(ROWS_META, RowFormat.NATIVE.value))
    if fmt is RowFormat.NATIVE:
        return handle
    dtypes = {name: _dtype(text) for name, text in meta.get(DTYPES_META, {}).items()}
    return DecodedTemplate(handle, fmt, dtypes)


class DecodedTemplate(TemplateHandle):
    """A held template whose rows rest encoded, read as the blocks compute with them."""

    def __init__(self, handle: Any, fmt: RowFormat, dtypes: dict[str, torch.dtype]) -> None:
        self.handle, self.format, self.dtypes = handle, fmt, dtypes
        self._counters = getattr(handle, "_counters", None) or StoreCounters()
        self._lock = threading.Lock()
        self._scales: dict[tuple[Slot, str], torch.Tensor] = {}  # moved to another device

    @property
    def key(self) -> str:
        return self.handle.key

    @property
    def meta(self) -> dict[str, Any]:
        return self.handle.meta

    @property
    def nbytes(self) -> int:
        return self.handle.nbytes

    def slots(self) -> list[Slot]:
        return self.handle.slots()

    def release(self) -> None:
        self.handle.release()

    def _is_encoded(self, step: int, name: str) -> bool:
        return _encoded(self.format, step, name) and name in self.dtypes

    def get(self, step: int, block: str, name: str) -> torch.Tensor:
        codes, scale = self.encoded(step, block, name)
        return decode(codes, scale, self.dtypes.get(name, codes.dtype))

    def encoded(self, step: int, block: str, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tensor as stored (pinned host codes where CUDA exists, device codes in the
        device tier), and its scales when it rests encoded."""
        codes = _stored(self.handle, step, block, name)
        if not self._is_encoded(step, name):
            return codes, None
        return codes, self.handle.get(step, block, scale_name(name))

    def scale(self, step: int, block: str, name: str, device: torch.device) -> torch.Tensor | None:
        """The scales of ``name``'s codes on ``device`` (``None`` for rows as recorded)."""
        if not self._is_encoded(step, name):
            return None
        slot = (step, block, scale_name(name))
        scale = self.handle.get(*slot)
        if same_device(scale.device, device):
            return scale
        with self._lock:
            moved = self._scales.get((slot, str(device)))
        if moved is None:
            moved = scale.to(device)
            with self._lock:
                self._scales[(slot, str(device))] = moved
        return moved

    def describe(self, step: int, block: str, name: str) -> tuple[torch.Size, torch.dtype]:
        codes = _stored(self.handle, step, block, name)
        return codes.shape, self.dtypes.get(name, codes.dtype) if self._is_encoded(
            step, name
        ) else codes.dtype

    def read_rows(
        self, step: int, block: str, name: str, rows: Rows, out: torch.Tensor
    ) -> torch.Tensor:
        """Gather rows of the codes into a buffer on ``out``'s device, then decode them
        there (element by element, so the same values as decoding first)."""
        if not self._is_encoded(step, name):
            return _gather(self.handle, step, block, name, rows, out)
        codes = _stored(self.handle, step, block, name)
        gathered = torch.empty(out.shape, dtype=codes.dtype, device=out.device)
        _gather(self.handle, step, block, name, rows, gathered)
        dtype = self.dtypes[name]
        target = (
            out if out.dtype == dtype else torch.empty(out.shape, dtype=dtype, device=out.device)
        )
        decode_into(target, gathered, self.scale(step, block, name, out.device))
        return out if target is out else out.copy_(target)

    def resident(
        self, step: int, block: str, name: str, device: torch.device
    ) -> torch.Tensor | None:
        """The device tier's stored tensor (codes for encoded rows: see :meth:`scale`)."""
        resident = getattr(self.handle, "resident", None)
        return None if resident is None else resident(step, block, name, device)

    def holds_on(self, device: torch.device) -> bool:
        holds_on = getattr(self.handle, "holds_on", None)
        return holds_on is not None and holds_on(device)

    def streams_to(self, device: torch.device) -> bool:
        streams_to = getattr(self.handle, "streams_to", None)
        return streams_to is not None and streams_to(device)


def _stored(handle: Any, step: int, block: str, name: str) -> torch.Tensor:
    encoded = getattr(handle, "encoded", None)
    return handle.get(step, block, name) if encoded is None else encoded(step, block, name)[0]


def _gather(
    handle: Any, step: int, block: str, name: str, rows: Rows, out: torch.Tensor
) -> torch.Tensor:
    """Rows of one stored tensor into ``out``: by the handle's own gather where it has one
    (the host and streaming tiers), else from its whole tensor (the device tier)."""
    if isinstance(handle, TemplateHandle):
        return handle.read_rows(step, block, name, rows, out)
    index = rows.rows if isinstance(rows, RowSelection) else rows
    return fetch_rows(handle, step, block, name, index, out)
