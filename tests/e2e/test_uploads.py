"""Edits of uploaded images end to end: the first edit of an unseen image runs the stock
path and bakes it in the background, later edits of it run mask-aware; the same pixels in
another encoding are the same ad-hoc template; the per-function count and byte limits are
enforced (least recently used bake deleted from the store); an image of another size is
resized (or, with ``padding_mask_crop``, cropped around its mask) to the function's
resolution, comes back at its own size with every pixel outside the mask its own, and is
mask-aware on its second edit, and so is a crop of a template; bad uploads are 4xx naming
the field and the server stays healthy.

One server for the file, one executor, ``tiny-sd`` at 128² with few steps.
"""

from __future__ import annotations

import dataclasses
import io
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from retouch.functions.errors import RetouchError
from retouch.functions.imaging import encode_mask
from retouch.functions.spec import UploadsSpec
from retouch.functions.wire.codec import pack, unpack
from retouch.functions.wire.invoke import CacheTier, InvokePath, InvokeResult
from retouch.platform.api.client import Client, read_spec_file
from retouch.platform.api.server import ServerProcess
from retouch.platform.jobs.reframe import crop_region, resize_mask
from retouch.platform.lab.bench.memory import zero_png
from retouch.platform.lab.cachecli import run_cache_command
from tests.support import decodes_run, run_cli, wait_for

from .conftest import ADMIN, INVOKE, TOKENS

FUNCTION, STEPS = "up-sd", 4
SIZE = 128
MASK = np.zeros((SIZE, SIZE), bool)
MASK[32:80, 40:96] = True


def photo(seed: int, fmt: str = "PNG", size: tuple[int, int] = (SIZE, SIZE)) -> bytes:
    """A smooth random 'photo' (of the function's size unless told), encoded losslessly."""
    img = Image.fromarray(photo_pixels(seed, size))
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


def photo_pixels(seed: int, size: tuple[int, int]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize(size, Image.BILINEAR))


@pytest.fixture(scope="module")
def server(data_dir: Path, examples: Path) -> Iterator[ServerProcess]:
    with ServerProcess(data_dir, env=TOKENS) as proc:
        spec, images = read_spec_file(examples / "tiny-sd.toml")
        spec = dataclasses.replace(
            spec, name=FUNCTION, steps=STEPS, templates={"street": spec.templates["street"]}
        )
        with Client(proc.url, ADMIN) as admin:
            assert admin.deploy(spec, {"street": images["street"]})["status"] == "ready"
        yield proc


def deploy(url: str, examples: Path, name: str, uploads: UploadsSpec) -> None:
    spec, images = read_spec_file(examples / "tiny-sd.toml")
    spec = dataclasses.replace(
        spec,
        name=name,
        steps=STEPS,
        templates={"street": spec.templates["street"]},
        uploads=uploads,
    )
    with Client(url, ADMIN) as admin:
        assert admin.deploy(spec, {"street": images["street"]})["status"] == "ready"


def edit(client: Client, image: bytes, seed: int = 1, name: str = FUNCTION) -> InvokeResult:
    return client.invoke(name, None, MASK, "a red door", seed=seed, image=image, format="raw")


def post_msgpack(server: ServerProcess, route: str, request: dict) -> httpx.Response:
    """``request`` to the function's ``invoke`` or ``jobs`` route, as msgpack."""
    return httpx.post(
        f"{server.url}/v1/functions/{FUNCTION}/{route}",
        content=pack(request),
        headers={"authorization": f"Bearer {INVOKE}", "content-type": "application/msgpack"},
        timeout=60,
    )


def uploads(client: Client, name: str) -> dict[str, dict]:
    return client.get(name)["uploads"]


def upload_in(client: Client, name: str, upload: str, state: str) -> dict:
    """The upload's document once it is in ``state``."""

    def doc() -> dict:
        return uploads(client, name).get(upload, {})

    def reached() -> dict | None:
        seen = doc()
        return seen if seen.get("state") == state else None

    return wait_for(f"{upload} {state}", reached, 180, detail=doc)


def wait_baked(client: Client, name: str, upload: str) -> dict:
    return upload_in(client, name, upload, "baked")


