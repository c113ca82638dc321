"""An executor's messages to the gateway: its state and changes, and the frames of its
invocation stream; and the vocabulary of deploys, bakes and executor phases."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

import msgpack

from retouch.functions.errors import BadRequest, RetouchError
from retouch.functions.wire.codec import as_map, enum_or
from retouch.functions.wire.invoke import InvokeResult


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
    DEAD = "dead"


# ---- an executor's state, as it reports it to the gateway --------------------------------


@dataclass(frozen=True)
class TemplateStatus:
    """One template on one executor: bake state, bakes done, cache key, last bake error."""

    state: BakeState
    bakes: int = 0
    key: str = ""
    error: str | None = None
    upload: bool = False  # an ad-hoc template (an uploaded image), not a deployed one
    bytes: int = 0  # its baked activations (0 until baked)
    host: bool = False  # host-resident now
    device: bool = False  # resident in the executor's device tier (GPU memory): no load at all

    def to_wire(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "bakes": self.bakes,
            "key": self.key,
            "error": self.error,
            "upload": self.upload,
            "bytes": self.bytes,
            "host": self.host,
            "device": self.device,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> TemplateStatus:
        body = obj if isinstance(obj, dict) else {}
        return cls(
            enum_or(BakeState, body.get("state"), BakeState.UNBAKED),
            int(body.get("bakes", 0)),
            str(body.get("key", "")),
            body.get("error"),
            bool(body.get("upload", False)),
            int(body.get("bytes", 0)),
            bool(body.get("host", False)),
            bool(body.get("device", False)),
        )


@dataclass(frozen=True)
class EngineStats:
    """The engine's liveness, load and recent per-step figures."""

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

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, obj: Any) -> EngineStats:
        body = obj if isinstance(obj, dict) else {}
        return cls(**{f.name: body[f.name] for f in fields(cls) if f.name in body})


@dataclass(frozen=True)
class CacheInfo:
    """The activation store as cheaply known (no disk scan): host-tier occupancy and the
    store's monotonic counters (hits, loads, bakes, evictions, ...)."""

    host_bytes: int = 0
    host_budget_bytes: int = 0
    host_templates: int = 0
    prefetches_in_flight: int = 0
    counters: dict[str, float] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            **self.counters,
            "host_bytes": self.host_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "host_templates": self.host_templates,
            "prefetches_in_flight": self.prefetches_in_flight,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> CacheInfo:
        body = dict(obj) if isinstance(obj, dict) else {}
        named = {f.name for f in fields(cls)} - {"counters"}
        return cls(
            **{k: int(body.pop(k)) for k in list(body) if k in named},
            counters={k: v for k, v in body.items() if isinstance(v, int | float)},
        )


@dataclass(frozen=True)
class DeviceMemory:
    """The executor's GPU memory in bytes (all 0 on a CPU executor): what the device holds
    in all (``total``), free to any process (``free``), and this process's torch allocator
    (``allocated`` by live tensors, ``reserved`` in its cache)."""

    total: int = 0
    free: int = 0
    allocated: int = 0
    reserved: int = 0

    def to_wire(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, obj: Any) -> DeviceMemory:
        body = obj if isinstance(obj, dict) else {}
        return cls(**{f.name: int(body.get(f.name, 0)) for f in fields(cls)})


@dataclass(frozen=True)
class AdapterStats:
    """An executor's LoRA adapter figures since it started (``runtime/adapters``): files
    read from disk (in the background) and injected into a denoiser (between steps),
    changes of the adapter set a step runs with, steps whose rows ran their own sets' updates
    (mixed batching), sets
    evicted for the byte budget, and the milliseconds each took in all."""

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

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, obj: Any) -> AdapterStats:
        body = obj if isinstance(obj, dict) else {}
        return cls(**{f.name: body[f.name] for f in fields(cls) if f.name in body})


