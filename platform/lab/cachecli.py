"""``retouch cache ls|stats|verify|gc`` over a data directory's activation store.

Executors may be running: LMDB lets this process read (and, for verify/gc, write) beside
them. ``ls``/``stats`` open the store read-only so they never take the writer lock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from retouch.cachestore.layout import store_path
from retouch.cachestore.store import ActivationStore, StoreConfig
from retouch.functions.errors import NotFound


def run_cache_command(command: str, data_dir: Path) -> Any:
    path = store_path(data_dir)
    if not path.exists():
        raise NotFound(f"no activation store at {path} (nothing baked yet?)", code="no_store")
    readonly = command in ("ls", "stats")
    with ActivationStore(
        StoreConfig(path=path, readonly=readonly, host_budget_bytes=0 if readonly else 1 << 30)
    ) as store:
        if command == "ls":
            return store.ls()
        if command == "stats":
            return store.stats()
        if command == "verify":
            return store.verify()
        if command == "gc":
            return {"bytes_freed": store.gc()}
    raise ValueError(f"unknown cache command {command!r}")
