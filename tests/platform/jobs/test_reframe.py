"""The geometry of any-size inputs and ``padding_mask_crop`` (no processes): the crop box is
diffusers' ``get_crop_region``, the paste-back is its ``apply_overlay`` (every pixel
outside the mask the input's own), masks resize as diffusers' mask processor does."""

from __future__ import annotations

import numpy as np
import pytest
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from retouch.functions.errors import BadRequest
from retouch.platform.jobs.reframe import Box, Frame, crop_region, overlay, resize_mask


def _rect(size: tuple[int, int], box: tuple[int, int, int, int]) -> np.ndarray:
    mask = np.zeros((size[1], size[0]), bool)
    left, top, right, bottom = box
    mask[top:bottom, left:right] = True
    return mask


def _blob(size: tuple[int, int], seed: int) -> np.ndarray:
    """Scattered masked pixels: the bounding box is not a drawn rectangle."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((size[1], size[0]), bool)
    n = int(rng.integers(1, 6))
    mask[rng.integers(0, size[1], n), rng.integers(0, size[0], n)] = True
    return mask


MASKS = [
    ("centre", (2048, 1536), _rect((2048, 1536), (900, 700, 1300, 1000))),
    ("wide-strip", (2048, 1536), _rect((2048, 1536), (100, 760, 1900, 800))),
    ("tall-strip", (2048, 1536), _rect((2048, 1536), (1000, 10, 1040, 1500))),
    ("corner", (2048, 1536), _rect((2048, 1536), (0, 0, 50, 40))),
    ("far-corner", (2048, 1536), _rect((2048, 1536), (2000, 1500, 2048, 1536))),
    ("one-pixel", (640, 480), _rect((640, 480), (639, 479, 640, 480))),
    ("whole", (300, 200), _rect((300, 200), (0, 0, 300, 200))),
    ("narrow-image", (100, 900), _rect((100, 900), (10, 100, 90, 300))),
    *[(f"blob-{seed}", (333, 517), _blob((333, 517), seed)) for seed in range(6)],
]
CANVASES = [(512, 512), (768, 512), (512, 768)]


@pytest.mark.parametrize("canvas", CANVASES, ids=lambda c: f"{c[0]}x{c[1]}")
@pytest.mark.parametrize("pad", [0, 32, 5000])
@pytest.mark.parametrize(("name", "size", "mask"), MASKS, ids=[m[0] for m in MASKS])
def test_crop_box_is_diffusers_get_crop_region(
    name: str, size: tuple[int, int], mask: np.ndarray, canvas: tuple[int, int], pad: int
) -> None:
    pil = Image.fromarray(mask.astype(np.uint8) * 255, "L")
    expected = VaeImageProcessor.get_crop_region(pil, canvas[0], canvas[1], pad=pad)
    box = crop_region(mask, canvas, pad)
    assert (box.left, box.top, box.right, box.bottom) == expected
    rows, cols = box.slices
    assert mask[rows, cols].sum() == mask.sum()  # the whole mask lies in the box


def test_paste_back_is_diffusers_apply_overlay() -> None:
    """A box of the canvas's aspect ratio (diffusers' resize then needs no crop): the same
    pixels as ``apply_overlay``, to the last bit."""
    rng = np.random.default_rng(3)
    source = rng.integers(0, 256, (600, 800, 3), dtype=np.uint8)
    mask = _rect((800, 600), (300, 250, 420, 330))
    box = crop_region(mask, (512, 256), 20)
    assert box.size[0] == 2 * box.size[1]
    edited = rng.integers(0, 256, (256, 512, 3), dtype=np.uint8)
    ours = overlay(source, edited, mask, box)
    theirs = VaeImageProcessor().apply_overlay(
        Image.fromarray(mask.astype(np.uint8) * 255, "L"),
        Image.fromarray(source),
        Image.fromarray(edited),
        (box.left, box.top, box.right, box.bottom),
    )
    assert np.array_equal(ours, np.asarray(theirs))
    assert np.array_equal(ours[~mask], source[~mask])  # outside the mask: the input's own


def test_mask_resize_is_diffusers_mask_processor() -> None:
    """LANCZOS, then binarised at one half, as diffusers' mask processor reads a mask
    (its ``resize`` and ``binarize``)."""
    rng = np.random.default_rng(5)
    mask = np.zeros((300, 410), bool)
    for _ in range(12):
        y, x = rng.integers(0, 280), rng.integers(0, 390)
        mask[y : y + rng.integers(1, 20), x : x + rng.integers(1, 20)] = True
    processor = VaeImageProcessor(do_normalize=False, do_binarize=True, do_convert_grayscale=True)
    theirs = processor.preprocess(Image.fromarray(mask.astype(np.uint8) * 255, "L"), 128, 96)
    assert np.array_equal(resize_mask(mask, (96, 128)), theirs[0, 0].numpy() == 1)


def test_a_frame_crops_resizes_and_pastes_back() -> None:
    rng = np.random.default_rng(7)
    source = rng.integers(0, 256, (1536, 2048, 3), dtype=np.uint8)
    mask = _rect((2048, 1536), (1000, 600, 1400, 900))
    frame = Frame.plan(mask, (512, 512), 32, None)
    assert frame.box == Box(968, 518, 1432, 982) and frame.reshapes and not frame.identity
    canvas, canvas_mask = frame.to_canvas(source, mask)
    assert canvas.shape == (512, 512, 3) and canvas_mask.shape == (512, 512)
    assert 0 < canvas_mask.mean() < 1
    out = frame.paste(np.zeros_like(canvas), source, mask)
    assert out.shape == source.shape
    assert np.array_equal(out[~mask], source[~mask]) and not out[mask].any()
    # the result at another size (the OpenAI route's ``size``)
    small = Frame.plan(mask, (512, 512), 32, (1024, 768))
    assert small.paste(canvas, source, mask).shape == (768, 1024, 3)


def test_a_resized_input_is_its_whole_image() -> None:
    mask = _rect((2048, 1536), (10, 10, 20, 20))
    frame = Frame.plan(mask, (512, 512), None, None)
    assert frame.box == Box.whole((2048, 1536)) and frame.reshapes and frame.output == (2048, 1536)
    same = Frame.plan(_rect((512, 512), (10, 10, 20, 20)), (512, 512), None, None)
    assert same.identity  # the executor's result is the answer as it is
    edited = np.full((512, 512, 3), 9, np.uint8)
    assert same.paste(edited, edited, mask) is edited
    # a crop whose box is the whole canvas-sized image edits the image itself
    whole = Frame.plan(_rect((512, 512), (0, 0, 512, 512)), (512, 512), 4, None)
    assert not whole.reshapes


def test_padding_mask_crop_with_an_empty_mask_is_refused() -> None:
    with pytest.raises(BadRequest) as refused:
        Frame.plan(np.zeros((64, 64), bool), (32, 32), 8, None)
    assert (refused.value.code, refused.value.field) == ("invalid_field", "padding_mask_crop")
    assert Frame.plan(np.zeros((64, 64), bool), (32, 32), None, None).reshapes  # resize only