@dataclass(frozen=True)
class ExecutorState:
    """What an executor reports on ``GET /state``: the gateway's typed view of it."""

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
    generations: dict[str, int] = field(default_factory=dict)  # of each function's deploy
    queued: int = 0  # accepted and not answered
    completed: int = 0
    failed: int = 0
    engine: EngineStats = field(default_factory=EngineStats)
    templates: dict[str, dict[str, TemplateStatus]] = field(default_factory=dict)
    cost_models: dict[str, dict[str, Any]] = field(default_factory=dict)  # CostModel.to_dict
    cache: CacheInfo = field(default_factory=CacheInfo)
    workers: dict[str, int] = field(default_factory=dict)  # pre/post worker processes (pid)
    gpu_memory: DeviceMemory = field(default_factory=DeviceMemory)
    # Adapter sets (``FunctionSpec.adapter_set``) whose weights are resident on the device,
    # least recently used first: placement adds no load cost for these.
    adapters: tuple[str, ...] = ()
    adapter_stats: AdapterStats = field(default_factory=AdapterStats)

    def template(self, function: str, template: str) -> TemplateStatus | None:
        return self.templates.get(function, {}).get(template)

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pid": self.pid,
            "device": self.device,
            "maskaware": self.maskaware,
            "deterministic": self.deterministic,
            "mixed_adapters": self.mixed_adapters,
            "models": list(self.models),
            "loading": list(self.loading),
            "functions": list(self.functions),
            "generations": self.generations,
            "queued": self.queued,
            "completed": self.completed,
            "failed": self.failed,
            "engine": self.engine.to_wire(),
            "templates": {
                fn: {tid: t.to_wire() for tid, t in tpls.items()}
                for fn, tpls in self.templates.items()
            },
            "cost_models": self.cost_models,
            "cache": self.cache.to_wire(),
            "workers": self.workers,
            "gpu_memory": self.gpu_memory.to_wire(),
            "adapters": list(self.adapters),
            "adapter_stats": self.adapter_stats.to_wire(),
        }

    @classmethod
    def from_wire(cls, obj: Any) -> ExecutorState:
        body = as_map(obj)
        return cls(
            name=str(body["name"]),
            pid=int(body["pid"]),
            device=str(body["device"]),
            maskaware=bool(body.get("maskaware", True)),
            deterministic=bool(body.get("deterministic", False)),
            mixed_adapters=bool(body.get("mixed_adapters", False)),
            models=tuple(body.get("models", ())),
            loading=tuple(body.get("loading", ())),
            functions=tuple(body.get("functions", ())),
            generations={str(k): int(v) for k, v in (body.get("generations") or {}).items()},
            queued=int(body.get("queued", 0)),
            completed=int(body.get("completed", 0)),
            failed=int(body.get("failed", 0)),
            engine=EngineStats.from_wire(body.get("engine")),
            templates={
                fn: {tid: TemplateStatus.from_wire(t) for tid, t in tpls.items()}
                for fn, tpls in (body.get("templates") or {}).items()
            },
            cost_models=dict(body.get("cost_models") or {}),
            cache=CacheInfo.from_wire(body.get("cache")),
            workers={str(k): int(v) for k, v in (body.get("workers") or {}).items()},
            gpu_memory=DeviceMemory.from_wire(body.get("gpu_memory")),
            adapters=tuple(str(a) for a in body.get("adapters") or ()),
            adapter_stats=AdapterStats.from_wire(body.get("adapter_stats")),
        )


# ---- the executor's invocation stream (POST /invoke/stream) ------------------------------


@dataclass(frozen=True)
class StepProgress:
    """One denoising step of an invocation done, as the executor's engine reports it."""

    step: int  # steps done, 1..total
    total: int

    def to_wire(self) -> dict[str, Any]:
        return {"progress": {"step": self.step, "total": self.total}}


class ChangeKind(StrEnum):
    """What changed on an executor that the gateway's cluster view must learn."""

    BAKED = "baked"  # a template's bake committed (it is in the store, usually host memory)
    BAKE_FAILED = "bake_failed"
    HOST_TIER = "host_tier"  # a template was loaded into host memory (others may have left)
    LOST = "lost"  # a template's activations were not found (it will be baked again)
    ADAPTERS = "adapters"  # an adapter set became resident on the device, or was evicted


@dataclass(frozen=True)
class ExecutorChange:
    """One numbered event of an executor's change feed."""

    version: int
    kind: ChangeKind
    function: str = ""
    template: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "kind": self.kind.value,
            "function": self.function,
            "template": self.template,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> ExecutorChange:
        body = as_map(obj)
        return cls(
            int(body["version"]),
            ChangeKind(body["kind"]),
            str(body.get("function", "")),
            str(body.get("template", "")),
        )


@dataclass(frozen=True)
class ExecutorChanges:
    """The answer to ``GET /changes?after=N``: the events after N, the feed's version, and
    ``reset`` when some were missed (the feed dropped them, or the executor restarted and
    counts from 0 again): the reader then re-reads the whole state."""

    version: int
    changes: tuple[ExecutorChange, ...] = ()
    reset: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "changes": [c.to_wire() for c in self.changes],
            "reset": self.reset,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> ExecutorChanges:
        body = as_map(obj)
        return cls(
            int(body["version"]),
            tuple(ExecutorChange.from_wire(c) for c in body.get("changes", ())),
            bool(body.get("reset", False)),
        )


Frame = StepProgress | InvokeResult | RetouchError


def result_frame(result: InvokeResult) -> dict[str, Any]:
    return {"result": result.to_wire()}


def error_frame(exc: RetouchError) -> dict[str, Any]:
    return {**exc.to_wire(), "status": exc.status}


def parse_frame(obj: Any) -> Frame:
    """A frame of the executor's stream: step progress, then one result or one error."""
    body = as_map(obj)
    if "progress" in body:
        p = as_map(body["progress"])
        return StepProgress(int(p["step"]), int(p["total"]))
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
