"""Hub ids resolved from the local Hugging Face cache, never downloaded.

The cache is laid out as ``huggingface_hub`` writes it: ``<cache>/models--<org>--<name>/``
with ``refs/<branch or tag>`` (a file holding a commit hash) and
``snapshots/<commit>/<files>``. The cache folder is ``HF_HUB_CACHE``, else
``HF_HOME/hub``, else ``~/.cache/huggingface/hub``, read when asked (so an executor and the
gateway started with the same environment agree). Reading the layout directly keeps the
gateway free of the hub client and of any network call.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from retouch.functions.errors import InvalidSpec

HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
COMMIT_RE = re.compile(r"[0-9a-f]{40}")


def is_hub_id(name: str) -> bool:
    """``org/name`` that is not an existing local path."""
    return bool(HUB_ID_RE.fullmatch(name)) and not Path(name).expanduser().exists()


def hub_cache() -> Path:
    """The local hub cache folder of this process's environment."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path("~/.cache/huggingface").expanduser()
    return Path(home) / "hub"


def snapshot(repo_id: str, revision: str | None, field: str = "model") -> Path:
    """The cached snapshot folder of ``repo_id`` at ``revision`` (a branch, tag or commit;
    ``main`` when None); an :class:`InvalidSpec` naming what is missing otherwise."""
    repo = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    if not repo.is_dir():
        raise InvalidSpec(
            f"{repo_id} is not in the local Hugging Face cache ({repo}); models are never "
            "downloaded: fetch it into the cache first",
            field=field,
        )
    ref = revision or "main"
    commit = ref if COMMIT_RE.fullmatch(ref) else _read_ref(repo, ref, field)
    folder = repo / "snapshots" / commit
    if not folder.is_dir():
        raise InvalidSpec(
            f"{repo_id}: revision {ref} ({commit}) has no snapshot in the cache: {folder}",
            field="revision" if revision else field,
        )
    return folder


def _read_ref(repo: Path, ref: str, field: str) -> str:
    path = repo / "refs" / ref
    try:
        commit = path.read_text().strip()
    except OSError:
        raise InvalidSpec(
            f"revision {ref!r} of {repo.name} is not in the cache (no {path})",
            field="revision" if ref != "main" else field,
        ) from None
    if not COMMIT_RE.fullmatch(commit):
        raise InvalidSpec(f"{path} does not hold a commit hash", field=field)
    return commit
