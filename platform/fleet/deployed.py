"""A deployed function as the gateway tracks it: its stored copy, the generation of the
control operation that put it there, the template sizes and the deploy's progress."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from retouch.functions.imaging import decode_image
from retouch.functions.spec import FunctionSpec
from retouch.functions.wire.executor import BAKE_PROGRESS, BakeState, DeployStatus, ExecutorState
from retouch.platform.control.cluster import PlacementRequest
from retouch.platform.state.registry import StoredFunction
from retouch.runtime.prediction import MaskFootprint


@dataclass
class DeployedFunction:
    """A function as the gateway tracks it: stored copy, sizes and deploy progress."""

    stored: StoredFunction
    generation: int
    status: DeployStatus = DeployStatus.DEPLOYING
    error: str | None = None
    # The refusal's field and code when an executor refused the deploy with a structured
    # error (a LoRA that does not fit the loaded model: ``adapters[0].path``).
    error_field: str | None = None
    error_code: str | None = None
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    task: asyncio.Task | None = None
    # Template images decoded for crops of them (``padding_mask_crop``), on first need.
    _pixels: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def spec(self) -> FunctionSpec:
        return self.stored.spec

    def template_pixels(self, tid: str) -> np.ndarray:
        """A template's RGB8 ``[H, W, 3]`` pixels (its stored PNG, decoded once)."""
        pixels = self._pixels.get(tid)
        if pixels is None:
            img = decode_image(self.stored.templates[tid], f"templates.{tid}.image")
            pixels = self._pixels[tid] = np.asarray(img.convert("RGB"), dtype=np.uint8)
        return pixels

    @cached_property
    def cheapest(self) -> PlacementRequest:
        """The cheapest invocation of this function (an empty mask, its template in host
        memory): when even it is predicted to miss the SLO, a 429 needs no body read."""
        spec = self.spec
        footprint = MaskFootprint.of(np.zeros((spec.height, spec.width), dtype=bool))
        slo = None if spec.slo_ms is None else spec.slo_ms / 1e3
        return PlacementRequest(
            spec.name,
            "",
            0.0,
            spec.model,
            spec.steps,
            footprint,
            slo,
            optimistic=True,
            copy=spec.source.key,
            adapter_set=spec.adapter_set,
            adapter_bytes=self.adapter_bytes,
        )

    @cached_property
    def adapter_bytes(self) -> int:
        """The size of its adapter files as the gateway sees them (0 where it cannot read
        one: an executor on another node): what a load of its set costs, by size."""
        total = 0
        for adapter in self.spec.adapters:
            try:
                total += Path(adapter.path).expanduser().stat().st_size
            except OSError:
                return 0
        return total

    def describe(self, executor_states: list[ExecutorState] | None = None) -> dict[str, Any]:
        """The status document; template states come from the executors when given."""
        spec = self.spec
        return {
            **spec.to_dict(),
            "status": self.status.value,
            "error": self.error,
            "error_field": self.error_field,
            "error_code": self.error_code,
            "generation": self.generation,
            "templates": {
                tid: {
                    "state": self._template_state(tid, executor_states or []).value,
                    "width": w,
                    "height": h,
                    "prompt": spec.templates[tid].prompt,
                    "seed": spec.templates[tid].seed,
                }
                for tid, (w, h) in self.sizes.items()
            },
            "uploads": self._uploads(executor_states or []),
        }

    def _uploads(self, executor_states: list[ExecutorState]) -> dict[str, dict[str, Any]]:
        """The ad-hoc templates (uploaded images) the executors hold, most advanced state."""
        out: dict[str, dict[str, Any]] = {}
        for state in executor_states:
            for tid, status in state.templates.get(self.spec.name, {}).items():
                if not status.upload:
                    continue
                seen = out.setdefault(tid, {"state": status.state.value, "bytes": 0})
                rank = BAKE_PROGRESS.index
                if rank(status.state) < rank(BakeState(seen["state"])):
                    seen["state"] = status.state.value
                seen["bytes"] = max(seen["bytes"], status.bytes)
        return out

    def _template_state(self, tid: str, executor_states: list[ExecutorState]) -> BakeState:
        """pending while deploying; then the most advanced bake state any executor reports
        (they share the host's store): baked > baking > queued > unbaked > failed."""
        if self.status is DeployStatus.DEPLOYING:
            return BakeState.PENDING
        if self.status is DeployStatus.FAILED:
            return BakeState.FAILED
        seen = {
            status.state
            for state in executor_states
            if (status := state.template(self.spec.name, tid)) is not None
        }
        return next((s for s in BAKE_PROGRESS if s in seen), BakeState.UNBAKED)
