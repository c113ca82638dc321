"""``retouch bench edits``: does an edit paint what the prompt asks? (edit-success rate)

A measure that needs no reference model: on held-out shapes scenes (seeds the training set
never uses), one object is masked and the model's stock inpainting pipeline is asked
for an object of another colour. An edit succeeds when the masked region's mean hue lies in
the requested colour's range (``shapes.colour_matches``). Two kinds of edit, reported apart
and together:

* ``recolour``: the same kind of object in a new colour, the mask its silhouette dilated by
  3 px (the region is mostly object, so its mean hue is the object's);
* ``replace``: another kind of object in a new colour, the mask the object's box plus 4 px.

The requested colour always differs from the object's and the background's, so keeping the
template or filling in background never counts as success.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageFilter

from retouch.functions.demo.shapes import (
    COLOURS,
    OBJECTS,
    colour_matches,
    hue_stats,
    make_scene,
    object_phrase,
)

log = logging.getLogger(__name__)

EVAL_SEED = 900_000_000  # far from every training seed (train.py: seed * 1e6 + index)


def edit_cases(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` edits (half recolour, half replace): scene, mask, prompt and requested colour."""
    cases = []
    rng = np.random.default_rng([seed, 7])
    for i in range(n):
        scene = make_scene(EVAL_SEED + seed * 10_000 + i)
        index = int(np.argmax([s.sum() for s in scene.silhouettes]))  # the most visible object
        colour, kind = scene.objects[index]
        taken = {colour, scene.background[0]}
        new_colour = str(rng.choice([c for c in COLOURS if c not in taken]))
        sil = scene.silhouettes[index]
        if i % 2 == 0:
            edit, new_kind = "recolour", kind
            mask = np.asarray(
                Image.fromarray(sil.astype(np.uint8) * 255).filter(ImageFilter.MaxFilter(7))
            )
            mask = mask > 127
        else:
            edit = "replace"
            new_kind = str(rng.choice([k for k in OBJECTS if k != kind]))
            ys, xs = np.nonzero(sil)
            size = sil.shape[0]
            mask = np.zeros_like(sil)
            mask[
                max(0, ys.min() - 4) : min(size, ys.max() + 5),
                max(0, xs.min() - 4) : min(size, xs.max() + 5),
            ] = True
        cases.append(
            {
                "image": scene.image,
                "mask": mask,
                "prompt": object_phrase(new_colour, new_kind),
                "colour": new_colour,
                "edit": edit,
                "seed": i,
            }
        )
    return cases


def run_edit_bench(
    pipe: Any,
    n: int = 50,
    *,
    steps: int = 25,
    guidance: float = 5.0,
    seed: int = 0,
    sheet: Path | None = None,
) -> dict[str, Any]:
    """Stock edits of ``edit_cases(n)`` with ``pipe``; success rate overall and per kind."""
    rows = []
    tiles = []
    for case in edit_cases(n, seed):
        out = pipe(
            prompt=case["prompt"],
            image=Image.fromarray(case["image"]),
            mask_image=Image.fromarray(case["mask"].astype(np.uint8) * 255),
            height=case["image"].shape[0],
            width=case["image"].shape[1],
            num_inference_steps=steps,
            guidance_scale=guidance,
            generator=torch.Generator().manual_seed(case["seed"]),
        ).images[0]
        result = np.asarray(out.convert("RGB"))
        ok = colour_matches(result, case["mask"], case["colour"])
        hue, sat, val = hue_stats(result, case["mask"])
        rows.append(
            {
                "edit": case["edit"],
                "prompt": case["prompt"],
                "success": bool(ok),
                "hue": round(hue, 1),
                "sat": round(sat, 3),
                "val": round(val, 3),
            }
        )
        if sheet is not None:
            shown = case["image"].copy()
            shown[case["mask"]] = shown[case["mask"]] // 2 + 127
            tiles.append(np.concatenate([shown, result], axis=0))
    if sheet is not None and tiles:
        _write_sheet(tiles, sheet)

    def rate(kind: str | None) -> float:
        chosen = [r["success"] for r in rows if kind is None or r["edit"] == kind]
        return float(np.mean(chosen)) if chosen else float("nan")

    return {
        "edits": len(rows),
        "steps": steps,
        "guidance": guidance,
        "success_rate": rate(None),
        "recolour_success_rate": rate("recolour"),
        "replace_success_rate": rate("replace"),
        "rows": rows,
    }


def _write_sheet(tiles: list[np.ndarray], path: Path, per_row: int = 10) -> None:
    """Template with the mask lightened above, the edit below; ``per_row`` edits a row."""
    blank = np.zeros_like(tiles[0])
    rows = []
    for start in range(0, len(tiles), per_row):
        row = tiles[start : start + per_row]
        row += [blank] * (per_row - len(row))
        rows.append(np.concatenate(row, axis=1))
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.concatenate(rows, axis=0)).save(path)


def load_pipeline(model: str, models_dir: Path) -> Any:
    """The stock inpainting pipeline of ``model`` (``retouch:shapes-sd`` or a folder), fp32."""
    from retouch.functions.demo.models import ensure_demo_model, is_demo
    from retouch.functions.models import model_family
    from retouch.runtime.models import load_pipeline as load_family_pipeline

    folder = ensure_demo_model(model, models_dir) if is_demo(model) else Path(model)
    return load_family_pipeline(folder, model_family(model), torch.device("cpu"))