def test_first_edit_is_stock_later_ones_mask_aware(server: ServerProcess) -> None:
    image = photo(1)
    with Client(server.url, INVOKE) as client:
        first = edit(client, image)
        assert first.path is InvokePath.STOCK
        assert first.template.startswith("upload:") and first.cache.tier is CacheTier.NONE
        assert (first.width, first.height) == (SIZE, SIZE)
        wait_baked(client, FUNCTION, first.template)
        second = edit(client, image, seed=2)
        third = edit(client, image, seed=3)
        assert second.template == third.template == first.template
        assert third.path is InvokePath.MASKAWARE
        assert third.cache.tier in (CacheTier.HOST, CacheTier.DISK)
        # the same pixels in another encoding are the same ad-hoc template, already baked
        webp = edit(client, photo(1, "WEBP"), seed=3)
        assert webp.template == first.template and webp.path is InvokePath.MASKAWARE
        assert webp.image == third.image
        # an empty mask answers the uploaded image itself
        empty = client.invoke(
            FUNCTION, None, np.zeros((SIZE, SIZE), bool), "x", seed=1, image=image, format="raw"
        )
        assert empty.path is InvokePath.TEMPLATE
        expected = np.asarray(Image.open(io.BytesIO(image)).convert("RGB"))
        assert np.array_equal(
            np.frombuffer(empty.image, np.uint8).reshape(expected.shape), expected
        )
        # an uploaded image as an async job
        job = client.submit(FUNCTION, None, MASK, "a red door", seed=3, image=image, format="raw")
        assert job.wait(timeout=120).image == third.image
    rows = [r for r in run_cache_command("ls", server.data_dir) if r["key"].startswith("~")]
    assert any(r["meta"].get("template") == first.template for r in rows)
    assert all(r["meta"].get("upload") for r in rows)


def test_byte_budget_drops_the_least_recently_used_bake(
    server: ServerProcess, examples: Path
) -> None:
    with Client(server.url, INVOKE) as client:
        first = edit(client, photo(10))
        one = wait_baked(client, FUNCTION, first.template)["bytes"]
        assert one > 0
        name = "up-budget"
        deploy(server.url, examples, name, UploadsSpec(max_images=8, max_bytes=int(1.5 * one)))
        a = edit(client, photo(11), name=name)
        wait_baked(client, name, a.template)
        b = edit(client, photo(12), name=name)
        wait_baked(client, name, b.template)
        held = uploads(client, name)
        assert a.template not in held and held[b.template]["bytes"] == one
        keys = {r["meta"].get("template"): r for r in run_cache_command("ls", server.data_dir)}
        held_bytes = sum(r["bytes"] for r in keys.values() if r["meta"].get("function") == name)
        assert held_bytes <= 1.5 * one
        assert b.template in keys
        # the dropped image is simply new again: stock, then baked again
        again = edit(client, photo(11), name=name)
        assert again.path is InvokePath.STOCK


def test_count_limit_and_uploads_disabled(server: ServerProcess, examples: Path) -> None:
    deploy(server.url, examples, "up-one", UploadsSpec(max_images=1))
    deploy(server.url, examples, "up-none", UploadsSpec(max_images=0))
    with Client(server.url, INVOKE) as client:
        a = edit(client, photo(21), name="up-one")
        b = edit(client, photo(22), name="up-one")
        assert list(uploads(client, "up-one")) == [b.template] != [a.template]
        with pytest.raises(RetouchError) as info:
            edit(client, photo(21), name="up-none")
        assert (info.value.status, info.value.code, info.value.field) == (
            400,
            "uploads_disabled",
            "image",
        )


def test_an_image_whose_bake_exceeds_the_budget_is_served_stock_without_churn(
    server: ServerProcess, examples: Path
) -> None:
    deploy(server.url, examples, "up-tiny-budget", UploadsSpec(max_bytes=1))
    with Client(server.url, INVOKE) as client:
        first = edit(client, photo(41), name="up-tiny-budget")
        upload_in(client, "up-tiny-budget", first.template, "failed")
        again = edit(client, photo(41), seed=2, name="up-tiny-budget")
        assert again.path is InvokePath.STOCK
        state = client.executors()["executors"][0]["state"]["templates"]["up-tiny-budget"]
        assert state[first.template]["bakes"] == 1  # baked once, not again on every edit
    rows = run_cache_command("ls", server.data_dir)
    assert not [r for r in rows if r["meta"].get("function") == "up-tiny-budget"]


