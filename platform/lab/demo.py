"""``retouch demo``: the product in one command, on any machine.

Starts ``retouch serve`` as a child process on a free loopback port, deploys
``shapes-sd.toml`` on the trained model ``retouch:shapes-sd``, asks for real edits ("a
yellow star"), runs the same edits through the stock diffusers pipeline in this process,
and writes a labelled sheet (prompt; template, mask, stock, retouch, difference) with the
fidelity, edit-success and speed figures of those edits. With ``tour`` it then deploys the
two example functions on random-weight models (``deploy/examples``), sends a mix of
invocations with masks of different shapes and sizes, prints a table and writes
input/mask/output images (their outputs are noise: the weights are random). Everything is
shut down at the end.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from retouch.functions.demo.images import mask_of_ratio
from retouch.functions.demo.shapes import edit_succeeded, make_scene, object_phrase
from retouch.functions.errors import RetouchError
from retouch.functions.imaging import composite, encode_mask
from retouch.platform.api.client import Client, read_spec_file
from retouch.platform.api.server import ServerProcess
from retouch.platform.lab.bench.edits import most_visible, recolour_mask, replace_mask
from retouch.runtime.maskaware.quality import psnr, ssim
from retouch.runtime.maskaware.request import EditRequest

log = logging.getLogger(__name__)

EXAMPLES = ("tiny-sd.toml", "tiny-flux.toml")
SHAPES_EXAMPLE = "shapes-sd.toml"
MASKS = (
    ("rect", 0.1),
    ("ellipse", 0.25),
    ("blob", 0.35),
    ("rect", 0.6),
    ("rect", 1.0),
    ("rect", 0.0),
)
PROMPTS = ("a red balloon", "a wooden door", "a bright yellow sun", "green leaves")
# One torch thread for the served model and for the stock pipeline in this process: the
# 5.8 M-parameter UNet at 16x16 latents is bound by per-op overhead, so a second thread buys
# nothing, and on a busy machine every op of a multi-threaded step waits for its slowest
# thread (a step's hundreds of small ops then stall on descheduled threads).
DEMO_THREADS = 1


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
        if folder and all((folder / name).exists() for name in (*EXAMPLES, SHAPES_EXAMPLE)):
            return folder
    raise RetouchError(
        f"example specs {EXAMPLES} not found in {[str(c) for c in candidates]}; pass --examples",
        code="examples_not_found",
    )


@dataclass
class DemoResult:
    edits: list[ShapeEdit]
    sheet: Path
    tour: list[DemoRow]  # empty unless the tour was asked for


def run_demo(out: Path, examples: Path | None, executors: int, tour: bool = False) -> DemoResult:
    """The trained model's edits and their sheet first; the random-weight tour on request."""
    folder = find_examples(examples)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"starting retouch serve ({executors} executor(s)); data and logs in {out / 'data'}")
    rows: list[DemoRow] = []
    import torch

    torch.set_num_threads(DEMO_THREADS)
    threads = ["--threads", str(DEMO_THREADS)]
    with (
        ServerProcess(out / "data", executors=executors, extra_args=threads) as server,
        Client(server.url) as client,
    ):
        edits = run_shape_edits(client, folder / SHAPES_EXAMPLE, out / "data" / "models")
        print_shape_edits(edits)
        sheet = write_shape_sheet(edits, out / "shapes-sheet.png")
        print(f"\nwrote the sheet {sheet.resolve()} in {time.perf_counter() - started:.1f} s")
        if tour:
            print("\nthe tour: random-weight models (their outputs are noise)")
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
            print(f"wrote {len(rows) * 3} images of the tour in {out.resolve()}")
        else:
            print("retouch demo --tour also deploys the random-weight example models")
    print(f"done in {time.perf_counter() - started:.1f} s; platform stopped")
    return DemoResult(edits, sheet, rows)


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


