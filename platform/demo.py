"""``retouch demo``: the whole product in one command, on any machine.

Starts ``retouch serve`` as a child process on a free loopback port, deploys the two example
functions (``deploy/examples``), sends a mix of invocations with masks of different shapes
and sizes, prints a table, writes input/mask/output images, and shuts everything down.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from retouch.functions.demo.images import mask_of_ratio
from retouch.functions.errors import RetouchError
from retouch.functions.imaging import encode_mask
from retouch.platform.client import Client, read_spec_file
from retouch.platform.server import ServerProcess

log = logging.getLogger(__name__)

EXAMPLES = ("tiny-sd.toml", "tiny-flux.toml")
MASKS = (
    ("rect", 0.1),
    ("ellipse", 0.25),
    ("blob", 0.35),
    ("rect", 0.6),
    ("rect", 1.0),
    ("rect", 0.0),
)
PROMPTS = ("a red balloon", "a wooden door", "a bright yellow sun", "green leaves")


@dataclass
class DemoRow:
    function: str
    template: str
    shape: str
    mask_ratio: float
    path: str
    executor: str
    total_ms: float
    run_ms: float


def find_examples(explicit: Path | None) -> Path:
    candidates = (
        [explicit]
        if explicit
        else [
            Path.cwd() / "deploy" / "examples",
            Path(__file__).resolve().parents[1] / "deploy" / "examples",
        ]
    )
    for folder in candidates:
        if folder and all((folder / name).exists() for name in EXAMPLES):
            return folder
    raise RetouchError(
        f"example specs {EXAMPLES} not found in {[str(c) for c in candidates]}; pass --examples",
        code="examples_not_found",
    )


def run_demo(out: Path, examples: Path | None, executors: int) -> list[DemoRow]:
    folder = find_examples(examples)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"starting retouch serve ({executors} executor(s)); data and logs in {out / 'data'}")
    with ServerProcess(out / "data", executors=executors) as server, Client(server.url) as client:
        rows = []
        for name in EXAMPLES:
            spec, images = read_spec_file(folder / name)
            print(f"deploying {spec.name} ({spec.model}, {len(spec.templates)} templates) ...")
            doc = client.deploy(spec, images)
            if doc["status"] != "ready":
                raise RetouchError(
                    f"{spec.name} failed to deploy: {doc.get('error')}", code="deploy_failed"
                )
            rows += _invoke_all(client, spec.name, spec.width, spec.height, images, out)
    _print_table(rows)
    print(
        f"\nwrote {len(rows) * 3} images to {out.resolve()} in {time.perf_counter() - started:.1f} s; platform stopped"
    )
    return rows


def _invoke_all(
    client: Client, function: str, width: int, height: int, images: dict[str, bytes], out: Path
) -> list[DemoRow]:
    rows = []
    for t_index, (template, image_bytes) in enumerate(images.items()):
        for m_index, (shape, ratio) in enumerate(MASKS):
            mask = mask_of_ratio((width, height), ratio, shape, seed=t_index * 10 + m_index)
            prompt = PROMPTS[(t_index + m_index) % len(PROMPTS)]
            result = client.invoke(function, template, encode_mask(mask), prompt, seed=m_index)
            stem = out / f"{function}-{template}-{m_index}-{shape}{int(ratio * 100):02d}"
            Path(f"{stem}-input.png").write_bytes(image_bytes)
            Image.fromarray(mask.astype("uint8") * 255).save(f"{stem}-mask.png")
            Path(f"{stem}-output.png").write_bytes(result.image)
            rows.append(
                DemoRow(
                    function,
                    template,
                    shape,
                    result.mask_ratio,
                    result.path,
                    result.executor,
                    result.timings.total_ms,
                    result.timings.run_ms,
                )
            )
    return rows


def _print_table(rows: list[DemoRow]) -> None:
    print(
        f"\n{'function':<10} {'template':<8} {'mask':<8} {'ratio':>6} {'path':<9} {'executor':<8} {'total ms':>9} {'run ms':>8}"
    )
    for r in rows:
        print(
            f"{r.function:<10} {r.template:<8} {r.shape:<8} {r.mask_ratio:>6.3f} {r.path:<9} {r.executor:<8} {r.total_ms:>9.1f} {r.run_ms:>8.1f}"
        )
    sys.stdout.flush()
