"""The durable function registry: a restarted gateway comes back with every function.

Layout under ``<data-dir>/functions/<name>/``: ``spec.json`` and ``templates/<id>.png``.
A deploy writes a complete new folder next to the live one and swaps it in with renames, so
a crash leaves either the old function or the new one, never a mix.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from retouch.functions.spec import FunctionSpec, parse_spec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredFunction:
    spec: FunctionSpec
    templates: dict[str, bytes]  # template id -> PNG bytes


class Registry:
    def __init__(self, root: Path) -> None:
        self.root = root / "functions"
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._cleanup()

    def put(self, spec: FunctionSpec, templates: dict[str, bytes]) -> None:
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

    def delete(self, name: str) -> bool:
        live = self.root / name
        with self._lock:
            if not live.exists():
                return False
            shutil.rmtree(live.rename(self.root / f".{name}.deleted"), ignore_errors=True)
            return True

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
        return StoredFunction(spec, templates)

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
