"""The import contract: data flows platform -> runtime -> cachestore, and the control plane
(gateway, pool, providers, queue, client, CLI) stays light — no torch, diffusers or lmdb."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.support import REPO

CONTROL_PLANE = (
    "retouch.platform.api.gateway",
    "retouch.platform.api.composition",
    "retouch.platform.api.home",
    "retouch.platform.api.served",
    "retouch.platform.api.frontdoor",
    "retouch.platform.api.httpapi",
    "retouch.platform.fleet.deployed",
    "retouch.platform.fleet.pool",
    "retouch.platform.fleet.fleet",
    "retouch.platform.fleet.changefeed",
    "retouch.platform.fleet.deployments",
    "retouch.platform.fleet.dispatch",
    "retouch.platform.fleet.executorlink",
    "retouch.platform.api.metrics",
    "retouch.platform.fleet.providers",
    "retouch.platform.api.server",
    "retouch.platform.control.queue",
    "retouch.platform.control.placement",
    "retouch.platform.control.residency",
    "retouch.platform.state.registry",
    "retouch.platform.state.catalogue",
    "retouch.platform.cli.capacity",
    "retouch.platform.cli.models",
    "retouch.platform.api.client",
    "retouch.platform.cli.main",
    "retouch.platform.jobs.store",
    "retouch.platform.jobs.source",
    "retouch.platform.jobs.mirrors",
    "retouch.platform.jobs.journal",
    "retouch.platform.jobs.webhooks",
    "retouch.platform.jobs.deliveryjournal",
    "retouch.platform.jobs.receiverqueue",
    "retouch.platform.jobs.resolver",
    "retouch.platform.jobs.sse",
    "retouch.platform.api.uploads",
    "retouch.platform.api.openai_images",
    "retouch.platform.api.web",
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


def heavy_modules_after(code: str) -> tuple[list[str], str]:
    """Run ``code`` in a fresh interpreter: the heavy packages it loaded, and its stderr."""
    code += f"\nimport sys\nprint(','.join(h for h in {list(HEAVY)!r} if h in sys.modules))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    return [m for m in out.stdout.strip().split(",") if m], out.stderr


def heavy_modules_after_import(modules: tuple[str, ...]) -> list[str]:
    """Import ``modules`` in a fresh interpreter; the heavy packages that got loaded."""
    code = f"import importlib\nfor m in {list(modules)!r}: importlib.import_module(m)"
    return heavy_modules_after(code)[0]


def every_import(root: Path = REPO, folder: str = "platform") -> list[tuple[Path, int, str]]:
    """``(file, line, module)`` for every absolute import of ``folder``'s modules, at any depth
    (a function's import counts: it runs on some request), ``TYPE_CHECKING`` ones included."""
    found = []
    for path in sorted((root / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(path, node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.count(".") >= 2 or not node.module.startswith("retouch"):
                    found.append((path, node.lineno, node.module))
                else:  # from retouch.platform import <room or module>
                    found += [(path, node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def forbidden_imports(root: Path = REPO) -> list[str]:
    """Every ``import retouch.<folder>`` that breaks the folder directions."""
    problems = []
    for folder, allowed in ALLOWED.items():
        for path, line, name in every_import(root, folder):
            parts = name.split(".")
            if parts[0] == "retouch" and len(parts) > 1:
                target = parts[1]
                if target != folder and target not in allowed:
                    problems.append(f"{path.relative_to(root)}:{line} imports {name}")
    return problems


# platform's rooms, lowest first: a room imports only the rooms below it (docs/architecture.md)
ROOMS = ("state", "control", "fleet", "jobs", "api", "lab", "cli")
# the only rooms of the platform that may import torch, diffusers or transformers, even
# inside a function (the server's rooms never load them)
HEAVY_ROOMS = ("lab",)


def room_of(module: str) -> str | None:
    """The room of a ``retouch.platform.<room>...`` module (None outside the platform)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "platform" else None


def room_violations(root: Path = REPO) -> list[str]:
    """Imports from a lower room into a higher one, modules outside a room, and heavy
    imports outside the lab."""
    problems = []
    for path, line, name in every_import(root):
        rel = path.relative_to(root)
        room = rel.parts[1] if len(rel.parts) > 2 else None
        where = f"{rel}:{line}"
        if room not in ROOMS:
            problems.append(f"{where}: {rel} is in no room")
            continue
        target = room_of(name)
        if target in ROOMS and ROOMS.index(target) > ROOMS.index(room):
            problems.append(f"{where}: the {room} room imports {name} (room {target}, above it)")
        if name.split(".")[0] in HEAVY and room not in HEAVY_ROOMS:
            problems.append(f"{where}: the {room} room imports {name}")
    return sorted(set(problems))


def module_imports(root: Path = REPO) -> dict[str, set[str]]:
    """Every module of ours and the modules of ours it imports at module level, the
    ``TYPE_CHECKING`` ones included (a type a module names is a dependency its reader
    follows); a function's import runs later and is left out."""
    paths = {}
    for folder in ALLOWED:
        for path in (root / folder).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            paths["retouch." + ".".join(parts)] = path
    graph = {}
    for module, path in paths.items():
        imported = set()
        for node in ast.parse(path.read_text(), str(path)).body:
            for inner in _run_at_import(node):
                if isinstance(inner, ast.Import):
                    imported.update(a.name for a in inner.names)
                elif isinstance(inner, ast.ImportFrom) and inner.module and inner.level == 0:
                    imported.add(inner.module)
                    imported.update(f"{inner.module}.{a.name}" for a in inner.names)
        graph[module] = {m for m in imported if m in paths and m != module}
    return graph


def _run_at_import(node: ast.AST) -> list[ast.AST]:
    """``node`` and what it holds, except the bodies of functions (run when called)."""
    found = [node]
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            found += _run_at_import(child)
    return found


def import_cycles(root: Path = REPO) -> list[list[str]]:
    """The groups of modules that import each other, directly or round a loop (strongly
    connected components of :func:`module_imports` with more than one module)."""
    graph = module_imports(root)
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for other in graph[module]:
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return cycles


def test_no_import_cycles() -> None:
    assert import_cycles() == []


def test_cycle_check_sees_a_cycle(tmp_path: Path) -> None:
    """The check can fail: a loop through a package's ``__init__`` (the shape of the one
    ``runtime/families`` and ``maskaware/flops`` once had) is reported."""
    for folder in ALLOWED:
        (tmp_path / folder).mkdir()
    package = tmp_path / "runtime" / "families"
    package.mkdir()
    (package / "__init__.py").write_text("from retouch.runtime.families.base import Family\n")
    (package / "base.py").write_text("from retouch.runtime.flops import Flops\n")
    (tmp_path / "runtime" / "flops.py").write_text("from retouch.runtime import families\n")
    (tmp_path / "runtime" / "fine.py").write_text("from retouch.runtime.flops import Flops\n")
    assert import_cycles(tmp_path) == [
        ["retouch.runtime.families", "retouch.runtime.families.base", "retouch.runtime.flops"]
    ]


def test_control_plane_imports_no_heavy_package() -> None:
    assert heavy_modules_after_import(CONTROL_PLANE) == []


def test_heavy_check_sees_a_heavy_import() -> None:
    """The check can fail: the row format does import torch (and nothing heavier)."""
    assert "torch" in heavy_modules_after_import(("retouch.runtime.maskaware.rowformat",))


def test_folder_directions() -> None:
    assert forbidden_imports() == []


def test_direction_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """A runtime module that imports the platform is reported."""
    for folder in ALLOWED:
        (tmp_path / folder).mkdir()
    (tmp_path / "runtime" / "bad.py").write_text(
        "from retouch.platform.api.gateway import Gateway\n"
    )
    (tmp_path / "cachestore" / "bad.py").write_text("import retouch.functions.wire\n")
    assert forbidden_imports(tmp_path) == [
        "cachestore/bad.py:1 imports retouch.functions.wire",
        "runtime/bad.py:1 imports retouch.platform.api.gateway",
    ]


def test_every_catalogued_model_has_a_builder() -> None:
    """The gateway checks deploys against the torch-free catalogue (which also gives each
    builder its family and resolution); every entry must be buildable and vice versa:
    into a folder, or (production shapes) in memory."""
    from retouch.functions.demo.models import DEMO_MODELS
    from retouch.functions.demo.production import SHAPES
    from retouch.functions.models import BUILTIN_MODELS

    shaped = {name for name, m in BUILTIN_MODELS.items() if m.shape is not None}
    assert set(BUILTIN_MODELS) == set(DEMO_MODELS) | shaped and not shaped & set(DEMO_MODELS)
    for name in shaped:
        assert SHAPES[BUILTIN_MODELS[name].shape].family == BUILTIN_MODELS[name].family
    for name, model in DEMO_MODELS.items():
        assert model.family == BUILTIN_MODELS[name].family


def test_the_capacity_planner_knows_every_production_shape() -> None:
    """``retouch plan-capacity --shape`` checks names without importing torch."""
    from retouch.functions.demo.production import SHAPES
    from retouch.platform.cli.capacity import SHAPE_NAMES

    assert sorted(SHAPE_NAMES) == sorted(SHAPES)


def test_commands_that_ask_a_server_load_nothing_heavy() -> None:
    """``retouch ls`` and ``retouch cache stats --url`` only talk HTTP: they answer in a
    fraction of a second, not after importing torch (seconds)."""
    heavy, stderr = heavy_modules_after(
        "from retouch.platform.cli.main import main\n"
        "for argv in (['ls'], ['cache', 'stats']):\n"
        "    try:\n        main([*argv, '--url', 'http://127.0.0.1:9'])\n"
        "    except SystemExit:\n        pass"
    )
    assert stderr.count("error: unreachable") == 2, stderr
    assert heavy == []


def test_platform_rooms_import_only_the_rooms_below() -> None:
    assert room_violations() == []


def test_room_check_sees_an_upward_and_a_heavy_import(tmp_path: Path) -> None:
    """The check can fail: a job that imports the gateway, a fleet module that imports
    torch on a request, and a module left outside the rooms are each reported."""
    for room in ("jobs", "fleet", "api"):
        (tmp_path / "platform" / room).mkdir(parents=True)
    (tmp_path / "platform" / "jobs" / "job.py").write_text(
        "from retouch.platform.api.gateway import Gateway\nfrom retouch.platform.state import auth\n"
    )
    (tmp_path / "platform" / "fleet" / "pool.py").write_text("def f():\n    import torch\n")
    (tmp_path / "platform" / "loose.py").write_text("import json\n")
    assert room_violations(tmp_path) == [
        "platform/fleet/pool.py:2: the fleet room imports torch",
        "platform/jobs/job.py:1: the jobs room imports retouch.platform.api.gateway"
        " (room api, above it)",
        "platform/loose.py:1: platform/loose.py is in no room",
    ]
