"""The functions an executor holds, and the order of the control operations on each name.

The gateway numbers every deploy and delete of a name (its *generation*); an operation
overtaken by a later one of the same name is dropped instead of resurrecting an older
version. The registry's lock guards its two tables only; registering a deploy also
registers its templates under it (lock order: the registry's, then the template cache's),
which only looks keys up and does no model work or scan.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from retouch.functions.errors import Conflict, NotFound
from retouch.functions.spec import FunctionSpec
from retouch.runtime.templates import Template, TemplateCache


class Superseded(Conflict):
    code = "superseded"


def refuse_if_superseded(name: str, generation: int, latest: int) -> None:
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


class FunctionRegistry:
    """The deployed functions of one executor, by name, and each name's latest operation."""

    def __init__(self, executor: str, templates: TemplateCache) -> None:
        self.executor = executor  # named in a not-found error
        self.templates = templates
        self._lock = threading.Lock()
        self._functions: dict[str, FunctionEntry] = {}
        self._generations: dict[str, int] = {}  # latest control operation per function name

    def check_generation(self, name: str, generation: int) -> None:
        """Fail early (before loading anything) when a later operation already ran."""
        with self._lock:
            latest = self._generations.get(name, 0)
        refuse_if_superseded(name, generation, latest)

    def register(self, entry: FunctionEntry, generation: int) -> list[Template]:
        """Hold ``entry`` and its templates, unless a later operation on its name ran
        meanwhile (:class:`Superseded`); the templates the store does not hold yet."""
        name = entry.spec.name
        registered: list[Template] = []
        with self._lock:
            latest = self._generations.get(name, 0)
            if generation >= latest:
                self._generations[name] = generation
                registered = self.templates.register(
                    entry.spec, entry.templates, entry.fingerprint, entry.scheduler_config
                )
                self._functions[name] = entry
        self.templates.drop_unused(self.templates.take_dropped())  # an earlier deploy's uploads
        refuse_if_superseded(name, generation, latest)
        return registered

    def remove(self, name: str, generation: int) -> bool:
        """Forget a function (unless a later deploy of the name already replaced it)."""
        with self._lock:
            if self._generations.get(name, 0) > generation:
                return False
            self._generations[name] = generation
            removed = self._functions.pop(name, None) is not None
            gone = self.templates.detach(name)
        self.templates.drop_unused(gone)
        return removed

    def entry(self, name: str) -> FunctionEntry:
        """The function ``name``, else a 404 naming the field."""
        with self._lock:
            entry = self._functions.get(name)
        if entry is None:
            raise NotFound(
                f"function {name!r} is not loaded on {self.executor}",
                field="function",
                code="function_not_found",
            )
        return entry

    def spec(self, name: str) -> FunctionSpec:
        """The spec of a function known to be held (a template's, while it bakes)."""
        with self._lock:
            return self._functions[name].spec

    def snapshot(self) -> tuple[tuple[str, ...], dict[str, int]]:
        """The held names, sorted, and each one's generation (``/state``)."""
        with self._lock:
            names = tuple(sorted(self._functions))
            return names, {name: self._generations.get(name, 0) for name in names}
