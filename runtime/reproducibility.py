"""Deterministic mode: the same request gives the same bits on one machine, however the
model's weights were loaded.

Without it, two copies of the same weights can give images that differ in the last bits:
MKL picks its GEMM kernels by the operands' memory alignment, and a single-file checkpoint,
a diffusers folder and a re-allocated copy place the same values at different alignments.
MKL's conditional numerical reproducibility (CNR, ``MKL_CBWR``) makes its kernels
independent of alignment and of run; on CUDA, cuBLAS needs a fixed workspace
(``CUBLAS_WORKSPACE_CONFIG``) and torch its deterministic algorithms. Across CPUs (another
instruction set: other MKL, ATen and oneDNN kernels) results still differ in the last bits:
that holds within a tolerance only (docs/maskaware.md, "Exactness and reproducibility").

Torch-free at import: the switches are environment variables that must be in place before
the libraries read them. MKL reads ``MKL_CBWR`` at its first call, not when torch loads,
and cuBLAS reads its workspace setting when its first handle is made, so setting them in a
process that imported torch but computed nothing yet is in time (the executor does so first
thing; forked pre/post workers inherit them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

# CNR's AUTO branch: the fastest kernels for this CPU, chosen independently of alignment
# (COMPATIBLE, the branch every x86 CPU runs, made GEMMs 3.5x slower on a 2-core x86 VM and
# still leaves ATen's and oneDNN's kernels CPU-specific, so it buys no cross-CPU equality).
SWITCHES = {
    "MKL_CBWR": "AUTO",
    "MKL_DYNAMIC": "FALSE",  # MKL's CNR condition: the thread count it is given, always
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # cuBLAS's deterministic reductions
}
OFF = ("", "OFF")  # MKL_CBWR values that leave CNR off


def set_switches(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Put the switches into ``env`` where it has none of its own (an operator's
    ``MKL_CBWR=COMPATIBLE`` wins); returns the values in effect."""
    for name, value in SWITCHES.items():
        env.setdefault(name, value)
    return {name: env[name] for name in SWITCHES}


def make_deterministic() -> None:
    """Deterministic mode for this process: the switches, then torch's deterministic
    algorithms. ``warn_only``: an op without a deterministic implementation warns instead
    of failing a served edit."""
    switches = set_switches(os.environ)
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    log.info("deterministic mode: %s", " ".join(f"{k}={v}" for k, v in switches.items()))


def in_effect() -> bool:
    """Whether this process runs in deterministic mode (what an executor reports)."""
    import torch

    cnr = os.environ.get("MKL_CBWR", "").upper() not in OFF
    return cnr and torch.are_deterministic_algorithms_enabled()
