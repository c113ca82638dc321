"""What many tests share: the repository's paths and one polling wait.

Tests that start real processes wait for states they are not told about (an executor
restarted, a pool back to zero, a job running); they all poll the same way, so a slow
machine shows up as one message with one budget, not a different loop per file. Waiting
for bakes is ``retouch.platform.lab.bench.load.wait_baked``, the bench's own wait."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "deploy" / "examples"
# Production shapes the CPU runs skip: flux-fill-dev and flux-kontext run flux-dev's blocks
# and qwen-image-edit qwen-image's (their own input layouts are covered by the tiny Fill,
# Kontext and Qwen-Image-Edit models' tests), and flux2-klein's blocks, layout and row
# loader are covered by the tiny Klein model's tests (its shape's tier tests took about
# 2 min on a 2-core CPU); a GPU checks every shape.
CPU_SKIPPED_SHAPES = frozenset({"flux-fill-dev", "flux-kontext", "flux2-klein", "qwen-image-edit"})
WAIT_S = 240.0  # a cold start on a loaded 2-core machine: process, imports, model, profile

T = TypeVar("T")


def wait_for(
    what: str,
    ok: Callable[[], T],
    timeout: float = WAIT_S,
    interval: float = 0.1,
    detail: Callable[[], object] | None = None,
) -> T:
    """Poll ``ok`` until it returns something truthy and return that value. On timeout
    the assertion names ``what`` and, when given, ``detail()``: the state that was seen."""
    deadline = time.monotonic() + timeout
    while True:
        value = ok()
        if value:
            return value
        if time.monotonic() > deadline:
            seen = f"; seen: {detail()}" if detail is not None else ""
            raise AssertionError(f"not seen within {timeout:.0f} s: {what}{seen}")
        time.sleep(interval)


@dataclass(frozen=True)
class CliRun:
    """What ``retouch ARGS`` did: its exit code, stdout and stderr."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> CliRun:
    """``retouch ARGS`` run in this process (the CLI's own ``main``: no interpreter and
    torch import per command; ``tests/platform/cli/test_cli.py`` runs the installed entry
    point). A traceback escapes as an exception other than SystemExit, failing the test."""
    from retouch.platform.cli.main import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    out = capsys.readouterr()
    return CliRun(code, out.out, out.err)


def cli_refusal(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``retouch ARGS`` in this process, refused: its exit code and stderr."""
    done = run_cli(capsys, *args)
    assert done.returncode != 0, done.stdout
    return done.returncode, done.stderr


def decodes_run(metrics_url: str) -> float:
    """The gateway's count of image decodes run since start (from its metrics listener)."""
    for line in httpx.get(metrics_url, timeout=30).text.splitlines():
        if line.startswith('retouch_image_decodes{quantity="decoded"}'):
            return float(line.split()[-1])
    raise AssertionError("no retouch_image_decodes decoded in /metrics")


def reap(process: subprocess.Popen, timeout: float = 30.0) -> int:
    """Wait for a process asked to stop; SIGKILL it if it takes longer than ``timeout``."""
    try:
        return process.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, TimeoutError):  # a Popen's, a ForkedProcess's
        process.kill()
        return process.wait()


def one_template(examples: Path, name: str, steps: int, template: str):
    """``tiny-sd.toml`` as function ``name`` with ``steps`` and only ``template``: the spec
    and its one image, for ``Client.deploy``."""
    import dataclasses

    from retouch.platform.api.client import read_spec_file

    spec, images = read_spec_file(examples / "tiny-sd.toml")
    spec = dataclasses.replace(
        spec, name=name, steps=steps, templates={template: spec.templates[template]}
    )
    return spec, {template: images[template]}
