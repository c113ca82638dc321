"""``retouch bench adapters``: LoRA adapters on one base model, memory and latency, one run.

* **memory** (real processes): ``retouch serve`` with one executor per configuration; the
  executor process's RSS (``/proc``) once every function is deployed and invoked once:
  1 function with a LoRA, 4 functions with 4 LoRAs on one base model, and 4 functions on 4
  copies of the model (its built folder copied to 4 paths: 4 model sources, same weights
  and dtype, so the executor loads 4 copies).
* **latency** (this process, the engine and residency the executor runs): a batch of the
  bare model steps; an invocation of a LoRA still on disk arrives. Its wait before joining
  against its load (read and built in the background, attached between steps), and the
  running batch's step period (from one of its steps to the next, attach slices included)
  while the set loads against before; diffusers' one-piece ``load_lora_adapter`` on the
  same model is timed beside it (what an unsliced load would stall a step by).
* **swaps**: activating another resident set, and the residency's counters.
"""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from retouch.functions.adapters import AdapterSpec
from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import demo_model, ensure_demo_model
from retouch.functions.imaging import encode_image
from retouch.functions.spec import parse_spec
from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess
from retouch.platform.lab.bench.engine import load_demo
from retouch.platform.lab.bench.load import wait_baked
from retouch.platform.lab.bench.memory import MiB, RssSampler
from retouch.runtime.adapters import BARE, AdapterResidency, read_lora
from retouch.runtime.demoloras import write_lora
from retouch.runtime.engine import Engine, EngineConfig, Work
from retouch.runtime.executor.options import BUILD_SHARE
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor

SIZE = 64  # the functions' resolution in the memory runs
STD = 0.3


def run_adapters_bench(
    model: str, models_dir: Path, data_dir: Path, batch: int = 2, steps: int = 40
) -> dict[str, Any]:
    """Memory (three real executors), latency and swap figures of LoRA adapters on
    ``model`` (a built-in model); LoRA files and servers' data go under ``data_dir``."""
    loras = [
        write_lora(model, models_dir, data_dir / "loras" / f"l{i}", seed=i, std=STD)
        for i in tqdm(range(5), desc="LoRA files", unit="file")
    ]
    return {
        "model": model,
        "device": "cpu",
        "latency": _latency(model, models_dir, loras[4], loras[:2], batch, steps),
        "memory": _memory(model, models_dir, data_dir, loras[:4]),
    }


# ---- memory ---------------------------------------------------------------------------------
def _memory(model: str, models_dir: Path, data_dir: Path, loras: list[Path]) -> dict[str, Any]:
    folder = ensure_demo_model(model, models_dir)
    copies = []
    for i in range(4):
        copy = data_dir / "copies" / f"copy{i}"
        if not copy.exists():
            shutil.copytree(folder, copy)
        copies.append(str(copy))
    family = demo_model(model).family
    runs = {
        "1_lora_one_model": [(model, [loras[0]])],
        "4_loras_one_model": [(model, [lora]) for lora in loras],
        "4_model_copies": [(copy, []) for copy in copies],
    }
    out = {}
    for name, functions in tqdm(runs.items(), desc="memory runs", unit="executor"):
        out[name] = _executor_rss(data_dir / name, family, functions)
    out["copies"] = "the built model folder copied to 4 paths: 4 sources, same weights"
    return out


def _executor_rss(data_dir: Path, family: str, functions: list[tuple[str, list[Path]]]):
    """The executor's RSS (MiB) after each function is deployed and invoked once."""
    template = encode_image(template_image((SIZE, SIZE), 7), "png")
    mask = _mask(SIZE)
    with ServerProcess(data_dir, executors=1) as server, Client(server.url) as client:
        for i, (model, loras) in enumerate(functions):
            doc = {
                "name": f"f{i}",
                "model": model,
                "family": family,
                "resolution": SIZE,
                "steps": 2,
                "templates": {"street": {"prompt": "a quiet street", "seed": 3}},
                "adapters": [{"path": str(p), "scale": 0.8} for p in loras],
            }
            client.deploy(parse_spec(doc), {"street": template})
            wait_baked(client, f"f{i}")
            client.invoke(f"f{i}", "street", mask, "a red door", seed=5)
        state = client.executors()["executors"][0]["state"]
        return {
            "functions": len(functions),
            "models_loaded": len(state["models"]),
            "adapter_sets_resident": len(state["adapters"]),
            "executor_rss_mib": round(RssSampler(state["pid"]).rss() / MiB, 1),
        }


