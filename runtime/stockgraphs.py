"""The stock pipeline's denoiser call replayed from CUDA graphs: the stock baseline at its best.

A user comparing retouch with a stock diffusers pipeline would not run it eagerly: at
production shapes an eager step's host work (Python, dispatch, launches) is a large part of
it, and servers capture or compile the denoiser (flux-fast, SGLang diffusion). So the
mask-aware step is compared with the stock step replayed from a graph as well.

:class:`StockGraphs` wraps a denoiser module while it is active (``with StockGraphs(m, d):``):
each call is keyed by its arguments' shapes, dtypes and non-tensor values; a key's first
call runs eagerly (lazy initialisations and kernel choices happen there), its second is
captured, and later calls copy their tensors into the static inputs and replay. The output
lives in the graph's memory until the next replay of that key, which is how the pipelines
use it (within the step). A capture that fails leaves its key eager (logged). On a CPU the
same bookkeeping runs with an eager call on the static inputs as the "replay", so the
substitution is tested without a GPU.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from retouch.runtime.maskaware.graphs import capture

log = logging.getLogger(__name__)

MAX_KEYS = 8  # captured argument layouts kept (batch sizes, resolutions)


@dataclass(eq=False)
class _Entry:
    runs: int = 0
    graph: Any = None  # CUDAGraph, True (CPU bookkeeping) or False (capture failed)
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    output: Any = None


class StockGraphs:
    """Capture-and-replay of one module's forward while active (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, device: torch.device, limit: int = MAX_KEYS):
        self.module, self.device, self.limit = module, torch.device(device), limit
        self.cuda = self.device.type == "cuda"
        self.entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.captures = self.replays = self.eager = 0
        self._pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self._forward: Any = None

    def __enter__(self) -> StockGraphs:
        self._forward = self.module.forward
        self.module.forward = self._call  # an instance attribute: hooks still run around it
        return self

    def __exit__(self, *exc: object) -> None:
        del self.module.forward
        self.entries.clear()

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        key = (_key(args), tuple(sorted((k, _key(v)) for k, v in kwargs.items())))
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry()
            while len(self.entries) > self.limit:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        entry.runs += 1
        if entry.runs == 1 or entry.graph is False:
            self.eager += 1
            return self._forward(*args, **kwargs)
        if entry.graph is None:
            self._capture(entry, args, kwargs)
            if entry.graph is False:
                self.eager += 1
                return self._forward(*args, **kwargs)
        else:
            _copy_into(entry.args, args)
            _copy_into(tuple(entry.kwargs.values()), tuple(kwargs[k] for k in entry.kwargs))
        self.replays += 1
        if self.cuda:
            entry.graph.replay()
            return entry.output
        return self._forward(*entry.args, **entry.kwargs)

    def _capture(self, entry: _Entry, args: tuple, kwargs: dict[str, Any]) -> None:
        entry.args = tuple(_static(a) for a in args)
        entry.kwargs = {k: _static(v) for k, v in kwargs.items()}
        if not self.cuda:
            entry.graph = True
            return
        graph = torch.cuda.CUDAGraph()
        try:
            entry.output = capture(
                graph, lambda: self._forward(*entry.args, **entry.kwargs), self.device, self._pool
            )
        except RuntimeError:
            log.exception("capturing the stock denoiser call failed: it runs eagerly")
            entry.graph = False
            return
        entry.graph = graph
        self.captures += 1


def _key(value: Any) -> Hashable:
    """What a capture depends on in one argument: a tensor's shape, dtype and device, a
    container's items, any other value itself (by ``repr`` when it is not hashable)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value


def _static(value: Any) -> Any:
    """A static copy of an argument: tensors cloned (contiguous), containers item by item."""
    if isinstance(value, torch.Tensor):
        return value.clone(memory_format=torch.contiguous_format)
    if isinstance(value, list | tuple):
        return type(value)(_static(v) for v in value)
    if isinstance(value, dict):
        return {k: _static(v) for k, v in value.items()}
    return value


def _copy_into(static: Any, value: Any) -> None:
    """Copy ``value``'s tensors into the matching static tensors."""
    if isinstance(static, torch.Tensor):
        static.copy_(value)
    elif isinstance(static, list | tuple):
        for s, v in zip(static, value, strict=True):
            _copy_into(s, v)
    elif isinstance(static, dict):
        for k, s in static.items():
            _copy_into(s, value[k])
