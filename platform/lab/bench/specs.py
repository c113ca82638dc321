"""The settings of the pool benchmarks (``bench sim``, ``bench load``, ``bench validate``),
declared once: each field a knob (:mod:`retouch.functions.knobs`), whose flag, default and
help text the command line registers from it and whose value the benchmark runs on. A
benchmark's knobs are set by their flags only (``env=False``): no environment variable
changes a measurement behind the command that is recorded with it.

Plain data and the control plane's light modules only: the CLI builds its parser from
these without importing the benchmarks (most of which need torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from retouch.functions.knobs import (
    knob,
    listed,
    mask_ratio,
    non_negative_float,
    non_negative_int,
    number,
    positive_float,
    positive_int,
)
from retouch.platform.control.autoscaler import AutoscalingConfig
from retouch.platform.lab.workload import MASK_MIXES, Workload

OVERHEADS = ("samples", "mean", "cpu")  # bench validate's simulated pre/post times
POLICIES = ("maskaware", "least-requests", "round-robin")


@dataclass(frozen=True)
class SimSpec:
    """One simulated workload on one pool (every placement gets the same arrivals)."""

    executors: int = knob(64, "pool size", parse=positive_int, env=False)
    placements: tuple[str, ...] = knob(
        POLICIES,
        "policies, comma-separated (a policy may add +no-admission)",
        flag="--placement",
        metavar="PLACEMENT",
        env=False,
    )
    arrivals: str = knob(
        "poisson",
        "poisson, gamma:CV (e.g. gamma:2), step:F@T (rate x F from T s on), diurnal:P:A[:CV] "
        "(rate x (1 + A sin 2 pi t/P), Poisson or Gamma with that CV), or trace:FILE (a CSV "
        "with arrival_s and optionally mask_ratio, replayed at --load of the pool's capacity)",
        env=False,
    )
    masks: str = knob("beta", "mask ratio mix", choices=MASK_MIXES, env=False)
    mask_mean: float = knob(0.19, "mean of the Beta mask ratios", parse=mask_ratio, env=False)
    load: float = knob(
        0.85,
        "offered rate as a fraction of the pool's capacity",
        parse=positive_float,
        env=False,
    )
    requests: int = knob(20000, "arrivals", parse=positive_int, env=False)
    warmup: int = knob(
        1000, "first arrivals left out of the figures", parse=non_negative_int, env=False
    )
    steps: int = knob(28, "denoising steps", parse=positive_int, env=False)
    max_batch: int = knob(8, "batch limit", parse=positive_int, env=False)
    size: int = 1024  # image side in pixels
    pre_s: float = 0.05  # text/VAE encode, in workers
    post_s: float = 0.05  # VAE decode and image encoding, in workers
    noise: float = 0.05  # sigma of the lognormal factor on every step's profiled time
    # The engine's step fit (``EngineStats.step_intercept_ms / step_slope``): a step takes
    # intercept + slope x its profiled plan, as a real executor reports it (bench validate)
    step_intercept_s: float = 0.0
    step_slope: float = 1.0
    # Measured pre/post times (seconds): each invocation draws its own from them (seeded)
    # instead of the constant pre_s/post_s
    pre_samples: tuple[float, ...] = ()
    post_samples: tuple[float, ...] = ()
    # Pre/post worker processes per executor (0: as many encodes/decodes at once as come);
    # more at once wait for a worker, as in the real executor
    pre_workers: int = 0
    post_workers: int = 0
    # Cores shared by every executor's steps and workers and by the gateway (0: none
    # shared, as on GPUs: each engine steps alone and its workers run beside it). With
    # them every step, encode, decode and ``outside_s`` is work on a :class:`SharedCPU`.
    cpu_cores: int = 0
    # The gateway's own work per invocation (HTTP, mask decode, result encoding), all of it
    # put before the invocation is queued (where in its life it happens matters less than
    # that it takes the cores)
    outside_s: float = 0.0
    # Work per invocation on the shared cores that its latency does not wait for (the
    # client, HTTP and serialisation in other processes): it only takes cores from the rest
    background_s: float = 0.0
    # The niceness of the executors' engines and workers on the shared cores, relative to
    # the gateway's and the background work (a CPU executor runs at ExecutorOptions.cpu_nice)
    executor_nice: int = 0
    slo_factor: float | None = knob(
        None,
        "an SLO of this many times the standalone latency, with admission (a policy may add "
        "+no-admission to compare)",
        parse=positive_float,
        env=False,
    )
    autoscale: AutoscalingConfig | None = None  # None: a static pool of ``executors``
    startup_s: float = knob(
        60.0,
        "a new executor's start-up time in the simulation (process, model load, first template)",
        parse=non_negative_float,
        env=False,
    )
    wake_s: float = knob(
        0.0,
        "scale-down puts executors to sleep (device given back, process and store kept) and "
        "scale-up wakes them in this many seconds before starting cold ones (0: they stop)",
        parse=non_negative_float,
        env=False,
    )
    startup_aware: bool = knob(
        True,
        "autoscaling weighs the start-up: a scale-down waits at least what bringing its "
        "victims back takes (--wake-s where they sleep, else --startup-s)",
        env=False,
    )
    sleeping_max: int = knob(
        0,
        "executors kept asleep at most, their weights in host memory (0: no limit)",
        parse=non_negative_int,
        env=False,
    )
    sleep_keep_s: float = knob(
        1800.0, "a sleeping executor stops after this long", parse=positive_float, env=False
    )
    tick_s: float = (
        1.0  # the autoscaler's period (the real pool's, platform/fleet/scaler.py TICK_S)
    )
    seed: int = knob(0, "seed of arrivals, masks and noise", env=False)
    # Templates: how many (Zipf popularity with exponent ``zipf``), how many each executor's
    # host tier holds (0: every one, always resident: no tiers simulated), a disk -> host
    # load (FlashPS: a 2.6 GiB template in 6.4 s), and whether they start unbaked.
    templates: int = knob(1, "templates, drawn with Zipf popularity", parse=positive_int, env=False)
    zipf: float = knob(1.1, "Zipf exponent", parse=non_negative_float, env=False)
    host_templates: int = knob(
        0,
        "templates each executor's host tier holds, LRU, empty at its start (0: every template "
        "always host-resident, no tiers simulated)",
        parse=non_negative_int,
        env=False,
    )
    disk_load_s: float = knob(
        6.4,
        "a template's disk -> host load (FlashPS: a 2.6 GiB template in 6.4 s)",
        parse=non_negative_float,
        env=False,
    )
    cold_templates: bool = knob(
        False,
        "no template is baked at the start: the first invocations of each run the full path "
        "and queue its bake",
        env=False,
    )
    # Adapters: functions on the one base model, each with a LoRA of its own (an adapter
    # set), drawn with Zipf popularity; each executor's device holds ``resident_adapters``
    # sets (LRU); a set it lacks is loaded from disk while the invocation waits, and its
    # engine runs one set per batch group, the groups taking turns with a swap between
    # (``turns``), or every set in one batch, each row its own updates (``mixed``).
    adapters: int = knob(
        0,
        "adapter sets of functions on the shared base model, drawn with Zipf popularity "
        "(0: every invocation runs the bare model)",
        parse=non_negative_int,
        env=False,
    )
    adapter_zipf: float = knob(
        1.1, "Zipf exponent of adapter set popularity", parse=non_negative_float, env=False
    )
    resident_adapters: int = knob(
        8, "adapter sets each executor's device holds, LRU", parse=positive_int, env=False
    )
    adapter_load_s: float = knob(
        0.5,
        "an adapter set's load from disk (Katz et al.: an SDXL-sized LoRA in ~0.5 s)",
        parse=non_negative_float,
        env=False,
    )
    adapter_swap_s: float = knob(
        0.1,
        "a swap between batch groups of different adapter sets (LegoDiffusion: ~100 ms)",
        parse=non_negative_float,
        env=False,
    )
    adapter_batching: str = knob(
        "turns",
        "how an engine batches invocations of different adapter sets: turns (a batch group "
        "per set, a swap between groups) or mixed (one batch, each row its own set's "
        "updates, no swaps)",
        choices=("turns", "mixed"),
        env=False,
    )
    mixed_step_overhead: float = knob(
        0.05,
        "a mixed step's time over a one-set step's, as a fraction (`retouch bench mixed-adapters`)",
        parse=non_negative_float,
        env=False,
    )


@dataclass(frozen=True)
class SimScaling:
    """``bench sim``'s autoscaling: the pool's Autoscaler between MIN and MAX executors."""

    autoscale: str | None = knob(
        None,
        "autoscale the pool between MIN and MAX executors (it starts with --executors; --load "
        "is then relative to MAX)",
        metavar="MIN,MAX",
        env=False,
    )
    target_s: float = knob(
        AutoscalingConfig.target_s,
        "autoscaling target: predicted seconds of work per executor",
        parse=positive_float,
        env=False,
    )
    target_utilisation: float = knob(
        AutoscalingConfig.target_utilisation,
        "autoscaling: the share of an executor's capacity the arrivals' demand may fill",
        parse=positive_float,
        env=False,
    )
    headroom_sigmas: float = knob(
        AutoscalingConfig.headroom_sigmas,
        "autoscaling: add this x sqrt(demand) executors (square-root staffing: room for "
        "bursts, relatively more in a small pool)",
        parse=non_negative_float,
        env=False,
    )
    downscale_delay_s: float = knob(
        AutoscalingConfig.downscale_delay_s,
        "autoscaling: a scale-down takes the highest recommendation of this window",
        parse=positive_float,
        env=False,
    )

    upscale_hold_s: float = knob(
        AutoscalingConfig.upscale_hold_s,
        "autoscaling: a scale-up's count holds the pool up at least this long (and at least "
        "the scale-down delay)",
        parse=non_negative_float,
        env=False,
    )
    rise_cap: float = knob(
        AutoscalingConfig.rise_cap,
        "autoscaling: a rise of the arrivals' demand is taken at most to this x its baseline",
        parse=positive_float,
        env=False,
    )
    downscale_margin: float = knob(
        AutoscalingConfig.downscale_margin,
        "autoscaling: a scale-down keeps this share above the count it holds",
        parse=non_negative_float,
        env=False,
    )

    def config(self) -> AutoscalingConfig | None:
        """The autoscaler's settings (None: a static pool)."""
        if self.autoscale is None:
            return None
        try:
            low, high = (int(v) for v in self.autoscale.split(","))
        except ValueError:
            raise ValueError(f"--autoscale takes MIN,MAX, not {self.autoscale!r}") from None
        return AutoscalingConfig(
            min_executors=low,
            max_executors=high,
            target_s=self.target_s,
            target_utilisation=self.target_utilisation,
            headroom_sigmas=self.headroom_sigmas,
            downscale_delay_s=self.downscale_delay_s,
            upscale_hold_s=self.upscale_hold_s,
            rise_cap=self.rise_cap,
            downscale_margin=self.downscale_margin,
        )


