"""The executor's knobs, each defined once (:mod:`retouch.functions.knobs`), and the flags
of an executor process.

``retouch serve`` offers every knob as a flag and a ``RETOUCH_*`` variable
(:class:`retouch.platform.api.config.ServeConfig` holds an :class:`ExecutorOptions`), passes
them to each executor process as flags, and the executor parses those flags from the same
declaration. :func:`add_process_flags` declares the process's own flags (name, device,
address, token file), which ``python -m retouch.runtime.executor`` (the providers' child)
and ``retouch executor`` (a standalone executor) share. Torch-free: the gateway and the CLI
import it.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from retouch.cachestore.defaults import HOST_BUDGET_BYTES
from retouch.functions.knobs import add_flags, from_flags, knob

ENGINE_MODES = ("continuous", "static")
PATH_CHOICES = ("auto", "maskaware")
ADAPTER_BATCHING = ("mixed", "turns")
CORES_PER_WORKER = 4  # pre and post workers each: one per this many cores, at least one
# LoRA weights each loaded model copy keeps in its denoiser: a few SD3-sized adapters
# (~0.9 GiB each), or dozens of SD 1.5 ones
ADAPTER_BUDGET_BYTES = 2 << 30
# The adapter reader's duty cycle while it builds a LoRA's layers: building is Python work
# holding the interpreter lock that a step needs too (on a CPU executor nearly all of a
# step), so at full speed a build slows the running batch's step by its own length. At 0.1
# the step slows by about a tenth (#34's bound) and a load takes about ten times its work.
BUILD_SHARE = 0.1
# An executor's room, in invocations running or waiting there: the running batch plus as
# many again being pre-processed. The gateway binds at most this many to it (its slots),
# and the executor refuses beyond it (429 executor_full), so gateways sharing it never
# overcommit it.
SLOTS_PER_BATCH = 2


def room(max_batch: int) -> int:
    """Invocations an executor with running batch limit ``max_batch`` holds at once."""
    return max(1, max_batch * SLOTS_PER_BATCH)


@dataclass(frozen=True)
class ExecutorOptions:
    host_cache_bytes: int = knob(
        HOST_BUDGET_BYTES,
        "host-RAM budget of each executor's activation store, in bytes",
        shown="4 GiB",
    )
    device_cache_bytes: int = knob(
        -1,
        "GPU memory for templates resident on the executor's device, in bytes (-1: a "
        "quarter of the GPU's memory, off on a CPU; 0: off)",
        shown="auto",
    )
    cuda_graphs: bool = knob(
        False,
        "replay mask-aware steps whose templates are all device-resident from CUDA graphs: "
        "masked tokens padded to buckets, one capture per bucket and batch size (on a CPU "
        "the same bookkeeping with eager replays, for tests)",
    )
    path_choice: str = knob(
        "auto",
        "how an edit whose template is baked runs: auto (mask-aware or stock, whichever the "
        "model's step times say is faster at its mask) or maskaware (always mask-aware)",
        choices=PATH_CHOICES,
    )
    graph_memory_bytes: int = knob(
        -1,
        "device memory CUDA graphs may hold (row buffers, static inputs, captures' pool), "
        "in bytes; a layout not yet captured beyond it runs eagerly (-1: a quarter of the "
        "GPU's memory, none on a CPU; 0: no limit)",
        shown="auto",
    )
    adapter_cache_bytes: int = knob(
        ADAPTER_BUDGET_BYTES,
        "LoRA adapter weights kept resident in each loaded model's denoiser, in bytes; "
        "beyond it the least recently used adapter set is unloaded",
        shown="2 GiB",
    )
    adapter_build_share: float = knob(
        BUILD_SHARE,
        "share of its time the background thread that builds a LoRA's layers may work "
        "(it sleeps the rest): the build holds the interpreter lock a step needs too, so "
        "at 0.1 a step slows by about a tenth while a LoRA loads, and the load takes ten "
        "times its work; in (0, 1]",
    )
    adapter_batching: str = knob(
        "mixed",
        "how invocations of one model with different LoRA sets share steps: mixed (one "
        "batch, each row adding its own set's low-rank updates) or turns (a batch per set, "
        "the sets taking turns, each turn a swap; for comparisons). With CUDA graphs sets "
        "take turns",
        choices=ADAPTER_BATCHING,
    )
    maskaware: bool = knob(
        True, "mask-aware edits; --no-maskaware computes every token (for comparisons)"
    )
    deterministic: bool = knob(
        False,
        "the same request gives the same bits on this machine however the model was "
        "loaded: MKL's conditional numerical reproducibility, cuBLAS's fixed workspace and "
        "torch's deterministic algorithms, set before the executor computes anything; "
        "mask-aware steps run every block sparse, so an edit's pixels do not follow the "
        "batch it joins or the timings profiled (docs/maskaware.md, exactness and "
        "reproducibility)",
    )
    engine: str = knob(
        "continuous",
        "step-level continuous batching, or static batches (for comparisons)",
        choices=ENGINE_MODES,
    )
    max_batch: int = knob(8, "running batch limit per model and resolution")
    inline_prepost: bool = knob(
        False, "pre/post-processing on the engine thread (naive batching, for comparisons)"
    )
    pre_workers: int = knob(
        0,
        "pre-processing worker processes per executor "
        f"(0: one per {CORES_PER_WORKER} of the executor's cores, at least one)",
    )
    post_workers: int = knob(
        0,
        "post-processing worker processes per executor "
        f"(0: one per {CORES_PER_WORKER} of the executor's cores, at least one)",
    )
    worker_threads: int = knob(1, "torch threads of each pre/post worker process")
    threads: int = knob(
        0, "torch threads of each executor (0: the machine's cores shared among executors)"
    )

    cpu_nice: int = knob(
        5,
        "niceness added to the engine thread and the pre/post workers of an executor that "
        "computes on the CPU: the gateway and the executor's own request handling share "
        "those cores, and an answer (a 429, a state read) must not wait for a time slice "
        "behind a denoising step (0: no change; ignored on a GPU)",
    )

    def check(self) -> None:
        """Refuse values that cannot work, naming the knob."""
        for name in (
            "host_cache_bytes",
            "adapter_cache_bytes",
            "pre_workers",
            "post_workers",
            "threads",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.adapter_build_share <= 1:
            raise ValueError(
                f"adapter_build_share must be in (0, 1], got {self.adapter_build_share}"
            )
        for name in ("max_batch", "worker_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.device_cache_bytes < -1:
            raise ValueError(
                f"device_cache_bytes must be >= -1 (auto), got {self.device_cache_bytes}"
            )
        if self.graph_memory_bytes < -1:
            raise ValueError(
                f"graph_memory_bytes must be >= -1 (auto), got {self.graph_memory_bytes}"
            )
        if not 0 <= self.cpu_nice <= 19:
            raise ValueError(f"cpu_nice must be in [0, 19], got {self.cpu_nice}")
        if self.engine not in ENGINE_MODES:
            raise ValueError(f"engine must be one of {ENGINE_MODES}, got {self.engine!r}")
        if self.path_choice not in PATH_CHOICES:
            raise ValueError(f"path_choice must be one of {PATH_CHOICES}, got {self.path_choice!r}")

    def workers(self, cores: int | None = None) -> tuple[int, int]:
        """(pre, post) worker processes for an executor with ``cores`` CPU cores (default:
        the cores this process may run on); a knob set above 0 wins."""
        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        auto = max(1, cores // CORES_PER_WORKER)
        return self.pre_workers or auto, self.post_workers or auto


def add_process_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of one executor process, then every :class:`ExecutorOptions` knob."""
    parser.add_argument(
        "--name",
        default=socket.gethostname(),
        help="executor name, as logs and the gateway's state report it (default: the host name)",
    )
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda:0, ...")
    parser.add_argument("--data-dir", type=Path, required=True, help="activation store root")
    parser.add_argument(
        "--shared-dir",
        type=Path,
        default=None,
        help="built demo models and device profiles (default: the data dir)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (0.0.0.0, or the node's own address, when the gateway is on "
        "another machine)",
    )
    parser.add_argument(
        "--port", type=int, default=0, help="port to bind (0: a free one, see --port-file)"
    )
    parser.add_argument(
        "--port-file", type=Path, default=None, help="where the bound port is published"
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="file holding the internal token the gateway sends (default: $RETOUCH_EXECUTOR_TOKEN)",
    )
    parser.add_argument(
        "--exit-with-parent",
        nargs="?",
        type=int,
        const=0,
        default=None,
        metavar="PID",
        help="end when the parent process ends (an executor its gateway or Ray actor "
        "started): PID, the parent that started it (seen gone even while this one starts), "
        "or none given: the parent it has when it starts",
    )
    add_flags(parser, ExecutorOptions)


def check_process_flags(args: argparse.Namespace) -> None:
    """Set ``args.options`` from the parsed knobs; a value that cannot work raises
    :class:`ValueError` naming it (the caller prints one line)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {args.port}")
    if args.port == 0 and args.port_file is None:
        raise ValueError("give --port, or --port-file to publish the free port bound")
    args.options = ExecutorOptions(**from_flags(ExecutorOptions, args))
    args.options.check()