# The trained-model edits: (template id in shapes-sd.toml, colour, kind). The id carries the
# scene's seed (``shapes.make_scene``); the edited object is the scene's most visible one. A
# kind equal to that object's is a recolour (mask: its silhouette + 3 px), another kind
# replaces it (mask: its box + 4 px), as ``retouch bench edits`` asks.
SHAPE_EDITS = (
    ("scene-900800001", "yellow", "star"),
    ("scene-900800003", "green", "ring"),
    ("scene-900800008", "orange", "circle"),
    ("scene-900800011", "red", "ring"),
)
BAKE_TIMEOUT_S = 300.0
DIFF_GAIN = 4  # the difference column, amplified so small differences show


@dataclass
class ShapeEdit:
    """One trained-model edit, served and by the stock pipeline, with its figures."""

    template: str
    prompt: str
    colour: str
    image: np.ndarray  # the template, RGB8
    mask: np.ndarray
    unpainted: np.ndarray  # the scene's colours an edit finds there (``Scene.unpainted``)
    stock: np.ndarray  # the stock diffusers pipeline, composited as the function does
    retouch: np.ndarray  # the served (mask-aware) edit
    path: str
    stock_ms: float  # the stock pipeline in this process
    served_ms: float  # the invocation's total on the platform (queue, pre, run, post)

    @property
    def psnr(self) -> float:
        return psnr(self.retouch / 255.0, self.stock / 255.0)

    @property
    def ssim(self) -> float:
        return ssim(self.retouch / 255.0, self.stock / 255.0)

    def success(self, image: np.ndarray) -> bool:
        return edit_succeeded(image, self.mask, self.colour, self.unpainted)


def run_shape_edits(client: Client, spec_file: Path, models_dir: Path) -> list[ShapeEdit]:
    """Deploy ``spec_file`` (trained model), wait for its bakes, and run :data:`SHAPE_EDITS`
    on the platform and through the stock pipeline here, same inputs."""
    from retouch.platform.lab.bench.edits import load_editor

    spec, images = read_spec_file(spec_file)
    print(f"deploying {spec.name} ({spec.model}, trained; {len(spec.templates)} templates) ...")
    doc = client.deploy(spec, images)
    if doc["status"] != "ready":
        raise RetouchError(
            f"{spec.name} failed to deploy: {doc.get('error')}", code="deploy_failed"
        )
    _wait_baked(client, spec.name)
    editor = load_editor(spec.model, models_dir)
    edits = []
    for seed, (template, colour, kind) in enumerate(SHAPE_EDITS):
        scene = make_scene(int(template.rsplit("-", 1)[1]))
        index = most_visible(scene)
        silhouette = scene.silhouettes[index]
        mask = (
            recolour_mask(silhouette)
            if kind == scene.objects[index][1]
            else replace_mask(silhouette)
        )
        prompt = object_phrase(colour, kind)
        result = client.invoke(spec.name, template, mask, prompt, seed=seed, format="raw")
        shape = (result.height, result.width, 3)
        retouch = np.frombuffer(result.image, np.uint8).reshape(shape)
        tpl = spec.templates[template]
        image = Image.fromarray(scene.image)
        request = EditRequest(
            image,
            mask,
            prompt,
            seed,
            spec.steps,
            spec.guidance,
            tpl.prompt,
            tpl.seed,
            spec.full_steps,
            spec.halo or 0,
        )
        started = time.perf_counter()
        stock = editor.stock_edit(request)
        stock_ms = (time.perf_counter() - started) * 1e3
        if spec.composite:
            stock = composite(stock, image, mask, spec.feather_px)
        edits.append(
            ShapeEdit(
                template,
                prompt,
                colour,
                scene.image,
                mask,
                scene.unpainted(index),
                np.asarray(stock.convert("RGB")),
                retouch,
                result.path.value,
                stock_ms,
                result.timings.total_ms,
            )
        )
    return edits


