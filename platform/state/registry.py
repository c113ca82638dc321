"""The durable function registry: a restarted gateway comes back with every function.

Layout under ``<data-dir>/functions/<name>/``: ``spec.json`` and ``templates/<id>.png``.
A deploy writes a complete new folder next to the live one and swaps it in with renames, so
a crash leaves either the old function or the new one, never a mix.

Every put and delete gets a revision: the generation the executors order control
operations on one name by (a later one supersedes an earlier one). Here it is the clock in
microseconds (kept increasing), so a restarted gateway's operations still supersede those
its executors saw before; the shared registry (``platform/state/sharedregistry.py``) numbers them
from one database sequence, for every gateway.

Both are a :class:`FunctionRegistry`: the gateway stores, deletes, loads and follows
functions through it and never asks which kind it has. Followed, the file registry has
no change to report (one gateway writes its data dir, and it knows its own writes);
the shared one reports every gateway's.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from retouch.functions.spec import FunctionSpec, parse_spec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredFunction:
    spec: FunctionSpec
    templates: dict[str, bytes]  # template id -> PNG bytes
    revision: int = 0  # the put that stored it: its deploy's generation on the executors


@dataclass(frozen=True)
class Changes:
    """What changed after a revision: functions stored, names deleted (with revisions)."""

    stored: list[StoredFunction]
    deleted: list[tuple[str, int]]
    revision: int  # the latest revision seen: ask for changes after it next


class FunctionRegistry(Protocol):
    """The durable functions every gateway of this registry serves (every method blocks:
    call it from a worker thread)."""

    def put(self, spec: FunctionSpec, templates: dict[str, bytes]) -> int:
        """Store the function (replacing one of its name); its revision."""

    def delete(self, name: str) -> int | None:
        """Remove the function; the delete's revision, or None when there was none."""

    def load_all(self) -> dict[str, StoredFunction]:
        """Every stored function, by name."""

    def changes(self, after: int) -> Changes:
        """Functions stored and names deleted by other gateways with a revision above
        ``after``."""


class Revisions:
    """Increasing revisions from the clock (microseconds), for one process."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._last = max(self._last + 1, time.time_ns() // 1000)
            return self._last


class Registry:
    """Functions in ``<data dir>/functions``, for one gateway."""

    def __init__(self, root: Path) -> None:
        self.root = root / "functions"
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._revisions = Revisions()
        self._cleanup()

    def put(self, spec: FunctionSpec, templates: dict[str, bytes]) -> int:
        """Store the function (replacing one of its name); its revision."""
        staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=self.root))
        (staging / "templates").mkdir()
        for tid, png in templates.items():
            (staging / "templates" / f"{tid}.png").write_bytes(png)
        (staging / "spec.json").write_text(json.dumps(spec.to_dict(), indent=1))
        live = self.root / spec.name
        with self._lock:
            old = None
            if live.exists():
                old = live.rename(self.root / f".{spec.name}.old")
            staging.rename(live)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        return self._revisions.next()

    def delete(self, name: str) -> int | None:
        """Remove the function; the delete's revision, or None when there was none."""
        live = self.root / name
        with self._lock:
            if not live.exists():
                return None
            shutil.rmtree(live.rename(self.root / f".{name}.deleted"), ignore_errors=True)
            return self._revisions.next()

    def changes(self, after: int) -> Changes:
        """None: this gateway alone writes its data dir, and it applied its own writes."""
        return Changes([], [], after)

    def load_all(self) -> dict[str, StoredFunction]:
        out = {}
        for folder in sorted(
            p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
        ):
            try:
                out[folder.name] = self._load(folder)
            except (OSError, ValueError) as exc:
                log.error("skipping unreadable function %s: %s", folder.name, exc)
        return out

    def _load(self, folder: Path) -> StoredFunction:
        spec = parse_spec(json.loads((folder / "spec.json").read_text()))
        templates = {
            tid: (folder / "templates" / f"{tid}.png").read_bytes() for tid in spec.templates
        }
        return StoredFunction(spec, templates, self._revisions.next())

    def _cleanup(self) -> None:
        """Finish or drop swaps a crash interrupted: keep ``.old`` only if the live one is gone."""
        for path in self.root.iterdir():
            if not path.name.startswith("."):
                continue
            if path.name.endswith(".old"):
                live = self.root / path.name[1:-4]
                if not live.exists():
                    path.rename(live)
                    continue
            shutil.rmtree(path, ignore_errors=True)
