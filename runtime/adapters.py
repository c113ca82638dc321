"""LoRA adapters resident in one loaded model copy's denoiser (issue #34).

Functions of one base model share its loaded copy; what differs between them is their
*adapter set* (``FunctionSpec.adapter_set``). :class:`AdapterResidency` keeps the sets
of one copy's functions in its denoiser through peft and diffusers' PEFT integration:

* **read** (a background thread): ``pipe.lora_state_dict`` reads a file and converts it
  to diffusers' layout (kohya files included), and ``adapterlayers.build_layers`` builds
  its peft LoRA layers off the live modules (the costly part of a load: peft creating
  modules). It starts when a function is deployed and when an invocation of a set not
  resident arrives; the invocation waits for it (:class:`AdapterUse`) while batches step.
* **inject** (the engine thread, between steps): the built layers are attached to the
  denoiser (``adapterlayers.attach_some``), a few at a time: the engine gives each load a
  share of the last step's time (:meth:`AdapterUse.load_step`), so the running batch's
  steps never wait for a whole load; the invocation joins once its set is in. The new
  adapter computes nowhere until it is selected. :meth:`AdapterResidency.activate` attaches
  whatever is left in one piece (a bake, an idle engine). A file is injected once even when
  several sets use it (at other scales).
* **activate** (the engine thread, before a group's step): ``set_adapters(names,
  weights)`` selects a set's files at their scales; the bare model (set ``""``) disables
  every LoRA layer (``disable_lora``), which computes exactly the base layers.
* **evict**: injected files stay up to a byte budget; beyond it the least recently used
  set is dropped (``delete_adapters`` of the files no other kept set uses), never one an
  accepted invocation or a bake holds (*pinned*).

The text encoders' part of a LoRA is not applied here: the pre workers encode prompts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from itertools import count
from pathlib import Path
from typing import Any

import torch
from diffusers import DiffusionPipeline

from retouch.functions.adapters import AdapterSpec, adapter_set_id
from retouch.functions.wire.executor import AdapterStats
from retouch.runtime.adapterlayers import LoraLayers, attach_some, build_layers
from retouch.runtime.mixedlora import RowAdapters, row_adapters, stack_bytes
from retouch.runtime.niceness import renice_this_thread

log = logging.getLogger(__name__)

BARE = ""  # the adapter set of the bare base model
PLANS_KEPT = 64  # mixed steps' plans memoised per residency (batches of distinct sets)
READER_NICE = 19  # added to the reader thread's niceness (Linux)


class FileState(StrEnum):
    """Where a read file's denoiser layers are."""

    BUILT = "built"  # built in the background, none in the denoiser
    ATTACHING = "attaching"  # some attached (computing nowhere), between steps
    INJECTED = "injected"  # all in and registered: ``set_adapters`` may select it


class AdapterSetFailed(RuntimeError):
    """A set that could not be put in for a mixed step (``set_id``): its requests fail,
    the batch's other rows, other functions' and tenants', step on without them."""

    def __init__(self, set_id: str, cause: Exception) -> None:
        super().__init__(f"adapter set {set_id}: {cause}")
        self.set_id = set_id
        self.cause = cause


class AdapterReadError(ValueError):
    """A LoRA file that could not be read or built for this denoiser (``path``): a deploy
    turns it into the spec's error naming the entry."""

    def __init__(self, path: str, cause: BaseException) -> None:
        super().__init__(f"{path}: {type(cause).__name__}: {cause}")
        self.path = path


@dataclass
class AdapterFile:
    """One LoRA file's denoiser layers (``layers.name``: its PEFT adapter name, unique per
    read) and their host bytes."""

    path: str
    nbytes: int
    layers: LoraLayers
    state: FileState = FileState.BUILT

    @property
    def name(self) -> str:
        return self.layers.name

    @property
    def injected(self) -> bool:
        return self.state is FileState.INJECTED


@dataclass
class AdapterSet:
    """A set's files and scales (one file named twice: its scales summed), pins and age."""

    id: str
    scales: dict[str, float]  # path -> scale
    pins: int = 0  # accepted invocations and queued bakes that need it
    resident: bool = False  # every file injected and counted as this set's
    last_used: float = 0.0


