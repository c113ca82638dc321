"""An executor's messages to the gateway: its state and changes, and the frames of its
invocation stream; and the vocabulary of deploys, bakes and executor phases."""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum
from typing import Annotated, Any

import msgpack
from pydantic import ConfigDict, Field, field_validator, model_validator

from retouch.functions.errors import BadRequest, RetouchError
from retouch.functions.wire.codec import as_map
from retouch.functions.wire.invoke import InvokeResult
from retouch.functions.wire.struct import NULL_AS_DEFAULTS, Message, lenient


class DeployStatus(StrEnum):
    """A function's deploy as the gateway tracks it."""

    DEPLOYING = "deploying"
    READY = "ready"
    FAILED = "failed"


class BakeState(StrEnum):
    """A template's activations on an executor's host (``pending`` while its function is
    still deploying, as the gateway reports it)."""

    PENDING = "pending"
    UNBAKED = "unbaked"
    QUEUED = "queued"
    BAKING = "baking"
    BAKED = "baked"
    FAILED = "failed"


ReadBakeState = lenient(BakeState, BakeState.UNBAKED)  # a state this reader does not know

# Most advanced first: the gateway reports the best state any executor of the host has.
BAKE_PROGRESS = (
    BakeState.BAKED,
    BakeState.BAKING,
    BakeState.QUEUED,
    BakeState.UNBAKED,
    BakeState.FAILED,
)


def template_variant(template: str, skipped: int, scheduler: str = "") -> str:
    """The id under which executors bake and report ``template`` for edits that skip the
    first ``skipped`` steps of its schedule (a ``strength`` < 1) or run with ``scheduler``,
    one the function allows besides its own ("": its own). Either is another trajectory,
    so another bake, residency and placement affinity; the template's own id for neither."""
    at_scheduler = f"@{scheduler}" if scheduler else ""
    at_step = f"@step{skipped}" if skipped else ""
    return f"{template}{at_scheduler}{at_step}"


class ExecutorPhase(StrEnum):
    """An executor's life as the gateway's pool sees it."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    SLEEPING = "sleeping"  # process and store kept, device memory given back (runtime/sleep)
    WAKING = "waking"
    DEAD = "dead"


# ---- an executor's state, as it reports it to the gateway --------------------------------


class TemplateStatus(Message):
    """One template on one executor: bake state, bakes done, cache key, last bake error."""

    model_config = ConfigDict(frozen=True)

    state: ReadBakeState = BakeState.UNBAKED
    bakes: int = 0
    key: str = ""
    error: str | None = None
    upload: bool = False  # an ad-hoc template (an uploaded image), not a deployed one
    bytes: int = 0  # its baked activations (0 until baked)
    host: bool = False  # host-resident now
    device: bool = False  # resident in the executor's device tier (GPU memory): no load at all


class EngineStats(Message):
    """The engine's liveness, load and recent per-step figures."""

    model_config = ConfigDict(frozen=True)

    mode: str = "continuous"
    max_batch: int = 8
    disaggregated: bool = True
    alive: bool = True
    error: str | None = None  # why the engine thread died
    preprocessing: int = 0
    ready: int = 0
    running: int = 0
    background: int = 0
    adapter_waits: int = 0  # encoded, waiting for their LoRA files to be read from disk
    steps: int = 0
    interruptions: int = 0
    bakes: int = 0
    canceled: int = 0  # invocations canceled (out of the queue, or out of the running batch)
    batch_overhead_ms_p50: float = 0.0
    step_ms_p50: float = 0.0
    load_wait_ms_p50: float = 0.0
    batch_mean: float = 0.0
    plan_sparse_blocks: int | None = None  # the last step's plan
    plan_blocks: int | None = None
    # How steps took against the plan's prediction: step = intercept_ms + slope x planned
    step_intercept_ms: float = 0.0
    step_slope: float = 1.0
    step_fit_prior: int = 0  # steps in that fit left by a previous engine (runtime/steprecords)
    # Pre/post worker processes: how many encodes (decodes) run at once, the rest queue
    # (0: pre/post run inline, or an executor that does not say).
    pre_workers: int = 0
    post_workers: int = 0
    # Mask-aware steps from graphs (runtime/maskaware/graphs, buckets), all editors told:
    # captured layouts kept, captures (those on the request path: a step that waited for
    # one; the rest at warm-up), replays, steps run eagerly (a layout's first runs, steps
    # graphs could not take, layouts the budget left uncaptured), pad slots computed by
    # bucketed layouts, and the bytes graphs hold against their budget (0: no budget).
    graph_layouts: int = 0
    graph_captures: int = 0
    graph_request_captures: int = 0
    graph_replays: int = 0
    graph_eager_steps: int = 0
    graph_over_budget: int = 0
    graph_bytes: int = 0
    graph_budget_bytes: int = 0
    padded_tokens: int = 0


