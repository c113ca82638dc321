"""The state one batched forward shares with the block wrappers it passes through.

Wrappers are installed once per model and stay inert: they only act while a
:class:`ForwardContext` is active in the current thread (a ``ContextVar``), so the stock
pipeline keeps running unchanged on the same model, even from another thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from retouch.runtime.maskaware.store import ActivationReader, ActivationWriter
from retouch.runtime.maskaware.tokens import TokenBatch
from retouch.runtime.plan import Mode


@dataclass(frozen=True)
class Slot:
    """One request of the batch as the blocks see it: where its rows come from or go to."""

    step: int  # the request's own denoising step index (requests may be at different steps)
    reader: ActivationReader | None = None  # an edit's template activations
    writer: ActivationWriter | None = None  # a bake's recording target


class RowSource(Protocol):
    """Cached rows staged ahead of the blocks (``retouch.runtime.maskaware.loader``)."""

    def rows(self, request: int, block: str, name: str) -> torch.Tensor:
        """Request ``request``'s unmasked rows ``[per, n, C]`` of ``name`` cached for ``block``."""
        ...


class CallRunner(Protocol):
    """Runs a step's denoiser call ``fn(**tensors)`` another way (``maskaware.graphs``)."""

    def run(self, ctx: ForwardContext, fn: Any, tensors: dict[str, Any]) -> Any: ...


class BlockHook(Protocol):
    """Told when each block of a mask-aware forward starts and ends (loader, profiler)."""

    def enter(self, block: str) -> None: ...

    def exit(self, block: str) -> None: ...


@dataclass
class ForwardContext:
    """Everything a wrapped block needs during one batched forward."""

    slots: list[Slot]
    rows_per_request: int  # 2 with classifier-free guidance halves, else 1
    modes: dict[str, Mode]  # per block name
    grids: dict[tuple[int, int], TokenBatch] = field(default_factory=dict)  # per token grid
    grid: TokenBatch | None = None  # the token grid of the sparse block now running
    text_len: int = 0  # text tokens in front of image tokens (joint-attention models)
    scratch: dict[object, Any] = field(default_factory=dict)  # one run of the call's (see call)
    loader: RowSource | None = None  # staged rows; None: blocks fetch synchronously
    hooks: list[BlockHook] = field(default_factory=list)
    runner: CallRunner | None = None  # CUDA graphs of the denoiser call; None: eager

    @property
    def recording(self) -> bool:
        return any(slot.writer is not None for slot in self.slots)

    def call(self, fn: Callable[..., Any], **tensors: Any) -> Any:
        """The step's denoiser call ``fn(**tensors)``: every tensor it reads is an argument
        (or fixed for the step's layout), so a runner may capture and replay it.

        Each run of ``fn`` starts with an empty :attr:`scratch`, the running context's
        (:func:`current`). A runner runs it more than once (a CUDA graph's warm-up then its
        capture; on a CPU, a later step's replay of the captured ``fn``), and the blocks keep
        there what one run shares: memos keyed by that run's objects (``id`` of its RoPE
        table) and the layout the hidden states are in. Kept from an earlier run, a memo
        whose key a new table's reused address matches reads rows gathered for other masks,
        which a capture would bake in for every mask of its bucket."""
        run = _scratch_emptied(fn)
        if self.runner is None:
            return run(**tensors)
        return self.runner.run(self, run, tensors)

    def mode(self, block: str) -> Mode:
        return self.modes.get(block, Mode.FULL)

    def enter_block(self, block: str) -> None:
        for hook in self.hooks:
            hook.enter(block)

    def exit_block(self, block: str) -> None:
        for hook in self.hooks:
            hook.exit(block)

    def record(self, block: str, name: str, tensor: torch.Tensor) -> None:
        """Hand each request's rows of a ``[rows, tokens, C]`` tensor to its writer."""
        per = self.rows_per_request
        for r, slot in enumerate(self.slots):
            if slot.writer is not None:
                slot.writer.put(slot.step, block, name, _host_copy(tensor[r * per : (r + 1) * per]))


def _scratch_emptied(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` starting each run with the running context's scratch empty (the wrapper holds
    no context: a runner keeps it as long as its graph)."""

    def run(**tensors: Any) -> Any:
        ctx = current()
        if ctx is not None:
            ctx.scratch.clear()
        return fn(**tensors)

    return run


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy that owns its memory (a writer may keep it as is)."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    return out.copy_(tensor.detach())


_ACTIVE: ContextVar[ForwardContext | None] = ContextVar("retouch_maskaware_forward", default=None)


def current() -> ForwardContext | None:
    return _ACTIVE.get()


@contextmanager
def activate(ctx: ForwardContext) -> Iterator[ForwardContext]:
    token = _ACTIVE.set(ctx)
    try:
        yield ctx
    finally:
        _ACTIVE.reset(token)