@dataclass
class AdapterCounters:
    """Cumulative figures of one residency (``AdapterStats`` sums them)."""

    reads: int = 0  # files read, converted and their layers built (background)
    loads: int = 0  # files injected into the denoiser (engine thread, between steps)
    swaps: int = 0  # activations of another set than the previous step's
    mixed_steps: int = 0  # steps whose rows ran their own sets' updates (no swap)
    evictions: int = 0  # sets dropped to keep the budget
    read_ms: float = 0.0  # reading and building, in the background
    inject_ms: float = 0.0  # attaching, on the engine thread (every slice summed)
    swap_ms: float = 0.0


def read_lora(
    pipeline: type[DiffusionPipeline], path: str
) -> tuple[dict[str, torch.Tensor], dict[str, float] | None]:
    """A LoRA file's tensors and network alphas in diffusers' layout, as the pipeline's
    own ``load_lora_weights`` reads and converts them (kohya and other trainers' layouts
    included)."""
    file = Path(path)
    out = pipeline.lora_state_dict(str(file.parent), weight_name=file.name)
    weights, alphas = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
    return weights, alphas if isinstance(alphas, dict) and alphas else None


class AdapterResidency:
    """The adapters of one loaded model copy (see the module's docstring).

    Threads: :meth:`use`, :meth:`register`, :meth:`resident` and :meth:`is_resident` from
    any thread (the lock guards the tables); :meth:`load_step` and :meth:`activate` on the
    engine thread only, which alone changes the denoiser's modules."""

    def __init__(
        self,
        pipe: DiffusionPipeline,
        budget_bytes: int,
        on_change: Callable[[], None] | None = None,
        build_share: float = 1.0,
    ) -> None:
        self.pipeline = type(pipe)
        self.prefix = "unet" if getattr(pipe, "unet", None) is not None else "transformer"
        self.denoiser = getattr(pipe, self.prefix)
        self.budget_bytes = budget_bytes
        # The reader's duty cycle while it builds layers (executors: ``adapter_build_share``).
        self.build_share = build_share
        # Called (engine thread) when a set becomes resident or is evicted: placement
        # follows the resident sets (the executor's change feed).
        self.on_change = on_change or (lambda: None)
        self.counters = AdapterCounters()
        self._lock = threading.Lock()
        self._files: dict[str, AdapterFile] = {}
        self._sets: dict[str, AdapterSet] = {BARE: AdapterSet(BARE, {}, resident=True)}
        self._reads: dict[str, Future[None]] = {}  # per set, while its files are read
        # Reads and builds at the lowest priority: on a CPU they share cores with the steps.
        self._reader = ThreadPoolExecutor(
            1,
            thread_name_prefix="adapter-read",
            initializer=renice_this_thread,
            initargs=(READER_NICE, "adapter reader"),
        )
        self._names = count(1)
        self._last = BARE  # the set the previous step ran with (swaps are counted against it)
        # Mixed steps' slots (runtime/mixedlora): injected files by slot, slot 0 the bare
        # model's zeros; the generation changes with the assignment (layers restack then).
        self._slot_names: list[str | None] = [None]
        self._generation = 0
        self._stacked = 0  # bytes of the layers' stacks for the slots (in the budget)
        self._plans: dict[tuple, RowAdapters] = {}  # mixed steps' plans, by batch
        self._applied = True  # whether the denoiser's active LoRA layers are ``_last``'s

    # ---- any thread -----------------------------------------------------------------------
    def register(self, adapters: tuple[AdapterSpec, ...]) -> str:
        """Know a function's set and start reading its files (a deploy); its id."""
        set_id = adapter_set_id(adapters)
        with self._lock:
            if set_id not in self._sets:
                scales: dict[str, float] = {}
                for a in adapters:
                    scales[a.path] = scales.get(a.path, 0.0) + a.scale
                self._sets[set_id] = AdapterSet(set_id, scales)
            self._start_read(self._sets[set_id])
        return set_id

    def use(self, set_id: str) -> AdapterUse:
        """Pin a registered set for one invocation or bake (never evicted while pinned) and
        start reading what of it is not in memory; ``AdapterUse.read`` says when it is."""
        with self._lock:
            entry = self._sets[set_id]
            entry.pins += 1
            read = self._start_read(entry)
        return AdapterUse(self, set_id, read)

    def resident(self) -> list[tuple[float, str]]:
        """(last used, id) of the sets whose weights are in the denoiser (not the bare)."""
        with self._lock:
            return [(s.last_used, s.id) for s in self._sets.values() if s.resident and s.id]

    def weights_key(self) -> Hashable:
        """What the denoiser computes with now: the active set and the injections it uses
        (a re-injected file gets a new name). A CUDA graph captured under one key replays
        only under it: the graph holds the LoRA tensors' addresses and scales."""
        with self._lock:
            entry = self._sets[self._last]
            files = (self._files.get(p) for p in entry.scales)
            return self._last, tuple(sorted(f.name for f in files if f is not None and f.injected))

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)

    def unpin(self, set_id: str) -> None:
        """An :class:`AdapterUse` ended (see :meth:`use`)."""
        with self._lock:
            self._sets[set_id].pins -= 1

    def _start_read(self, entry: AdapterSet) -> Future[None]:
        """(lock held) The future of the set's files being in memory, starting their read
        when some are neither read nor injected."""
        missing = [p for p in entry.scales if p not in self._files]
        if not missing:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        running = self._reads.get(entry.id)
        if running is None or running.done():
            running = self._reads[entry.id] = self._reader.submit(self._read, entry.id, missing)
        return running

    def _read(self, set_id: str, paths: list[str], paced: bool = True) -> None:
        """(reader thread) Read the files one after another and build their layers (one
        reader: no file twice)."""
        for path in paths:
            with self._lock:
                if path in self._files:
                    continue
                name = f"lora{next(self._names)}"
            started = time.perf_counter()
            try:
                weights, alphas = read_lora(self.pipeline, path)
                nbytes = sum(t.numel() * t.element_size() for t in weights.values())
                layers = build_layers(
                    self.denoiser, self.prefix, weights, alphas, name, self._pace if paced else None
                )
            except Exception as exc:
                raise AdapterReadError(path, exc) from exc
            took = (time.perf_counter() - started) * 1e3
            with self._lock:
                self._files.setdefault(path, AdapterFile(path, nbytes, layers))
                self.counters.reads += 1
                self.counters.read_ms += took
            log.info("read LoRA %s (%d bytes) in %.1f ms for %s", path, nbytes, took, set_id)
        if paced:  # the reader thread: built layers count in the budget as soon as they exist
            self._evict(keep=set_id, engine_thread=False)

    def _pace(self, worked_s: float) -> None:
        """(reader thread) Sleep so that building takes ``build_share`` of the time."""
        time.sleep(worked_s * (1.0 / self.build_share - 1.0))

    def is_resident(self, set_id: str) -> bool:
        """Whether every file of the set is in the denoiser (it can step now)."""
        with self._lock:
            return self._sets[set_id].resident

    # ---- the engine thread ----------------------------------------------------------------
    def load_step(self, set_id: str, budget_s: float) -> bool:
        """Attach the set's read layers for about ``budget_s`` (at least one layer), between
        two steps of other batches; True once the set is resident. Its files must be read
        (``AdapterUse.read`` done)."""
        with self._lock:
            entry = self._sets[set_id]
        if not entry.resident:
            self._inject(entry, deadline=time.perf_counter() + budget_s)
        return entry.resident

    def activate(self, set_id: str) -> None:
        """Make the denoiser compute with ``set_id``: inject what of it is not resident (in
        one piece), evict beyond the budget, and select its adapters at their scales."""
        with self._lock:
            entry = self._sets[set_id]
            entry.last_used = time.perf_counter()
        if not entry.resident:
            self._inject(entry, deadline=None)
        if set_id == self._last and self._applied:
            return
        started = time.perf_counter()
        with self._lock:
            files = [self._files[p] for p in entry.scales]
        selected = [
            (f.name, s)
            for f, s in zip(files, entry.scales.values(), strict=True)
            if f.layers.config
        ]
        if selected:
            self.denoiser.enable_lora()
            self.denoiser.set_adapters([n for n, _ in selected], [s for _, s in selected])
        elif self.denoiser._hf_peft_config_loaded:  # the bare model (or no denoiser part)
            self.denoiser.disable_lora()
        if set_id != self._last:
            self.counters.swaps += 1
            self.counters.swap_ms += (time.perf_counter() - started) * 1e3
        self._last, self._applied = set_id, True

    def rows(self, set_ids: Sequence[str], rows_per_request: int, device: object) -> RowAdapters:
        """A mixed step's plan (``runtime/mixedlora``): request ``i`` runs ``set_ids[i]``,
        each set injected first where it is not (in one piece). The step itself leaves
        peft's adapters off, so the next single-set step selects its set again (a swap
        is counted against the set the previous single-set step ran)."""
        sets = []
        for set_id in set_ids:
            with self._lock:
                entry = self._sets[set_id]
                entry.last_used = time.perf_counter()
            if not entry.resident:
                try:
                    self._inject(entry, deadline=None)
                except Exception as exc:
                    raise AdapterSetFailed(set_id, exc) from exc
            with self._lock:
                files = [(self._files[p], s) for p, s in entry.scales.items()]
            sets.append({f.name: s for f, s in files if f.layers.config})
        generation = self._generation
        for name in {name for adapters in sets for name in adapters}:
            self._slot(name)
        if self._generation != generation:  # the stacks grow: they count in the budget
            self._restacked()
            evictions = self.counters.evictions
            self._evict(keep=BARE)  # this batch's sets are pinned: never the victims
            if self.counters.evictions != evictions:
                self.on_change()
        self._applied = False
        self.counters.mixed_steps += 1
        # A batch keeps its members for many steps: its plan (device index tensors) is
        # built once per membership and slot assignment, not every step.
        key = (tuple(set_ids), rows_per_request, str(device), self._generation)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= PLANS_KEPT:
                self._plans.clear()
            names = tuple(self._slot_names)
            slots = {name: i for i, name in enumerate(names) if name is not None}
            plan = row_adapters(sets, rows_per_request, slots, names, self._generation, device)
            self._plans[key] = plan
        return plan

    def _slot(self, name: str) -> None:
        """(engine thread) Give an injected file a slot in the layers' stacks (a free one,
        else a new one): the stacks are rebuilt once for the new assignment."""
        if name in self._slot_names:
            return
        free = [i for i, held in enumerate(self._slot_names) if i and held is None]
        if free:
            self._slot_names[free[0]] = name
        else:
            self._slot_names.append(name)
        self._generation += 1

    def _unslot(self, names: list[str]) -> None:
        """(engine thread) Free the slots of unloaded files; free slots at the end go, so
        the stacks shrink when the last slots empty."""
        for i, held in enumerate(self._slot_names):
            if held in names:
                self._slot_names[i] = None
                self._generation += 1
        while len(self._slot_names) > 1 and self._slot_names[-1] is None:
            self._slot_names.pop()
        self._restacked()

    def _restacked(self) -> None:
        """(engine thread) Recount the stacks' bytes for the current slots."""
        stacked = stack_bytes(self.denoiser, self._slot_names) if len(self._slot_names) > 1 else 0
        with self._lock:
            self._stacked = stacked

    def _inject(self, entry: AdapterSet, deadline: float | None) -> None:
        """Attach the set's files' layers until ``deadline`` (None: all); once every file
        is in, the set is resident and the budget is enforced."""
        for path in entry.scales:
            file = self._file(entry, path)
            if file.injected:
                continue
            started = time.perf_counter()
            done = attach_some(self.denoiser, file.layers, deadline)
            took = (time.perf_counter() - started) * 1e3
            with self._lock:
                file.state = FileState.INJECTED if done else FileState.ATTACHING
                self.counters.inject_ms += took
                self.counters.loads += done
            if not done:
                return
            log.info("injected LoRA %s as %s", path, file.name)
        with self._lock:
            entry.resident = True
        self._evict(keep=entry.id)
        self.on_change()

    def _file(self, entry: AdapterSet, path: str) -> AdapterFile:
        with self._lock:
            file = self._files.get(path)
        if file is None:  # evicted after its read (an unpinned prefetch): read it now
            log.warning("LoRA %s read on the engine thread (it was evicted)", path)
            self._read(entry.id, [path], paced=False)  # the engine thread never sleeps
            with self._lock:
                file = self._files[path]
        return file

    def _evict(self, keep: str, engine_thread: bool = True) -> None:
        """Drop least recently used unpinned sets while the bytes of the files holding
        layers — built (they sit on the device, beside the base layers they wrap) or in the
        denoiser — exceed the budget. A file stays while a kept or pinned set uses it, so a
        set whose files all stay frees nothing and is kept. Off the engine thread only
        files not in the denoiser are dropped (unloading changes live modules); a set
        whose layers are being attached is never a victim."""
        while True:
            with self._lock:
                used = sum(f.nbytes for f in self._files.values()) + self._stacked
                if used <= self.budget_bytes:
                    return
                freeing = {
                    s.id: self._freed_by(s)
                    for s in self._sets.values()
                    if s.id not in (BARE, keep) and s.pins == 0
                }
                victims = [
                    self._sets[i]
                    for i, paths in freeing.items()
                    if paths and self._evictable(paths, engine_thread)
                ]
                if not victims:
                    return
                victim = min(victims, key=lambda s: s.last_used)
                was_resident, victim.resident = victim.resident, False
                gone = [self._files.pop(p) for p in freeing[victim.id]]
                self.counters.evictions += 1
            unloaded = [f.name for f in gone if f.injected]
            if unloaded:
                self.denoiser.delete_adapters(unloaded)
                self._unslot(unloaded)
            if victim.id == self._last:
                self._applied = False
            log.info("evicted adapter set %s (%d files dropped)", victim.id, len(gone))
            if was_resident:
                self.on_change()

    def _evictable(self, paths: list[str], engine_thread: bool) -> bool:
        """(lock held) Whether these read files may be dropped from this thread."""
        states = {self._files[p].state for p in paths if p in self._files}
        if FileState.ATTACHING in states or len(states) == 0:
            return False
        return engine_thread or states == {FileState.BUILT}

    def _freed_by(self, victim: AdapterSet) -> list[str]:
        """(lock held) The files evicting ``victim`` unloads: those no other resident or
        pinned set uses."""
        needed = {
            p
            for s in self._sets.values()
            if s.id != victim.id and (s.resident or s.pins)
            for p in s.scales
        }
        return [p for p in victim.scales if p not in needed and p in self._files]