class CacheInfo(Message):
    """The activation store as cheaply known (no disk scan): host-tier occupancy and the
    store's monotonic counters (hits, loads, bakes, evictions, ...), which travel beside
    the named fields in one map."""

    model_config = ConfigDict(frozen=True)

    host_bytes: int = 0
    host_budget_bytes: int = 0
    host_templates: int = 0
    prefetches_in_flight: int = 0
    counters: dict[str, int | float] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _counters_beside(cls, body: Any) -> Any:
        """On the wire the counters are keys of the map itself: gathered here."""
        if not isinstance(body, dict) or "counters" in body:
            return body
        named = cls.model_fields.keys()
        return {
            **{k: v for k, v in body.items() if k in named},
            "counters": {
                k: v
                for k, v in body.items()
                if k not in named and isinstance(v, int | float) and not isinstance(v, bool)
            },
        }

    def to_wire(self) -> dict[str, Any]:
        return {**self.counters, **self.model_dump(exclude={"counters"})}


class DeviceMemory(Message):
    """The executor's GPU memory in bytes (all 0 on a CPU executor): what the device holds
    in all (``total``), free to any process (``free``), and this process's torch allocator
    (``allocated`` by live tensors, ``reserved`` in its cache)."""

    model_config = ConfigDict(frozen=True)

    total: int = 0
    free: int = 0
    allocated: int = 0
    reserved: int = 0


class AdapterStats(Message):
    """An executor's LoRA adapter figures since it started (``runtime/adapters``): files
    read from disk (in the background) and injected into a denoiser (between steps),
    changes of the adapter set a step runs with, steps whose rows ran their own sets' updates
    (mixed batching), sets
    evicted for the byte budget, and the milliseconds each took in all."""

    model_config = ConfigDict(frozen=True)

    reads: int = 0
    loads: int = 0
    swaps: int = 0
    mixed_steps: int = 0
    evictions: int = 0
    read_ms: float = 0.0
    inject_ms: float = 0.0
    swap_ms: float = 0.0

    @property
    def mean_load_ms(self) -> float:
        """A file's load as measured here: read and built, then attached (0: none yet).
        Placement's load cost of a set this executor does not hold."""
        if not self.reads or not self.loads:
            return 0.0
        return self.read_ms / self.reads + self.inject_ms / self.loads

    @property
    def mean_swap_ms(self) -> float:
        """A change of the active set between steps as measured here (0: none yet)."""
        return self.swap_ms / self.swaps if self.swaps else 0.0


class SleepMode(StrEnum):
    """Whether an executor holds its device (``awake``) or gave it back (``asleep``)."""

    AWAKE = "awake"
    ASLEEP = "asleep"


ReadSleepMode = lenient(SleepMode, SleepMode.AWAKE)


class SleepInfo(Message):
    """An executor's sleeps and wakes: the last of each took ``*_ms`` (``runtime/sleep.py``)."""

    model_config = ConfigDict(frozen=True)

    mode: ReadSleepMode = SleepMode.AWAKE
    sleeps: int = 0
    wakes: int = 0
    last_sleep_ms: float = 0.0
    last_wake_ms: float = 0.0
    freed_bytes: int = 0  # device memory the last sleep gave back (0 on a CPU)
    host_bytes: int = 0  # the process's resident memory when it last fell asleep


