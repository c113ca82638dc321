"""How an input image of any size maps onto a function's canvas, and its edit back.

A function edits images of one size, its *canvas* (the spec's ``resolution``). An input of
another size is resized to the canvas, as diffusers' ``VaeImageProcessor`` resizes to the
pipeline's ``width`` x ``height`` (LANCZOS; a mask is resized the same way, then
binarised at one half). With ``padding_mask_crop`` only a *box* of the input goes to the
canvas: the mask's bounding box, padded by that many pixels, grown to the canvas's aspect
ratio and clipped to the image (``VaeImageProcessor.get_crop_region``), so a small edit of
a large photo is made at the canvas's full resolution.

Whenever the canvas is not the input itself (a resize or a crop), the edited canvas is
resized back to the box and pasted into the input where the mask is, as diffusers'
``apply_overlay`` does: every pixel outside the mask is the input's own. The result is then
resized to the size asked for, if any (the OpenAI route's ``size``).

Everything here is a pure function of its arguments: a job resumed from the journal frames
its request again and gets the same box, canvas and paste-back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from retouch.functions.errors import BadRequest

Size = tuple[int, int]  # (width, height), as PIL counts


@dataclass(frozen=True)
class Box:
    """A rectangle of an image: columns ``left:right``, rows ``top:bottom``."""

    left: int
    top: int
    right: int
    bottom: int

    @classmethod
    def whole(cls, size: Size) -> Box:
        return cls(0, 0, size[0], size[1])

    @property
    def size(self) -> Size:
        return self.right - self.left, self.bottom - self.top

    @property
    def slices(self) -> tuple[slice, slice]:
        """Index of the box in an ``[H, W, ...]`` array."""
        return slice(self.top, self.bottom), slice(self.left, self.right)


def crop_region(mask: np.ndarray, canvas: Size, pad: int) -> Box:
    """diffusers' ``get_crop_region``: the bounding box of ``mask`` (boolean ``[H, W]``,
    at least one pixel set), padded by ``pad`` pixels (clipped to the image), then grown
    about its centre to the aspect ratio of ``canvas``, shifted back inside the image and
    clipped to it (an image too narrow for the ratio gives a box of its whole width)."""
    h, w = mask.shape
    cols, rows = np.flatnonzero(mask.any(axis=0)), np.flatnonzero(mask.any(axis=1))
    x1, x2 = max(int(cols[0]) - pad, 0), min(int(cols[-1]) + 1 + pad, w)
    y1, y2 = max(int(rows[0]) - pad, 0), min(int(rows[-1]) + 1 + pad, h)
    ratio = canvas[0] / canvas[1]
    if (x2 - x1) / (y2 - y1) > ratio:
        y1, y2 = _grow(y1, y2, int((x2 - x1) / ratio - (y2 - y1)), h)
    else:
        x1, x2 = _grow(x1, x2, int((y2 - y1) * ratio - (x2 - x1)), w)
    return Box(x1, y1, x2, y2)


def _grow(lo: int, hi: int, by: int, limit: int) -> tuple[int, int]:
    """``lo:hi`` widened by ``by`` (half each side), moved back within ``0:limit``."""
    lo, hi = lo - by // 2, hi + by - by // 2
    if hi > limit:
        lo, hi = lo - (hi - limit), limit
    if lo < 0:
        lo, hi = 0, hi - lo
    return lo, min(hi, limit)


def resize_pixels(pixels: np.ndarray, size: Size) -> np.ndarray:
    """An RGB8 ``[H, W, 3]`` image resized to ``size`` (LANCZOS, as diffusers resizes)."""
    if (pixels.shape[1], pixels.shape[0]) == size:
        return pixels
    return np.asarray(
        Image.fromarray(np.ascontiguousarray(pixels), "RGB").resize(size, Image.LANCZOS)
    )


def resize_mask(mask: np.ndarray, size: Size) -> np.ndarray:
    """A boolean mask resized to ``size``: LANCZOS over 0/255, then binarised at one half
    (diffusers' mask processor: resize, then ``binarize``)."""
    if (mask.shape[1], mask.shape[0]) == size:
        return mask
    grey = Image.fromarray(mask.astype(np.uint8) * 255, "L").resize(size, Image.LANCZOS)
    return np.asarray(grey) >= 128


def overlay(source: np.ndarray, edited: np.ndarray, mask: np.ndarray, box: Box) -> np.ndarray:
    """diffusers' ``apply_overlay`` with a binary mask: ``source`` with ``edited`` (the
    canvas, any size) resized to ``box`` and taken where ``mask`` is set; every other
    pixel is ``source``'s own."""
    out = source.copy()
    patch = resize_pixels(edited, box.size)
    region, selected = out[box.slices], mask[box.slices]
    region[selected] = patch[selected]
    return out


@dataclass(frozen=True)
class Frame:
    """Where a function's canvas comes from in an input of ``size``, and the result's size."""

    size: Size  # the input's
    box: Box  # the part of the input the canvas shows
    canvas: Size  # the function's resolution
    output: Size  # the result's

    @classmethod
    def plan(cls, mask: np.ndarray, canvas: Size, pad: int | None, output: Size | None) -> Frame:
        """The frame of an input whose mask (at the input's size) is ``mask``: all of it,
        or, with ``pad`` (``padding_mask_crop``), the crop around the mask, refused for an
        empty mask (there is nothing to crop around)."""
        size = (mask.shape[1], mask.shape[0])
        if pad is None:
            box = Box.whole(size)
        elif not mask.any():
            raise BadRequest(
                "padding_mask_crop crops the image around its mask, and the mask selects no "
                "pixel (send a mask, or leave padding_mask_crop out)",
                field="padding_mask_crop",
                code="invalid_field",
            )
        else:
            box = crop_region(mask, canvas, pad)
        return cls(size, box, canvas, output or size)

    @property
    def reshapes(self) -> bool:
        """Whether the canvas is other than the input (a crop or a resize)."""
        return self.box != Box.whole(self.size) or self.size != self.canvas

    @property
    def identity(self) -> bool:
        """Whether the executor's result is the answer as it is."""
        return not self.reshapes and self.output == self.size

    def to_canvas(self, pixels: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The input's image and mask as the executor edits them: the box, resized."""
        rows, cols = self.box.slices
        return (
            resize_pixels(pixels[rows, cols], self.canvas),
            resize_mask(mask[rows, cols], self.canvas),
        )

    def paste(self, edited: np.ndarray, source: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The answer from the executor's ``edited`` canvas: pasted into ``source`` where
        ``mask`` is when the canvas was reshaped (:func:`overlay`), then at ``output``."""
        out = overlay(source, edited, mask, self.box) if self.reshapes else edited
        return resize_pixels(out, self.output)
