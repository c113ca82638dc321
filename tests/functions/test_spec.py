from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retouch.functions.demo.shapes import WORDS
from retouch.functions.errors import BadRequest, InvalidSpec
from retouch.functions.families import check_reference
from retouch.functions.spec import STORAGES, FunctionSpec, load_spec_file, parse_spec
from retouch.functions.wire.codec import pack, unpack
from retouch.functions.wire.invoke import MAX_PROMPT_CHARS
from retouch.runtime.asgi import parse_json
from retouch.runtime.maskaware.rowformat import RowFormat
from tests.support import EXAMPLES


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
    assert spec.halo == 0  # a DiT family blends the unmasked latents back: no halo
    sd = parse_spec({**_doc(), "family": "sd-inpaint"})
    assert sd.halo == 2  # a UNet's convolutions reach past the mask
    assert parse_spec(sd.to_dict()).halo == 2
    assert parse_spec({**_doc(), "family": "sd-inpaint", "halo": 0}).halo == 0


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


def test_scaling_settings_parse_and_round_trip() -> None:
    doc = {"name": "ok", "model": "m", "family": "sd-inpaint", "resolution": 128}
    doc["templates"] = {"t": {}}
    scaling = {"upscale_hold_s": 300, "rise_cap": 1.25, "downscale_margin": 0.2}
    spec = parse_spec({**doc, "scaling": {**scaling, "headroom_sigmas": 1.0}})
    held = spec.scaling
    assert (held.upscale_hold_s, held.rise_cap, held.downscale_margin) == (300.0, 1.25, 0.2)
    assert held.headroom_sigmas == 1.0 and held.downscale_delay_s == 600.0  # the rest default
    assert parse_spec(spec.to_dict()) == spec
    plain = parse_spec(doc).scaling
    assert (plain.upscale_hold_s, plain.rise_cap, plain.downscale_margin) == (0.0, 2.0, 0.0)


def test_storage_defaults_to_native_and_round_trips() -> None:
    doc = {"name": "ok", "model": "m", "family": "sd-inpaint", "resolution": 128}
    doc["templates"] = {"t": {}}
    assert parse_spec(doc).storage == "native"
    fp8 = parse_spec({**doc, "storage": "fp8"})
    assert fp8.storage == "fp8"
    assert parse_spec(fp8.to_dict()) == fp8


def test_examples_are_shown_as_given_and_bounded() -> None:
    """The page's menu of example prompts: kept in order through the stored document, at
    most 16 of at most 200 characters (the limits accepted at their edges)."""
    assert parse_spec(_doc()).examples == () and parse_spec(_doc()).to_dict()["examples"] == []
    examples = [f"prompt {i}".ljust(200, ".") for i in range(16)]
    spec = parse_spec(_doc(examples=examples))
    assert spec.to_dict()["examples"] == examples and parse_spec(spec.to_dict()) == spec


def test_schedulers_a_request_may_choose() -> None:
    """Besides the spec's own scheduler only those it lists; the stored document keeps the
    list, and a name outside it is a 400 naming ``scheduler`` and the allowed ones."""
    plain = parse_spec(_doc())
    assert plain.schedulers == () and plain.allowed_schedulers == ("ddim",)
    assert plain.request_scheduler(None) == plain.request_scheduler("ddim") == "ddim"
    spec = parse_spec(_doc(schedulers=["euler-a", "ddim", "dpm++"]))
    assert spec.to_dict()["schedulers"] == ["euler-a", "ddim", "dpm++"]
    assert parse_spec(spec.to_dict()) == spec
    assert spec.allowed_schedulers == ("ddim", "euler-a", "dpm++")
    assert spec.request_scheduler("dpm++") == "dpm++"
    for refused in (plain, spec):
        with pytest.raises(BadRequest) as err:
            refused.request_scheduler("euler")
        assert (err.value.status, err.value.field, err.value.code) == (
            400,
            "scheduler",
            "invalid_field",
        )
        assert all(name in err.value.message for name in refused.allowed_schedulers)


def test_every_example_function_offers_example_prompts() -> None:
    for path in sorted(EXAMPLES.glob("*.toml")):
        assert load_spec_file(path)[0].examples, path.name
    shapes, _ = load_spec_file(EXAMPLES / "shapes-sd.toml")
    vocabulary = set(WORDS)  # the trained model's captions: each word one token
    for text in shapes.examples:
        assert set(text.split()) <= vocabulary, text


