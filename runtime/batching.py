"""Batch formation, pure: which ready invocations join the running batch before the next
step (vLLM v1's ``schedule()``), and the per-row adapter plan of a mixed step. The engine
applies what these decide; they read no clock and change nothing."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from retouch.runtime.adapters import BARE, AdapterUse
from retouch.runtime.engineconfig import EngineConfig, EngineMode
from retouch.runtime.maskaware.editor import MaskAwareEditor
from retouch.runtime.mixedlora import RowAdapters
from retouch.runtime.work import Work


@dataclass(frozen=True)
class Admission:
    """What :func:`schedule` decided for the next step: who joins the running batch, and
    whose adapter set is attached between steps first."""

    joining: tuple[Work, ...] = ()
    loading: tuple[Work, ...] = ()


def schedule(
    ready: Sequence[Work],
    running: Mapping[Hashable, int],
    config: EngineConfig,
    joined: Sequence[Work] = (),
) -> Admission:
    """Which ready invocations join before the next step (pure: the engine applies it).

    ``running``: the size of every running group; ``joined``: invocations this iteration
    admitted already (they count towards their group's size). Continuous mode: in arrival
    order, each joins its group while the group has room (``max_batch``); while a batch
    runs, one whose adapter set is not resident waits for it to be attached between steps
    instead. Static mode: a batch forms only when nothing runs, from the oldest ready
    invocation's group, and runs to completion."""
    cap = config.max_batch
    if config.mode is EngineMode.STATIC:
        if running or not ready:
            return Admission()
        key = ready[0].key
        return Admission(tuple([w for w in ready if w.key == key][:cap]))
    sizes = dict(running)
    for work in joined:
        sizes[work.key] = sizes.get(work.key, 0) + 1
    joining: list[Work] = []
    loading: list[Work] = []
    for work in ready:
        if running and not (work.adapters is None or work.adapters.resident):
            loading.append(work)  # attached between steps, then it joins
        elif sizes.get(work.key, 0) < cap:
            sizes[work.key] = sizes.get(work.key, 0) + 1
            joining.append(work)
    return Admission(tuple(joining), tuple(loading))


def mixed_rows(group: list[Work], editor: MaskAwareEditor, mixed: bool) -> RowAdapters | None:
    """The per-row adapter plan of a group's step in mixed batching (None: the group runs
    one set through peft, ``activate``). Every step with an adapter runs the rows' plan,
    even of one set, so that batching never swaps; a batch of the bare model alone turns
    peft's layers off instead (they then compute their base only)."""
    uses = [w.adapters for w in group]
    if any(u is None for u in uses):
        return None
    if not mixed and len({u.set_id for u in uses}) < 2:
        return None
    if all(u.set_id == BARE for u in uses):
        return None
    residency = uses[0].residency
    per = editor.impl.rows_per_request
    return residency.rows([u.set_id for u in uses], per, editor.device)


def same_set(a: AdapterUse | None, b: AdapterUse) -> bool:
    return a is not None and a.residency is b.residency and a.set_id == b.set_id


def starved(queued_at: float, waiting: Iterable[Work], now: float, starvation_s: float) -> bool:
    """Whether a background job queued at ``queued_at`` runs before the next step: once
    it has waited ``starvation_s`` *and* the load is sustained (some invocation that
    arrived after it was queued is ``waiting`` or running). Without newer work the engine
    becomes idle when the current invocations end, and the job runs then; so a single long
    edit (a first edit of an uploaded image on a CPU) is not stalled by the bake it queued
    itself."""
    if now - queued_at <= starvation_s:
        return False
    return any(w.arrived > queued_at for w in waiting)


def without_canceled(
    running: Mapping[Hashable, list[Work]],
) -> tuple[dict[Hashable, list[Work]], list[Work]]:
    """The running groups without their canceled invocations (a group left empty goes),
    and those canceled, in group order: they leave the batch between steps. Called every
    step: groups without a cancel are kept as they are (no copy)."""
    kept: dict[Hashable, list[Work]] = {}
    gone: list[Work] = []
    for key, group in running.items():
        if not any(w.cancel_requested for w in group):
            kept[key] = group
            continue
        gone += [w for w in group if w.cancel_requested]
        stay = [w for w in group if not w.cancel_requested]
        if stay:
            kept[key] = stay
    return kept, gone