@dataclass(frozen=True)
class LoadSpec:
    """``bench load``: configurations compared on one planned workload, each on its own
    server, one server at a time."""

    model: str
    configs: tuple[str, ...] = knob(
        ("continuous", "static"),
        "configurations: +-joined tokens of continuous|static, maskaware|stock, "
        "disaggregated|naive, mixed|turns",
        flag="--compare",
        metavar="COMPARE",
        env=False,
    )
    rate: str = knob(
        "auto:0.7",
        "invocations/s, or auto:F = F x measured capacity of the first configuration; "
        "several comma-separated (auto:0.5,auto:0.8): each replayed on every server",
        env=False,
    )
    workload: Workload = field(default_factory=Workload)
    steps: int = knob(8, "denoising steps", parse=positive_int, env=False)
    templates: int = knob(4, "templates of the function", parse=positive_int, env=False)
    max_batch: int = knob(8, "each executor's running batch limit", parse=positive_int, env=False)
    executors: int = knob(1, "executors of each server", parse=positive_int, env=False)
    plot: Path | None = knob(None, "write latency CDFs to this PNG", env=False)
    slo_ms: float | None = knob(
        None,
        "the function's latency SLO in ms (admission)",
        flag="--slo",
        parse=number,  # run_load_bench refuses one <= 0, naming --slo
        env=False,
    )
    rounds: int = knob(
        1,
        "replays per configuration, the order reversed every other round (A B, B A)",
        parse=positive_int,
        env=False,
    )
    host_cache_bytes: int | None = knob(
        None,
        "each executor's host-RAM tier (e.g. room for ~3 templates to compare affinity)",
        parse=non_negative_int,
        env=False,
    )
    threads: int = knob(
        0,
        "torch threads of each executor (0: the machine's cores shared out)",
        parse=non_negative_int,
        env=False,
    )
    out: Path | None = knob(
        None,
        "also write load.json and load.md (the table, with the command) into this folder",
        env=False,
    )
    adapters: int = knob(
        0,
        "functions on the model, each with a LoRA of its own, invocations spread over them "
        "with Zipf popularity (--adapter-zipf); compare turns and mixed adapter batching "
        "(0: one function without adapters)",
        parse=non_negative_int,
        env=False,
    )
    adapter_zipf: float = knob(
        1.1,
        "Zipf exponent of the adapter functions' popularity",
        parse=non_negative_float,
        env=False,
    )
    ray_address: str | None = None  # executors as Ray actors on this cluster (one per slot)