def test_storages_are_the_row_formats() -> None:
    """The spec's choices are exactly the formats the runtime stores rows in."""
    assert set(STORAGES) == {f.value for f in RowFormat}


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
        ({"composite": "yes"}, "composite"),
        ({"composite": 1}, "composite"),
        ({"feather_px": -1}, "feather_px"),
        ({"halo": -1}, "halo"),
        ({"halo": 17}, "halo"),
        ({"feather_px": 65}, "feather_px"),
        ({"scheduler": "flow-euler"}, "scheduler"),
        ({"storage": "fp16"}, "storage"),
        ({"storage": 8}, "storage"),
        ({"templates": []}, "templates"),
        ({"templates": {"bad id!": {}}}, "templates.bad id!"),
        ({"templates": {"t": {"seed": -1}}}, "templates.t.seed"),
        ({"templates": {"t": {"prompt": 5}}}, "templates.t.prompt"),
        ({"scaling": {"min_executors": 3, "max_executors": 1}}, "scaling.min_executors"),
        ({"scaling": {"target_utilisation": 0}}, "scaling.target_utilisation"),
        ({"scaling": {"target_utilisation": 1.5}}, "scaling.target_utilisation"),
        ({"scaling": {"headroom_sigmas": -1}}, "scaling.headroom_sigmas"),
        ({"scaling": {"upscale_hold_s": -1}}, "scaling.upscale_hold_s"),
        ({"scaling": {"rise_cap": 0.5}}, "scaling.rise_cap"),
        ({"scaling": {"downscale_margin": 1}}, "scaling.downscale_margin"),
        ({"slo": {"latency_ms": 0}}, "slo.latency_ms"),
        ({"examples": "a red star"}, "examples"),
        ({"examples": {"0": "a red star"}}, "examples"),
        ({"examples": ["a red star"] * 17}, "examples[16]"),
        ({"examples": ["a red star", "x" * 201]}, "examples[1]"),
        ({"examples": ["a red star", 5]}, "examples[1]"),
        ({"examples": [None]}, "examples[0]"),
        ({"examples": ["  "]}, "examples[0]"),
        ({"examples": ["a red\nstar"]}, "examples[0]"),
        ({"schedulers": "euler"}, "schedulers"),
        ({"schedulers": ["euler", "flow-euler"]}, "schedulers[1]"),
        ({"schedulers": ["euler", 3]}, "schedulers[1]"),
        ({"schedulers": ["euler", "ddim", "euler"]}, "schedulers[2]"),
        ({"schedulers": ["euler"] * 9}, "schedulers[8]"),
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


def _doc(**change: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "ok",
        "model": "m",
        "family": "sd-inpaint",
        "resolution": 128,
        "templates": {"t": {"prompt": "p", "seed": 1}},
    }
    doc.update(change)
    return doc


@pytest.mark.parametrize(
    ("doc", "field", "suggestion"),
    [
        (_doc(modell="m"), "modell", "model"),
        (_doc(step=5), "step", "steps"),
        (_doc(guidence=3.0), "guidence", "guidance"),
        (_doc(fullsteps=2), "fullsteps", "full_steps"),
        (_doc(colour="red"), "colour", None),
        (_doc(templates={"t": {"promt": "x"}}), "templates.t.promt", "prompt"),
        (_doc(templates={"t": {"sede": 1}}), "templates.t.sede", "seed"),
        (_doc(scaling={"max_executor": 2}), "scaling.max_executor", "max_executors"),
        (_doc(slo={"latency": 100.0}), "slo.latency", "latency_ms"),
    ],
)
def test_unknown_fields_are_refused_with_a_suggestion(
    doc: dict[str, Any], field: str, suggestion: str | None
) -> None:
    """A misspelt field must not deploy silently with the default (``step = 5`` ran 20)."""
    with pytest.raises(InvalidSpec) as err:
        parse_spec(doc)
    assert err.value.field == field and err.value.code == "invalid_spec"
    assert f"unknown field {field.rsplit('.', 1)[-1]!r}" in err.value.message
    if suggestion is None:
        assert "known fields" in err.value.message
    else:
        assert f"did you mean {suggestion!r}?" in err.value.message


