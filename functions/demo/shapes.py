"""A procedural captioned data set of coloured shapes, for training the ``shapes-sd`` model.

Nothing can be downloaded, so the trained demo model learns from scenes generated here: one
or two objects (circle, square, triangle, star, ring, stripes) in named colours on a plain,
gradient, striped or textured background, captioned with the same words ("a red star on a
blue striped background"), plus inpainting masks of the kinds SD-inpainting training uses
(rectangles, blobs, strokes) and masks around one object, whose caption then names that
object first. Everything is a pure function of a seed, so a data set is reproducible and
needs no storage.

The same colour names define the edit-success measure (``colour_matches``): an edit asking
for "a yellow star" succeeded when the masked region's mean hue lies in yellow's hue range.
"""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from retouch.functions.demo.images import mask_of_ratio

SIZE = 128

# Base RGB of each named colour; training jitters hue, saturation and value around it.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (245, 140, 20),
    "yellow": (240, 220, 30),
    "green": (40, 170, 60),
    "cyan": (40, 200, 210),
    "blue": (30, 70, 220),
    "purple": (130, 50, 190),
    "pink": (240, 110, 180),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
# Hue ranges in degrees [lo, hi) (lo > hi wraps through 0), half-way between the base hues.
HUE_RANGES: dict[str, tuple[float, float]] = {
    "red": (344.0, 16.0),
    "orange": (16.0, 43.0),
    "yellow": (43.0, 90.0),
    "green": (90.0, 156.0),
    "cyan": (156.0, 205.0),
    "blue": (205.0, 250.0),
    "purple": (250.0, 300.0),
    "pink": (300.0, 344.0),
}
CHROMATIC = tuple(HUE_RANGES)
OBJECTS = ("circle", "square", "triangle", "star", "ring", "stripes")
BACKGROUNDS = ("plain", "gradient", "striped", "textured")
MASK_KINDS = ("object", "rect", "blob", "strokes")
# Every word a caption can contain: the demo tokenizer makes each one a single token.
WORDS = ("a", "and", "on", "background", *COLOURS, *OBJECTS, *BACKGROUNDS)


@dataclass
class Scene:
    """One generated image with its caption parts and per-object silhouettes."""

    image: np.ndarray  # [H, W, 3] uint8
    background: tuple[str, str]  # (colour, kind)
    objects: list[tuple[str, str]]  # (colour, kind), drawing order
    silhouettes: list[np.ndarray]  # [H, W] bool per object
    backdrop: np.ndarray  # [H, W, 3] uint8: the background before any object was drawn

    def caption(self, first: int | None = None) -> str:
        """Full caption; ``first`` names that object first (the one under an object mask)."""
        order = list(range(len(self.objects)))
        if first is not None:
            order.remove(first)
            order.insert(0, first)
        parts = [object_phrase(*self.objects[i]) for i in order]
        colour, kind = self.background
        return f"{' and '.join(parts)} on a {colour} {kind} background"

    def unpainted(self, index: int) -> np.ndarray:
        """The colours an edit of object ``index`` finds already there ([N, 3] uint8): the
        background's and every other object's, sampled every 4th pixel."""
        others = [s for i, s in enumerate(self.silhouettes) if i != index]
        rest = self.image[np.logical_or.reduce(others)] if others else self.image[:0, 0]
        return np.concatenate([self.backdrop[::4, ::4].reshape(-1, 3), rest[::4]])

    def background_caption(self) -> str:
        colour, kind = self.background
        return f"a {colour} {kind} background"


@dataclass
class Sample:
    """A training sample: a scene, an inpainting mask and the captions it may be shown with."""

    image: np.ndarray  # [H, W, 3] uint8
    mask: np.ndarray  # [H, W] bool, True = repaint
    captions: list[str]  # the trainer picks one at random


def object_phrase(colour: str, kind: str) -> str:
    """ "a red star", or "red stripes" (a plural takes no article)."""
    return f"{colour} {kind}" if kind == "stripes" else f"a {colour} {kind}"


def _jitter(rgb: tuple[int, int, int], rng: np.random.Generator) -> np.ndarray:
    """A shade of a named colour: hue ±6°, saturation and value varied, still that colour."""
    h, s, v = colorsys.rgb_to_hsv(*(c / 255.0 for c in rgb))
    h = (h + rng.uniform(-6, 6) / 360.0) % 1.0
    if s > 0.2:
        s = float(np.clip(s * rng.uniform(0.8, 1.1), 0.45, 1.0))
        v = float(np.clip(v * rng.uniform(0.85, 1.1), 0.55, 1.0))
    else:
        v = float(np.clip(v + rng.uniform(-0.06, 0.06), 0.0, 1.0))
    return np.array(colorsys.hsv_to_rgb(h, s, v)) * 255.0


