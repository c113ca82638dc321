from __future__ import annotations

import base64

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from retouch.functions.errors import BadRequest, RetouchError
from retouch.functions.wire.codec import RawArray, pack, unpack
from retouch.functions.wire.executor import BakeState, CacheInfo, ExecutorState, TemplateStatus
from retouch.functions.wire.invoke import (
    CacheRead,
    CacheTier,
    InvokePath,
    InvokeRequest,
    InvokeResult,
    RunStats,
)
from retouch.functions.wire.jobs import JobRequest, WebhookEvent


@given(
    hnp.arrays(
        st.sampled_from([np.uint8, np.float16, np.float32, np.int64]),
        hnp.array_shapes(max_dims=4, max_side=5),
    )
)
def test_raw_array_round_trip(array: np.ndarray) -> None:
    raw = RawArray.of(array)
    back = RawArray.from_wire(unpack(pack(raw.to_wire())), "x").to_numpy()
    assert back.dtype == array.dtype and back.shape == array.shape
    assert np.array_equal(back, array, equal_nan=True)


def test_raw_array_rejects_inconsistent_shape() -> None:
    with pytest.raises(BadRequest) as err:
        RawArray.from_wire({"dtype": "|u1", "shape": [3, 3], "data": b"\0" * 8}, "mask")
    assert err.value.field == "mask"


def test_invoke_request_validation() -> None:
    ok = {"template": "t", "mask": b"m", "prompt": "p", "seed": 3}
    assert InvokeRequest.from_wire(ok).format == "png"
    for change, field, code in [
        ({"seed": True}, "seed", "invalid_field"),
        ({"seed": 2**63}, "seed", "invalid_field"),
        ({"guidance": -1.0}, "guidance", "invalid_field"),
        ({"template": None}, "template", "missing_field"),
        ({"mask": "not base64!"}, "mask", "invalid_field"),
        ({"mask": "data:image/png,rawtext"}, "mask", "invalid_field"),
        ({"mask": None}, "mask", "missing_field"),
        ({"steps": 0}, "steps", "invalid_field"),
        ({"num_inference_steps": 201}, "num_inference_steps", "invalid_field"),
        ({"guidance_scale": 51}, "guidance_scale", "invalid_field"),
        ({"steps": 4, "num_inference_steps": 4}, "num_inference_steps", "invalid_field"),
        ({"strength": 0}, "strength", "invalid_field"),
        ({"strength": 1.5}, "strength", "invalid_field"),
        ({"strength": float("nan")}, "strength", "invalid_field"),
        ({"padding_mask_crop": -1}, "padding_mask_crop", "invalid_field"),
        ({"padding_mask_crop": 1.5}, "padding_mask_crop", "invalid_field"),
        ({"negative_prompt": 3}, "negative_prompt", "invalid_field"),
        ({"negative_prompt": "x" * 5000}, "negative_prompt", "invalid_field"),
        ({"num_inference_step": 4}, "num_inference_step", "unknown_field"),
    ]:
        with pytest.raises(BadRequest) as err:
            InvokeRequest.from_wire({**ok, **change})
        assert (err.value.field, err.value.code) == (field, code)


def test_invoke_request_takes_diffusers_names_and_json_images() -> None:
    """diffusers' argument names, the older ones as aliases; images as base64 or data URIs
    (what a JSON caller sends); a misspelt name is refused with the closest known one."""
    png = b"\x89PNG fake"
    b64 = base64.b64encode(png).decode()
    req = InvokeRequest.from_wire(
        {
            "template": "t",
            "mask": f"data:image/png;base64,{b64}",
            "prompt": "p",
            "negative_prompt": "blurry",
            "num_inference_steps": 7,
            "guidance": 3,
            "strength": 0.6,
            "padding_mask_crop": 32,
            "image_reference": b64,
        }
    )
    assert (req.mask, req.steps, req.guidance, req.strength) == (png, 7, 3.0, 0.6)
    assert (req.negative_prompt, req.padding_mask_crop) == ("blurry", 32)
    assert req.image_reference == png and req.echo()["image_reference"] == f"<{len(png)} bytes>"
    assert 0 <= req.seed < 2**63  # no seed: a random one, recorded with the request
    again = InvokeRequest.from_wire(req.to_wire())
    assert again == req
    assert {"num_inference_steps", "guidance_scale"} <= req.to_wire().keys()
    assert req.echo()["mask"] == f"<{len(png)} bytes>"
    with pytest.raises(BadRequest) as err:
        InvokeRequest.from_wire({"template": "t", "mask": b64, "prompt": "p", "gudance": 1})
    assert "did you mean 'guidance_scale'" in err.value.message


