from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from retouch.functions import wire
from retouch.functions.errors import BadRequest, RetouchError


@given(
    hnp.arrays(
        st.sampled_from([np.uint8, np.float16, np.float32, np.int64]),
        hnp.array_shapes(max_dims=4, max_side=5),
    )
)
def test_raw_array_round_trip(array: np.ndarray) -> None:
    raw = wire.RawArray.of(array)
    back = wire.RawArray.from_wire(wire.unpack(wire.pack(raw.to_wire())), "x").to_numpy()
    assert back.dtype == array.dtype and back.shape == array.shape
    assert np.array_equal(back, array, equal_nan=True)


def test_raw_array_rejects_inconsistent_shape() -> None:
    with pytest.raises(BadRequest) as err:
        wire.RawArray.from_wire({"dtype": "|u1", "shape": [3, 3], "data": b"\0" * 8}, "mask")
    assert err.value.field == "mask"


def test_invoke_request_validation() -> None:
    ok = {"template": "t", "mask": b"m", "prompt": "p", "seed": 3}
    assert wire.InvokeRequest.from_wire(ok).format == "png"
    for change, field, code in [
        ({"seed": True}, "seed", "invalid_field"),
        ({"seed": 2**63}, "seed", "invalid_field"),
        ({"guidance": -1.0}, "guidance", "invalid_field"),
        ({"template": None}, "template", "missing_field"),
        ({"mask": "text"}, "mask", "invalid_field"),
    ]:
        with pytest.raises(BadRequest) as err:
            wire.InvokeRequest.from_wire({**ok, **change})
        assert (err.value.field, err.value.code) == (field, code)


def test_unpack_malformed() -> None:
    with pytest.raises(BadRequest) as err:
        wire.unpack(b"\x92\x01")  # array of 2 with one element
    assert err.value.code == "malformed_body"


def test_error_round_trip() -> None:
    exc = RetouchError.from_wire(
        404, {"error": {"code": "template_not_found", "message": "m", "field": "template"}}
    )
    assert (exc.status, exc.code, exc.field) == (404, "template_not_found", "template")
    assert exc.to_wire() == {
        "error": {"code": "template_not_found", "message": "m", "field": "template"}
    }