def _tint(rgb: np.ndarray, amount: float) -> np.ndarray:
    """Towards white (amount > 0) or black (amount < 0), keeping the hue."""
    target = 255.0 if amount > 0 else 0.0
    return rgb + (target - rgb) * abs(amount)


def _background(colour: str, kind: str, rng: np.random.Generator, size: int) -> np.ndarray:
    base = _jitter(COLOURS[colour], rng)
    shift = 0.35 if colour != "white" else -0.25
    if colour == "black":
        shift = 0.25
    other = _tint(base, shift * (1 if rng.random() < 0.5 else 0.7))
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    if kind == "plain":
        img = np.broadcast_to(base, (size, size, 3)).copy()
    elif kind == "gradient":
        angle = rng.uniform(0, 2 * math.pi)
        t = (np.cos(angle) * xx + np.sin(angle) * yy) / size
        t = (t - t.min()) / max(t.max() - t.min(), 1e-6)
        img = base * (1 - t[..., None]) + other * t[..., None]
    elif kind == "striped":
        period = rng.uniform(10, 22)
        angle = rng.choice([0.0, math.pi / 2, math.pi / 4, -math.pi / 4])
        u = np.cos(angle) * xx + np.sin(angle) * yy + rng.uniform(0, period)
        on = (u % period) < period / 2
        img = np.where(on[..., None], base, other)
    else:  # textured: smooth random blotches of the two shades
        noise = rng.normal(0, 1, (size // 8, size // 8))
        field_ = np.asarray(
            Image.fromarray(((noise - noise.min()) / np.ptp(noise) * 255).astype(np.uint8))
            .resize((size, size), Image.BICUBIC)
            .filter(ImageFilter.GaussianBlur(2)),
            dtype=np.float64,
        )
        t = field_ / 255.0
        img = base * (1 - t[..., None]) + other * t[..., None]
    img = img + rng.normal(0, 3.0, img.shape)  # a little grain: real images are never flat
    return np.clip(img, 0, 255)


def _star(cx: float, cy: float, r: float, rot: float) -> list[tuple[float, float]]:
    pts = []
    for i in range(10):
        rad = r if i % 2 == 0 else r * 0.45
        a = rot + i * math.pi / 5
        pts.append((cx + rad * math.sin(a), cy - rad * math.cos(a)))
    return pts


def _silhouette(kind: str, cx: float, cy: float, r: float, rng: np.random.Generator, size: int):
    """The object's coverage as an ``L`` image (stripes also return their stripe pattern)."""
    img = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(img)
    box = [cx - r, cy - r, cx + r, cy + r]
    if kind == "circle":
        draw.ellipse(box, fill=255)
    elif kind == "square":
        rot = rng.uniform(0, math.pi / 2)
        pts = [
            (cx + r * 0.9 * math.cos(rot + k * math.pi / 2 + math.pi / 4) * math.sqrt(2) * 0.8,
             cy + r * 0.9 * math.sin(rot + k * math.pi / 2 + math.pi / 4) * math.sqrt(2) * 0.8)
            for k in range(4)
        ]  # fmt: skip
        draw.polygon(pts, fill=255)
    elif kind == "triangle":
        rot = rng.uniform(-0.3, 0.3)
        pts = [
            (cx + r * math.sin(rot + k * 2 * math.pi / 3), cy - r * math.cos(rot + k * 2 * math.pi / 3))
            for k in range(3)
        ]  # fmt: skip
        draw.polygon(pts, fill=255)
    elif kind == "star":
        draw.polygon(_star(cx, cy, r, rng.uniform(-0.3, 0.3)), fill=255)
    elif kind == "ring":
        draw.ellipse(box, fill=255)
        inner = r * 0.55
        draw.ellipse([cx - inner, cy - inner, cx + inner, cy + inner], fill=0)
    else:  # stripes: a patch of parallel bars
        bars = Image.new("L", (size, size), 0)
        bdraw = ImageDraw.Draw(bars)
        width = max(3.0, r / 3.5)
        x = cx - r
        while x < cx + r:
            bdraw.rectangle([x, cy - r, x + width, cy + r], fill=255)
            x += 2 * width
        img = bars.rotate(
            float(rng.choice([0, 45, 90, -45])), center=(cx, cy), resample=Image.BILINEAR
        )
    return img


def make_scene(seed: int, size: int = SIZE) -> Scene:
    """The scene of ``seed``: a background and one or two objects of other colours."""
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    bg_colour = names[int(rng.integers(len(names)))]
    bg_kind = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    img = _background(bg_colour, bg_kind, rng, size)
    backdrop = np.clip(img, 0, 255).round().astype(np.uint8)
    n = 1 if rng.random() < 0.55 else 2
    objects: list[tuple[str, str]] = []
    silhouettes: list[np.ndarray] = []
    centres: list[tuple[float, float, float]] = []
    for _ in range(n):
        colour = names[int(rng.integers(len(names)))]
        while colour == bg_colour:
            colour = names[int(rng.integers(len(names)))]
        kind = OBJECTS[int(rng.integers(len(OBJECTS)))]
        r = float(rng.uniform(0.13, 0.27) * size)
        for _try in range(20):  # keep objects apart so each mask covers one of them
            cx, cy = (float(rng.uniform(r, size - r)) for _ in range(2))
            if all(math.hypot(cx - x, cy - y) > (r + q) * 0.9 for x, y, q in centres):
                break
        centres.append((cx, cy, r))
        cover = np.asarray(_silhouette(kind, cx, cy, r, rng, size), dtype=np.float64) / 255.0
        rgb = _jitter(COLOURS[colour], rng)
        img = img * (1 - cover[..., None]) + rgb * cover[..., None]
        for prev in silhouettes:  # an object drawn on top hides what it covers
            prev &= cover < 0.5
        objects.append((colour, kind))
        silhouettes.append(cover >= 0.5)
    image = np.clip(img, 0, 255).round().astype(np.uint8)
    return Scene(image, (bg_colour, bg_kind), objects, silhouettes, backdrop)


def object_mask(scene: Scene, index: int, rng: np.random.Generator) -> np.ndarray:
    """A mask around one object: its dilated silhouette, its box, or an ellipse around it."""
    sil = scene.silhouettes[index]
    size = sil.shape[0]
    if not sil.any():
        return mask_of_ratio((size, size), 0.15, "rect", int(rng.integers(1 << 30)))
    ys, xs = np.nonzero(sil)
    pad = int(rng.integers(2, 7))
    x0, x1 = max(0, xs.min() - pad), min(size - 1, xs.max() + pad)
    y0, y1 = max(0, ys.min() - pad), min(size - 1, ys.max() + pad)
    choice = rng.random()
    img = Image.new("L", (size, size), 0)
    if choice < 0.4:
        img = Image.fromarray(sil.astype(np.uint8) * 255).filter(ImageFilter.MaxFilter(2 * pad + 1))
    elif choice < 0.75:
        ImageDraw.Draw(img).rectangle([x0, y0, x1, y1], fill=255)
    else:
        ImageDraw.Draw(img).ellipse([x0 - pad, y0 - pad, x1 + pad, y1 + pad], fill=255)
    return np.asarray(img) > 127


def stroke_mask(size: int, rng: np.random.Generator) -> np.ndarray:
    """Free-form brush strokes, as LaMa/SD-inpainting training masks draw them."""
    img = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(1, 4))):
        x, y = rng.uniform(0, size, 2)
        width = int(rng.integers(size // 16, size // 6))
        for _ in range(int(rng.integers(3, 8))):
            a = rng.uniform(0, 2 * math.pi)
            length = rng.uniform(size / 10, size / 3)
            nx = float(np.clip(x + length * math.cos(a), 0, size - 1))
            ny = float(np.clip(y + length * math.sin(a), 0, size - 1))
            draw.line([float(x), float(y), nx, ny], fill=255, width=width)
            draw.ellipse([nx - width / 2, ny - width / 2, nx + width / 2, ny + width / 2], fill=255)
            x, y = nx, ny
    return np.asarray(img) > 127


def make_sample(seed: int, size: int = SIZE) -> Sample:
    """Scene, mask and captions of ``seed``: half the masks cover one object, named first."""
    scene = make_scene(seed, size)
    rng = np.random.default_rng([seed, 1])
    kind = MASK_KINDS[0] if rng.random() < 0.5 else MASK_KINDS[1 + int(rng.integers(3))]
    if kind == "object":
        index = int(rng.integers(len(scene.objects)))
        mask = object_mask(scene, index, rng)
        captions = [scene.caption(first=index), object_phrase(*scene.objects[index])]
    else:
        if kind == "strokes":
            mask = stroke_mask(size, rng)
        else:
            ratio = float(rng.uniform(0.05, 0.45))
            mask = mask_of_ratio((size, size), ratio, kind, int(rng.integers(1 << 30)))
        captions = [scene.caption()]
        if len(scene.objects) == 1:
            captions.append(object_phrase(*scene.objects[0]))
    return Sample(scene.image, mask, captions)


def hue_stats(image: np.ndarray, mask: np.ndarray) -> tuple[float, float, float]:
    """Mean hue (degrees, circular, saturation-weighted), mean saturation and mean value."""
    rgb = image[mask].astype(np.float64) / 255.0
    if len(rgb) == 0:
        return float("nan"), 0.0, 0.0
    mx, mn = rgb.max(axis=1), rgb.min(axis=1)
    delta = mx - mn
    sat = np.where(mx > 0, delta / np.maximum(mx, 1e-12), 0.0)
    r, g, b = rgb[:, 0], rgb[:, 1], rgb[:, 2]
    safe = np.maximum(delta, 1e-12)
    hue = np.where(
        mx == r, ((g - b) / safe) % 6, np.where(mx == g, (b - r) / safe + 2, (r - g) / safe + 4)
    )
    angle = hue * (math.pi / 3)
    weight = sat * mx  # grey pixels carry no hue
    x, y = float((np.cos(angle) * weight).sum()), float((np.sin(angle) * weight).sum())
    mean_hue = math.degrees(math.atan2(y, x)) % 360.0 if weight.sum() > 1e-9 else float("nan")
    return mean_hue, float(sat.mean()), float(mx.mean())


def colour_matches(image: np.ndarray, mask: np.ndarray, colour: str) -> bool:
    """Whether the masked region has the named colour (the issue's edit-success measure).

    Chromatic colours: the region's mean hue lies in the colour's range and the region is
    coloured at all (mean saturation ≥ 0.25). White and black: mean value ≥ 0.75 with
    saturation < 0.25, and mean value ≤ 0.25.
    """
    hue, sat, val = hue_stats(image, mask)
    if colour == "white":
        return val >= 0.75 and sat < 0.25
    if colour == "black":
        return val <= 0.25
    if math.isnan(hue) or sat < 0.25:
        return False
    lo, hi = HUE_RANGES[colour]
    return lo <= hue < hi if lo < hi else (hue >= lo or hue < hi)


# RGB distance within which a pixel counts as background: the backdrop's own grain and the
# VAE's error are ~10-30, the nearest pair of named colours (with the backdrop's tints) ~90.
BACKDROP_TOLERANCE = 32.0
PAINTED_MIN_FRACTION = 0.1  # of the mask: less than this and nothing was drawn


def painted(image: np.ndarray, mask: np.ndarray, unpainted: np.ndarray) -> np.ndarray:
    """The masked pixels of ``image`` that were drawn there: farther than
    :data:`BACKDROP_TOLERANCE` from every colour of ``unpainted`` (``Scene.unpainted``), less
    a 1 px rim (an object's anti-aliased edge is a blend with the background, not its
    colour)."""
    # Distinct colours only, to the nearest 4 (≤ 3.5 off, well inside the tolerance): a
    # scene's few thousand samples reduce to a few hundred, and the judge gets ~10× faster.
    palette = np.unique(unpainted.reshape(-1, 3) // 4, axis=0).astype(np.float32) * 4 + 1.5
    pixels = image[mask].astype(np.float32)
    nearest = np.full(len(pixels), np.inf, dtype=np.float32)
    for start in range(0, len(palette), 256):  # bounded memory for big masks
        chunk = palette[start : start + 256]
        d = np.sqrt(((pixels[:, None, :] - chunk[None]) ** 2).sum(-1)).min(axis=1)
        nearest = np.minimum(nearest, d)
    out = np.zeros(mask.shape, dtype=bool)
    out[mask] = nearest > BACKDROP_TOLERANCE
    eroded = np.asarray(
        Image.fromarray(out.astype(np.uint8) * 255).filter(ImageFilter.MinFilter(3))
    )
    return eroded > 127 if eroded.sum() >= PAINTED_MIN_FRACTION * 255 * mask.sum() else out


def edit_succeeded(image: np.ndarray, mask: np.ndarray, colour: str, unpainted: np.ndarray) -> bool:
    """Whether an edit drew something of ``colour`` in ``mask`` (the edit-success measure).

    The region judged is what was painted there (:func:`painted`), not the whole mask: a
    replacement's box, or a recolour's dilated silhouette, also holds background, whose
    colour would otherwise pull the mean hue away from a correctly drawn object. At least
    :data:`PAINTED_MIN_FRACTION` of the mask must be painted, and its colour must match.
    """
    drawn = painted(image, mask, unpainted)
    if drawn.sum() < PAINTED_MIN_FRACTION * mask.sum():
        return False
    return colour_matches(image, drawn, colour)
