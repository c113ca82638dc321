"""How an engine batches: continuous or static, its batch limit, where pre- and
post-processing run, and its knobs for bakes, adapters and niceness."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class EngineMode(StrEnum):
    CONTINUOUS = "continuous"
    STATIC = "static"


@dataclass(frozen=True)
class EngineConfig:
    mode: EngineMode = EngineMode.CONTINUOUS
    max_batch: int = 8  # FlashPS: throughput plateaus around 8 (4 on small GPUs)
    disaggregated: bool = True
    bake_starvation_s: float = 30.0
    # engine-thread time an iteration gives to attaching a waiting adapter set's layers, as
    # a share of the last step's time (at least one layer: a load always progresses)
    adapter_load_share: float = 0.1
    # batches mix adapter sets (each row its own LoRA updates, runtime/mixedlora) instead
    # of one set per batch, the sets taking turns; the executor's keys then omit the set
    mixed_adapters: bool = False
    # added to the engine thread's niceness (Linux, where a thread has its own): on a CPU
    # the steps share cores with request handling, which must not wait behind a step
    nice: int = 0
