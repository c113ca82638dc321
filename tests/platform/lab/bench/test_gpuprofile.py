"""The GPU profile derived from FlashPS's published figures, and reading profile files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from retouch.platform.cli.main import main
from retouch.platform.lab.bench import gpuprofile
from retouch.runtime.costmodel import CostModel, LinearFit
from retouch.runtime.prediction import StepCoster, plan_table
from tests.support import REPO

SHIPPED = REPO / "deploy" / "profiles" / gpuprofile.SHIPPED
STEPS = 28
GRID = 4096


@pytest.fixture(scope="module")
def shipped() -> CostModel:
    return gpuprofile.load_profile(SHIPPED)


@pytest.fixture(scope="module")
def coster(shipped: CostModel) -> StepCoster:
    """The simulator's coster: the profile with the plan table an executor ships."""
    grids = shipped.extra["grids"]
    return StepCoster(shipped, grids, plan_table(shipped, grids, 8))


def edit_s(coster: StepCoster, ratio: float) -> float:
    return STEPS * coster.step_s0(1, round(ratio * GRID))


def throughput(coster: StepCoster, batch: int, ratio: float = 0.19) -> float:
    return batch / (STEPS * coster.step_s0(batch, batch * round(ratio * GRID)))


def test_the_shipped_file_is_what_the_builder_writes(tmp_path: Path) -> None:
    built = tmp_path / "built.json"
    gpuprofile.main([str(built)])
    assert json.loads(SHIPPED.read_text()) == json.loads(built.read_text())
    assert SHIPPED.read_text() == built.read_text()  # regenerate: see deploy/profiles/README
    model = gpuprofile.load_profile(built)  # what the builder wrote (it plans ~2 s a build)
    assert len(model.blocks) == 57
    assert sum(b.name.startswith("double") for b in model.blocks) == 19
    assert model.extra["grids"] == [GRID]
    assert "FlashPS" in model.extra["source"] and model.extra["derivation"]


def test_the_profile_reproduces_the_published_edit_latencies(coster: StepCoster) -> None:
    assert edit_s(coster, 1.0) == pytest.approx(2.06 * 1.9, rel=0.05)  # stock, ~3.9 s
    assert edit_s(coster, 0.2) == pytest.approx(2.06, rel=0.05)
    ratios = np.linspace(0.05, 0.6, 12)
    fit = LinearFit.fit(list(ratios), [edit_s(coster, float(m)) for m in ratios])
    assert fit.r2 >= 0.98  # latency linear in the mask ratio
    assert fit.slope > 0


def test_batching_gains_then_plateaus(coster: StepCoster) -> None:
    one, four, eight = (throughput(coster, n) for n in (1, 4, 8))
    assert 1.6 <= eight / one <= 2.5
    assert eight / four - 1 < 0.25 * (four / one - 1)  # 4 -> 8 gains far less than 1 -> 4
    stock_gain = throughput(coster, 4, 1.0) / throughput(coster, 1, 1.0)
    assert (four / one) / stock_gain == pytest.approx(1.29, rel=0.1)  # published 1.29x


def test_the_file_states_what_it_reproduces(shipped: CostModel, coster: StepCoster) -> None:
    figures = shipped.extra["figures"]
    for ratio, seconds in figures["edit_s"].items():
        assert edit_s(coster, float(ratio)) == pytest.approx(seconds, abs=1e-3)
    for batch, rps in figures["throughput_rps"].items():
        assert throughput(coster, int(batch)) == pytest.approx(rps, abs=1e-3)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (None, "cannot read the profile"),
        ("{not json", "is not JSON"),
        ('{"device": "x", "blocks": []}', "lacks the key 'load'"),
        ('{"device": "x", "blocks": [], "load": {"intercept": 0, "slope": 0, "r2": 1}}', "grids"),
        ("[1, 2]", "is not a cost model"),
    ],
)
def test_a_bad_profile_file_is_a_clear_error(tmp_path: Path, text: str | None, says: str) -> None:
    path = tmp_path / "profile.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=says) as exc:
        gpuprofile.load_profile(path)
    assert str(path) in str(exc.value)


def test_named_profiles_and_a_bad_one_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpuprofile.sim_profile("flux-h800").device.startswith("NVIDIA H800")
    assert gpuprofile.sim_profile("synthetic").device == "cuda-synthetic"
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    for profile, says in (("flux-h900", "--profile is synthetic"), (str(bad), "not JSON")):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "sim", "--profile", profile, "--requests", "20", "--warmup", "0"])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and says in err, err


def test_the_summary_names_its_profile(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "sim", "--executors", "2", "--requests", "40", "--warmup", "4"]
    main([*args, "--placement", "maskaware", "--steps", "4", "--profile", "flux-h800", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["profile"] == "flux-h800"
    assert out["configs"]["maskaware"]["p50_ms"] > 0
