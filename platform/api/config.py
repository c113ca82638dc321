"""The one config loader: ``retouch serve`` settings from flags, then environment, then defaults.

Every setting is a knob (:mod:`retouch.functions.knobs`) declared once below, or in
:class:`~retouch.runtime.executor.options.ExecutorOptions` for the executors' own: the
``retouch serve`` flags, the ``RETOUCH_*`` variables and the flags each executor process is
started with all come from those declarations.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from retouch.functions.knobs import from_env, knob, knobs, to_flags
from retouch.platform.jobs.links import check_public_url
from retouch.runtime.executor.options import ExecutorOptions

DEFAULT_PORT = 8000
DEFAULT_METRICS_PORT = 8001
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
DEFAULT_DATA_DIR = Path.home() / ".retouch"
PROVIDERS = ("local", "ray", "attach")
# what sleeping executors may hold of a machine by default (platform/fleet/sleepers.py)
_QUARTER_OF_MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def default_data_dir() -> Path:
    """The data directory when none is given: ``$RETOUCH_DATA_DIR``, else ~/.retouch."""
    return Path(os.environ.get("RETOUCH_DATA_DIR", DEFAULT_DATA_DIR))


def default_url() -> str:
    return os.environ.get("RETOUCH_URL", DEFAULT_URL)


@dataclass(frozen=True)
class ServeConfig:
    """``retouch serve``'s settings: its own knobs, and the executors' (``executor``)."""

    host: str = knob("127.0.0.1", "bind address")
    port: int = knob(DEFAULT_PORT, "port")
    metrics_port: int = knob(
        DEFAULT_METRICS_PORT,
        "port of the metrics listener, on --host: GET /metrics, which the API port answers "
        "404 (0: no metrics listener)",
    )
    data_dir: Path = knob(DEFAULT_DATA_DIR, "registry, models, caches, jobs", shown="~/.retouch")
    executors: int = knob(
        1, "CPU executors when no GPU is found (with GPUs: one per GPU); with --autoscale, the most"
    )
    provider: str = knob(
        "local",
        "where executors run: local (processes on this machine), ray (Ray actors on the "
        "cluster at --ray-address; pip install retouch[ray]) or attach (executors started "
        "on their own with `retouch executor`, at --executor-urls)",
        choices=PROVIDERS,
    )
    ray_address: str = knob("auto", "the Ray cluster to join with --provider ray")
    ray_wait_s: float = knob(
        120.0,
        "how long --provider ray waits for the Ray head at --ray-address to answer before "
        "the gateway fails (it may start first, as beside a KubeRay head)",
    )
    executor_zygote: Path | None = knob(
        None,
        "the Unix socket of an executor zygote on this machine (python -m "
        "retouch.runtime.executor.zygote --socket PATH): CPU executors fork from it, "
        "its imports already done, instead of starting afresh (7-8 s of CPU each)",
        shown="none: fresh processes",
    )
    executor_urls: tuple[str, ...] = knob(
        (),
        "comma-separated URLs of the executors --provider attach uses (http://host:port)",
        shown="none",
    )
    executor_token_file: Path | None = knob(
        None,
        "file holding the internal token the attached executors were started with",
        shown="$RETOUCH_EXECUTOR_TOKEN",
    )
    state_store: str | None = knob(
        None,
        "PostgreSQL URL (postgresql://user:pass@host/db) of the store several gateways share: "
        "registry, jobs, webhook deliveries and generated secrets (pip install "
        "retouch[postgres])",
        shown="none: files in the data dir, one gateway",
    )
    state_store_ttl_s: float = knob(
        10.0,
        "seconds a gateway may go without stamping the state store before the others take "
        "over its unfinished jobs",
        flag="--state-store-ttl",
    )
    autoscale: bool = knob(
        False,
        "start and stop executors on load, as the functions' scaling tables say (from zero), "
        "instead of one per device at start-up",
    )
    autoscale_dry_run: bool = knob(False, "log the autoscaler's decisions, start and stop nothing")
    drain_timeout_s: float = knob(
        600.0, "how long a scaled-down executor's running invocations get to finish"
    )
    sleep_keep_s: float = knob(
        300.0,
        "with --autoscale: how long a scaled-down executor sleeps (device given back; process, "
        "weights in host memory and store kept; a scale-up wakes it in seconds) before it is "
        "stopped (0: stopped at once)",
    )
    sleep_host_bytes: int = knob(
        _QUARTER_OF_MEMORY,
        "host memory the sleeping executors may hold together; over it the oldest stop",
        shown="a quarter of this machine's memory",
    )
    token_file: Path | None = knob(None, "a file of '<admin|invoke> <token> [tenant]' lines")
    model_catalogue: Path | None = knob(
        None,
        "a model catalogue (retouch models catalogue): deploys of its models are checked "
        "against it, for a gateway without the weights on its disk",
        shown="none: every model is checked on this machine's disk",
    )
    max_body_bytes: int = knob(32 << 20, "payload limit in bytes", shown="32 MiB")
    max_image_pixels: int = knob(
        0,
        "largest image (width x height, read from its header) a request may carry: uploads, "
        "masks, templates (0: the decoders' own ceiling)",
        shown="4096 x 4096",
    )
    decode_memory_bytes: int = knob(
        0,
        "memory for image decodes in flight (each reserves 24 bytes per declared pixel; "
        "others wait)",
        shown="two decodes at --max-image-pixels (768 MiB), at most an eighth of the memory",
    )
    body_memory_bytes: int = knob(
        0,
        "memory for request bodies held at once (each reserves its content-length, or "
        "--max-body-bytes when it declares none; beyond it: 429 too_many_bodies)",
        shown="an eighth of the machine's memory",
    )
    placement: str = knob(
        "maskaware",
        "placement policy: maskaware (predicted completion + template residency), or a "
        "baseline: least-requests, round-robin, least-masked-tokens, template-hash",
    )
    admission: bool = knob(True, "refuse (429) invocations predicted to miss their function's SLO")
    admission_dry_run: bool = knob(False, "log what SLO admission would refuse, refuse nothing")
    admission_quantile: float = knob(
        0.8,
        "admission scales each prediction by this quantile of recent actual/predicted "
        "completion ratios: higher keeps more of the admitted within the SLO, refuses more",
    )
    shared_dir: Path | None = knob(
        None, "built demo models and device profiles", shown="the data dir"
    )
    max_queued: int = knob(
        256, "invocations (all functions) that may wait in the gateway before 429 overloaded"
    )
    max_queued_per_function: int = knob(0, "the same limit for each function (0: none of its own)")
    queue_timeout_s: float = knob(
        120.0,
        "seconds an invocation may wait for an executor, e.g. during a restart",
        flag="--queue-timeout",
    )
    invoke_timeout_s: float = knob(
        600.0,
        "seconds an invocation may take in all before 504 timeout",
        flag="--invoke-timeout",
    )
    max_attempts: int = knob(3, "executors an invocation may be sent to when one dies mid-run")
    job_retention_s: float = knob(
        24 * 3600.0, "seconds finished jobs and their results are kept", flag="--job-retention"
    )
    max_live_jobs: int = knob(512, "queued or running jobs the gateway keeps (all tenants)")
    max_live_jobs_per_tenant: int = knob(64, "queued or running jobs one tenant may have")
    max_retained_bytes: int = knob(
        2 << 30,
        "bytes of jobs the gateway retains (live payloads, finished results; all tenants)",
        shown="2 GiB",
    )
    max_retained_bytes_per_tenant: int = knob(
        512 << 20, "bytes of jobs one tenant may have retained", shown="512 MiB"
    )
    progress_interval_s: float = knob(
        0.25,
        "least seconds between a job's progress events (0: every step)",
        flag="--progress-interval",
    )
    webhook_allow: tuple[str, ...] = knob(
        ("127.0.0.0/8", "::1/128", "localhost"),
        "comma-separated hosts and IP networks webhooks may target",
    )
    fetch_allow: tuple[str, ...] = knob(
        (),
        "comma-separated hosts and IP networks image/mask URLs may be fetched from "
        "(none: inputs given as URLs are refused)",
        shown="none",
    )
    webhook_secret: str | None = knob(
        None, "webhook signing secret (none: generated once into <data dir>)", flag=""
    )
    public_url: str | None = knob(
        None,
        "the gateway's URL as clients reach it: the base of signed result links",
        shown="http://<host>:<port>",
    )
    link_key_file: Path | None = knob(
        None,
        "file of result-link signing keys, hex, one a line (the last signs, all verify)",
        shown="<data dir>/link-keys, created 0600",
    )
    exit_with_parent: int = knob(
        0,
        "the pid of the process that started this server: it stops (its executors too) "
        "when that process ends, even killed (0: it outlives it)",
        env=False,  # its children must not inherit it
        metavar="PID",
    )
    executor: ExecutorOptions = field(default_factory=ExecutorOptions)

    def executor_args(self) -> tuple[str, ...]:
        """Flags every executor process is started with (its threads: the provider's)."""
        args = to_flags(self.executor, skip=("threads",))
        if self.shared_dir is not None:
            args += ["--shared-dir", str(self.shared_dir)]
        return tuple(args)

    @classmethod
    def from_env(cls, **given: Any) -> ServeConfig:
        """Settings given (non-None; the server's or the executors') win over ``RETOUCH_*``
        environment variables, which win over the declared defaults."""
        given = {k: v for k, v in given.items() if v is not None}
        ours, theirs = {f.name for f in knobs(cls)}, {f.name for f in knobs(ExecutorOptions)}
        unknown = set(given) - ours - theirs
        if unknown:
            raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
        executor = ExecutorOptions(
            **{**from_env(ExecutorOptions), **{k: v for k, v in given.items() if k in theirs}}
        )
        settings = {**from_env(cls), **{k: v for k, v in given.items() if k in ours}}
        config = cls(**settings, executor=executor)
        config.check()
        return config

    def check(self) -> None:
        """Refuse values that cannot work, naming the setting (the CLI prints one line)."""
        self.executor.check()
        positive = {
            "executors": self.executors,
            "max_queued": self.max_queued,
            "max_attempts": self.max_attempts,
            "queue_timeout_s": self.queue_timeout_s,
            "invoke_timeout_s": self.invoke_timeout_s,
            "job_retention_s": self.job_retention_s,
            "drain_timeout_s": self.drain_timeout_s,
            "state_store_ttl_s": self.state_store_ttl_s,
            "max_live_jobs": self.max_live_jobs,
            "max_live_jobs_per_tenant": self.max_live_jobs_per_tenant,
            "max_retained_bytes": self.max_retained_bytes,
            "max_retained_bytes_per_tenant": self.max_retained_bytes_per_tenant,
            "sleep_host_bytes": self.sleep_host_bytes,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        nonnegative = (
            "max_queued_per_function",
            "progress_interval_s",
            "max_image_pixels",
            "decode_memory_bytes",
            "body_memory_bytes",
            "ray_wait_s",
            "metrics_port",
            "exit_with_parent",
            "sleep_keep_s",
        )
        for name in nonnegative:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.metrics_port == self.port:
            raise ValueError(f"metrics_port must differ from port, both are {self.port}")
        if not 0.5 <= self.admission_quantile < 1:
            raise ValueError(
                f"admission_quantile must be in [0.5, 1), got {self.admission_quantile}"
            )
        if self.public_url is not None:
            check_public_url(self.public_url)
        if self.state_store is not None and not self.state_store.startswith(
            ("postgresql://", "postgres://")
        ):
            raise ValueError("state_store must be a postgresql:// URL")
        from retouch.functions.spec import PLACEMENTS  # torch-free, as this module

        self.check_provider()
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )

    def check_provider(self) -> None:
        """The provider knobs agree: attach needs executor URLs and cannot autoscale (its
        executors are started by someone else); the URLs mean nothing to another provider."""
        if self.provider not in PROVIDERS:
            raise ValueError(
                f"provider must be one of {', '.join(PROVIDERS)}, got {self.provider!r}"
            )
        if self.provider != "attach":
            if self.executor_urls:
                raise ValueError("executor_urls is read only with --provider attach")
            return
        if not self.executor_urls:
            raise ValueError("--provider attach needs --executor-urls URL[,URL...]")
        if self.autoscale or self.autoscale_dry_run:
            raise ValueError(
                "--autoscale cannot start or stop attached executors: use it with --provider "
                "local or ray"
            )
        for url in self.executor_urls:
            check_executor_url(url)
        if len(set(self.executor_urls)) != len(self.executor_urls):
            raise ValueError(f"executor_urls lists a URL twice: {','.join(self.executor_urls)}")


def check_executor_url(url: str) -> None:
    """An executor URL is ``http(s)://host:port`` and nothing more."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(f"executor URL must be http://host:port, got {url!r}")
    if parts.path.strip("/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"executor URL must be http://host:port, got {url!r}")
