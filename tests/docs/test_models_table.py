"""docs/api.md's "Built-in models" table is the one list of built-in models, and it is the
code's: every entry of ``BUILTIN_MODELS`` with its family, resolution and kind of weights."""

from __future__ import annotations

from retouch.functions.models import BUILTIN_MODELS, PREFIX
from tests.support import REPO

API = REPO / "docs" / "api.md"


def documented_models() -> dict[str, tuple[str, int, bool]]:
    """The rows of the table under "### Built-in models": name -> (family, resolution, trained)."""
    lines = API.read_text().splitlines()
    start = lines.index("### Built-in models")
    rows = {}
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or not cells[0].startswith(PREFIX):
            continue
        name, family, resolution, weights = cells[:4]
        rows[name.removeprefix(PREFIX)] = (family, int(resolution), weights.startswith("trained"))
    return rows


def test_the_built_in_models_table_is_the_catalogue() -> None:
    catalogue = {name: (m.family, m.resolution, m.trained) for name, m in BUILTIN_MODELS.items()}
    assert documented_models() == catalogue