def bomb(side: int = 30000) -> bytes:
    """A PNG whose header declares side x side pixels: a decompression bomb's header (what
    the gateway must refuse before decoding anything), a few dozen bytes on the wire."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )  # fmt: skip

    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\0" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    ("body", "status", "code", "field"),
    [
        ({"image": b"not an image"}, 400, "undecodable_image", "image"),
        ({"image": photo(1)[:200]}, 400, "undecodable_image", "image"),
        ({"image": "a string"}, 400, "invalid_field", "image"),
        ({"image": b"x", "template": "street"}, 400, "invalid_field", "image"),
        ({}, 400, "missing_field", "template"),
        ({"image": "bomb"}, 400, "image_too_large", "image"),
    ],
)
def test_bad_uploads_are_4xx_naming_the_field(
    server: ServerProcess, body: dict, status: int, code: str, field: str
) -> None:
    if body.get("image") == "bomb":
        body = {"image": BOMB}
    mask = io.BytesIO()
    Image.fromarray(MASK.astype(np.uint8) * 255).save(mask, format="PNG")
    request = {"mask": mask.getvalue(), "prompt": "p", "seed": 1, **body}
    for route in ("invoke", "jobs"):
        resp = post_msgpack(server, route, request)
        assert resp.status_code == status, resp.content
        error = unpack(resp.content)["error"]
        assert (error["code"], error["field"]) == (code, field), error
    assert httpx.get(f"{server.url}/healthz").status_code == 200


BOMB = bomb()


def test_cli_edits_an_image_file(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "photo.png").write_bytes(photo(31))
    mask = io.BytesIO()
    Image.fromarray(MASK.astype(np.uint8) * 255).save(mask, format="PNG")
    (tmp_path / "mask.png").write_bytes(mask.getvalue())
    common = ["--mask", str(tmp_path / "mask.png"), "--url", server.url, "--token", INVOKE]
    out = run_cli(
        capsys, "invoke", FUNCTION, "--image", str(tmp_path / "photo.png"), *common,
        "--prompt", "a red door", "-o", str(tmp_path / "out.png"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "path=stock" in out.stdout and Image.open(tmp_path / "out.png").size == (SIZE, SIZE)
    both = run_cli(
        capsys, "invoke", FUNCTION, "--template", "street", "--image", str(tmp_path / "photo.png"),
        *common, "--prompt", "x",
    )  # fmt: skip
    assert both.returncode != 0 and "not allowed with" in both.stderr


def test_uploads_are_refused_from_their_header_before_any_pixel_is_decoded(
    server: ServerProcess,
) -> None:
    """A 130 KB PNG that declares 8192 x 8192 (above the pixel limit), through invoke,
    jobs and the OpenAI route: 4xx naming ``image``, and not one decode run for it."""
    mask = io.BytesIO()
    Image.fromarray(MASK.astype(np.uint8) * 255).save(mask, format="PNG")
    cases = [(zero_png(8192, 8192), "image_too_large")]
    before = decodes_run(server.metrics_url)
    auth = {"authorization": f"Bearer {INVOKE}"}
    for image, code in cases:
        request = {"image": image, "mask": mask.getvalue(), "prompt": "p", "seed": 1}
        for route in ("invoke", "jobs"):
            resp = post_msgpack(server, route, request)
            assert resp.status_code == 400, resp.content
            error = unpack(resp.content)["error"]
            assert (error["code"], error["field"]) == (code, "image"), error
        resp = httpx.post(
            f"{server.url}/v1/images/edits",
            headers=auth,
            data={"model": FUNCTION, "prompt": "p"},
            files={"image": ("big.png", image, "image/png"), "mask": ("m.png", mask.getvalue())},
            timeout=60,
        )
        assert resp.status_code == 400, resp.text
        assert (resp.json()["error"]["code"], resp.json()["error"]["param"]) == (code, "image")
    assert decodes_run(server.metrics_url) == before
    with Client(server.url, INVOKE) as client:
        edit(client, photo(41))  # a good upload is decoded
    assert decodes_run(server.metrics_url) > before


BIG = (2048, 1536)


def test_padding_mask_crop_edits_a_crop_of_a_large_photo(server: ServerProcess) -> None:
    """A 2048 x 1536 photo with a 10 % mask, ``padding_mask_crop=32``: edited at the
    function's 128 x 128 and back at 2048 x 1536, every pixel outside the crop box (and
    outside the mask) the photo's own; a second edit with another mask of the same bounding
    box (the same crop) is mask-aware once the first one's bake is done."""
    pixels, image = photo_pixels(51, BIG), photo(51, size=BIG)
    mask = np.zeros((BIG[1], BIG[0]), bool)
    mask[560:1046, 700:1348] = True  # 648 x 486: 10.0 %
    ring = mask.copy()
    ring[600:1006, 740:1308] = False  # the same bounding box, so the same crop
    outside_box = np.ones_like(mask)
    outside_box[crop_region(mask, (SIZE, SIZE), 32).slices] = False
    with Client(server.url, INVOKE) as client:
        first = client.invoke(
            FUNCTION, None, mask, "a red door", seed=1, image=image, padding_mask_crop=32,
            format="raw",
        )  # fmt: skip
        assert (first.width, first.height) == BIG and first.path is InvokePath.STOCK
        out = np.frombuffer(first.image, np.uint8).reshape(pixels.shape)
        assert np.array_equal(out[outside_box], pixels[outside_box])
        assert np.array_equal(out[~mask], pixels[~mask])
        assert np.abs(out[mask].astype(int) - pixels[mask]).mean() > 5  # the mask was edited
        wait_baked(client, FUNCTION, first.template)
        second = client.invoke(
            FUNCTION, None, ring, "a red door", seed=2, image=image, padding_mask_crop=32
        )
        assert second.template == first.template and second.path is InvokePath.MASKAWARE
        got = np.asarray(Image.open(io.BytesIO(second.image)).convert("RGB"))
        assert second.format == "png" and got.shape == pixels.shape
        assert np.array_equal(got[~ring], pixels[~ring])


