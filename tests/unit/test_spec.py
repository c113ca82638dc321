from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retouch.functions.errors import InvalidSpec
from retouch.functions.spec import FunctionSpec, load_spec_file, parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"


def test_examples_parse() -> None:
    spec, images = load_spec_file(EXAMPLES / "tiny-sd.toml")
    assert (
        spec.name == "tiny-sd"
        and spec.family == "sd-inpaint"
        and (spec.width, spec.height) == (128, 128)
    )
    assert set(images) == {"street", "poster"} and all(p.exists() for p in images.values())
    flux, _ = load_spec_file(EXAMPLES / "tiny-flux.toml")
    assert flux.name == "tiny-flux" and flux.scheduler == "flow-euler" and flux.slo_ms == 30000.0


def test_defaults_follow_family() -> None:
    spec = parse_spec(
        {
            "name": "f",
            "model": "m",
            "family": "flux-inpaint",
            "resolution": [256, 128],
            "templates": {"t": {}},
        }
    )
    assert (spec.width, spec.height, spec.scheduler, spec.steps) == (256, 128, "flow-euler", 20)
    assert spec.full_steps == 0  # every step mask-aware unless the function asks otherwise


@given(
    steps=st.integers(1, 200),
    guidance=st.floats(0, 50, allow_nan=False),
    width=st.integers(4, 64).map(lambda v: v * 16),
    seeds=st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True),
        st.integers(0, 2**63 - 1),
        min_size=1,
        max_size=4,
    ),
    lo=st.integers(0, 3),
    full=st.integers(0, 200),
)
def test_round_trip(
    steps: int, guidance: float, width: int, seeds: dict[str, int], lo: int, full: int
) -> None:
    doc = {
        "name": "fn-1",
        "model": "retouch:tiny-sd",
        "family": "sd-inpaint",
        "resolution": [width, 128],
        "steps": steps,
        "guidance": guidance,
        "scheduler": "euler",
        "templates": {k: {"prompt": f"p {k}", "seed": s} for k, s in seeds.items()},
        "scaling": {"min_executors": lo, "max_executors": lo + 1},
        "full_steps": full,
    }
    spec = parse_spec(doc)
    assert isinstance(spec, FunctionSpec)
    assert parse_spec(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"name": "Bad Name"}, "name"),
        ({"model": 3}, "model"),
        ({"family": "gan"}, "family"),
        ({"resolution": None}, "resolution"),
        ({"resolution": [128]}, "resolution"),
        ({"resolution": 120}, "resolution"),
        ({"steps": 0}, "steps"),
        ({"steps": True}, "steps"),
        ({"guidance": "high"}, "guidance"),
        ({"full_steps": -1}, "full_steps"),
        ({"full_steps": 2.5}, "full_steps"),
        ({"scheduler": "flow-euler"}, "scheduler"),
        ({"templates": []}, "templates"),
        ({"templates": {"bad id!": {}}}, "templates.bad id!"),
        ({"templates": {"t": {"seed": -1}}}, "templates.t.seed"),
        ({"templates": {"t": {"prompt": 5}}}, "templates.t.prompt"),
        ({"scaling": {"min_executors": 3, "max_executors": 1}}, "scaling.min_executors"),
        ({"slo": {"latency_ms": 0}}, "slo.latency_ms"),
    ],
)
def test_errors_name_the_field(change: dict, field: str) -> None:
    doc = {
        "name": "ok",
        "model": "m",
        "family": "sd-inpaint",
        "resolution": 128,
        "templates": {"t": {}},
    }
    doc.update(change)
    with pytest.raises(InvalidSpec) as err:
        parse_spec(doc)
    assert err.value.field == field
    assert err.value.status == 422


def test_spec_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "f.toml"
    path.write_text(
        'name = "f"\nmodel = "m"\nfamily = "sd-inpaint"\nresolution = 64\n[templates.t]\nprompt = "x"\n'
    )
    with pytest.raises(InvalidSpec) as err:
        load_spec_file(path)
    assert err.value.field == "templates.t.image"
    path.write_text("= broken")
    with pytest.raises(InvalidSpec, match="not valid TOML"):
        load_spec_file(path)
