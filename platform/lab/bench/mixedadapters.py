"""``retouch bench mixed-adapters``: the cost of a step whose rows run different LoRA sets.

One batch of ``batch`` requests of a built-in model steps three ways, side by side in one
run (each round times one step of each, in rotating order; medians over the rounds):

* **bare**: no adapter (peft's layers off: their base layers alone);
* **one set**: every row under one LoRA (peft's ``set_adapters``, what a turn runs);
* **mixed**: each row under its own LoRA (``runtime/mixedlora``: the base projection once,
  each file's update on its rows).

Each LoRA targets the attention projections at ``rank``. Steps are the stock path's (every
token computed: the LoRA layers see every row's whole input, the most they ever compute).
Time is the process's CPU clock (``time.process_time``: other processes on a shared machine
do not count) and the wall clock; the ops a step dispatches (``bench ops``' counter) are the
machine-independent figure of its host overhead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from retouch.functions.adapters import AdapterSpec
from retouch.functions.demo.images import template_image
from retouch.platform.lab.bench.engine import load_demo
from retouch.platform.lab.bench.ops import count_ops
from retouch.runtime.adapters import BARE, AdapterResidency
from retouch.runtime.demoloras import write_lora
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.mixedlora import rows_with

STD = 0.05
STEPS = 50  # a request's schedule: long enough that no timed step is its last


def run_mixed_bench(
    model: str, models_dir: Path, work_dir: Path, batch: int = 4, rank: int = 16, rounds: int = 7
) -> dict[str, Any]:
    """Step time and ops of bare, one-set and mixed batches of ``batch`` requests."""
    device = torch.device("cpu")
    family, pipe, size = load_demo(model, models_dir, "mixed-adapters", device)
    loras = [
        write_lora(model, models_dir, work_dir / f"l{i}", family=family, rank=rank, seed=i, std=STD)
        for i in tqdm(range(batch), desc="LoRA files", unit="file")
    ]
    editor = MaskAwareEditor(pipe, family, device)
    residency = AdapterResidency(pipe, 1 << 34)
    ids = []
    for lora in loras:
        set_id = residency.register((AdapterSpec(str(lora), 0.8),))
        use = residency.use(set_id)
        use.read.result()
        use.activate()  # injected before anything is timed
        use.release()
        ids.append(set_id)
    per = editor.impl.rows_per_request

    def bare(states: list) -> None:
        residency.activate(BARE)
        editor.step(states)

    def one_set(states: list) -> None:
        residency.activate(ids[0])
        editor.step(states)

    def mixed(states: list) -> None:
        with rows_with(residency.denoiser, residency.rows(ids, per, device)):
            editor.step(states, packed=False)

    ways = {"bare": bare, "one_set": one_set, "mixed": mixed}
    requests = _requests(editor, size, batch)
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    wall: dict[str, list[float]] = {name: [] for name in ways}
    for r in tqdm(range(rounds), desc="rounds", unit="round"):
        names = list(ways)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            c, w = _timed_step(editor, requests, ways[name])
            cpu[name].append(c)
            wall[name].append(w)
    ops = {name: _step_ops(editor, requests, way) for name, way in ways.items()}
    cpu_ms = {name: round(statistics.median(v) * 1e3, 2) for name, v in cpu.items()}
    return {
        "model": model,
        "batch": batch,
        "rank": rank,
        "rounds": rounds,
        "step_cpu_ms": cpu_ms,
        "step_wall_ms": {name: round(statistics.median(v) * 1e3, 2) for name, v in wall.items()},
        "ops": ops,
        "mixed_over_one_set": round(cpu_ms["mixed"] / cpu_ms["one_set"], 3),
        "ops_mixed_over_one_set": round(ops["mixed"] / ops["one_set"], 3),
        "threads": torch.get_num_threads(),
    }


def _requests(editor: MaskAwareEditor, size: int, batch: int) -> list[EditRequest]:
    mask = np.ones((size, size), bool)
    image = template_image((size, size), 7)
    return [
        EditRequest(image, mask, "a red door", 5 + i, STEPS, 4.0, "a quiet street", 3)
        for i in range(batch)
    ]


def _timed_step(
    editor: MaskAwareEditor, requests: list[EditRequest], way: Callable[[list], None]
) -> tuple[float, float]:
    """CPU and wall seconds of one step of fresh states (their second: the first builds
    what a batch re-uses), prepared outside the clock."""
    states = [editor.prepare(r, None) for r in requests]
    way(states)
    cpu, wall = time.process_time(), time.perf_counter()
    way(states)
    return time.process_time() - cpu, time.perf_counter() - wall


def _step_ops(
    editor: MaskAwareEditor, requests: list[EditRequest], way: Callable[[list], None]
) -> int:
    states = [editor.prepare(r, None) for r in requests]
    way(states)
    return sum(count_ops(lambda: way(states)).values())
