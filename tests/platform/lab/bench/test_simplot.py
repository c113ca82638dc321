"""``retouch bench sim --plot``: the timelines as stacked panels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from retouch.platform.cli.main import main
from retouch.platform.lab.bench.simplot import DPI, FIGSIZE_IN, plot_timelines

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _timeline(windows: int, ready: int, rejected_from: int) -> list[dict]:
    return [
        {
            "t_s": 10.0 * k,
            "arrivals": 100 + 20 * k,
            "rejected": 5 * k if k >= rejected_from else 0,
            "queued": max(0, 3 * k - 10),
            "ready": ready + k // 3,
            "starting": 2 if k % 4 == 1 else 0,
            "draining": 1 if k == windows - 2 else 0,
            "p95_ms": None if k == 0 else 2000.0 + 150.0 * k,
        }
        for k in range(windows)
    ]


RESULT = {
    "executors": 4,
    "rate_rps": 12.5,
    "load": 0.8,
    "arrivals": "gamma:2",
    "masks": "beta:0.19",
    "slo_ms": 5900.0,
    "profile": "flux-h800",
    "configs": {
        "maskaware": {"p95_ms": 3000.0, "timeline": _timeline(12, 4, 6)},
        "least-requests": {"p95_ms": 3500.0, "timeline": _timeline(12, 4, 4)},
    },
}


def _check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        assert image.size == (int(FIGSIZE_IN[0] * DPI), int(FIGSIZE_IN[1] * DPI))
        colours = np.unique(np.asarray(image.convert("RGB")).reshape(-1, 3), axis=0)
    assert len(colours) > 10  # lines in several colours, not a blank canvas


def test_a_small_result_draws_a_png(tmp_path: Path) -> None:
    path = tmp_path / "sim.png"
    plot_timelines(RESULT, path)
    _check_png(path)


def test_a_result_without_a_timeline_is_a_clear_error(tmp_path: Path) -> None:
    result = {**RESULT, "configs": {"maskaware": {"p95_ms": 3000.0}}}
    with pytest.raises(ValueError, match="'maskaware' has no timeline"):
        plot_timelines(result, tmp_path / "sim.png")
    assert not (tmp_path / "sim.png").exists()
    broken = {"maskaware": {"timeline": [{"t_s": 0.0, "arrivals": 1}]}}
    with pytest.raises(ValueError, match="window 0 lacks rejected"):
        plot_timelines({**RESULT, "configs": broken}, tmp_path / "sim.png")


def test_a_plot_into_a_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        plot_timelines(RESULT, tmp_path / "nowhere" / "sim.png")


def test_bench_sim_plots_and_a_bad_plot_path_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "sim", "--executors", "2", "--requests", "60", "--warmup", "6"]
    args += ["--placement", "maskaware,round-robin", "--steps", "4", "--json"]
    for plot, says in (
        (tmp_path / "nowhere" / "sim.png", "does not exist"),
        (tmp_path / "sim.txt", "--plot writes"),
    ):
        with pytest.raises(SystemExit) as exc:
            main([*args, "--plot", str(plot)])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and says in err, err
    path = tmp_path / "sim.png"
    main([*args, "--plot", str(path)])
    assert json.loads(capsys.readouterr().out)["configs"]["maskaware"]["timeline"]
    _check_png(path)
