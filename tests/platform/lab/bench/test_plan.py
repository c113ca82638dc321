"""``retouch bench plan`` from the command line: it runs, reports every configuration, and
behind a slow emulated link the plan stops loading rows for some blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import cli_refusal, run_cli


def _bench_plan(
    shared_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    *args: str,
) -> dict:
    """``retouch bench plan --json ARGS`` in this process, on the session's built models."""
    monkeypatch.setenv("RETOUCH_DATA_DIR", str(shared_dir))
    done = run_cli(capsys, "bench", "plan", "--json", *args)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_bench_plan_reports_plan_and_naive_loading(
    shared_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _bench_plan(
        shared_dir,
        capsys,
        monkeypatch,
        *("--model", "retouch:tiny-flux", "--steps", "2", "--repeats", "1"),
        *("--link-gbps", "0.002"),
    )
    for name in ("plan", "sequential", "overlapped", "sync"):
        assert result[f"{name}_s"] > 0
    assert result["ratio_sequential_over_plan"] > 0
    assert len(result["plan_modes"]) == result["blocks"]
    # 2 MB/s makes every load cost far more than recomputing the block, by a margin no load
    # on a shared machine closes: the plan must not load rows for every block (all-sparse
    # would be "S" everywhere).
    assert "F" in result["plan_modes"], result["plan_modes"]
    assert result["predicted_s"]["plan"] <= result["predicted_s"]["sequential"]
    assert result["memory"]["reader"] == "memory"


def test_bench_plan_rejects_unknown_model_without_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = cli_refusal(capsys, "bench", "plan", "--model", "nope")
    assert code != 0 and "retouch:" in err
