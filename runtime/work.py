"""One invocation's life inside the engine (:class:`Work`) and where it stands
(:class:`WorkStatus`), after vLLM v1's request and its status.

The engine alone moves a work from status to status; other threads only read it. Two of
its fields are not statuses: ``cancel_requested`` is a request another thread makes, which
the engine honours at its next look (the work then ends ``CANCELED``), and ``state``, the
denoising state, exists while the work runs (it is dropped when it leaves the batch, to
free its tensors before post-processing).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import torch

from retouch.functions.adapters import AdapterSpec
from retouch.runtime.adapters import AdapterUse
from retouch.runtime.maskaware.editor import MaskAwareEditor
from retouch.runtime.maskaware.request import EditRequest, RequestState


class WorkStatus(StrEnum):
    """Where an invocation is in the engine (set by the engine as it moves it on)."""

    ACCEPTED = "accepted"  # submitted: pre-processing (or waiting to be encoded inline)
    WAITING_ADAPTERS = "waiting_adapters"  # encoded; its LoRA files are still being read
    READY = "ready"  # in the ready queue, may join the next step
    RUNNING = "running"  # in the running batch, one step per iteration
    POSTPROCESSING = "postprocessing"  # denoised, being decoded
    DONE = "done"
    FAILED = "failed"
    CANCELED = "canceled"

    @property
    def finished(self) -> bool:
        return self in (WorkStatus.DONE, WorkStatus.FAILED, WorkStatus.CANCELED)


@dataclass(frozen=True)
class Output:
    """What post-processing returns: the encoded image."""

    image: bytes
    width: int
    height: int


class Stages(Protocol):
    """Where pre- and post-processing run when they are disaggregated (worker processes)."""

    def encode(self, work: Work) -> Future: ...  # -> the editor's Encoded

    def decode(self, work: Work, latents: torch.Tensor) -> Future: ...  # -> (bytes, w, h)


Acquire = Callable[[], tuple[Any, dict[str, Any]]]  # -> (reader or None, cache info)
OnStep = Callable[[int, int], None]  # (steps done, total steps), called on the engine thread


@dataclass
class Work:
    """One invocation's life inside the engine, with its timestamps and counters."""

    key: Hashable  # invocations with the same key can share a denoising step
    model: str
    family: str
    scheduler: str
    editor: MaskAwareEditor
    request: EditRequest
    fmt: str
    acquire: Acquire  # makes the template host-resident (or not) at join time
    future: Future = field(default_factory=Future)
    id: int = 0  # set by the engine at submit
    arrived: float = field(default_factory=time.perf_counter)
    pre_done: float = 0.0
    joined: float = 0.0
    first_step: float = 0.0
    last_step: float = 0.0
    post_done: float = 0.0
    encoded: Any = None
    state: RequestState | None = None
    reader: Any = None
    cache: dict[str, Any] = field(default_factory=dict)
    interruptions: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    on_step: OnStep | None = None  # progress: must be cheap and never block
    cancel_requested: bool = False  # set by Engine.cancel; honoured before the next step
    status: WorkStatus = WorkStatus.ACCEPTED
    feather_px: int | None = None  # composite into the template, this soft edge (None: off)
    adapters: AdapterUse | None = None  # the model's adapter set (None: a model without any)
    # The function's LoRA files, whose text-encoder parts encode its prompt (pre workers).
    text_adapters: tuple[AdapterSpec, ...] = ()
    # Pre-processing on the engine thread (no pre workers) when the editor's own encode
    # would miss the function's text-encoder LoRAs; None: ``editor.encode``.
    encode_inline: Callable[[EditRequest], Any] | None = None

    @property
    def path(self) -> str:
        return "maskaware" if self.reader is not None else "stock"

    def report(self, output: Output) -> dict[str, Any]:
        ms = 1e3
        return {
            "output": output,
            "path": self.path,
            "cache": self.cache,
            "timings": {
                "pre_ms": (self.pre_done - self.arrived) * ms,
                "queue_ms": (self.joined - self.pre_done) * ms,
                "run_ms": (self.last_step - self.joined) * ms,
                "post_ms": (self.post_done - self.last_step) * ms,
            },
            "engine": {
                "steps": len(self.batch_sizes),
                "interruptions": self.interruptions,
                "batch_sizes": self.batch_sizes,
            },
        }
