"""README.md's quickstart runs as written: every fenced block after a ``<!-- quickstart -->``
line, in order, from a folder laid out like a checkout after ``make demo`` (``.venv``,
``deploy/``, ``docs/``), against a real ``retouch serve`` on loopback."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFilter

from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess
from tests.support import REPO

MARK = "<!-- quickstart -->"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.DOTALL)
BLOCK_TIMEOUT_S = 600  # a cold deploy profiles the model and bakes its templates


def quickstart_blocks(readme: str) -> list[tuple[str, str]]:
    """(language, code) of the fenced block that follows each quickstart mark."""
    blocks = []
    for part in readme.split(MARK)[1:]:
        found = BLOCK.match(part.lstrip("\n"))
        assert found, f"a {MARK} line is not followed by a fenced block: {part[:80]!r}"
        blocks.append((found.group(1), found.group(2)))
    return blocks


def test_the_quickstart_marks_a_shell_and_a_python_block() -> None:
    languages = [lang for lang, _ in quickstart_blocks((REPO / "README.md").read_text())]
    assert "sh" in languages and "python" in languages
    assert set(languages) <= {"sh", "python"}


def _checkout(where: Path) -> Path:
    """A folder with what the README's commands use: the venv, the specs, the shipped mask."""
    venv = Path(sys.prefix)
    if not (venv / "bin" / "retouch").exists():
        pytest.skip(f"the README runs .venv/bin/retouch; {venv} has no bin/retouch")
    where.mkdir()
    (where / ".venv").symlink_to(venv)
    for name in ("deploy", "docs"):
        (where / name).symlink_to(REPO / name)
    return where


def test_the_readme_quickstart_runs_as_written(tmp_path: Path) -> None:
    work = _checkout(tmp_path / "checkout")
    blocks = quickstart_blocks((REPO / "README.md").read_text())
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("RETOUCH_") or k.endswith("_DIR")
    }
    # one torch thread, as `retouch demo` runs the same model: a 128 px model is bound by
    # per-op overhead, and on a shared machine a multi-threaded step stalls on every op
    with ServerProcess(tmp_path / "data", extra_args=["--threads", "1"]) as server:
        env["RETOUCH_URL"] = server.url
        for number, (language, code) in enumerate(blocks, 1):
            if language == "sh":
                cmd = ["bash", "-euo", "pipefail", "-c", code]
            else:
                script = tmp_path / f"block{number}.py"
                script.write_text(code)
                cmd = [sys.executable, str(script)]
            done = subprocess.run(
                cmd, cwd=work, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
            )
            assert done.returncode == 0, (
                f"quickstart block {number} ({language}) failed:\n{code}\n"
                f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
            )
        with Client(server.url) as client:
            assert "shapes" not in [f["name"] for f in client.list()]  # the last block removed it

    template = np.asarray(Image.open(REPO / "deploy/examples/templates/scene-900800003.png"))
    mask_image = Image.open(REPO / "docs/examples/ring-mask.png")
    mask = np.asarray(mask_image) > 0
    far = np.asarray(mask_image.filter(ImageFilter.MaxFilter(9))) == 0  # beyond the feather
    for name in ("green-ring.png", "red-ring.png"):  # written by the shell and Python blocks
        edit = np.asarray(Image.open(io.BytesIO((work / name).read_bytes())).convert("RGB"))
        assert edit.shape == (*template.shape[:2], 3)
        assert not np.array_equal(edit[mask], template[..., :3][mask])  # the ring was repainted
        assert np.array_equal(edit[far], template[..., :3][far])  # composited into the template


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces → -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_headline_number_links_to_a_section_of_the_benchmarks() -> None:
    readme = (REPO / "README.md").read_text()
    headings = [
        line.lstrip("#").strip()
        for line in (REPO / "docs" / "benchmarks.md").read_text().splitlines()
        if line.startswith("#")
    ]
    anchors = {_slug(h) for h in headings}
    table = readme.split("## Headline numbers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) >= 7  # the header and the figures
    for row in rows[1:]:
        links = re.findall(r"\]\(docs/benchmarks\.md#([\w-]+)\)", row)
        assert links, f"a headline number without its section: {row}"
        assert set(links) <= anchors, f"{links} is not a heading of docs/benchmarks.md"
