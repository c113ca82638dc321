"""Edits of one uploaded image: the first (stock, bakes it), two later ones (mask-aware once
baked), and the same edit computed in full without a bake (``guidance`` overridden by 1e-4).

``python -m retouch.platform.bench.uploads [--model retouch:small-sd] [--size 256]
[--steps 10] [--photo 13] [--data-dir DIR]`` prints one JSON line per edit
(``docs/benchmarks.md``, "Uploaded images").
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from retouch.functions.modelcheck import model_family
from retouch.functions.spec import parse_spec
from retouch.platform.client import Client
from retouch.platform.server import ServerProcess

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
