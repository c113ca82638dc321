"""An executor's templates: cache keys, bake state, and the activation store behind them.

Every deployed template gets a cache key (``fingerprint.template_key``) under its
function's settings. A template is *baked* when the store holds its activations; an edit
with exactly those settings then runs mask-aware, anything else runs the stock path. A
template found corrupt or missing is marked unbaked and baked again (insert on miss).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from retouch.cachestore.errors import CorruptEntry, StoreError
from retouch.cachestore.store import ActivationStore, HostTemplate, Tier
from retouch.functions.spec import FunctionSpec
from retouch.functions.wire import BakeState, TemplateStatus
from retouch.runtime.fingerprint import template_key

log = logging.getLogger(__name__)

STORE_DIRNAME = "cache"


def store_path(data_dir: Path) -> Path:
    """Where the executors of one host keep their shared activation store."""
    return data_dir / STORE_DIRNAME


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

    def covers(self, steps: int, guidance: float) -> bool:
        """Whether the bake's activations are valid for an edit with these settings."""
        return steps == self.steps and guidance == self.guidance


@dataclass
class Acquired:
    """The outcome of making a template host-resident for one edit."""

    handle: HostTemplate | None
    tier: str  # where it was found: host, disk or none
    wait_ms: float


@dataclass
class TemplateCache:
    store: ActivationStore
    templates: dict[tuple[str, str], Template] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def register(
        self,
        spec: FunctionSpec,
        images: dict[str, Image.Image],
        model_fp: str,
        scheduler_config: dict[str, Any],
    ) -> list[Template]:
        settings = {
            "family": spec.family,
            "width": spec.width,
            "height": spec.height,
            "steps": spec.steps,
            "guidance": spec.guidance,
            "scheduler": spec.scheduler,
        }
        added = []
        for tid, tspec in spec.templates.items():
            image = images[tid]
            key = template_key(
                model_fp,
                settings,
                scheduler_config,
                np.asarray(image).tobytes(),
                tspec.prompt,
                tspec.seed,
            )
            baked = self.store.tier(key) is not Tier.NONE
            template = Template(
                spec.name,
                tid,
                image,
                tspec.prompt,
                tspec.seed,
                spec.steps,
                spec.guidance,
                key,
                BakeState.BAKED if baked else BakeState.UNBAKED,
            )
            added.append(template)
        with self.lock:
            for key in [k for k in self.templates if k[0] == spec.name]:
                del self.templates[key]
            self.templates.update({(t.function, t.id): t for t in added})
        return added

    def detach(self, function: str) -> list[Template]:
        """Forget a function's templates (fast: no store work); see :meth:`drop_unused`."""
        with self.lock:
            return [self.templates.pop(k) for k in [k for k in self.templates if k[0] == function]]

    def drop_unused(self, gone: list[Template]) -> None:
        """Delete the bakes of detached templates that no registered template uses."""
        with self.lock:
            in_use = {t.key for t in self.templates.values()}
        for template in gone:
            if template.key not in in_use:
                self.store.delete(template.key)

    def get(self, function: str, template: str) -> Template | None:
        with self.lock:
            return self.templates.get((function, template))

    def claim_bake(self, template: Template) -> bool:
        """Mark an unbaked template as queued for baking; False if it is baked or queued."""
        with self.lock:
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

    def acquire(self, template: Template) -> Acquired:
        """The host-resident activations of a baked template, or no handle if it has none
        (never baked, evicted from every tier, or found corrupt: then it is re-baked)."""
        tier = self.store.tier(template.key).value
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
        return Acquired(handle, tier, wait_ms)

    def bake(self, template: Template, record) -> None:
        """Run ``record(writer)`` (one recorded generation) into the store, atomically."""
        with self.lock:
            template.state = BakeState.BAKING
        meta = {"function": template.function, "template": template.id, "steps": template.steps}
        try:
            with self.store.bake(template.key, meta) as writer:
                record(writer)
        except Exception as exc:
            with self.lock:
                template.state, template.error = BakeState.FAILED, str(exc)
            log.exception("baking %s/%s failed", template.function, template.id)
            return
        with self.lock:
            template.state, template.error = BakeState.BAKED, None
            template.bakes += 1

    def states(self) -> dict[str, dict[str, TemplateStatus]]:
        with self.lock:
            out: dict[str, dict[str, TemplateStatus]] = {}
            for t in self.templates.values():
                out.setdefault(t.function, {})[t.id] = TemplateStatus(
                    t.state, t.bakes, t.key, t.error
                )
            return out
