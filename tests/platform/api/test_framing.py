"""The front door's framing of any-size inputs (no processes): what the executor gets of a
large upload with ``padding_mask_crop`` (a crop at the function's resolution, named by its
pixels, so another mask with the same box is the same ad-hoc template), the same again when
a resumed job is prepared from its request, a crop of a template named like an upload of
the same pixels, and the paste-back of the executor's edit."""

from __future__ import annotations

import asyncio
import dataclasses
import io

import numpy as np
import pytest
from PIL import Image

from retouch.functions.errors import BadRequest
from retouch.functions.imaging import encode_mask
from retouch.functions.spec import UploadsSpec, parse_spec
from retouch.functions.wire.invoke import InvokePath, InvokeRequest, InvokeResult
from retouch.platform.api import frontdoor
from retouch.platform.api.imagegate import DecodeBudget, ImageGate
from retouch.platform.api.uploads import UploadNames
from retouch.platform.fleet.deployed import DeployedFunction
from retouch.platform.jobs.reframe import crop_region
from retouch.platform.jobs.store import PreparedInvocation
from retouch.platform.state.registry import StoredFunction

CANVAS = 64
PHOTO = (640, 480)


def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _pixels(size: tuple[int, int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


def _function(uploads: UploadsSpec | None = None) -> DeployedFunction:
    spec = parse_spec(
        {
            "name": "f",
            "model": "retouch:tiny-sd",
            "family": "sd-inpaint",
            "resolution": CANVAS,
            "steps": 2,
            "templates": {"t": {"prompt": "", "seed": 0}},
        }
    )
    if uploads is not None:
        spec = dataclasses.replace(spec, uploads=uploads)
    return DeployedFunction(
        StoredFunction(spec, {"t": _png(_pixels((CANVAS, CANVAS), 9))}),
        1,
        sizes={"t": (CANVAS, CANVAS)},
    )


def _door() -> frontdoor.FrontDoor:
    door = frontdoor.FrontDoor.__new__(frontdoor.FrontDoor)
    door.images = ImageGate(4096 * 4096, DecodeBudget(1 << 30))
    door.names = UploadNames(b"k" * 32)
    return door


def _prepare(fn: DeployedFunction, **fields: object) -> PreparedInvocation:
    req = InvokeRequest(prompt="p", seed=1, **fields)  # type: ignore[arg-type]
    return asyncio.run(_door()._prepare(fn, req, "job", "tenant"))


def _rect(size: tuple[int, int], left: int, top: int, right: int, bottom: int) -> np.ndarray:
    mask = np.zeros((size[1], size[0]), bool)
    mask[top:bottom, left:right] = True
    return mask


def test_a_crop_of_a_large_upload_is_what_the_executor_edits() -> None:
    fn, photo = _function(), _pixels(PHOTO, 1)
    mask = _rect(PHOTO, 300, 200, 380, 260)
    first = _prepare(
        fn, template=None, image=_png(photo), mask=encode_mask(mask), padding_mask_crop=8
    )
    inv = first.invocation
    assert inv.image is not None and inv.image.shape == (CANVAS, CANVAS, 3)
    assert inv.mask.shape == (CANVAS, CANVAS) and inv.format == "raw"  # pasted back at the gateway
    assert inv.template.startswith("upload:")
    assert first.frame is not None and first.frame.box == crop_region(mask, (64, 64), 8)
    # a resumed job is prepared again from its request: the same canvas, id and box
    again = _prepare(
        fn, template=None, image=_png(photo), mask=encode_mask(mask), padding_mask_crop=8
    )
    assert again.invocation == inv and again.frame == first.frame
    # another mask with the same bounding box: the same crop, the same ad-hoc template
    ring = mask.copy()
    ring[210:250, 310:370] = False
    other = _prepare(
        fn, template=None, image=_png(photo), mask=encode_mask(ring), padding_mask_crop=8
    )
    assert other.invocation.template == inv.template and other.invocation.mask != inv.mask
    # the mask sent at half the photo's size is resized to it first
    half = encode_mask(mask[::2, ::2])
    resized = _prepare(fn, template=None, image=_png(photo), mask=half, padding_mask_crop=8)
    assert resized.invocation.template == inv.template


def test_the_paste_back_keeps_every_pixel_outside_the_mask() -> None:
    fn, photo = _function(), _pixels(PHOTO, 2)
    mask = _rect(PHOTO, 100, 100, 180, 150)
    req = InvokeRequest(
        template=None,
        image=_png(photo),
        mask=encode_mask(mask),
        prompt="p",
        seed=1,
        padding_mask_crop=16,
        format="png",
    )
    prepared = asyncio.run(_door()._prepare(fn, req, "job", "tenant"))
    edited = np.full((CANVAS, CANVAS, 3), 7, np.uint8)
    result = InvokeResult(
        image=edited.tobytes(),
        format="raw",
        width=CANVAS,
        height=CANVAS,
        mask_ratio=0.1,
        executor="e",
        path=InvokePath.STOCK,
    )
    door = _door()
    out = asyncio.run(door._paste(prepared.frame, result, fn, req))
    assert (out.format, out.width, out.height) == ("png", *PHOTO)
    pixels = np.asarray(Image.open(io.BytesIO(out.image)).convert("RGB"))
    assert np.array_equal(pixels[~mask], photo[~mask]) and (pixels[mask] == 7).all()
    raw = asyncio.run(
        door._paste(prepared.frame, result, fn, req.model_copy(update={"format": "raw"}))
    )
    assert np.array_equal(np.frombuffer(raw.image, np.uint8).reshape(pixels.shape), pixels)


def test_an_upload_of_the_functions_size_is_edited_as_it_is() -> None:
    fn, photo = _function(), _pixels((CANVAS, CANVAS), 3)
    mask = _rect((CANVAS, CANVAS), 10, 10, 30, 30)
    prepared = _prepare(fn, template=None, image=_png(photo), mask=encode_mask(mask))
    assert prepared.frame is None and prepared.invocation.format == "png"
    assert prepared.invocation.template == UploadNames(b"k" * 32).id(photo, "tenant")
    resized = _prepare(fn, template=None, image=_png(photo), mask=encode_mask(mask), size=(32, 16))
    assert resized.frame is not None and resized.frame.output == (32, 16)


def test_a_crop_of_a_template_is_an_ad_hoc_template_like_an_upload() -> None:
    fn = _function()
    mask = _rect((CANVAS, CANVAS), 20, 24, 30, 32)
    crop = _prepare(fn, template="t", mask=encode_mask(mask), padding_mask_crop=2)
    inv = crop.invocation
    assert inv.template.startswith("upload:") and inv.image is not None
    box = crop.frame.box
    assert box.size == (14, 14)
    # the same pixels sent as an upload are the same ad-hoc template (one bake serves both)
    cut = fn.template_pixels("t")[box.slices]
    as_upload = _prepare(
        fn, template=None, image=_png(cut), mask=encode_mask(np.ones((14, 14), bool))
    )
    assert as_upload.invocation.template == inv.template
    # without a crop the template is edited as deployed, a mask of another size resized
    plain = _prepare(fn, template="t", mask=encode_mask(np.ones((128, 128), bool)))
    assert plain.invocation.template == "t" and plain.invocation.image is None
    assert plain.frame is None and plain.invocation.mask.shape == (CANVAS, CANVAS)


def test_bad_framing_input_is_refused_naming_the_field() -> None:
    fn, empty = _function(), encode_mask(np.zeros((CANVAS, CANVAS), bool))
    cases = [
        (dict(template="t", mask=empty, padding_mask_crop=4), "invalid_field", "padding_mask_crop"),
        (dict(template="t", mask=empty, size=(5000, 5000)), "image_too_large", "size"),
        # WebP cannot hold a side over 16383 pixels: refused before the model runs
        (dict(template="t", mask=empty, size=(16400, 8), format="webp"), "invalid_field", "size"),
    ]
    for fields, code, field in cases:
        with pytest.raises(BadRequest) as refused:
            _prepare(fn, **fields)
        assert (refused.value.code, refused.value.field) == (code, field)
    closed = _function(UploadsSpec(max_images=0))
    mask = encode_mask(_rect((CANVAS, CANVAS), 20, 20, 30, 30))
    with pytest.raises(BadRequest) as refused:
        _prepare(closed, template="t", mask=mask, padding_mask_crop=2)
    assert (refused.value.code, refused.value.field) == ("uploads_disabled", "padding_mask_crop")
