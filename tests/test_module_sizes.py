"""A newcomer reads a module in one sitting and a class by its name: no module over
``MAX_LINES`` lines and no class with more than ``MAX_METHODS`` methods in the packages.

Data tables are exempt, named in ``TABLES`` with why; anything else that grows past the
limits is split by concept (one module per concept), not into grab-bags.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("platform", "runtime", "functions", "cachestore")
MAX_LINES = 650
MAX_METHODS = 30
TABLES: dict[str, str] = {}  # path -> why it is a data table, not code


def modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def long_modules(paths: list[Path], root: Path = REPO) -> list[str]:
    out = []
    for path in paths:
        name = str(path.relative_to(root))
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES and name not in TABLES:
            out.append(f"{name}: {lines} lines")
    return out


def big_classes(paths: list[Path], root: Path = REPO) -> list[str]:
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [
                    n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
                if len(methods) > MAX_METHODS:
                    out.append(f"{path.relative_to(root)}: {node.name} has {len(methods)} methods")
    return out


def test_no_module_is_too_long() -> None:
    assert not long_modules(modules())


def test_no_class_has_too_many_methods() -> None:
    assert not big_classes(modules())


def test_the_checks_see_a_long_module_and_a_big_class(tmp_path: Path) -> None:
    body = "".join(f"    def m{i}(self):\n        pass\n" for i in range(MAX_METHODS + 1))
    source = tmp_path / "big.py"
    source.write_text("class Big:\n" + body + "\n" * MAX_LINES)
    lines = len(source.read_text().splitlines())
    assert long_modules([source], tmp_path) == [f"big.py: {lines} lines"]
    assert big_classes([source], tmp_path) == [f"big.py: Big has {MAX_METHODS + 1} methods"]