class ExecutorState(Message):
    """What an executor reports on ``GET /state``: the gateway's typed view of it."""

    model_config = ConfigDict(frozen=True)

    name: str
    pid: int
    device: str
    maskaware: bool = True
    deterministic: bool = False  # runs in deterministic mode (ExecutorOptions.deterministic)
    # batches mix adapter sets, each row its own LoRA updates (no swaps between sets)
    mixed_adapters: bool = False
    models: tuple[str, ...] = ()  # loaded
    loading: tuple[str, ...] = ()  # being loaded or profiled
    functions: tuple[str, ...] = ()
    generations: dict[str, int] = Field(default_factory=dict)  # of each function's deploy
    queued: int = 0  # accepted and not answered
    completed: int = 0
    failed: int = 0
    engine: Annotated[EngineStats, NULL_AS_DEFAULTS] = Field(default_factory=EngineStats)
    templates: dict[str, dict[str, TemplateStatus]] = Field(default_factory=dict)
    cost_models: dict[str, dict[str, Any]] = Field(default_factory=dict)  # CostModel.to_dict
    cache: Annotated[CacheInfo, NULL_AS_DEFAULTS] = Field(default_factory=CacheInfo)
    workers: dict[str, int] = Field(default_factory=dict)  # pre/post worker processes (pid)
    gpu_memory: Annotated[DeviceMemory, NULL_AS_DEFAULTS] = Field(default_factory=DeviceMemory)
    # Adapter sets (``FunctionSpec.adapter_set``) whose weights are resident on the device,
    # least recently used first: placement adds no load cost for these.
    adapters: tuple[str, ...] = ()
    adapter_stats: Annotated[AdapterStats, NULL_AS_DEFAULTS] = Field(default_factory=AdapterStats)
    # Its start, phase by phase, in ms (``runtime/startup.py``): its own (process, store,
    # workers, listening, first_edit) and each model's (weights, profile, graphs).
    startup_ms: dict[str, float] = Field(default_factory=dict)
    model_startup_ms: dict[str, dict[str, float]] = Field(default_factory=dict)
    sleep: Annotated[SleepInfo, NULL_AS_DEFAULTS] = Field(default_factory=SleepInfo)

    @field_validator(
        "generations",
        "templates",
        "cost_models",
        "workers",
        "startup_ms",
        "model_startup_ms",
        mode="before",
    )
    @classmethod
    def _null_as_empty(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("models", "loading", "functions", "adapters", mode="before")
    @classmethod
    def _null_as_none(cls, value: Any) -> Any:
        return () if value is None else value

    def template(self, function: str, template: str) -> TemplateStatus | None:
        return self.templates.get(function, {}).get(template)

    def to_wire(self) -> dict[str, Any]:
        return {**self.model_dump(exclude={"cache"}), "cache": self.cache.to_wire()}


# ---- the executor's invocation stream (POST /invoke/stream) ------------------------------


class StepProgress(Message):
    """One denoising step of an invocation done, as the executor's engine reports it."""

    model_config = ConfigDict(frozen=True)

    step: int  # steps done, 1..total
    total: int


class ChangeKind(StrEnum):
    """What changed on an executor that the gateway's cluster view must learn."""

    BAKED = "baked"  # a template's bake committed (it is in the store, usually host memory)
    BAKE_FAILED = "bake_failed"
    HOST_TIER = "host_tier"  # a template was loaded into host memory (others may have left)
    LOST = "lost"  # a template's activations were not found (it will be baked again)
    ADAPTERS = "adapters"  # an adapter set became resident on the device, or was evicted


class ExecutorChange(Message):
    """One numbered event of an executor's change feed."""

    model_config = ConfigDict(frozen=True)

    version: int
    kind: ChangeKind
    function: str = ""
    template: str = ""


class ExecutorChanges(Message):
    """The answer to ``GET /changes?after=N``: the events after N, the feed's version, and
    ``reset`` when some were missed (the feed dropped them, or the executor restarted and
    counts from 0 again): the reader then re-reads the whole state."""

    model_config = ConfigDict(frozen=True)

    version: int
    changes: tuple[ExecutorChange, ...] = ()
    reset: bool = False


Frame = StepProgress | InvokeResult | RetouchError


def progress_frame(progress: StepProgress) -> dict[str, Any]:
    return {"progress": progress.to_wire()}


def result_frame(result: InvokeResult) -> dict[str, Any]:
    return {"result": result.to_wire()}


def error_frame(exc: RetouchError) -> dict[str, Any]:
    return {**exc.to_wire(), "status": exc.status}


def parse_frame(obj: Any) -> Frame:
    """A frame of the executor's stream: step progress, then one result or one error."""
    body = as_map(obj)
    if "progress" in body:
        return StepProgress.from_wire(body["progress"])
    if "result" in body:
        return InvokeResult.from_wire(body["result"])
    if "error" in body:
        return RetouchError.from_wire(int(body.get("status", 500)), body)
    raise BadRequest("unknown frame in the invocation stream", code="malformed_body")


class FrameReader:
    """Incremental decoder of a stream of msgpack maps (the executor's invocation stream)."""

    def __init__(self) -> None:
        self._unpacker = msgpack.Unpacker(raw=False, strict_map_key=True)

    def feed(self, data: bytes) -> Iterator[Frame]:
        self._unpacker.feed(data)
        for obj in self._unpacker:
            yield parse_frame(obj)