# ---- latency and swaps ----------------------------------------------------------------------
def _latency(
    model: str, models_dir: Path, late: Path, resident: list[Path], batch: int, steps: int
) -> dict[str, Any]:
    where = torch.device("cpu")
    family, pipe, size = load_demo(model, models_dir, "adapters", where)
    editor = MaskAwareEditor(pipe, family, where)
    residency = AdapterResidency(pipe, budget_bytes=1 << 30, build_share=BUILD_SHARE)
    swaps = _swaps(residency, resident)
    request = EditRequest(
        template_image((size, size), 7), _mask(size), "a red door", 5, steps, 4.0, "street", 3
    )
    engine = Engine(EngineConfig(disaggregated=False), stages=None).start()
    stepped: list[float] = []
    try:
        running = [
            _work(editor, dataclasses.replace(request, seed=i), residency, BARE)
            for i in range(batch)
        ]
        running[0].on_step = lambda done, total: stepped.append(time.perf_counter())
        futures = [engine.submit(w) for w in running]
        with tqdm(total=steps, desc="running batch", unit="step") as bar:
            while len(stepped) < steps // 3:
                time.sleep(0.01)
                bar.update(len(stepped) - bar.n)
            arrived = time.perf_counter()
            late_set = residency.register((AdapterSpec(str(late), 0.8),))  # read starts now
            newcomer = _work(editor, dataclasses.replace(request, steps=4), residency, late_set)
            read_at: list[float] = []
            newcomer.adapters.read.add_done_callback(lambda _: read_at.append(time.perf_counter()))
            engine.submit(newcomer).result()
            for future in futures:
                future.result()
            bar.update(len(stepped) - bar.n)
    finally:
        engine.stop()
    periods = [(b, (b - a) * 1e3) for a, b in itertools.pairwise(stepped)]
    before = [p for t, p in periods if t < arrived]
    loading = [p for t, p in periods if arrived < t <= newcomer.joined]
    counters = residency.counters
    # Any newcomer, of the running set or none, joins at a step boundary: the first one
    # after its arrival is the wait a newcomer without an adapter to load would have.
    boundary = min(t for t in stepped if t > arrived)
    load_ms = (counters.read_ms - swaps["read_ms"]) + (counters.inject_ms - swaps["inject_ms"])
    return {
        "running_batch": batch,
        "step_period_ms_before": round(statistics.median(before), 1),
        "step_period_ms_while_loading": round(statistics.median(loading), 1),
        "step_period_ratio": round(statistics.median(loading) / statistics.median(before), 3),
        "step_period_ms_max_while_loading": round(max(loading), 1),
        "steps_while_loading": len(loading),
        "newcomer_wait_ms": round((newcomer.joined - arrived) * 1e3, 1),
        "newcomer_read_and_build_ms": round(counters.read_ms - swaps["read_ms"], 1),
        "newcomer_attach_engine_ms": round(counters.inject_ms - swaps["inject_ms"], 1),
        "newcomer_read_done_to_join_ms": round((newcomer.joined - read_at[0]) * 1e3, 1),
        "newcomer_load_ms": round(load_ms, 1),
        "next_step_boundary_ms": round((boundary - arrived) * 1e3, 1),
        "newcomer_wait_beyond_boundary_ms": round((newcomer.joined - boundary) * 1e3, 1),
        "one_piece_load_lora_adapter_ms": round(_one_piece_ms(model, models_dir, late), 1),
        "swaps": swaps,
        "counters": dataclasses.asdict(counters),
    }


def _mask(size: int) -> np.ndarray:
    mask = np.zeros((size, size), bool)
    mask[size // 8 : size // 2, size // 5 : size * 2 // 3] = True
    return mask


def _work(
    editor: MaskAwareEditor, request: EditRequest, residency: AdapterResidency, set_id: str
) -> Work:
    """An invocation of ``set_id`` encoded beforehand (its join encodes nothing)."""
    use = residency.use(set_id)
    work = Work(
        key=("bench", set_id),
        model="bench",
        family=editor.family,
        scheduler="default",
        editor=editor,
        request=request,
        fmt="png",
        acquire=lambda: (None, {}),
        adapters=use,
    )
    work.encoded = editor.encode(request)
    work.future.add_done_callback(lambda _: use.release())
    return work


def _swaps(residency: AdapterResidency, loras: list[Path], rounds: int = 10) -> dict[str, Any]:
    """Activate two resident sets in turn: the mean swap time, and the counters so far."""
    ids = [residency.register((AdapterSpec(str(p), 0.8),)) for p in loras]
    for set_id in ids:
        use = residency.use(set_id)
        use.read.result()
        use.activate()
        use.release()
    before = residency.counters.swaps, residency.counters.swap_ms
    for i in range(rounds * len(ids)):
        residency.activate(ids[i % len(ids)])
    count = residency.counters.swaps - before[0]
    return {
        "swaps": count,
        "swap_ms_mean": round((residency.counters.swap_ms - before[1]) / count, 2),
        "read_ms": residency.counters.read_ms,
        "inject_ms": residency.counters.inject_ms,
    }


def _one_piece_ms(model: str, models_dir: Path, lora: Path) -> float:
    """Diffusers' ``load_lora_adapter`` of ``lora``, read beforehand: what the engine
    thread spent in one piece before loads were built in the background."""
    pipe = load_demo(model, models_dir, "adapters", torch.device("cpu"))[1]
    denoiser = pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer
    prefix = "unet" if denoiser is getattr(pipe, "unet", None) else "transformer"
    weights, alphas = read_lora(type(pipe), str(lora))
    started = time.perf_counter()
    denoiser.load_lora_adapter(
        weights, prefix=prefix, network_alphas=alphas, adapter_name="one", low_cpu_mem_usage=True
    )
    return (time.perf_counter() - started) * 1e3