def _wait_baked(client: Client, name: str) -> None:
    """Mask-aware edits need the templates' bakes: wait for them (they run at deploy)."""
    deadline = time.monotonic() + BAKE_TIMEOUT_S
    while time.monotonic() < deadline:
        states = {t["state"] for t in client.get(name)["templates"].values()}
        if states == {"baked"}:
            return
        if "failed" in states:
            raise RetouchError(f"a template of {name} failed to bake", code="bake_failed")
        time.sleep(0.2)
    raise RetouchError(f"{name} not baked in {BAKE_TIMEOUT_S:.0f} s", code="bake_timeout")


def print_shape_edits(edits: list[ShapeEdit]) -> None:
    print(
        f"\n{'template':<16} {'prompt':<16} {'path':<9} {'PSNR dB':>8} {'SSIM':>6} "
        f"{'stock ok':>8} {'retouch ok':>10} {'stock ms':>9} {'served ms':>9}"
    )
    for e in edits:
        print(
            f"{e.template:<16} {e.prompt:<16} {e.path:<9} {e.psnr:>8.1f} {e.ssim:>6.3f} "
            f"{e.success(e.stock)!s:>8} {e.success(e.retouch)!s:>10} "
            f"{e.stock_ms:>9.0f} {e.served_ms:>9.0f}"
        )
    print(
        "PSNR/SSIM: the served mask-aware edit against the stock diffusers pipeline (same "
        "inputs, both composited); ok: the masked region has the requested colour; stock ms: "
        "the stock pipeline in this process; served ms: the invocation's total on the platform"
    )
    sys.stdout.flush()


def row_label(edit: ShapeEdit) -> list[str]:
    """The lines written left of an edit's row on the sheet: the prompt first."""
    ok = {True: "yes", False: "no"}
    return [
        f'"{edit.prompt}"',
        edit.template,
        f"painted: stock {ok[edit.success(edit.stock)]}, retouch {ok[edit.success(edit.retouch)]}",
        "retouch = stock, pixel for pixel"
        if edit.psnr == float("inf")
        else f"retouch vs stock {edit.psnr:.1f} dB, SSIM {edit.ssim:.3f}",
        f"served {edit.served_ms:.0f} ms ({edit.path})",
    ]


SHEET_COLUMNS = ("prompt", "template", "mask", "stock", "retouch", f"difference x{DIFF_GAIN}")
LABEL_H = 28  # the column headers' band
LABEL_W = 300  # the prompt column


def write_shape_sheet(edits: list[ShapeEdit], path: Path, scale: int = 2) -> Path:
    """One row per edit: its prompt and figures (:func:`row_label`), then template, mask,
    stock, retouch and |retouch - stock| x DIFF_GAIN; the columns named along the top."""
    rows = []
    for e in edits:
        mask = np.repeat(e.mask[..., None].astype(np.uint8) * 255, 3, axis=-1)
        diff = np.abs(e.retouch.astype(int) - e.stock.astype(int)) * DIFF_GAIN
        tiles = [e.image, mask, e.stock, e.retouch, np.clip(diff, 0, 255).astype(np.uint8)]
        rows.append(np.concatenate(tiles, axis=1))
    grid = Image.fromarray(np.concatenate(rows, axis=0))
    grid = grid.resize((grid.width * scale, grid.height * scale), Image.NEAREST)
    tile = grid.width // (len(SHEET_COLUMNS) - 1)
    row_h = grid.height // len(edits)
    sheet = Image.new("RGB", (LABEL_W + grid.width, LABEL_H + grid.height), "white")
    sheet.paste(grid, (LABEL_W, LABEL_H))
    draw = ImageDraw.Draw(sheet)
    header, body = ImageFont.load_default(size=18), ImageFont.load_default(size=14)
    for i, name in enumerate(SHEET_COLUMNS):
        draw.text((LABEL_W + (i - 1) * tile + 6 if i else 6, 4), name, fill="black", font=header)
    for r, e in enumerate(edits):
        top = LABEL_H + r * row_h
        draw.line((0, top, LABEL_W, top), fill="lightgray")
        y = top + 8
        for n, line in enumerate(row_label(e)):
            font = header if n == 0 else body
            draw.text((6, y), line, fill="black", font=font)
            y += 26 if n == 0 else 20
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path