def test_an_image_of_another_size_comes_back_at_its_size(server: ServerProcess) -> None:
    """A 200 x 150 photo with a mask sent at half its size: both resized to 128 x 128, the
    edit back at 200 x 150, pixels outside the (resized) mask the photo's own, as a job too;
    its second edit, with any mask, is mask-aware."""
    size = (200, 150)
    pixels, image = photo_pixels(52, size), photo(52, size=size)
    half = np.zeros((75, 100), bool)
    half[20:50, 30:70] = True
    mask = resize_mask(half, size)
    with Client(server.url, INVOKE) as client:
        first = client.invoke(FUNCTION, None, half, "a red door", seed=1, image=image, format="raw")
        out = np.frombuffer(first.image, np.uint8).reshape(pixels.shape)
        assert (first.width, first.height) == size and np.array_equal(out[~mask], pixels[~mask])
        job = client.submit(FUNCTION, None, half, "a red door", seed=1, image=image, format="raw")
        done = job.wait(timeout=120)  # stock or mask-aware: the bake may be done by now
        job_out = np.frombuffer(done.image, np.uint8).reshape(pixels.shape)
        assert done.template == first.template and np.array_equal(job_out[~mask], pixels[~mask])
        wait_baked(client, FUNCTION, first.template)
        other = np.zeros((150, 200), bool)
        other[100:140, 10:60] = True
        second = client.invoke(FUNCTION, None, other, "x", seed=2, image=image, format="raw")
        assert second.template == first.template and second.path is InvokePath.MASKAWARE


def test_a_crop_of_a_template_is_mask_aware_on_its_second_edit(
    server: ServerProcess, examples: Path
) -> None:
    """``padding_mask_crop`` on a deployed template edits a crop of it (an ad-hoc template
    named by its pixels): the result is the template's size, the template's own pixels
    outside the mask, and the second edit of the same crop is mask-aware."""
    _, images = read_spec_file(examples / "tiny-sd.toml")
    street = np.asarray(Image.open(io.BytesIO(images["street"])).convert("RGB"))
    mask = np.zeros((SIZE, SIZE), bool)
    mask[40:60, 50:66] = True
    dot = np.zeros_like(mask)
    dot[40, 50] = dot[59, 65] = True  # the same bounding box
    with Client(server.url, INVOKE) as client:
        first = client.invoke(
            FUNCTION, "street", mask, "a red door", seed=1, padding_mask_crop=6, format="raw"
        )
        assert first.template.startswith("upload:") and first.path is InvokePath.STOCK
        out = np.frombuffer(first.image, np.uint8).reshape(street.shape)
        assert np.array_equal(out[~mask], street[~mask])
        wait_baked(client, FUNCTION, first.template)
        second = client.invoke(
            FUNCTION, "street", dot, "a red door", seed=2, padding_mask_crop=6, format="raw"
        )
        assert second.template == first.template and second.path is InvokePath.MASKAWARE


@pytest.mark.parametrize(
    ("fields", "code", "field"),
    [
        ({"padding_mask_crop": 8, "mask": "empty"}, "invalid_field", "padding_mask_crop"),
        ({"padding_mask_crop": -1}, "invalid_field", "padding_mask_crop"),
        ({"size": "0x10"}, "invalid_field", "size"),
        ({"size": "5000x5000"}, "image_too_large", "size"),
        ({"size": 512}, "invalid_field", "size"),
    ],
)
def test_bad_sizes_and_crops_are_4xx_naming_the_field(
    server: ServerProcess, fields: dict, code: str, field: str
) -> None:
    mask = np.zeros_like(MASK) if fields.get("mask") == "empty" else MASK
    request = {
        "image": photo(1, size=(300, 200)), "prompt": "p", "seed": 1,
        **fields, "mask": encode_mask(mask),
    }  # fmt: skip
    for route in ("invoke", "jobs"):
        resp = post_msgpack(server, route, request)
        assert resp.status_code == 400, resp.content
        error = unpack(resp.content)["error"]
        assert (error["code"], error["field"]) == (code, field), error
    assert httpx.get(f"{server.url}/healthz").status_code == 200
