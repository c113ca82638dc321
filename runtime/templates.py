"""An executor's templates: cache keys, bake state, and the activation store behind them.

Every deployed template gets a cache key (``fingerprint.template_key``) under its
function's settings. A template is *baked* when the store holds its activations; an edit
with exactly those settings then runs mask-aware, anything else runs the stock path. A
template found corrupt or missing is marked unbaked and baked again (insert on miss).

An edit at ``strength`` < 1 follows another trajectory (the schedule without its first
steps, from the template noised part-way), and so does an edit with another scheduler than
the function's own (one its spec allows): it is served by a *variant* of the template
(:meth:`TemplateCache.variant`), keyed by the steps the strength skips and the scheduler
(its name and config) and baked on its first use like any template.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from retouch.cachestore.devicetier import DeviceTemplate, DeviceTier
from retouch.cachestore.errors import CorruptEntry, StoreError
from retouch.cachestore.policy import EPHEMERAL_PREFIX
from retouch.cachestore.store import ActivationStore, HostTemplate, Tier
from retouch.cachestore.streaming import StreamedTemplate
from retouch.functions.families import family_spec
from retouch.functions.spec import FunctionSpec, UploadsSpec
from retouch.functions.wire.executor import BakeState, ChangeKind, TemplateStatus
from retouch.functions.wire.invoke import CacheTier
from retouch.runtime.fingerprint import template_key
from retouch.runtime.maskaware.editor import BakeCancelled
from retouch.runtime.maskaware.rowformat import RowFormat
from retouch.runtime.maskaware.storedrows import DecodedTemplate, EncodingWriter, decoded

log = logging.getLogger(__name__)


@dataclass
class Template:
    function: str
    id: str
    image: Image.Image
    prompt: str
    seed: int
    steps: int
    guidance: float
    key: str
    state: BakeState = BakeState.UNBAKED
    error: str | None = None
    bakes: int = 0
    upload: bool = False  # an ad-hoc template: an uploaded image
    nbytes: int = 0  # bytes of its bake, once baked here
    dropped: bool = False  # no longer tracked (evicted upload, removed function): never baked
    too_large: bool = False  # an upload whose bake alone exceeds uploads.max_bytes: never baked
    storage: RowFormat = RowFormat.NATIVE  # how its bake's rows rest in the store
    strength: float = 1.0  # a variant's: the strength its bake runs at (the key: its skip)
    scheduler: str = ""  # the scheduler its bake runs with (the key holds it and its config)

    def covers(self, steps: int, guidance: float) -> bool:
        """Whether the bake's activations are valid for an edit with these settings."""
        return steps == self.steps and guidance == self.guidance


@dataclass
class Acquired:
    """The outcome of making a template's activations readable for one edit."""

    # the tier's handle; wrapped in a DecodedTemplate when the rows rest encoded
    handle: HostTemplate | StreamedTemplate | DeviceTemplate | DecodedTemplate | None
    tier: str  # where it was found: device, host, disk or none
    wait_ms: float


def _settings(spec: FunctionSpec) -> dict[str, Any]:
    """The generation settings a bake depends on (part of its key)."""
    return {
        "family": spec.family,
        "width": spec.width,
        "height": spec.height,
        "steps": spec.steps,
        "guidance": spec.guidance,
        "scheduler": spec.scheduler,
        "storage": spec.storage,  # an fp8 bake holds other bytes than a native one
    }