@dataclass
class AdapterUse:
    """One invocation's (or bake's) hold on its adapter set: ``read`` completes when the
    set's files are read and built; on the engine thread, :meth:`load_step` between other
    batches' steps until :attr:`resident`, then :meth:`activate` before each of its steps;
    :meth:`release` once, when it ends."""

    residency: AdapterResidency
    set_id: str
    read: Future[None]
    released: bool = False

    @property
    def resident(self) -> bool:
        return self.residency.is_resident(self.set_id)

    def load_step(self, budget_s: float) -> bool:
        return self.residency.load_step(self.set_id, budget_s)

    def activate(self) -> None:
        self.residency.activate(self.set_id)

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.residency.denoiser

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.residency.unpin(self.set_id)


def adapter_stats(residencies: list[AdapterResidency]) -> AdapterStats:
    """The executor's adapter figures: every loaded copy's counters summed."""
    total: dict[str, Any] = {}
    for residency in residencies:
        for name, value in vars(residency.counters).items():
            total[name] = total.get(name, 0) + value
    return AdapterStats(**total)


def resident_sets(residencies: list[AdapterResidency]) -> tuple[str, ...]:
    """Resident set ids of every loaded copy, least recently used first."""
    return tuple(set_id for _, set_id in sorted(r for x in residencies for r in x.resident()))
