"""The executor's core: functions, models, templates and the engine, without HTTP.

Threads and locks (documented in docs/architecture.md): the event loop thread (the app)
only does cheap work — it checks an invocation and submits it to the engine; deploys run
on a thread-pool thread; the engine thread runs denoising steps and bakes; pre/post worker
dispatch threads belong to the worker pool. ``ExecutorCore.lock`` guards the function and
editor tables only and is never held across a model load, a profile or any I/O: a slow
build is a per-(model, scheduler) future that others wait on outside the lock.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from retouch.functions.adapters import AdapterSpec
from retouch.functions.errors import BadRequest, Canceled, Conflict, ExecutorFull, NotFound
from retouch.functions.families import check_edit, check_reference
from retouch.functions.imaging import encode_image, mask_ratio
from retouch.functions.spec import FunctionSpec
from retouch.functions.wire.codec import RawArray
from retouch.functions.wire.executor import (
    CacheInfo,
    ChangeKind,
    DeviceMemory,
    EngineStats,
    ExecutorState,
)
from retouch.functions.wire.invoke import (
    CacheRead,
    CacheTier,
    ExecutorInvoke,
    InvokePath,
    InvokeResult,
    RunStats,
    Timings,
)
from retouch.runtime.costmodel import CostModel
from retouch.runtime.engine import Engine, OnStep, Output, Work
from retouch.runtime.executor.adapterhost import AdapterHost
from retouch.runtime.executor.changes import ChangeFeed
from retouch.runtime.executor.options import ADAPTER_BUDGET_BYTES, BUILD_SHARE, room
from retouch.runtime.fingerprint import weights_fingerprint
from retouch.runtime.maskaware.buckets import Buckets
from retouch.runtime.maskaware.editor import EditRequest, Encoded, MaskAwareEditor
from retouch.runtime.maskaware.loader import LoadMode, RowLoader, attach
from retouch.runtime.maskaware.warmup import warm_graphs
from retouch.runtime.models import ModelCache
from retouch.runtime.pathchoice import PathChoice, StepTimes, choose_path
from retouch.runtime.plan import Policy, make_planner
from retouch.runtime.prediction import MaskFootprint, plan_table
from retouch.runtime.profiling import (
    cached_profile,
    load_or_profile,
    profile_in_subprocess,
    profile_path,
)
from retouch.runtime.replaytimes import ReplayTimes
from retouch.runtime.reproducibility import in_effect as deterministic_mode
from retouch.runtime.steprecords import load_step_records, save_step_records
from retouch.runtime.templates import BakeState, Template, TemplateCache
from retouch.runtime.worker_server import POST, PRE
from retouch.runtime.workers import PrePostPool, WorkerDied

log = logging.getLogger(__name__)

STAGE_ATTEMPTS = 3  # a pre/post job whose worker died is re-run on the restarted worker
CANCELED_IDS = 4096  # cancels that arrived before their invocation, remembered (bounded)


def plan_policy() -> Policy:
    """Deterministic mode plans every block sparse: an edit's pixels then follow the
    request alone, not the batch it joined or the timings profiled (``runtime/plan.py``)."""
    return Policy.SPARSE if deterministic_mode() else Policy.BUBBLE_FREE


def _retrying(submit: Callable[[], Future], attempts: int, what: str) -> Future:
    """``submit()``, re-submitted when its worker process died (the pool restarts it);
    any other failure, or the last death, fails the returned future."""
    result: Future = Future()

    def attempt(left: int) -> None:
        try:
            inner = submit()
        except Exception as exc:
            result.set_exception(exc)
            return

        def done(f: Future) -> None:
            exc = f.exception()
            if isinstance(exc, WorkerDied) and left > 1:
                log.warning("%s: %s; retrying on the restarted worker", what, exc)
                attempt(left - 1)
            elif exc is not None:
                result.set_exception(exc)
            else:
                result.set_result(f.result())

        inner.add_done_callback(done)

    attempt(attempts)
    return result


@dataclass
class WorkerStages:
    """Pre/post-processing of the engine's invocations in the pool's worker processes.

    Edits are deterministic, so a job whose worker was killed is simply run again."""

    pool: PrePostPool
    attempts: int = STAGE_ATTEMPTS

    def encode(self, work: Work) -> Future:
        pipeline = (work.model, work.family, work.scheduler)
        return self.encode_request(pipeline, work.request, adapters=work.text_adapters)

    def encode_request(
        self,
        pipeline: tuple[str, str, str],
        request: EditRequest,
        latents: Any = None,
        adapters: tuple[AdapterSpec, ...] = (),
    ) -> Future:
        """``editor.encode`` of any request (an invocation's, a bake's, a profile's) on the
        ``(model, family, scheduler)`` pipeline with ``adapters``' text-encoder part;
        ``latents``: the template's, if cached."""
        return _retrying(
            lambda: self.pool.encode(*pipeline, request, latents, adapters),
            self.attempts,
            "encode",
        )

    def decode(self, work: Work, latents: torch.Tensor) -> Future:
        request = work.request
        return _retrying(
            lambda: self.pool.decode(
                work.model,
                work.family,
                latents,
                request.height,
                request.width,
                work.fmt,
                over=request if work.feather_px is not None else None,
                feather_px=work.feather_px or 0,
            ),
            self.attempts,
            "decode",
        )


class Superseded(Conflict):
    code = "superseded"


def _refuse_if_superseded(name: str, generation: int, latest: int) -> None:
    if generation < latest:
        raise Superseded(
            f"deploy {generation} of {name!r} was superseded by operation {latest}",
            field="generation",
        )


@dataclass
class FunctionEntry:
    """A deployed function as the executor holds it: its spec and decoded templates, and
    what keys its bakes (for the ad-hoc templates of uploaded images)."""

    spec: FunctionSpec
    templates: dict[str, Image.Image]
    fingerprint: str = ""
    scheduler_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExecutorStats:
    queued: int = 0
    completed: int = 0
    failed: int = 0


class ExecutorCore:
    """Functions, models, templates and the engine of one executor; owns their lifecycle."""

    def __init__(
        self,
        name: str,
        models: ModelCache,
        templates: TemplateCache,
        engine: Engine,
        stages: WorkerStages | None = None,
        *,
        maskaware: bool = True,
        data_dir: Path = Path("."),
        profile_in_background: bool = True,
        cuda_graphs: bool = False,
        graph_budget_bytes: int | None = None,
        path_choice: str = "auto",
        adapter_bytes: int = ADAPTER_BUDGET_BYTES,
        adapter_build_share: float = BUILD_SHARE,
    ) -> None:
        self.name = name
        self.cuda_graphs = cuda_graphs  # steps of device-resident batches from CUDA graphs
        self.graph_budget_bytes = graph_budget_bytes  # per editor (None: no limit)
        self.path_choice = path_choice  # "auto" or "maskaware" (--path-choice)
        # per loaded copy: the step times the path choice compares (runtime/pathchoice)
        self.step_times: dict[str, StepTimes | None] = {}
        self.models = models
        self.templates = templates
        self.changes = ChangeFeed()  # what the gateway's cluster view follows
        templates.on_change = self.changes.publish
        self.engine = engine
        self.stages = stages  # None: pre/post on the engine thread
        self.maskaware = maskaware  # False: every token computed, no cache (comparisons)
        self.data_dir = data_dir  # where device profiles are cached (profiles/)
        self.profile_in_background = profile_in_background  # in a nice'd child process
        self.stats = ExecutorStats()
        self.lock = threading.Lock()  # guards the three tables below; never held across work
        self.functions: dict[str, FunctionEntry] = {}
        self.cost_models: dict[str, CostModel] = {}  # per loaded copy (source key), here
        self._profiles: dict[str, Path] = {}  # per loaded model (source key): step records
        self._editors: dict[tuple[str, str], Future[MaskAwareEditor]] = {}
        self.adapters = AdapterHost(
            models,
            adapter_bytes,
            adapter_build_share,
            on_change=lambda: self.changes.publish(ChangeKind.ADAPTERS),
            encodes_here=lambda: not self._encodes_elsewhere(),
        )
        self._generations: dict[str, int] = {}  # latest control operation per function name
        self._closed = False
        # Invocations by the gateway's id (for cancel), and ids canceled before they came.
        self._invocations: dict[str, Work] = {}
        self._canceled: OrderedDict[str, None] = OrderedDict()

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self.engine.start()

    def close(self) -> None:
        """Stop the engine (failing what it had not finished), the workers and the store."""
        if self._closed:
            return
        self._closed = True
        self.engine.stop()
        self.adapters.close()
        self._keep_step_records()
        if self.stages is not None:
            self.stages.pool.close()
        self.templates.store.close()

    def _keep_step_records(self) -> None:
        """Add this engine's latest steps of each model to those kept beside its profile,
        so the next executor of the model starts with a step fit (``runtime/steprecords``).
        Added, not replaced: executors sharing a data dir each leave theirs (two closing at
        the same moment may lose one's; the file stays whole)."""
        with self.lock:
            profiles = dict(self._profiles)
        for model, profile in profiles.items():
            own = self.engine.counters.own_pairs(model)
            if own:
                save_step_records(profile, [*load_step_records(profile), *own])

    @property
    def healthy(self) -> bool:
        return self.engine.alive

    # ---- deploys (a deploy thread) ----------------------------------------------------
    def deploy(self, spec: FunctionSpec, images: dict[str, Image.Image], generation: int) -> None:
        """Load the function's model (shared with other functions), register its templates
        and queue the bake of every template the store does not hold yet.

        ``generation`` orders the control operations on one name (the gateway numbers
        them): a deploy overtaken by a later deploy or delete of the same name is dropped
        (:class:`Superseded`) instead of resurrecting an older version."""
        self._check_generation(spec.name, generation)
        loaded = self.models.get(spec.source.key, spec.family)
        self.adapters.deploy(spec, loaded)
        if self.stages is not None:  # load it in the workers now, not on the first request
            for future in self.stages.pool.load(spec.source.key, spec.family, spec.adapters):
                future.result()
        editor = self.editor(spec)
        for other in spec.schedulers:  # the ones requests may choose: built now, not on one
            self.editor(spec, other)
        sched_config = dict(editor.impl.pipe.scheduler.config)
        fingerprint = weights_fingerprint(loaded.fingerprint, spec.adapters)
        # Lock order: core.lock, then the template cache's lock. Registration only looks
        # keys up in the store's tables; the held section does no model work and no scan.
        with self.lock:
            latest = self._generations.get(spec.name, 0)
            if generation >= latest:
                self._generations[spec.name] = generation
                registered = self.templates.register(spec, images, fingerprint, sched_config)
                self.functions[spec.name] = FunctionEntry(spec, images, fingerprint, sched_config)
        self.templates.drop_unused(self.templates.take_dropped())  # an earlier deploy's uploads
        _refuse_if_superseded(spec.name, generation, latest)
        if self.maskaware:
            for template in registered:
                self._queue_bake(template)

    def deploy_async(
        self, spec: FunctionSpec, images: dict[str, Image.Image], generation: int
    ) -> Future[None]:
        """:meth:`deploy` on its own thread (a deploy waits on loads and on the profiling
        child; it never holds a lock others need meanwhile)."""
        done: Future[None] = Future()

        def run() -> None:
            try:
                self.deploy(spec, images, generation)
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)

        threading.Thread(target=run, name=f"deploy-{spec.name}", daemon=True).start()
        return done

    def remove(self, name: str, generation: int) -> bool:
        """Forget a function (unless a later deploy of the name already replaced it)."""
        with self.lock:
            if self._generations.get(name, 0) > generation:
                return False
            self._generations[name] = generation
            removed = self.functions.pop(name, None) is not None
            gone = self.templates.detach(name)
        self.templates.drop_unused(gone)
        return removed

    def _check_generation(self, name: str, generation: int) -> None:
        """Fail early (before loading anything) when a later operation already ran."""
        with self.lock:
            latest = self._generations.get(name, 0)
        _refuse_if_superseded(name, generation, latest)

    def editor(self, spec: FunctionSpec, scheduler: str = "") -> MaskAwareEditor:
        """One editor per (model, scheduler) (``scheduler``: one the spec allows, "" its
        own); editors of a model share its modules.

        A new editor gets an overlapped row loader and the bubble-free planner of the
        model's cost model on this device (profiled once, then read from the profile
        cache). The build runs outside the lock; concurrent callers wait on its future."""
        scheduler = scheduler or spec.scheduler
        key = (spec.source.key, scheduler)
        with self.lock:
            future = self._editors.get(key)
            owner = future is None
            if owner:
                future = self._editors[key] = Future()
        if not owner:
            return future.result()
        try:
            editor, cost_model = self._build_editor(spec, scheduler)
        except BaseException as exc:
            with self.lock:
                self._editors.pop(key, None)
            future.set_exception(exc)
            raise
        with self.lock:
            self.cost_models[spec.source.key] = cost_model  # per loaded copy
        future.set_result(editor)
        return editor

    def _build_editor(
        self, spec: FunctionSpec, scheduler: str
    ) -> tuple[MaskAwareEditor, CostModel]:
        loaded = self.models.get(spec.source.key, spec.family)
        if self.profile_in_background and not cached_profile(
            loaded.fingerprint, self.data_dir, loaded.device, spec.family, spec.width
        ):
            profile_in_subprocess(
                spec.source.key,
                spec.family,
                scheduler,
                spec.width,
                self.data_dir,
                loaded.device,
                torch.get_num_threads(),
            )  # on failure, load_or_profile below profiles in-process
        editor = MaskAwareEditor(loaded.pipeline_for(scheduler), spec.family, loaded.device)
        if self._encodes_elsewhere():
            editor.set_encoder(functools.partial(self._encode_in_worker, spec))
        attach(editor, RowLoader.for_editor(editor, LoadMode.OVERLAPPED))
        cost_model = load_or_profile(editor, loaded.fingerprint, self.data_dir, spec.width)
        # after profiling (it times eager blocks); a capture is per active adapter set.
        # Graphs run bucketed layouts: one capture per bucket and batch size serves every mask.
        buckets = Buckets.for_batches(self.engine.config.max_batch)
        if self.cuda_graphs:
            editor.set_buckets(buckets)
        editor.set_planner(make_planner(cost_model, editor.device, editor.buckets, plan_policy()))
        editor.set_graphs(
            self.cuda_graphs,
            weights=self.adapters.residency(spec).weights_key,
            limit=(buckets.levels + 1) * len(buckets.batch_sizes),  # +1: stock steps
            budget_bytes=self.graph_budget_bytes,
        )
        replays = None
        if self.cuda_graphs:  # every bucket and batch size captured before it serves
            size = (spec.width, spec.height)
            warm = warm_graphs(editor, size, self.engine.config.max_batch, spec.halo)
            log.info("graphs of %s warmed: %s", spec.model, warm)
            # Served steps replay when their rows are on the device or stream from pinned
            # host memory a step ahead (CUDA); on a CPU without a device tier, host rows
            # go through the row loader eagerly, and the profile's plans say what they cost.
            if self.templates.device_tier is not None or editor.device.type == "cuda":
                replays = warm.times
                editor.set_replay_times(replays)
        profile = profile_path(self.data_dir, loaded.fingerprint, loaded.device)
        prior = load_step_records(profile)
        with self.lock:
            self._profiles[spec.source.key] = profile
        prior_of = {**self.engine.counters.prior, spec.source.key: tuple(prior)}
        self.engine.counters.prior = prior_of
        if prior:
            log.info("step fit of %s starts from %d kept steps", spec.model, len(prior))
        self._ship_step_tables(cost_model, replays)
        times = replays.batch_one() if replays is not None else None
        if times is None and "step_table" in cost_model.extra:  # the profile's planned steps
            times = StepTimes.from_plan(cost_model.extra["step_table"][0])
        with self.lock:
            self.step_times[spec.source.key] = times
        return editor, cost_model

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

    def _encodes_elsewhere(self) -> bool:
        """Whether this executor's pipelines lack their text encoders: its pre workers
        hold them, and encode for bakes and profiling too."""
        return self.stages is not None and "text_encoders" in self.models.without

    def _encode_in_worker(
        self, spec: FunctionSpec, request: EditRequest, template_latents: torch.Tensor | None
    ) -> Encoded:
        """``editor.encode`` in a pre worker, waited for (a deploy's profiling)."""
        return self._encode_future(spec, request, template_latents).result()

    def _encode_future(
        self,
        spec: FunctionSpec,
        request: EditRequest,
        template_latents: torch.Tensor | None = None,
    ) -> Future[Encoded]:
        assert self.stages is not None
        return self.stages.encode_request(
            (spec.source.key, spec.family, spec.scheduler), request, template_latents, spec.adapters
        )

    def entry(self, name: str) -> FunctionEntry:
        with self.lock:
            entry = self.functions.get(name)
        if entry is None:
            raise NotFound(
                f"function {name!r} is not loaded on {self.name}",
                field="function",
                code="function_not_found",
            )
        return entry

    # ---- invocations (the event loop: cheap checks, then the engine) --------------------
    async def invoke(self, inv: ExecutorInvoke, on_step: OnStep | None = None) -> InvokeResult:
        return await self.begin(inv, on_step)

    def cancel(self, invocation_id: str) -> bool:
        """Cancel the invocation the gateway numbered ``invocation_id``. One that has not
        arrived yet is refused when it does (the gateway may bind and cancel in the same
        moment). False when it is unknown or already finished."""
        with self.lock:
            work = self._invocations.get(invocation_id)
            if work is None:
                self._canceled[invocation_id] = None
                while len(self._canceled) > CANCELED_IDS:
                    self._canceled.popitem(last=False)
                return False
        return self.engine.cancel(work)

    def begin(self, inv: ExecutorInvoke, on_step: OnStep | None = None) -> Awaitable[InvokeResult]:
        """Check and submit an invocation (raises at once on bad input, a dead engine or a
        cancel that came first); the returned awaitable is its result. ``on_step`` hears
        each denoising step on the engine thread. Beyond the executor's room (several
        gateways may send here) it refuses with 429 ``executor_full``."""
        self._check_room()
        if inv.id:
            with self.lock:
                if inv.id in self._canceled:
                    del self._canceled[inv.id]
                    raise Canceled(f"invocation {inv.id} was canceled", field="id")
        entry = self.entry(inv.function)
        if inv.image is not None:
            template = self._upload(entry, inv)
        else:
            template = self.templates.get(inv.function, inv.template)
        if template is None:
            raise NotFound(
                f"unknown template {inv.template!r}", field="template", code="template_not_found"
            )
        mask = inv.mask.to_numpy().astype(bool)
        if mask.shape != (template.image.height, template.image.width):
            raise BadRequest(
                "mask does not match the template size", field="mask", code="mask_size_mismatch"
            )
        spec = entry.spec
        check_edit(spec.family, inv.steps, inv.strength, inv.negative_prompt)
        scheduler = spec.request_scheduler(inv.scheduler or None)
        arrived = time.perf_counter()
        if not mask.any():  # nothing to edit: the template, without running the model
            return asyncio.to_thread(self._template_result, template, inv, arrived)
        covered = self.maskaware and template.covers(inv.steps, inv.guidance)
        found = CacheTier.NONE
        editor = self.editor(spec, scheduler)  # built at deploy, before it was registered
        choice = self._path_choice(spec, template, inv, mask)
        covered = covered and choice.path is InvokePath.MASKAWARE
        if covered:  # at strength < 1 or another scheduler its variant: that trajectory's bake
            config = dict(editor.impl.pipe.scheduler.config)
            template = self.templates.variant(
                spec, template, inv.strength, scheduler, entry.fingerprint, config
            )
            found = self.templates.tier(template)  # where placement found it
            self.templates.prefetch(template)  # disk -> host while the invocation queues
        request = EditRequest(
            template.image,
            mask,
            inv.prompt,
            inv.seed,
            inv.steps,
            inv.guidance,
            template.prompt,
            template.seed,
            spec.full_steps,
            spec.halo,
            inv.negative_prompt,
            inv.strength,
            self._reference(spec, inv, template.image.size),
        )
        encode_inline = self.adapters.inline_encoder(spec, editor)
        # pinned from here: nothing that can fail comes between this and the submit's try
        adapters = self.adapters.residency(spec).use(spec.adapter_set)  # read now if not in memory
        # Bucketed steps pad every row to the batch's largest mask: a stock edit (every
        # token) would pad its batch-mates to full, so with buckets the paths batch apart.
        apart = (covered,) if editor.buckets is not None else ()
        # Adapter sets batch together in mixed steps; a CUDA graph holds one set's weights
        # (and pads batches by repeating a row), so with graphs sets batch apart.
        if not self.engine.config.mixed_adapters or editor.buckets is not None:
            apart = (spec.adapter_set, *apart)
        work = Work(
            key=(spec.source.key, scheduler, spec.width, spec.height, *apart),
            model=spec.source.key,
            family=spec.family,
            scheduler=scheduler,
            editor=editor,
            request=request,
            fmt=inv.format,
            acquire=lambda: self._acquire(template, covered, found),
            arrived=arrived,
            on_step=on_step,
            feather_px=spec.feather_px if spec.composite else None,
            adapters=adapters,
            text_adapters=spec.adapters,
            encode_inline=encode_inline,
        )
        try:
            future = self.engine.submit(work)  # raises EngineUnavailable when dead or stopping
        except BaseException:
            adapters.release()
            raise
        future.add_done_callback(lambda _: adapters.release())
        if inv.id:
            with self.lock:
                self._invocations[inv.id] = work
        self.stats.queued += 1
        return self._finish(inv, work, future, mask, choice)

    def _path_choice(
        self, spec: FunctionSpec, template: Template, inv: ExecutorInvoke, mask: Any
    ) -> PathChoice:
        """Mask-aware or stock for this edit, and why (``path_reason`` in the answer)."""
        if not self.maskaware:
            return PathChoice(InvokePath.STOCK, "mask-aware steps are off on this executor")
        if inv.image_reference is not None:
            return PathChoice(
                InvokePath.STOCK,
                "another reference image than the template: every token computed (the "
                "bake's reference tokens are the template's)",
            )
        if not template.covers(inv.steps, inv.guidance):
            return PathChoice(
                InvokePath.STOCK,
                f"the template is baked for {template.steps} steps at guidance "
                f"{template.guidance:g}, not {inv.steps} at {inv.guidance:g}: every token computed",
            )
        if self.path_choice == "maskaware":
            return PathChoice(InvokePath.MASKAWARE, "mask-aware: --path-choice maskaware")
        with self.lock:
            times = self.step_times.get(spec.source.key)
            cost_model = self.cost_models.get(spec.source.key)
        grids = cost_model.extra.get("grids") if cost_model is not None else None
        if not grids:
            return choose_path(times, mask_ratio(mask))
        footprint = MaskFootprint.of(np.asarray(mask, dtype=bool), spec.halo)
        px = round(math.sqrt(mask.size / grids[0]))  # the finest grid's token, in pixels
        return choose_path(times, footprint.masked.get(px, mask.sum() / px**2) / grids[0])

    def _check_room(self) -> None:
        """Refuse an invocation beyond :func:`room`: each gateway keeps within it for its
        own invocations, and this keeps several gateways together within it."""
        limit = room(self.engine.config.max_batch)
        if self.stats.queued >= limit:
            raise ExecutorFull(
                f"executor {self.name} holds {self.stats.queued} invocations, its room",
                detail={"queued": self.stats.queued, "room": limit},
            )

    @staticmethod
    def _reference(
        spec: FunctionSpec, inv: ExecutorInvoke, size: tuple[int, int]
    ) -> Image.Image | None:
        """The edit's own reference image (the gateway decoded it at the edited image's
        ``size``), for the families that read one; None: the template is the reference."""
        if inv.image_reference is None:
            return None
        check_reference(spec.family)
        return _rgb8(inv.image_reference, size, "image_reference")

    def _upload(self, entry: FunctionEntry, inv: ExecutorInvoke) -> Template:
        """The ad-hoc template of an uploaded image (the gateway decoded and checked it)."""
        spec = entry.spec
        assert inv.image is not None
        image = _rgb8(inv.image, (spec.width, spec.height), "image")
        if spec.uploads.max_images == 0:
            raise BadRequest(
                f"function {spec.name!r} does not accept uploaded images",
                field="image",
                code="uploads_disabled",
            )
        return self.templates.upload(
            spec, inv.template, image, entry.fingerprint, entry.scheduler_config
        )

    async def _finish(
        self, inv: ExecutorInvoke, work: Work, future: Future, mask: Any, choice: PathChoice
    ) -> InvokeResult:
        try:
            report = await asyncio.wrap_future(future)
            self.stats.completed += 1
        except Exception:
            self.stats.failed += 1
            raise
        finally:
            self.stats.queued -= 1
            if inv.id:
                with self.lock:
                    self._invocations.pop(inv.id, None)
        output: Output = report["output"]
        path = InvokePath(report["path"])
        reason = choice.reason
        if path is not choice.path:  # chosen, but its activations were not there at join
            reason = (
                "the template's activations were not readable when it joined (not baked "
                "yet, or being baked again): every token computed"
            )
        return InvokeResult(
            image=output.image,
            format=inv.format,
            width=output.width,
            height=output.height,
            mask_ratio=mask_ratio(mask),
            executor=self.name,
            path=path,
            path_reason=reason,
            timings=Timings(**report["timings"]),
            cache=CacheRead.from_wire(report["cache"]),
            engine=RunStats.from_wire(report["engine"]),
            template=inv.template,
        )

    def _template_result(
        self, template: Template, inv: ExecutorInvoke, arrived: float
    ) -> InvokeResult:
        encoded = encode_image(template.image, inv.format)
        return InvokeResult(
            image=encoded,
            format=inv.format,
            width=template.image.width,
            height=template.image.height,
            mask_ratio=0.0,
            executor=self.name,
            path=InvokePath.TEMPLATE,
            timings=Timings(run_ms=(time.perf_counter() - arrived) * 1e3),
            template=inv.template,
        )

    # ---- the engine thread ----------------------------------------------------------------
    def _acquire(
        self, template: Template, covered: bool, found: CacheTier
    ) -> tuple[Any, dict[str, Any]]:
        """At join (engine thread): the template's host-resident activations when it is
        baked for these settings; otherwise no reader (every token computed, i.e. the stock
        result) and the template is queued for baking (insert on miss). ``found``: its tier
        when the invocation arrived, reported beside the tier the read found."""
        if covered and template.state is BakeState.BAKED:
            got = self.templates.acquire(template)
            if got.handle is not None:
                return got.handle, {"tier": got.tier, "wait_ms": got.wait_ms, "found": found.value}
        if covered:
            self._queue_bake(template)
        return None, {"tier": CacheTier.NONE.value, "wait_ms": 0.0, "found": found.value}

    def _queue_bake(self, template: Template) -> None:
        if not self.templates.claim_bake(template):
            return
        with self.lock:
            spec = self.functions[template.function].spec
        editor = self.editor(spec, template.scheduler)
        bake = (template.image, template.prompt, template.seed, template.steps, template.guidance)
        strength = template.strength
        adapters = self.adapters.residency(spec).use(spec.adapter_set)  # the weights it records

        def record(writer, encoded: Encoded | None = None) -> None:
            adapters.activate()
            editor.bake(*bake, writer, encoded=encoded, cancelled=unwanted, strength=strength)

        def unwanted() -> bool:  # a stopping executor, a deleted or redeployed function
            return self.engine.stopping or self.templates.unwanted(template)

        def queue(recorder: Callable[..., None]) -> None:
            """Onto the engine thread once the adapter files are read (it never waits)."""

            def job() -> None:
                try:
                    self.templates.bake(template, recorder)
                finally:
                    adapters.release()

            adapters.read.add_done_callback(lambda _: self.engine.submit_background(job))

        if not self._encodes_elsewhere():  # encoded here, with the function's prompt LoRAs
            request = MaskAwareEditor.bake_request(*bake, strength=strength)

            def record_here(writer) -> None:
                with self.adapters.text(spec).encoding(spec.adapters):
                    encoded = editor.encode(request)
                record(writer, encoded)

            queue(record_here)
            return
        # encoded by a pre worker first: the engine thread, which runs the bake, never
        # waits for it (a failed encode fails the bake, as a failed bake does)
        encoding = self._encode_future(spec, MaskAwareEditor.bake_request(*bake, strength=strength))

        def encoded_record(writer) -> None:
            record(writer, encoding.result())

        encoding.add_done_callback(lambda _: queue(encoded_record))

    # ---- state (cheap: counters and tables, no disk scan, no waiting on a load) ---------
    def state(self) -> ExecutorState:
        with self.lock:
            functions = tuple(sorted(self.functions))
            generations = {name: self._generations.get(name, 0) for name in functions}
            cost_models = {
                model: {"min_r2": cm.min_r2(), **cm.to_dict()}
                for model, cm in self.cost_models.items()
            }
        cache = self.templates.store.live_stats()
        if self.templates.device_tier is not None:
            cache = {**cache, **self.templates.device_tier.usage()}
        resident, adapter_figures = self.adapters.report()
        return ExecutorState(
            name=self.name,
            pid=os.getpid(),
            device=str(self.models.device),
            maskaware=self.maskaware,
            deterministic=deterministic_mode(),
            mixed_adapters=self.engine.config.mixed_adapters,
            models=tuple(self.models.loaded()),
            loading=tuple(self.models.loading()),
            functions=functions,
            generations=generations,
            queued=self.stats.queued,
            completed=self.stats.completed,
            failed=self.stats.failed,
            engine=self._engine_stats(),
            templates=self.templates.states(),
            cost_models=cost_models,
            cache=CacheInfo.from_wire(cache),
            workers={}
            if self.stages is None
            else {n: p for n, p in self.stages.pool.pids().items() if p is not None},
            gpu_memory=device_memory(self.models.device),
            adapters=resident,
            adapter_stats=adapter_figures,
        )

    def _engine_stats(self) -> EngineStats:
        summary = self.engine.counters.summary()
        plan = summary.pop("last_plan", None) or {}
        config = self.engine.config
        pool = None if self.stages is None else self.stages.pool
        return EngineStats(
            mode=config.mode.value,
            max_batch=config.max_batch,
            disaggregated=config.disaggregated,
            alive=self.engine.alive,
            error=self.engine.error,
            **self.engine.load(),
            **summary,
            plan_sparse_blocks=plan.get("sparse"),
            plan_blocks=plan.get("blocks"),
            pre_workers=0 if pool is None else pool.workers(PRE),
            post_workers=0 if pool is None else pool.workers(POST),
            **self._graph_stats(),
        )

    def _graph_stats(self) -> dict[str, int]:
        """The built editors' graph and bucket counters, summed (read without their lock:
        plain integers the engine thread increments)."""
        with self.lock:
            built = [f.result() for f in self._editors.values() if f.done() and not f.exception()]
        names = ("graph_layouts", "graph_captures", "graph_request_captures", "graph_replays")
        stats = dict.fromkeys(
            (*names, "graph_eager_steps", "graph_over_budget", "graph_bytes", "padded_tokens"), 0
        )
        stats["graph_budget_bytes"] = self.graph_budget_bytes or 0
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


def device_memory(device: torch.device) -> DeviceMemory:
    """GPU memory as ``/v1/executors`` reports it (zeros on a CPU)."""
    if device.type != "cuda":
        return DeviceMemory()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(
        total=total,
        free=free,
        allocated=torch.cuda.memory_allocated(device),
        reserved=torch.cuda.memory_reserved(device),
    )


def _rgb8(array: RawArray, size: tuple[int, int], field: str) -> Image.Image:
    """An image the gateway decoded (RGB8 ``[H, W, 3]``) of ``size``, else a 400 naming
    ``field``."""
    pixels = array.to_numpy()
    if pixels.dtype != "uint8" or pixels.shape != (size[1], size[0], 3):
        raise BadRequest(
            f"{field} must be RGB8 of {size[0]}x{size[1]}, got {array.dtype} {list(pixels.shape)}",
            field=field,
            code="image_size_mismatch",
        )
    return Image.fromarray(np.ascontiguousarray(pixels), "RGB")