def test_unpack_malformed() -> None:
    with pytest.raises(BadRequest) as err:
        unpack(b"\x92\x01")  # array of 2 with one element
    assert err.value.code == "malformed_body"


def test_error_round_trip() -> None:
    exc = RetouchError.from_wire(
        404, {"error": {"code": "template_not_found", "message": "m", "field": "template"}}
    )
    assert (exc.status, exc.code, exc.field) == (404, "template_not_found", "template")
    assert exc.to_wire() == {
        "error": {"code": "template_not_found", "message": "m", "field": "template"}
    }


def test_an_answer_from_an_older_or_newer_executor_still_reads() -> None:
    """A gateway reads its executors' answers leniently: a field it does not know is
    ignored, a missing part or a ``null`` one takes its defaults, an unknown enum value
    its fallback; what it knows keeps its value and type through a round trip."""
    result = InvokeResult(
        image=b"px",
        format="png",
        width=2,
        height=1,
        mask_ratio=0.5,
        executor="e",
        path=InvokePath.MASKAWARE,
        seed=7,
        cache=CacheRead(tier=CacheTier.HOST, wait_ms=1.5, found=CacheTier.DISK),
        engine=RunStats(steps=4, batch_sizes=(1, 2, 2, 1)),
    )
    assert InvokeResult.from_wire(unpack(pack(result.to_wire()))) == result
    newer = {**result.to_wire(), "a_later_field": 1, "path": "a-later-path", "timings": None}
    newer["cache"] = {"tier": "host", "wait_ms": 2}  # an older executor: no "found"
    read = InvokeResult.from_wire(newer)
    assert read.path is InvokePath.STOCK and read.timings.total_ms == 0.0
    assert read.cache == CacheRead(tier=CacheTier.HOST, wait_ms=2.0, found=CacheTier.HOST)

    state = ExecutorState(
        name="e",
        pid=3,
        device="cpu",
        templates={"f": {"t": TemplateStatus(state=BakeState.BAKED, bytes=10, host=True)}},
        cache=CacheInfo(host_bytes=10, counters={"hits": 2, "load_ms": 0.5}),
    )
    wire = unpack(pack(state.to_wire()))
    assert wire["cache"]["hits"] == 2  # counters travel beside the named fields
    assert ExecutorState.from_wire(wire) == state
    older = {"name": "e", "pid": 3, "device": "cpu", "engine": None, "templates": None}
    older["cache"] = {"host_bytes": 4, "hits": 1, "a_label": "x"}
    read_state = ExecutorState.from_wire({**older, "templates": {"f": {"t": {"state": "new"}}}})
    assert read_state.engine.max_batch == 8 and read_state.cache.counters == {"hits": 1}
    assert read_state.template("f", "t").state is BakeState.UNBAKED
    with pytest.raises(BadRequest) as missing:
        ExecutorState.from_wire({"name": "e", "device": "cpu"})
    assert missing.value.field == "pid" and missing.value.code == "missing_field"


def test_a_job_request_checks_its_reporting_fields_beside_the_invocations() -> None:
    body = {"template": "t", "prompt": "p", "mask": b"m", "seed": 1}
    body |= {"webhook": "https://hooks.example/x", "webhook_events": ["started", "started"]}
    request = JobRequest.from_wire(body)
    assert request.webhook_events == (WebhookEvent.STARTED,)
    assert JobRequest.from_wire(request.to_wire()) == request
    for field, value in [
        ("webhook", "ftp://hooks.example/x"),
        ("webhook_events", ["done"]),
        ("webhook_format", "zapier"),
        ("num_images_per_prompt", 2),
    ]:
        with pytest.raises(BadRequest) as refused:
            JobRequest.from_wire({**body, field: value})
        assert refused.value.field == field
