"""``retouch bench load``: its request plan, and one small comparison run end to end (real
``retouch serve`` processes, one per configuration). The workload's statistics are
tests/platform/lab/test_workload.py's."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from retouch.platform.lab.bench.load import config_args, parse_rate, parse_rates, plan_requests
from retouch.platform.lab.workload import Workload
from tests.support import cli_refusal


def test_every_configuration_replays_the_same_requests() -> None:
    workload = Workload(requests=6, warmup=2, seed=7)
    first = plan_requests(workload, 1.5, ["t0", "t1"], (64, 64))
    again = plan_requests(workload, 1.5, ["t0", "t1"], (64, 64))
    assert len(first) == 8 and first == again
    assert first[0].at == 0.0 and all(a.at <= b.at for a, b in itertools.pairwise(first))


def test_configuration_names_map_to_serve_flags() -> None:
    assert config_args("continuous") == ["--engine", "continuous"]
    assert config_args("static+stock") == ["--engine", "static", "--no-maskaware"]
    assert config_args("continuous+naive") == ["--engine", "continuous", "--inline-prepost"]
    with pytest.raises(ValueError, match="unknown configuration token 'fast'"):
        config_args("continuous+fast")


@pytest.mark.slow
def test_bench_load_compares_configurations_in_one_run(shared_dir: Path, tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "retouch.platform.cli.main",
        "bench",
        "load",
        *("--model", "retouch:tiny-flux", "--placement", "maskaware,least-requests+static"),
        *("--rate", "auto:0.9,auto:0.6", "--requests", "4", "--warmup", "1", "--steps", "2"),
        *("--templates", "2", "--max-batch", "2", "--data-dir", str(tmp_path / "data")),
        *("--masks", "bimodal", "--slo", "600000"),
        *("--plot", str(tmp_path / "cdf.png"), "--out", str(tmp_path / "out"), "--json"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["model"] == "retouch:tiny-flux" and result["capacity_rps"] > 0
    rates = result["rates_rps"]  # both replayed on each configuration's one server
    assert rates["auto:0.6"] == pytest.approx(result["capacity_rps"] * 0.6)
    assert rates["auto:0.9"] == pytest.approx(result["capacity_rps"] * 0.9)
    assert result["requests"] == 4 and result["masks"] == "bimodal"
    assert set(result["configs"]) == {
        f"{name}@{rate}" for name in ("maskaware", "least-requests+static") for rate in rates
    }
    for figures in result["configs"].values():
        assert figures["errors"] == 0 and figures["rejected"] == 0  # a generous SLO
        assert figures["interruptions"] == 0  # pre/post ran in worker processes
        assert 0 < figures["p50_ms"] <= figures["p95_ms"] <= figures["p99_ms"]
        assert figures["throughput_rps"] > 0 and figures["goodput_rps"] > 0
        assert figures["slo_attainment"] == 1.0
        assert 0.0 <= figures["host_hit_rate"] <= 1.0
        assert figures["prediction_error_p50"] >= 0  # every result carried a prediction
        assert figures["step_ms_p50"] > 0 and figures["batch_mean"] >= 1
    assert (tmp_path / "cdf.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "load.json").read_text()) == result
    table = (tmp_path / "out" / "load.md").read_text()
    # a row per configuration and rate, the first configuration the baseline of its rate
    assert table.count("| maskaware | auto:") == 2 and "| p50 / base |" in table
    base_rows = [r for r in table.splitlines() if r.startswith("| maskaware |")]
    assert all(r.split("|")[5].strip() == "1.00" for r in base_rows)


@pytest.mark.parametrize("rate", ["fast", "auto:", "auto:-1", "0"])
def test_bad_rates_are_rejected(rate: str) -> None:
    with pytest.raises(ValueError, match="--rate must be a positive number"):
        parse_rate(rate)


def test_rates() -> None:
    assert parse_rate("2.5") == (2.5, 1.0)
    assert parse_rate("auto:0.7") == (None, 0.7)
    assert parse_rates("auto:0.5, auto:0.8") == {"auto:0.5": (None, 0.5), "auto:0.8": (None, 0.8)}
    with pytest.raises(ValueError, match="twice"):
        parse_rates("2,2")
    with pytest.raises(ValueError, match="positive number"):
        parse_rates("auto:0.5,")


def test_bench_load_rejects_bad_input_without_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for args, message in (
        (["--compare", "fast"], "unknown configuration token 'fast'"),
        (["--placement", "maskaware,closest"], "unknown configuration token 'closest'"),
        (["--slo", "-5"], "--slo must be a positive number"),
        (["--rate", "auto:x"], "--rate must be a positive number"),
    ):
        code, err = cli_refusal(capsys, "bench", "load", *args)
        assert code == 2 and message in err
