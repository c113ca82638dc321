"""The one codec for an ``EditRequest`` crossing the pre-worker boundary."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
from PIL import Image

from retouch.functions.wire.codec import pack, unpack
from retouch.runtime.maskaware.request import ARRAY_FIELDS, EditRequest


def _request(**overrides: object) -> EditRequest:
    image = Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3))
    mask = np.zeros((4, 4), dtype=bool)
    mask[1:3, 2:] = True
    values = dict(
        image=image,
        mask=mask,
        prompt="a red door",
        seed=np.int64(7),
        steps=6,
        guidance=4.5,
        template_prompt="a quiet street",
        template_seed=3,
        full_steps=2,
    )
    return EditRequest(**(values | overrides))


def test_every_field_survives_the_round_trip_full_steps_included() -> None:
    request = _request()
    meta = unpack(pack(request.wire_meta()))  # as the pool sends it
    back = EditRequest.from_wire(meta, request.wire_arrays())
    assert back.full_steps == 2
    for f in fields(EditRequest):
        if f.name not in ARRAY_FIELDS:
            assert getattr(back, f.name) == getattr(request, f.name), f.name
    assert np.array_equal(np.asarray(back.image), np.asarray(request.image))
    assert np.array_equal(back.mask, request.mask)
    assert back.reference is None


def test_a_reference_image_crosses_as_an_array() -> None:
    reference = Image.fromarray(np.full((4, 4, 3), 9, dtype=np.uint8))
    request = _request(reference=reference)
    back = EditRequest.from_wire(request.wire_meta(), request.wire_arrays())
    assert np.array_equal(np.asarray(back.reference), np.asarray(reference))


def test_meta_is_plain_data_and_names_every_scalar_field() -> None:
    meta = _request().wire_meta()
    assert set(meta) == {f.name for f in fields(EditRequest)} - set(ARRAY_FIELDS)
    assert type(meta["seed"]) is int  # numpy scalars become Python ones


def test_an_image_mode_without_a_faithful_array_goes_as_rgb() -> None:
    request = _request(image=Image.new("P", (4, 4)))
    assert EditRequest.from_wire(request.wire_meta(), request.wire_arrays()).image.mode == "RGB"
