"""The one config loader: ``retouch serve`` settings from flags, then environment, then defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PORT = 8000
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"


def default_data_dir() -> Path:
    return Path(os.environ.get("RETOUCH_DATA_DIR", Path.home() / ".retouch"))


def default_url() -> str:
    return os.environ.get("RETOUCH_URL", DEFAULT_URL)


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    data_dir: Path = Path(".retouch")
    executors: int = 1  # CPU slots when no GPU is found; with GPUs, one executor per GPU
    token_file: Path | None = None
    max_body_bytes: int = 32 << 20
    placement: str = "maskaware"  # or a baseline: least-requests, round-robin, ...
    admission: bool = True  # refuse invocations predicted to miss their function's SLO
    admission_dry_run: bool = False  # log what admission would refuse, refuse nothing
    host_cache_bytes: int = 4 << 30  # per executor: host-RAM tier of the activation store
    maskaware: bool = True  # False: every token computed, the cache never read (comparisons)
    engine: str = "continuous"  # or "static" (a batch runs to completion; for comparisons)
    max_batch: int = 8
    inline_prepost: bool = False  # pre/post on the engine thread (naive batching; comparisons)
    shared_dir: Path | None = None  # built demo models + device profiles (default: data_dir)
    max_queued: int = 256  # invocations waiting in the gateway (all functions); then 429
    max_queued_per_function: int = 0  # per function (0: only the server-wide limit)
    queue_timeout_s: float = 120.0  # longest wait for an executor slot (restarts, deploys)
    invoke_timeout_s: float = 600.0  # an invocation's whole life in the gateway
    max_attempts: int = 3  # executors an invocation may be sent to when one is lost
    job_retention_s: float = 24 * 3600.0  # finished jobs are kept this long, then removed
    progress_interval_s: float = 0.25  # at most one progress event per job per interval
    webhook_allow: tuple[str, ...] = ("127.0.0.0/8", "::1/128", "localhost")
    webhook_secret: str | None = None  # None: generated once into <data dir>/webhook-secret

    def executor_args(self) -> tuple[str, ...]:
        """Flags every executor process is started with."""
        args = [
            "--host-cache-bytes",
            str(self.host_cache_bytes),
            "--engine",
            self.engine,
            "--max-batch",
            str(self.max_batch),
        ]
        if not self.maskaware:
            args.append("--no-maskaware")
        if self.inline_prepost:
            args.append("--inline-prepost")
        if self.shared_dir is not None:
            args += ["--shared-dir", str(self.shared_dir)]
        return tuple(args)

    @classmethod
    def from_env(cls, **overrides: object) -> ServeConfig:
        """Flags given (non-None) win over ``RETOUCH_*`` environment, which wins over defaults."""
        env = {
            "host": os.environ.get("RETOUCH_HOST"),
            "port": _int_env("RETOUCH_PORT"),
            "data_dir": default_data_dir(),
            "executors": _int_env("RETOUCH_EXECUTORS"),
            "token_file": _path_env("RETOUCH_TOKEN_FILE"),
            "max_body_bytes": _int_env("RETOUCH_MAX_BODY_BYTES"),
            "placement": os.environ.get("RETOUCH_PLACEMENT"),
            "host_cache_bytes": _int_env("RETOUCH_HOST_CACHE_BYTES"),
            "engine": os.environ.get("RETOUCH_ENGINE"),
            "max_batch": _int_env("RETOUCH_MAX_BATCH"),
            "shared_dir": _path_env("RETOUCH_SHARED_DIR"),
            "max_queued": _int_env("RETOUCH_MAX_QUEUED"),
            "max_queued_per_function": _int_env("RETOUCH_MAX_QUEUED_PER_FUNCTION"),
            "queue_timeout_s": _float_env("RETOUCH_QUEUE_TIMEOUT_S"),
            "invoke_timeout_s": _float_env("RETOUCH_INVOKE_TIMEOUT_S"),
            "max_attempts": _int_env("RETOUCH_MAX_ATTEMPTS"),
            "job_retention_s": _float_env("RETOUCH_JOB_RETENTION_S"),
            "progress_interval_s": _float_env("RETOUCH_PROGRESS_INTERVAL_S"),
            "webhook_allow": _list_env("RETOUCH_WEBHOOK_ALLOW"),
            "webhook_secret": os.environ.get("RETOUCH_WEBHOOK_SECRET") or None,
        }
        merged = {k: v for k, v in env.items() if v is not None}
        merged.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**merged)  # type: ignore[arg-type]
        config.check()
        return config

    def check(self) -> None:
        """Refuse values that cannot work, naming the setting (the CLI prints one line)."""
        positive = {
            "executors": self.executors,
            "max_batch": self.max_batch,
            "max_queued": self.max_queued,
            "max_attempts": self.max_attempts,
            "queue_timeout_s": self.queue_timeout_s,
            "invoke_timeout_s": self.invoke_timeout_s,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.max_queued_per_function < 0:
            raise ValueError("max_queued_per_function must be >= 0")
        if self.job_retention_s <= 0:
            raise ValueError(f"job_retention_s must be positive, got {self.job_retention_s}")
        if self.progress_interval_s < 0:
            raise ValueError("progress_interval_s must be >= 0")
        from retouch.functions.spec import PLACEMENTS  # torch-free, as this module

        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _float_env(name: str) -> float | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def _list_env(name: str) -> tuple[str, ...] | None:
    value = os.environ.get(name)
    return None if value is None else tuple(v.strip() for v in value.split(",") if v.strip())


def _path_env(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None