def test_template_image_path_is_a_known_field() -> None:
    spec = parse_spec(_doc(templates={"t": {"image": "t.png", "prompt": "p"}}))
    assert spec.templates["t"].image == "t.png"


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (_doc(name="ok\n"), "name"),
        (_doc(name="ok\n\n"), "name"),
        (_doc(name="a" * 64), "name"),
        (_doc(name="Ok"), "name"),
        (_doc(name="café"), "name"),
        (_doc(name=""), "name"),
        (_doc(templates={"t\n": {}}), "templates.t\n"),
        (_doc(templates={"t" * 129: {}}), "templates." + "t" * 129),
        (_doc(templates={"ünï": {}}), "templates.ünï"),
        (_doc(templates={"t": {"prompt": "x" * 4097}}), "templates.t.prompt"),
    ],
    ids=lambda v: repr(v)[:30] if isinstance(v, str) else None,
)
def test_names_ids_and_prompts_are_bounded(doc: dict[str, Any], field: str) -> None:
    """Patterns match the whole string (``$`` used to accept a trailing newline) and a
    template prompt has the invocation prompt's limit."""
    with pytest.raises(InvalidSpec) as err:
        parse_spec(doc)
    assert err.value.field == field


def test_limits_at_their_edges_are_accepted() -> None:
    spec = parse_spec(
        _doc(name="a" * 63, templates={"T" * 128: {"prompt": "x" * MAX_PROMPT_CHARS}})
    )
    assert spec.name == "a" * 63 and len(spec.templates["T" * 128].prompt) == 4096


def test_duplicate_template_in_toml_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f.toml"
    path.write_text(
        'name = "f"\nmodel = "m"\nfamily = "sd-inpaint"\nresolution = 64\n'
        '[templates.t]\nimage = "a.png"\n[templates.t]\nimage = "b.png"\n'
    )
    with pytest.raises(InvalidSpec, match="not valid TOML"):
        load_spec_file(path)


def test_duplicate_template_in_a_body_is_refused() -> None:
    """msgpack and JSON bodies keep the last duplicate silently unless the decoder refuses."""
    body = b"\x81\xa4spec\x81\xa9templates\x82\xa1t\x80\xa1t\x80"  # {"spec": {"templates": {t, t}}}
    with pytest.raises(BadRequest) as err:
        unpack(body)
    assert (err.value.code, err.value.field) == ("duplicate_key", "spec.templates.t")
    with pytest.raises(BadRequest) as err:
        parse_json(b'{"spec": {"templates": {"t": {}, "u": [{"a": 1, "a": 2}]}}}')
    assert (err.value.code, err.value.field) == ("duplicate_key", "spec.templates.u[0].a")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (pack({b"name": "x"}), "name"),
        (pack({"spec": {"templates": {b"t": {}}}}), "spec.templates.t"),
        (pack({"a": [1, {b"k": 2}]}), "a[1].k"),
    ],
)
def test_bytes_map_keys_are_refused(body: bytes, field: str) -> None:
    with pytest.raises(BadRequest) as err:
        unpack(body)
    assert (err.value.code, err.value.field) == ("malformed_body", field)


@pytest.mark.parametrize(
    "data",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        b'{"steps": ' + b"9" * 5000 + b"}",
        b'{"guidance": NaN}',
        b'{"guidance": -Infinity}',
        b"\xff\xfe",
        b"",
    ],
    ids=["deep-array", "deep-object", "huge-int", "nan", "infinity", "not-utf8", "empty"],
)
def test_hostile_json_is_a_400(data: bytes) -> None:
    with pytest.raises(BadRequest) as err:
        parse_json(data)
    assert err.value.code == "malformed_body" and err.value.status == 400


def test_deep_msgpack_is_a_400() -> None:
    with pytest.raises(BadRequest) as err:
        unpack(b"\x91" * 5000 + b"\x01")
    assert err.value.code == "malformed_body" and "deeply" in err.value.message


def test_flux_fill_defaults_are_fills_own() -> None:
    """FLUX.1-Fill is run at 50 steps and guidance 30 (FluxFillPipeline's defaults)."""
    doc = {"name": "f", "model": "m", "family": "flux-fill", "resolution": 128}
    spec = parse_spec({**doc, "templates": {"t": {}}})
    assert (spec.steps, spec.guidance, spec.scheduler) == (50, 30.0, "flow-euler")


def test_only_a_family_that_reads_a_reference_image_takes_one() -> None:
    """``image_reference`` is FLUX.1 Kontext's: another family's function refuses it with a
    400 naming the field (the gateway checks before anything is decoded)."""
    check_reference("flux-kontext")
    for family in ("flux-inpaint", "flux-fill", "sd-inpaint"):
        with pytest.raises(BadRequest) as refused:
            check_reference(family)
        assert (refused.value.field, refused.value.code) == ("image_reference", "unsupported_field")
