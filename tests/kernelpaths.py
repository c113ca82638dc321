"""The same weights on other kernels, reproduced on one machine.

Two copies of a model's weights (a single-file checkpoint and its folder, or a copy made
elsewhere) hold the same values at other memory alignments, and MKL outside CNR mode picks
its GEMM kernels by alignment: the images then differ in the last bits, as they do on
another CPU (other MKL, ATen and oneDNN kernels). What a comparison across loading paths
can promise is therefore equality within :data:`CROSS_PATH_TOLERANCE`; bit equality holds
on the same kernels only (docs/maskaware.md, "Exactness and reproducibility").

:func:`realigned` re-allocates every weight of a pipeline at another offset from a 64-byte
boundary; :func:`images_elsewhere` runs the tiny models in a child interpreter whose
environment forces other kernels (:data:`OTHER_KERNELS`), optionally with its weights
realigned, or in deterministic mode. ``python -m tests.kernelpaths JOB OUT`` is that child.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from retouch.runtime.reproducibility import SWITCHES
from tests.support import REPO

# The tolerance of every comparison across loading paths, allocations or CPUs, in the [0, 1]
# range of the images (max abs difference). The same weights on other kernels (another
# alignment, MKL branch, ATen or oneDNN instruction set) moved the tiny models' 2-step
# images by at most 5e-6 on a 2-core x86 VM (2026-11-29, tests/runtime/test_kernel_paths.py);
# 1e-4 leaves 20 times that, and is still 40 times below one 8-bit level (1/255): a wrong or
# missing weight moves these images by 1e-2 and more.
CROSS_PATH_TOLERANCE = 1e-4
ALIGNMENT = 64  # bytes: the widest vector load MKL dispatches on (AVX-512)
# Tiny models and families of the cross-path tests (single-file and folder loads).
MODELS = (
    ("retouch:tiny-sdxl", "sdxl-inpaint"),
    ("retouch:tiny-sd3", "sd3-inpaint"),
    ("retouch:tiny-flux-fill", "flux-fill"),
    ("retouch:tiny-sd", "sd-inpaint"),
)
SIZE, STEPS, GUIDANCE = 128, 2, 5.0
# Environments of a child interpreter that computes on kernels other than the suite's.
# MKL_CBWR "" turns CNR off: MKL picks its kernels by the operands' alignment again (the
# suite's own environment has it on, tests/conftest.py). "another-cpu": MKL's COMPATIBLE
# branch, ATen's unvectorised kernels and oneDNN held to SSE4.1, as an older x86 runs them.
OTHER_KERNELS: dict[str, dict[str, str]] = {
    "alignment": {"MKL_CBWR": ""},
    "another-cpu": {
        "MKL_CBWR": "COMPATIBLE",
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
    },
}


@contextlib.contextmanager
def realigned(pipe, offset: int) -> Iterator[None]:
    """Every parameter and buffer of ``pipe``'s models moved to fresh memory that starts
    ``offset`` elements past a 64-byte boundary (the same values), and back on the way out."""
    import torch

    moved = []
    for module in pipe.components.values():
        if not isinstance(module, torch.nn.Module):
            continue
        for tensor in (*module.parameters(), *module.buffers()):
            moved.append((tensor, tensor.data))
            tensor.data = _shifted(tensor.data, offset)
    try:
        yield
    finally:
        for tensor, data in moved:
            tensor.data = data


def weights_differing(a, b) -> list[str]:
    """The parameters and buffers in which two pipelines' models differ, bit for bit (a
    loading path must give the same values; only their allocation may differ)."""
    import torch

    differing = []
    for name, module in a.components.items():
        if not isinstance(module, torch.nn.Module):
            continue
        ours, theirs = module.state_dict(), b.components[name].state_dict()
        differing += [f"{name}.{key}" for key in theirs.keys() - ours.keys()]
        for key, tensor in ours.items():
            other = theirs.get(key)
            if other is None or other.dtype != tensor.dtype or not torch.equal(other, tensor):
                differing.append(f"{name}.{key}")
    return differing


def assert_close_across_paths(image: np.ndarray, reference: np.ndarray) -> None:
    """Images of the same weights loaded, allocated or run elsewhere: equal within
    :data:`CROSS_PATH_TOLERANCE`."""
    np.testing.assert_allclose(image, reference, rtol=0, atol=CROSS_PATH_TOLERANCE)


def _shifted(tensor, offset: int):
    import torch

    per_line = ALIGNMENT // tensor.element_size()
    room = torch.empty(tensor.numel() + 2 * per_line, dtype=tensor.dtype)
    start = (offset - room.data_ptr() % ALIGNMENT // tensor.element_size()) % per_line
    out = room[start : start + tensor.numel()].view(tensor.shape)
    out.copy_(tensor)
    return out


def stock_image(pipe, family: str):
    """The stock pipeline's edit of a fixed request (what the cross-path tests compare)."""
    import torch

    from retouch.functions.demo.images import template_image
    from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor

    mask = np.zeros((SIZE, SIZE), dtype=bool)
    mask[20:70, 30:90] = True
    request = EditRequest(
        template_image((SIZE, SIZE), 4), mask, "the red door", 9, STEPS, GUIDANCE, "a street", 3
    )
    return MaskAwareEditor(pipe, family, torch.device("cpu")).stock_edit(request, "np")


@dataclass(frozen=True)
class Job:
    """What the child computes: each model's image with its weights as loaded, and
    realigned at each of ``offsets`` (elements past a 64-byte boundary)."""

    models_dir: str
    models: tuple[tuple[str, str], ...] = MODELS
    offsets: tuple[int, ...] = ()
    threads: int = 1  # the thread count changes the images too: compare at the same one
    deterministic: bool = False  # the executor's --deterministic, after torch is imported


def images_elsewhere(job: Job, env: Mapping[str, str], out: Path) -> dict[str, np.ndarray]:
    """Run ``job`` in a child interpreter with ``env`` over the suite's environment less the
    deterministic switches; its images by ``"<model>@loaded"`` and ``"<model>@<offset>"``."""
    base = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    spec = out.with_suffix(".json")
    spec.write_text(json.dumps(asdict(job)))
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernelpaths", str(spec), str(out)],
        env={**base, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as images:
        return dict(images)


def _child(spec: Path, out: Path) -> None:
    job = Job(**json.loads(spec.read_text()))
    import torch  # first, as in an executor: the switches come after torch is loaded

    if job.deterministic:
        from retouch.runtime.reproducibility import make_deterministic

        make_deterministic()
    torch.set_num_threads(job.threads)
    from retouch.functions.modelsource import ModelSource
    from retouch.runtime.models import ModelCache

    cache = ModelCache(Path(job.models_dir), torch.device("cpu"))
    images = {}
    for model, family in job.models:
        pipe = cache.get(ModelSource(model).key, family).pipe
        images[f"{model}@loaded"] = stock_image(pipe, family)
        for offset in job.offsets:
            with realigned(pipe, offset):
                images[f"{model}@{offset}"] = stock_image(pipe, family)
    with out.open("wb") as f:
        np.savez(f, **images)


if __name__ == "__main__":
    _child(Path(sys.argv[1]), Path(sys.argv[2]))
