"""The executor's editors: one per (model, scheduler), built once, with the cost model,
step times and step tables of each loaded model copy.

A build loads nothing itself (the model cache does) but profiles the model on this device
once (in a nice'd child process, then read from the profile cache) and warms its CUDA
graphs; it runs outside the lock, and concurrent callers wait on its future. The lock
guards the tables only and is never held across a build.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from retouch.functions.spec import FunctionSpec
from retouch.runtime.costmodel import CostModel
from retouch.runtime.engine import Engine
from retouch.runtime.executor.adapterhost import AdapterHost
from retouch.runtime.executor.stages import WorkerStages
from retouch.runtime.maskaware.buckets import Buckets
from retouch.runtime.maskaware.editor import EditRequest, Encoded, MaskAwareEditor
from retouch.runtime.maskaware.loader import LoadMode, RowLoader, attach
from retouch.runtime.maskaware.warmup import warm_graphs
from retouch.runtime.models import ModelCache
from retouch.runtime.pathchoice import StepTimes
from retouch.runtime.plan import Policy
from retouch.runtime.planner import make_planner
from retouch.runtime.prediction import plan_table
from retouch.runtime.profiling import (
    cached_profile,
    load_or_profile,
    profile_in_subprocess,
    profile_path,
)
from retouch.runtime.replaytimes import ReplayTimes
from retouch.runtime.reproducibility import in_effect as deterministic_mode
from retouch.runtime.steprecords import load_step_records, save_step_records
from retouch.runtime.templates import TemplateCache

log = logging.getLogger(__name__)

GRAPH_COUNTERS = (
    "graph_layouts",
    "graph_captures",
    "graph_request_captures",
    "graph_replays",
    "graph_eager_steps",
    "graph_over_budget",
    "graph_bytes",
    "padded_tokens",
)


def plan_policy() -> Policy:
    """Deterministic mode plans every block sparse: an edit's pixels then follow the
    request alone, not the batch it joined or the timings profiled (``runtime/plan.py``)."""
    return Policy.SPARSE if deterministic_mode() else Policy.BUBBLE_FREE


def encodes_elsewhere(stages: WorkerStages | None, models: ModelCache) -> bool:
    """Whether an executor's pipelines lack their text encoders: its pre workers hold
    them, and encode for bakes and profiling too."""
    return stages is not None and "text_encoders" in models.without


@dataclass(frozen=True)
class EditorOptions:
    """How an executor builds its editors (its flags)."""

    data_dir: Path = Path(".")  # where device profiles are cached (profiles/)
    profile_in_background: bool = True  # in a nice'd child process
    cuda_graphs: bool = False  # steps of device-resident batches from CUDA graphs
    graph_budget_bytes: int | None = None  # per editor (None: no limit)


class Editors:
    """One editor per (model, scheduler) of an executor; editors of a model share its
    modules, and each loaded copy (source key) has one cost model and one step fit."""

    def __init__(
        self,
        models: ModelCache,
        templates: TemplateCache,
        engine: Engine,
        stages: WorkerStages | None,
        adapters: AdapterHost,
        options: EditorOptions,
    ) -> None:
        self.models = models
        self.startup = models.startup  # each model's profile and warm-up, beside its weights
        self.templates = templates
        self.engine = engine
        self.stages = stages
        self.adapters = adapters
        self.options = options
        self._lock = threading.Lock()  # guards the four tables below; never held across work
        self._editors: dict[tuple[str, str], Future[MaskAwareEditor]] = {}
        self._cost_models: dict[str, CostModel] = {}  # per loaded copy (source key), here
        self._profiles: dict[str, Path] = {}  # per loaded model (source key): step records
        # per loaded copy: the step times the path choice compares (runtime/pathchoice)
        self._step_times: dict[str, StepTimes | None] = {}
        # per editor with graphs: the spec its warm-up captured for (a wake captures again)
        self._graphed: dict[tuple[str, str], FunctionSpec] = {}

    def get(self, spec: FunctionSpec, scheduler: str = "") -> MaskAwareEditor:
        """The editor of ``spec``'s model with ``scheduler`` (one the spec allows, "" its
        own), built on first use: an overlapped row loader and the bubble-free planner of
        the model's cost model on this device."""
        scheduler = scheduler or spec.scheduler
        key = (spec.source.key, scheduler)
        with self._lock:
            future = self._editors.get(key)
            owner = future is None
            if owner:
                future = self._editors[key] = Future()
        if not owner:
            return future.result()
        try:
            editor, cost_model = self._build(spec, scheduler)
        except BaseException as exc:
            with self._lock:
                self._editors.pop(key, None)
            future.set_exception(exc)
            raise
        with self._lock:
            self._cost_models[spec.source.key] = cost_model  # per loaded copy
            if editor.graphs is not None:
                self._graphed[key] = spec
        future.set_result(editor)
        return editor

    def _build(self, spec: FunctionSpec, scheduler: str) -> tuple[MaskAwareEditor, CostModel]:
        loaded = self.models.get(spec.source.key, spec.family)
        options = self.options
        key = spec.source.key
        with self.startup.timed("profile", key):  # read from the profile cache, or run
            if options.profile_in_background and not cached_profile(
                loaded.fingerprint, options.data_dir, loaded.device, spec.family, spec.width
            ):
                profile_in_subprocess(
                    key,
                    spec.family,
                    scheduler,
                    spec.width,
                    options.data_dir,
                    loaded.device,
                    torch.get_num_threads(),
                )  # on failure, load_or_profile below profiles in-process
            editor = MaskAwareEditor(loaded.pipeline_for(scheduler), spec.family, loaded.device)
            if encodes_elsewhere(self.stages, self.models):
                editor.set_encoder(functools.partial(self._encode_in_worker, spec))
            attach(editor, RowLoader.for_editor(editor, LoadMode.OVERLAPPED))
            cost_model = load_or_profile(editor, loaded.fingerprint, options.data_dir, spec.width)
        with self.startup.timed("graphs", key):
            replays = self._plan_and_graph(spec, editor, cost_model)
        self._start_step_fit(spec, loaded.fingerprint, loaded.device)
        self._ship_step_tables(cost_model, replays)
        times = replays.batch_one() if replays is not None else None
        if times is None and "step_table" in cost_model.extra:  # the profile's planned steps
            times = StepTimes.from_plan(cost_model.extra["step_table"][0])
        with self._lock:
            self._step_times[key] = times
        return editor, cost_model

    def _plan_and_graph(
        self, spec: FunctionSpec, editor: MaskAwareEditor, cost_model: CostModel
    ) -> ReplayTimes | None:
        """The editor's planner and graphs (after profiling: it times eager blocks; a
        capture is per active adapter set); with graphs, the replay times warm-up took."""
        # Graphs run bucketed layouts: one capture per bucket and batch size serves every mask.
        max_batch = self.engine.config.max_batch
        buckets = Buckets.for_batches(max_batch)
        cuda_graphs = self.options.cuda_graphs
        if cuda_graphs:
            editor.set_buckets(buckets)
        editor.set_planner(make_planner(cost_model, editor.device, editor.buckets, plan_policy()))
        editor.set_graphs(
            cuda_graphs,
            weights=self.adapters.residency(spec).weights_key,
            limit=(buckets.levels + 1) * len(buckets.batch_sizes),  # +1: stock steps
            budget_bytes=self.options.graph_budget_bytes,
        )
        if not cuda_graphs:
            return None
        # every bucket and batch size captured before it serves
        warm = warm_graphs(editor, (spec.width, spec.height), max_batch, spec.halo)
        log.info("graphs of %s warmed: %s", spec.model, warm)
        # Served steps replay when their rows are on the device or stream from pinned
        # host memory a step ahead (CUDA); on a CPU without a device tier, host rows
        # go through the row loader eagerly, and the profile's plans say what they cost.
        if self.templates.device_tier is None and editor.device.type != "cuda":
            return None
        editor.set_replay_times(warm.times)
        return warm.times

    def _start_step_fit(self, spec: FunctionSpec, fingerprint: str, device: torch.device) -> None:
        """The engine's step fit of the model starts from the steps kept beside its
        profile by the executors before (``runtime/steprecords``)."""
        profile = profile_path(self.options.data_dir, fingerprint, device)
        prior = load_step_records(profile)
        with self._lock:
            self._profiles[spec.source.key] = profile
        prior_of = {**self.engine.counters.prior, spec.source.key: tuple(prior)}
        self.engine.counters.prior = prior_of
        if prior:
            log.info("step fit of %s starts from %d kept steps", spec.model, len(prior))

    def _ship_step_tables(self, cost_model: CostModel, replays: ReplayTimes | None) -> None:
        """The tables the gateway predicts completions from (step times at 17 mask ratios
        per batch size), built here once: the gateway never runs the plan itself. With
        graphs, the layouts' replays timed at warm-up (``step_source``: what ran), else the
        profile's plans (with a device tier, also of batches that load nothing)."""
        max_batch = self.engine.config.max_batch
        if replays is not None:  # a graphed step copies its rows a step ahead: one table
            table = replays.table(max_batch)
            cost_model.extra.update(
                step_table=table, resident_step_table=table, step_source="graph replays"
            )
            return
        grids = cost_model.extra.get("grids")
        policy = plan_policy()
        if not grids or cost_model.extra.get("step_source") == f"profiled plan ({policy.value})":
            return
        cost_model.extra["step_table"] = plan_table(cost_model, grids, max_batch, policy=policy)
        cost_model.extra["step_source"] = f"profiled plan ({policy.value})"
        if self.templates.device_tier is not None:
            cost_model.extra["resident_step_table"] = plan_table(
                cost_model, grids, max_batch, resident=True, policy=policy
            )

    def _encode_in_worker(
        self, spec: FunctionSpec, request: EditRequest, template_latents: torch.Tensor | None
    ) -> Encoded:
        """``editor.encode`` in a pre worker, waited for (a deploy's profiling)."""
        return self.encode_in_worker(spec, request, template_latents).result()

    def encode_in_worker(
        self,
        spec: FunctionSpec,
        request: EditRequest,
        template_latents: torch.Tensor | None = None,
    ) -> Future[Encoded]:
        """``editor.encode`` of ``request`` in a pre worker, with the function's prompt
        LoRAs (only where :func:`encodes_elsewhere`)."""
        assert self.stages is not None
        return self.stages.encode_request(
            (spec.source.key, spec.family, spec.scheduler), request, template_latents, spec.adapters
        )

    def lookup(self, model: str) -> tuple[StepTimes | None, CostModel | None]:
        """The step times and cost model of a loaded copy (the path choice's inputs)."""
        with self._lock:
            return self._step_times.get(model), self._cost_models.get(model)

    def cost_models(self) -> dict[str, dict]:
        """Each loaded copy's cost model as ``/state`` reports it."""
        with self._lock:
            return {
                model: {"min_r2": cm.min_r2(), **cm.to_dict()}
                for model, cm in self._cost_models.items()
            }

    def release_device(self) -> None:
        """Before the executor sleeps (``runtime/executor/sleep``): every editor's graphs
        dropped (their pools hold the weights' device addresses) and the device tier's
        templates forgotten."""
        for editor in self._built():
            if editor.graphs is not None:
                editor.graphs.close()
        if self.templates.device_tier is not None:
            self.templates.device_tier.clear()

    def retake_device(self) -> None:
        """After a wake moved the weights back: graphs captured again for every bucket and
        batch size, as at the executor's start, before it serves."""
        with self._lock:
            graphed = dict(self._graphed)
            editors = {k: f.result() for k, f in self._editors.items() if k in graphed}
        for key, editor in editors.items():
            spec = graphed[key]
            size = (spec.width, spec.height)
            if editor.graphs is not None:  # nothing captured before the move may replay
                editor.graphs.close()
            log.info("graphs of %s warmed again: %s", spec.model,
                     warm_graphs(editor, size, self.engine.config.max_batch, spec.halo))  # fmt: skip

    def _built(self) -> list[MaskAwareEditor]:
        with self._lock:
            return [f.result() for f in self._editors.values() if f.done() and not f.exception()]

    def graph_stats(self) -> dict[str, int]:
        """The built editors' graph and bucket counters, summed (read without their lock:
        plain integers the engine thread increments)."""
        built = self._built()
        stats = dict.fromkeys(GRAPH_COUNTERS, 0)
        stats["graph_budget_bytes"] = self.options.graph_budget_bytes or 0
        for editor in built:
            stats["padded_tokens"] += editor.padded_tokens
            stats["graph_eager_steps"] += editor.ungraphed_steps
            graphs = editor.graphs
            if graphs is not None:
                stats["graph_layouts"] += len(graphs.layouts)
                stats["graph_captures"] += graphs.captures
                stats["graph_request_captures"] += graphs.request_captures
                stats["graph_replays"] += graphs.replays
                stats["graph_eager_steps"] += graphs.eager
                stats["graph_over_budget"] += graphs.over_budget
                stats["graph_bytes"] += graphs.nbytes
        return stats

    def keep_step_records(self) -> None:
        """Add this engine's latest steps of each model to those kept beside its profile,
        so the next executor of the model starts with a step fit (``runtime/steprecords``).
        Added, not replaced: executors sharing a data dir each leave theirs (two closing at
        the same moment may lose one's; the file stays whole)."""
        with self._lock:
            profiles = dict(self._profiles)
        for model, profile in profiles.items():
            own = self.engine.counters.own_pairs(model)
            if own:
                save_step_records(profile, [*load_step_records(profile), *own])
