"""What a held template is to its reader, whatever tier it is read from."""

from __future__ import annotations

import abc
from types import TracebackType

import torch

from retouch.cachestore.layout import Slot
from retouch.cachestore.rows import Rows, gather_rows
from retouch.cachestore.stats import StoreCounters


class TemplateHandle(abc.ABC):
    """A held template (``release`` it, or use ``with``): ``get`` one tensor, gather rows
    of it (``read_rows``), or hand it whole to a loader that moves it by DMA
    (``encoded``). Subclasses say where the tensors come from."""

    _counters: StoreCounters

    @property
    @abc.abstractmethod
    def key(self) -> str: ...

    @abc.abstractmethod
    def slots(self) -> list[Slot]: ...

    @abc.abstractmethod
    def get(self, step: int, block: str, name: str) -> torch.Tensor: ...

    @abc.abstractmethod
    def release(self) -> None: ...

    def describe(self, step: int, block: str, name: str) -> tuple[torch.Size, torch.dtype]:
        tensor = self.get(step, block, name)
        return tensor.shape, tensor.dtype

    def streams_to(self, device: torch.device) -> bool:
        """Whether its tensors sit whole in pinned host memory, so ``device`` (a GPU) can
        copy them by DMA (a step ahead, for a graphed step)."""
        return False

    def encoded(self, step: int, block: str, name: str) -> tuple[torch.Tensor, None]:
        """The tensor as stored (rows in the compute dtype, no scales): in pinned memory
        where CUDA exists, so a CUDA row loader moves it by DMA and gathers on the GPU."""
        return self.get(step, block, name), None

    def read_rows(
        self, step: int, block: str, name: str, rows: Rows, out: torch.Tensor
    ) -> torch.Tensor:
        """Gather rows (tokens, dim -2) of one tensor into ``out`` (CPU or CUDA).

        ``rows``: a 1-D integer tensor, or a ``RowSelection`` built once per mask and
        reused for every block (saves re-deriving the flat indices on each call)."""
        gather_rows(self.get(step, block, name), rows, out)
        self._counters.add(host_reads=1, host_bytes_read=out.nbytes)
        return out

    def __enter__(self) -> TemplateHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
