"""The import contract: data flows platform -> runtime -> cachestore, and the control plane
(gateway, pool, providers, queue, client, CLI) stays light — no torch, diffusers or lmdb."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTROL_PLANE = (
    "retouch.platform.gateway",
    "retouch.platform.frontdoor",
    "retouch.platform.httpapi",
    "retouch.platform.deployed",
    "retouch.platform.pool",
    "retouch.platform.fleet",
    "retouch.platform.deployments",
    "retouch.platform.dispatch",
    "retouch.platform.executorlink",
    "retouch.platform.metrics",
    "retouch.platform.providers",
    "retouch.platform.server",
    "retouch.platform.control.queue",
    "retouch.platform.placement",
    "retouch.platform.registry",
    "retouch.platform.client",
    "retouch.platform.cli",
    "retouch.platform.jobs",
    "retouch.platform.journal",
    "retouch.platform.webhooks",
    "retouch.platform.sse",
    "retouch.platform.uploads",
    "retouch.platform.openai_images",
    "retouch.platform.web",
    "retouch.runtime.executor.app",
)
HEAVY = ("torch", "diffusers", "lmdb", "transformers")
# folder -> the folders of ours it may import (besides itself)
ALLOWED = {
    "cachestore": set(),
    "functions": set(),
    "runtime": {"functions", "cachestore"},
    "platform": {"functions", "runtime", "cachestore"},
}


def heavy_modules_after_import(modules: tuple[str, ...]) -> list[str]:
    """Import ``modules`` in a fresh interpreter; the heavy packages that got loaded."""
    code = (
        "import importlib, sys\n"
        f"for m in {list(modules)!r}: importlib.import_module(m)\n"
        f"print(','.join(h for h in {list(HEAVY)!r} if h in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    return [m for m in out.stdout.strip().split(",") if m]


def forbidden_imports(root: Path = REPO) -> list[str]:
    """Every ``import retouch.<folder>`` that breaks the folder directions."""
    problems = []
    for folder, allowed in ALLOWED.items():
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for name in names:
                    parts = name.split(".")
                    if parts[0] != "retouch" or len(parts) < 2:
                        continue
                    target = parts[1]
                    if target != folder and target not in allowed:
                        rel = path.relative_to(root)
                        problems.append(f"{rel}:{node.lineno} imports {name}")
    return problems


def test_control_plane_imports_no_heavy_package() -> None:
    assert heavy_modules_after_import(CONTROL_PLANE) == []


def test_heavy_check_sees_a_heavy_import() -> None:
    """The check can fail: the executor core does import torch."""
    assert "torch" in heavy_modules_after_import(("retouch.runtime.executor.core",))


def test_folder_directions() -> None:
    assert forbidden_imports() == []


def test_direction_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """A runtime module that imports the platform is reported."""
    for folder in ALLOWED:
        (tmp_path / folder).mkdir()
    (tmp_path / "runtime" / "bad.py").write_text("from retouch.platform.gateway import Gateway\n")
    (tmp_path / "cachestore" / "bad.py").write_text("import retouch.functions.wire\n")
    assert forbidden_imports(tmp_path) == [
        "cachestore/bad.py:1 imports retouch.functions.wire",
        "runtime/bad.py:1 imports retouch.platform.gateway",
    ]


def test_every_catalogued_model_has_a_builder() -> None:
    """The gateway checks deploys against the torch-free catalogue (which also gives each
    builder its family and resolution); every entry must be buildable and vice versa."""
    from retouch.functions.demo.models import DEMO_MODELS
    from retouch.functions.models import BUILTIN_MODELS

    assert set(BUILTIN_MODELS) == set(DEMO_MODELS)
    for name, model in DEMO_MODELS.items():
        assert model.family == BUILTIN_MODELS[name].family