@dataclass
class TemplateCache:
    store: ActivationStore
    templates: dict[tuple[str, str], Template] = field(default_factory=dict)
    # Ad-hoc templates per function, least recently used first, with the function's limits.
    uploads: dict[str, OrderedDict[str, Template]] = field(default_factory=dict)
    limits: dict[str, UploadsSpec] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Told (on the thread where it happens) when placement-relevant state changed: a bake
    # finished or failed, a template entered host memory or was found missing.
    on_change: Callable[[ChangeKind, str, str], None] | None = None
    # Hot templates resident on the compute device (None: off, e.g. a CPU executor).
    device_tier: DeviceTier | None = None
    _dropped: list[Template] = field(default_factory=list)

    def register(
        self,
        spec: FunctionSpec,
        images: dict[str, Image.Image],
        model_fp: str,
        scheduler_config: dict[str, Any],
    ) -> list[Template]:
        """Register a function's deployed templates (replacing an earlier deploy's). Its
        ad-hoc templates are dropped (the settings may have changed): see
        :meth:`take_dropped`."""
        added = [
            self._make(spec, tid, images[tid], t.prompt, t.seed, model_fp, scheduler_config)
            for tid, t in spec.templates.items()
        ]
        keys = {t.key for t in added}
        with self.lock:
            for key in [k for k in self.templates if k[0] == spec.name]:
                old = self.templates.pop(key)
                if old.key not in keys:  # superseded: its queued or running bake is not wanted
                    old.dropped = True
            self.templates.update({(t.function, t.id): t for t in added})
            self._dropped.extend(self._drop_uploads(spec.name))
            self.limits[spec.name] = spec.uploads
        return added

    def _make(
        self,
        spec: FunctionSpec,
        tid: str,
        image: Image.Image,
        prompt: str,
        seed: int,
        model_fp: str,
        scheduler_config: dict[str, Any],
        upload: bool = False,
        strength: float = 1.0,
        scheduler: str = "",
    ) -> Template:
        """A template keyed by its content and settings; baked if the store holds the key
        (ad-hoc ones get the store's ephemeral prefix: evicted before deployed ones). An
        ad-hoc template's key holds its id too: the gateway's upload ids say who may share
        a bake (one tenant's uploads, never another's). Below ``strength`` 1 the key holds
        the steps it skips (strengths that skip as many share one trajectory). ``scheduler``
        ("": the spec's) is the one its bake runs with, ``scheduler_config`` that one's."""
        pixels = np.asarray(image).tobytes()
        scheduler = scheduler or spec.scheduler
        settings = {**_settings(spec), "scheduler": scheduler}
        if upload:
            settings["upload"] = tid
        skipped = family_spec(spec.family).skipped_steps(spec.steps, strength)
        if skipped:
            settings["skipped_steps"] = skipped
        key = template_key(model_fp, settings, scheduler_config, pixels, prompt, seed)
        if upload:
            key = EPHEMERAL_PREFIX + key
        baked = self.store.tier(key) is not Tier.NONE
        return Template(
            spec.name,
            tid,
            image,
            prompt,
            seed,
            spec.steps,
            spec.guidance,
            key,
            BakeState.BAKED if baked else BakeState.UNBAKED,
            upload=upload,
            nbytes=self.store.nbytes(key) if baked else 0,
            storage=RowFormat(spec.storage),
            strength=strength,
            scheduler=scheduler,
        )

    def detach(self, function: str) -> list[Template]:
        """Forget a function's templates (fast: no store work); see :meth:`drop_unused`."""
        with self.lock:
            gone = [self.templates.pop(k) for k in [k for k in self.templates if k[0] == function]]
            for template in gone:
                template.dropped = True
            self.limits.pop(function, None)
            return gone + self._drop_uploads(function)

    def _drop_uploads(self, function: str) -> list[Template]:
        """(lock held) Untrack a function's ad-hoc templates."""
        gone = list(self.uploads.pop(function, {}).values())
        for template in gone:
            template.dropped = True
        return gone

    def unwanted(self, template: Template) -> bool:
        """Its bake may stop: the function was deleted or redeployed with other settings
        (asked between a bake's steps)."""
        with self.lock:
            return template.dropped

    def take_dropped(self) -> list[Template]:
        """Templates dropped by :meth:`register` whose bakes should go (:meth:`drop_unused`)."""
        with self.lock:
            dropped, self._dropped = self._dropped, []
            return dropped

    def drop_unused(self, gone: list[Template]) -> None:
        """Delete the bakes of detached templates that no registered template uses."""
        with self.lock:
            in_use = {t.key for t in self.templates.values()}
            in_use |= {t.key for ups in self.uploads.values() for t in ups.values()}
        for template in gone:
            if template.key not in in_use:
                self.store.delete(template.key)
                self._forget_on_device(template.key)

    def get(self, function: str, template: str) -> Template | None:
        with self.lock:
            return self.templates.get((function, template))

    def upload(
        self,
        spec: FunctionSpec,
        template_id: str,
        image: Image.Image,
        model_fp: str,
        scheduler_config: dict[str, Any],
    ) -> Template:
        """The ad-hoc template of an uploaded image (created on first sight, marked most
        recently used). Baked already when the store holds it (another executor of the
        host, or an earlier life of this one, baked the same upload)."""
        with self.lock:
            known = self._tracked(spec.name, template_id, True)
            if known is not None:
                return known
        up = spec.uploads
        template = self._make(
            spec, template_id, image, up.prompt, up.seed, model_fp, scheduler_config, upload=True
        )
        return self._track(spec.name, template)

    def variant(
        self,
        spec: FunctionSpec,
        base: Template,
        strength: float,
        scheduler: str,
        model_fp: str,
        scheduler_config: dict[str, Any],
    ) -> Template:
        """``base`` as edits of ``spec``'s steps at ``strength`` < 1 or with ``scheduler``
        (another than the spec's, with its config ``scheduler_config``) see it: its own key
        and bake, tracked beside ``base`` under the id ``FunctionSpec.template_variant`` names (an
        upload's among the uploads, under their limits); ``base`` itself at strength 1 with
        the spec's scheduler."""
        vid = spec.template_variant(base.id, strength, scheduler)
        if vid == base.id:
            return base
        with self.lock:
            known = self._tracked(spec.name, vid, base.upload)
            if known is not None:
                return known
        made = self._make(
            spec, vid, base.image, base.prompt, base.seed, model_fp, scheduler_config,
            upload=base.upload, strength=strength, scheduler=scheduler,
        )  # fmt: skip
        return self._track(spec.name, made)

    def _track(self, function: str, template: Template) -> Template:
        """Track a template made outside the lock, unless a racing arrival of the same one
        (an image, a strength) was tracked meanwhile: then that one. An upload's may evict
        the least recently used uploads."""
        victims: list[Template] = []
        with self.lock:
            known = self._tracked(function, template.id, template.upload)
            if known is not None:
                return known
            if template.upload:
                self.uploads.setdefault(function, OrderedDict())[template.id] = template
                victims = self._over_limits(function, keep=template)
            else:
                self.templates[(function, template.id)] = template
        self._delete(victims)
        return template

    def _tracked(self, function: str, tid: str, upload: bool) -> Template | None:
        """(lock held) A tracked template (an upload's marked most recently used)."""
        if not upload:
            return self.templates.get((function, tid))
        table = self.uploads.get(function, {})
        if tid in table:
            table.move_to_end(tid)
        return table.get(tid)

    def _over_limits(self, function: str, keep: Template | None = None) -> list[Template]:
        """(lock held) Untrack the least recently used ad-hoc templates of ``function``
        until its count and byte limits hold; ``keep`` goes last (it is being used)."""
        table = self.uploads.get(function)
        limits = self.limits.get(function, UploadsSpec())
        if not table:
            return []
        victims = []
        while table and (
            len(table) > limits.max_images
            or sum(t.nbytes for t in table.values()) > limits.max_bytes
        ):
            order = [t for t in table.values() if t is not keep] + ([keep] if keep else [])
            victim = next(t for t in order if t.id in table)
            del table[victim.id]
            victim.dropped = True
            victims.append(victim)
        return victims

    def _delete(self, victims: list[Template]) -> None:
        """Delete dropped ad-hoc templates' bakes (no lock held: this is store I/O)."""
        for victim in victims:
            log.info(
                "upload %s/%s dropped (limits of the function); its bake is deleted",
                victim.function,
                victim.id,
            )
            self._forget_on_device(victim.key)
            try:
                self.store.delete(victim.key)
            except StoreError as exc:
                log.warning("deleting the bake of %s/%s: %s", victim.function, victim.id, exc)

    def claim_bake(self, template: Template) -> bool:
        """Mark an unbaked template as queued for baking; False if it is baked or queued,
        or no longer tracked (a dropped upload is not baked again)."""
        with self.lock:
            if template.dropped or template.too_large:
                return False
            if template.state not in (BakeState.UNBAKED, BakeState.FAILED):
                return False
            template.state = BakeState.QUEUED
            return True

    def prefetch(self, template: Template) -> None:
        """Start bringing a baked template disk -> host while its invocation queues."""
        if template.state is BakeState.BAKED:
            try:
                self.store.prefetch(template.key)
            except StoreError as exc:
                log.warning("prefetch of %s/%s failed: %s", template.function, template.id, exc)

    def tier(self, template: Template) -> CacheTier:
        """Where the template's activations are now (host, disk or none)."""
        return CacheTier(self.store.tier(template.key).value)

    def acquire(self, template: Template) -> Acquired:
        """The activations of a baked template: device-resident when the device tier holds
        them, else host-resident (and then promoted to the device tier in the background);
        no handle if it has none (never baked, evicted from every tier, or found corrupt:
        then it is re-baked)."""
        if self.device_tier is not None:
            resident = self.device_tier.acquire(template.key)
            if resident is not None:
                return Acquired(decoded(resident), CacheTier.DEVICE.value, 0.0)
        tier = self.tier(template).value
        started = time.perf_counter()
        try:
            handle = self.store.acquire(template.key)
        except KeyError:
            handle = None
        except CorruptEntry as exc:
            log.error(
                "template %s/%s is corrupt (%s); it will be re-baked",
                template.function,
                template.id,
                exc,
            )
            handle = None
        wait_ms = (time.perf_counter() - started) * 1e3
        if handle is None:
            with self.lock:
                if template.state is BakeState.BAKED:
                    template.state = BakeState.UNBAKED
            tier = Tier.NONE.value
            self._changed(ChangeKind.LOST, template)
        elif tier != Tier.HOST.value:
            self._changed(ChangeKind.HOST_TIER, template)
        device = self.device_tier
        if (
            isinstance(handle, HostTemplate)
            and device is not None
            and handle.nbytes <= device.budget
        ):
            device.promote(template.key, lambda: self._whole(template.key))
        return Acquired(None if handle is None else decoded(handle), tier, wait_ms)

    def _forget_on_device(self, key: str) -> None:
        if self.device_tier is not None:
            self.device_tier.drop(key)

    def _whole(self, key: str) -> HostTemplate | None:
        """A host-tier handle of the whole template (what a promotion copies), or None
        when it is gone or too big for the host tier (then it is too big for the device)."""
        try:
            handle = self.store.acquire(key)
        except (KeyError, StoreError):
            return None
        if isinstance(handle, HostTemplate):
            return handle
        handle.release()
        return None

    def _changed(self, kind: ChangeKind, template: Template) -> None:
        if self.on_change is not None:
            self.on_change(kind, template.function, template.id)

    def bake(self, template: Template, record) -> None:
        """Run ``record(writer)`` (one recorded generation) into the store, atomically, its
        rows in the template's storage format."""
        with self.lock:
            if template.dropped:  # deleted or superseded while its bake waited
                template.state = BakeState.UNBAKED
                return
            template.state = BakeState.BAKING
        meta = {
            "function": template.function,
            "template": template.id,
            "steps": template.steps,
            "scheduler": template.scheduler,
        }
        if template.strength < 1.0:
            meta["strength"] = template.strength
        if template.upload:
            meta["upload"] = True
        try:
            self._forget_on_device(template.key)  # a re-bake replaces its activations
            with self.store.bake(template.key, meta) as writer:
                record(EncodingWriter(writer, template.storage))
        except BakeCancelled as exc:  # stopping, or no longer wanted: unbaked, nothing stored
            with self.lock:
                template.state = BakeState.UNBAKED
            log.info("bake of %s/%s cancelled: %s", template.function, template.id, exc)
            return
        except Exception as exc:
            with self.lock:
                template.state, template.error = BakeState.FAILED, str(exc)
            log.exception("baking %s/%s failed", template.function, template.id)
            self._changed(ChangeKind.BAKE_FAILED, template)
            return
        with self.lock:
            template.state, template.error = BakeState.BAKED, None
            template.bakes += 1
            template.nbytes = writer.nbytes
            limit = self.limits.get(template.function, UploadsSpec()).max_bytes
            if template.upload and not template.dropped and writer.nbytes > limit:
                # kept (its edits run stock) but never baked again: no bake-and-delete churn
                template.state, template.nbytes, template.too_large = BakeState.FAILED, 0, True
                template.error = f"its bake ({writer.nbytes} bytes) exceeds uploads.max_bytes"
                victims = [template]
            elif template.dropped:  # dropped while it baked: its bake goes too
                victims = [template]
            else:  # the byte budget may now bite
                victims = self._over_limits(template.function)
            baked = template.state is BakeState.BAKED
        self._delete(victims)
        self._changed(ChangeKind.BAKED if baked else ChangeKind.BAKE_FAILED, template)

    def states(self) -> dict[str, dict[str, TemplateStatus]]:
        """Every template's state, ad-hoc ones included (cheap: host residency is a set
        lookup, no disk access)."""
        with self.lock:
            tracked = [*self.templates.values()]
            tracked += [t for ups in self.uploads.values() for t in ups.values()]
        on_device = self.device_tier.keys() if self.device_tier is not None else frozenset()
        out: dict[str, dict[str, TemplateStatus]] = {}
        for t in tracked:
            out.setdefault(t.function, {})[t.id] = TemplateStatus(
                state=t.state,
                bakes=t.bakes,
                key=t.key,
                error=t.error,
                upload=t.upload,
                bytes=t.nbytes,
                host=self.store.resident(t.key),
                device=t.key in on_device,
            )
        return out