@dataclass(frozen=True)
class ValidateSpec:
    """``bench validate``: policies at several loads on a real pool, then the simulator on
    what each run sent and measured."""

    model: str = "retouch:tiny-flux"
    loads: tuple[float, ...] = knob(
        (0.5, 0.7, 0.85),
        "offered loads, fractions of the capacity in (0, 1]",
        parse=listed(mask_ratio, "mask ratios in (0, 1]"),
        env=False,
    )
    placements: tuple[str, ...] = knob(
        POLICIES,
        "policies, comma-separated",
        flag="--placement",
        metavar="PLACEMENT",
        env=False,
    )
    workload: Workload = field(
        default_factory=lambda: Workload(requests=100, warmup=5, masks="bimodal")
    )
    steps: int = knob(8, "denoising steps", parse=positive_int, env=False)
    templates: int = knob(4, "templates", parse=positive_int, env=False)
    max_batch: int = knob(8, "batch limit", parse=positive_int, env=False)
    executors: int = knob(2, "executors", parse=positive_int, env=False)
    threads: int = knob(1, "torch threads per executor", parse=positive_int, env=False)
    noise: float = knob(0.05, "simulated step noise sigma", parse=non_negative_float, env=False)
    # the capacity (invocations/s); None: probed once
    rate_rps: float | None = knob(
        None,
        "the pool's capacity in invocations/s (none: one closed-loop probe)",
        flag="--capacity",
        parse=positive_float,
        metavar="CAPACITY",
        env=False,
    )
    # "samples": each simulated invocation draws its pre/post from the run's measured ones;
    # "mean": every one takes the run's mean pre/post time; "cpu": the shared-CPU model
    # (every step, encode, decode and the gateway's own work share ``cpu_cores``, each at
    # its uncontended time: ``solo_inputs``)
    overheads: str = knob(
        "samples",
        "the simulated pre/post times: drawn from the run's measured ones (samples), or their "
        "mean; cpu: a shared-CPU model (steps, encodes, decodes and the gateway's own work "
        "share --cpu-cores, each at its uncontended time)",
        choices=OVERHEADS,
        env=False,
    )
    # the shared-CPU model's cores: the recording machine's (set when the runs are
    # recorded; 0 in older records: the cores of the machine that replays them)
    cpu_cores: int = knob(
        0,
        "with --overheads cpu: the cores the model shares (0: those of the machine the runs "
        "were recorded on)",
        parse=non_negative_int,
        env=False,
    )
