"""Every file or folder of this repository the docs name exists: a module moved or renamed
without its docs fails here, with the documents and the paths that went stale."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = ("platform", "runtime", "functions", "cachestore", "tests", "deploy", "docs", "examples")
# a path in backticks or a link: starts at one of the repository's top folders
PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(TOP)})/[\w./-]*[\w/])")


def named_paths(text: str) -> set[str]:
    """Paths a document names in code spans and links (globs and placeholders skipped)."""
    spans = re.findall(r"`([^`\n]+)`", text) + re.findall(r"\]\(([^)\s]+)\)", text)
    found = set()
    for span in spans:
        for path in PATH.findall(span):
            if not any(c in path for c in "*<>{}"):
                found.add(path.split("#")[0].rstrip("/."))
    return found


def exists(path: str, doc: Path) -> bool:
    """A file or folder, or ``module.name``: a name a module defines at its top level."""
    if (REPO / path).exists() or (doc.parent / path).exists():
        return True
    folder, _, last = path.rpartition("/")
    module, dot, name = last.partition(".")
    source = REPO / folder / f"{module}.py"
    if not dot or not source.is_file():
        return False
    defined = rf"^(?:class|def|async def) {re.escape(name)}\b|^{re.escape(name)}\s*[:=]"
    return re.search(defined, source.read_text(), re.M) is not None


def test_every_path_the_docs_name_exists() -> None:
    stale = {
        f"{doc.relative_to(REPO)}: {path}"
        for doc in DOCUMENTS
        for path in named_paths(doc.read_text())
        if not exists(path, doc)
    }
    assert not stale, "\n".join(sorted(stale))


def test_the_reader_finds_code_spans_links_and_names() -> None:
    text = "see `platform/api/gateway.py` and [the store](cachestore/disktier.py#L3), not `x/y.py`"
    assert named_paths(text) == {"platform/api/gateway.py", "cachestore/disktier.py"}
    doc = REPO / "docs" / "api.md"
    assert exists("runtime/models.load_pipeline", doc)
    assert not exists("runtime/models.load_pipelines", doc)  # a name the module lacks
    assert not exists("runtime/model.py", doc)
