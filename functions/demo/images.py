"""Procedural template images and masks: nothing is downloaded, everything is reproducible.

Templates are simple scenes (gradient sky, ground, a few shapes) so an edit is easy to see.
Masks come in the shapes editing traffic has — rectangles, ellipses and irregular blobs —
and can be drawn to a target mask ratio.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

SHAPES = ("rect", "ellipse", "blob")


def template_image(size: tuple[int, int], seed: int) -> Image.Image:
    """A small scene: vertical gradient, a ground band, and a few coloured shapes."""
    rng = np.random.default_rng(seed)
    w, h = size
    top, bottom = rng.integers(40, 255, 3), rng.integers(0, 200, 3)
    t = np.linspace(0.0, 1.0, h)[:, None, None]
    sky = (top * (1 - t) + bottom * t).astype(np.uint8)
    img = Image.fromarray(np.broadcast_to(sky, (h, w, 3)).copy())
    draw = ImageDraw.Draw(img)
    draw.rectangle([0, int(h * 0.7), w, h], fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
    for _ in range(4):
        x0, y0 = int(rng.integers(0, w * 3 // 4)), int(rng.integers(0, h * 3 // 4))
        x1, y1 = x0 + int(rng.integers(w // 8, w // 3)), y0 + int(rng.integers(h // 8, h // 3))
        fill = tuple(int(c) for c in rng.integers(0, 255, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=fill)
    return img


def mask_of_ratio(
    size: tuple[int, int], ratio: float, shape: str = "rect", seed: int = 0
) -> np.ndarray:
    """A boolean ``[H, W]`` mask of ``shape`` covering about ``ratio`` of the image."""
    w, h = size
    if ratio >= 1.0:
        return np.ones((h, w), dtype=bool)
    if ratio <= 0.0:
        return np.zeros((h, w), dtype=bool)
    rng = np.random.default_rng(seed)
    if shape == "blob":
        return _blob(size, ratio, rng)
    if shape not in SHAPES:
        raise ValueError(f"unknown mask shape {shape!r}; choose from {SHAPES}")
    center = (float(rng.uniform(0.3, 0.7) * w), float(rng.uniform(0.3, 0.7) * h))
    aspect = float(rng.uniform(0.6, 1.6))
    # Bisect the shape's scale: the covered area grows monotonically with it, also once
    # the shape is clipped by the image border (large ratios).
    lo, hi = 0.0, 2.0 * max(w, h)
    best = _shape(size, shape, center, aspect, hi)
    for _ in range(24):
        mid = (lo + hi) / 2
        candidate = _shape(size, shape, center, aspect, mid)
        if candidate.mean() < ratio:
            lo = mid
        else:
            hi, best = mid, candidate
    return best


def _shape(
    size: tuple[int, int], shape: str, center: tuple[float, float], aspect: float, scale: float
) -> np.ndarray:
    half_w, half_h = scale * np.sqrt(aspect) / 2, scale / np.sqrt(aspect) / 2
    box = [center[0] - half_w, center[1] - half_h, center[0] + half_w, center[1] + half_h]
    img = Image.new("L", size, 0)
    (ImageDraw.Draw(img).ellipse if shape == "ellipse" else ImageDraw.Draw(img).rectangle)(
        box, fill=255
    )
    return np.asarray(img) > 0


def _blob(size: tuple[int, int], ratio: float, rng: np.random.Generator) -> np.ndarray:
    """An irregular region: blurred random strokes thresholded at the target quantile."""
    w, h = size
    img = Image.new("L", size, 0)
    draw = ImageDraw.Draw(img)
    x, y = float(rng.uniform(0.2, 0.8) * w), float(rng.uniform(0.2, 0.8) * h)
    for _ in range(12):
        nx = float(np.clip(x + rng.normal(0, w / 6), 0, w - 1))
        ny = float(np.clip(y + rng.normal(0, h / 6), 0, h - 1))
        draw.line([x, y, nx, ny], fill=255, width=max(2, w // 10))
        x, y = nx, ny
    field = np.asarray(img.filter(ImageFilter.GaussianBlur(w / 12)), dtype=np.float64)
    field = field + rng.uniform(0, 1e-3, field.shape)  # break ties so the quantile is exact
    return field >= np.quantile(field, 1.0 - ratio)
