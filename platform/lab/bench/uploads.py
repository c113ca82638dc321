"""Edits of one uploaded image: the first (stock, bakes it), two later ones (mask-aware once
baked), and the same edit computed in full without a bake (``guidance`` overridden by 1e-4).

``python -m retouch.platform.lab.bench.uploads [--model retouch:small-sd] [--size 256]
[--steps 10] [--photo 13] [--data-dir DIR]`` prints one JSON line per edit
(``docs/benchmarks.md``, "Uploaded images").

:func:`run_crop_bench` (``retouch bench crop``) edits a photo larger than the function's
resolution both ways, side by side in one run: with ``padding_mask_crop`` (a crop around
the mask at the function's resolution, pasted back) and resized whole to the function's
resolution (pasted back too); each mode's first edit (stock, bakes its ad-hoc template) and,
once baked, later edits with another mask of the same bounding box (mask-aware).
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from retouch.functions.modelcheck import model_family
from retouch.functions.spec import parse_spec
from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess

MASK_SIDE = 0.45  # a centred square: a mask ratio of about 0.20


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def run(model: str, size: int, steps: int, photo_seed: int, data_dir: Path) -> list[dict]:
    rng = np.random.default_rng(photo_seed)
    small = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    image = png(Image.fromarray(small).resize((size, size), Image.BILINEAR))
    template = png(Image.new("RGB", (size, size), (90, 120, 150)))
    mask = np.zeros((size, size), bool)
    side, at = int(size * MASK_SIDE), size // 4
    mask[at : at + side, at : at + side] = True
    spec = parse_spec(
        {
            "name": "m",
            "model": model,
            "family": model_family(model),
            "resolution": size,
            "steps": steps,
            "templates": {"t": {"prompt": "", "seed": 0}},
        }
    )
    rows: list[dict] = []
    with (
        ServerProcess(data_dir, extra_args=["--invoke-timeout", "3600"]) as server,
        Client(server.url, timeout=3600) as client,
    ):
        client.deploy(spec, {"t": template})
        client.wait_baked("m", timeout=3600)
        for guidance in (spec.guidance, spec.guidance - 1e-4):  # warm-up: mask-aware, stock
            client.invoke("m", "t", mask, "warm-up", seed=1, guidance=guidance, format="raw")

        def edit(label: str, **options) -> str:
            r = client.invoke(
                "m", None, mask, "a red door", seed=3, image=image, format="raw", **options
            )
            engine = client.executors()["executors"][0]["state"]["engine"]
            row = {
                "edit": label,
                "path": r.path.value,
                "run_ms": round(r.timings.run_ms),
                "total_ms": round(r.timings.total_ms),
                "tier": r.cache.tier.value,
                "bakes_so_far": engine["bakes"],
                "mask_ratio": round(r.mask_ratio, 3),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            return r.template

        upload = edit("1")
        started = time.monotonic()
        while client.get("m")["uploads"].get(upload, {}).get("state") != "baked":
            time.sleep(0.5)
        baked = client.get("m")["uploads"][upload]
        print(json.dumps({"baked_after_s": round(time.monotonic() - started, 1), **baked}))
        edit("2")
        edit("3")
        edit("stock reference", guidance=spec.guidance - 1e-4)
    return rows


def _photo(size: tuple[int, int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize(size, Image.BILINEAR))


def _masks(size: tuple[int, int], ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """A centred rectangle of ``ratio`` of the photo, and a frame of it (the same bounding
    box, so the same crop, and another mask)."""
    width, height = size
    w, h = int(width * ratio**0.5), int(height * ratio**0.5)
    left, top = (width - w) // 2, (height - h) // 2
    mask = np.zeros((height, width), bool)
    mask[top : top + h, left : left + w] = True
    frame = mask.copy()
    frame[top + h // 8 : top + h - h // 8, left + w // 8 : left + w - w // 8] = False
    return mask, frame


def run_crop_bench(
    model: str,
    resolution: int,
    steps: int,
    photo: tuple[int, int],
    pad: int,
    repeats: int,
    data_dir: Path,
) -> dict[str, Any]:
    """Edits of one ``photo``-sized image with a 10 % mask: ``padding_mask_crop=pad`` and
    the whole photo resized, interleaved in one run against one server; wall time at the
    client, the gateway's ``total_ms`` and the executor's ``run_ms``, per edit."""
    image = png(Image.fromarray(_photo(photo, 7)))
    mask, frame = _masks(photo, 0.10)
    spec = parse_spec(
        {
            "name": "m",
            "model": model,
            "family": model_family(model),
            "resolution": resolution,
            "steps": steps,
            "templates": {"t": {"prompt": "", "seed": 0}},
        }
    )
    modes = {"padding_mask_crop": {"padding_mask_crop": pad}, "resized": {}}
    rows: list[dict[str, Any]] = []
    with (
        ServerProcess(data_dir, extra_args=["--invoke-timeout", "3600"]) as server,
        Client(server.url, timeout=3600) as client,
    ):
        client.deploy(spec, {"t": png(Image.new("RGB", (resolution, resolution)))}, timeout=3600)
        client.wait_baked("m", timeout=3600)
        client.invoke("m", "t", np.ones((resolution, resolution), bool), "warm-up", seed=1)

        def edit(mode: str, edit_mask: np.ndarray, label: str, seed: int) -> str:
            started = time.perf_counter()
            r = client.invoke(
                "m", None, edit_mask, "a red door", seed=seed, image=image, **modes[mode]
            )
            rows.append(
                {
                    "mode": mode,
                    "edit": label,
                    "path": r.path.value,
                    "size": f"{r.width}x{r.height}",
                    "canvas_mask_ratio": round(r.mask_ratio, 3),
                    "wall_ms": round((time.perf_counter() - started) * 1e3),
                    "total_ms": round(r.timings.total_ms),
                    "run_ms": round(r.timings.run_ms),
                }
            )
            return r.template

        uploads = {mode: edit(mode, mask, "first", 1) for mode in modes}
        for upload in uploads.values():
            while client.get("m")["uploads"].get(upload, {}).get("state") != "baked":
                time.sleep(0.5)
        for i in range(repeats):
            for mode in modes:
                edit(mode, frame, "later", 2 + i)
    return {
        "model": model,
        "resolution": resolution,
        "steps": steps,
        "photo": f"{photo[0]}x{photo[1]}",
        "padding_mask_crop": pad,
        "mask_ratio": round(float(mask.mean()), 3),
        "edits": rows,
        "mean_later_wall_ms": {
            mode: round(
                float(
                    np.mean(
                        [r["wall_ms"] for r in rows if r["mode"] == mode and r["edit"] == "later"]
                    )
                )
            )
            for mode in modes
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="retouch:small-sd")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--photo", type=int, default=13, help="seed of the random photo")
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="retouch-uploads-"))
    run(args.model, args.size, args.steps, args.photo, data_dir)


if __name__ == "__main__":
    main()
