"""Knobs are defined once: the executor's flags, ``retouch serve`` and the store agree."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from retouch.cachestore.store import StoreConfig
from retouch.functions.knobs import add_flags, from_env, from_flags, knob, to_flags
from retouch.runtime.executor.main import parse_args
from retouch.runtime.executor.options import ExecutorOptions

IDENTITY = ["--name", "e0", "--data-dir", "/tmp/d", "--port-file", "/tmp/p"]


def test_executor_flags_reproduce_the_options() -> None:
    options = ExecutorOptions(
        host_cache_bytes=123,
        maskaware=False,
        engine="static",
        max_batch=3,
        inline_prepost=True,
        pre_workers=2,
        post_workers=3,
        worker_threads=2,
        threads=5,
    )
    assert parse_args([*IDENTITY, *to_flags(options)]).options == options
    assert parse_args(IDENTITY).options == ExecutorOptions()


def test_store_and_executor_share_the_host_budget_default() -> None:
    assert StoreConfig(path=Path("x")).host_budget_bytes == ExecutorOptions().host_cache_bytes


def test_pre_and_post_workers_are_sized_from_the_cores() -> None:
    assert ExecutorOptions().workers(2) == (1, 1)
    assert ExecutorOptions().workers(16) == (4, 4)
    assert ExecutorOptions(pre_workers=3).workers(16) == (3, 4)


def test_a_bad_executor_value_is_one_line_and_exit_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args([*IDENTITY, "--max-batch", "0"])
    assert exc.value.code == 2
    assert "max_batch must be >= 1" in capsys.readouterr().err


@dataclass(frozen=True)
class Example:
    size: int = knob(4, "a size")
    rate: float = knob(0.5, "a rate")
    on: bool = knob(True, "a switch")
    hosts: tuple[str, ...] = knob(("a", "b"), "some hosts")
    path: Path | None = knob(None, "a path")
    secret: str | None = knob(None, "env only", flag="")


def test_knobs_from_flags_environment_and_back() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, Example, unset=True)
    args = parser.parse_args(["--size", "7", "--no-on", "--hosts", "x, y", "--path", "/p"])
    given = from_flags(Example, args)
    assert given == {"size": 7, "on": False, "hosts": ("x", "y"), "path": Path("/p")}
    assert from_flags(Example, parser.parse_args([])) == {}
    env = {"RETOUCH_RATE": "2", "RETOUCH_ON": "false", "RETOUCH_SECRET": "s"}
    assert from_env(Example, env) == {"rate": 2.0, "on": False, "secret": "s"}
    with pytest.raises(ValueError, match="RETOUCH_SIZE"):
        from_env(Example, {"RETOUCH_SIZE": "big"})
    value = Example(size=7, on=False, hosts=("x", "y"), path=Path("/p"))
    parser = argparse.ArgumentParser()
    add_flags(parser, Example)
    assert Example(**from_flags(Example, parser.parse_args(to_flags(value)))) == value
    assert "--secret" not in parser.format_help()


def test_a_command_may_give_a_knob_its_own_default() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, Example, defaults={"size": 9})
    assert parser.parse_args([]).size == 9
    assert "a size (default 9)" in " ".join(parser.format_help().split())
    assert from_flags(Example, parser.parse_args(["--size", "2"]))["size"] == 2


def test_bench_sim_flags_build_the_simulators_spec() -> None:
    """``bench sim`` registers SimSpec's knobs and reads them back: its defaults are the
    spec's, and each flag lands in its field."""
    from retouch.platform.cli.main import build_parser
    from retouch.platform.control.autoscaler import AutoscalingConfig
    from retouch.platform.lab.bench.specs import SimScaling, SimSpec

    def spec(*flags: str) -> SimSpec:
        args = build_parser().parse_args(["bench", "sim", *flags])
        scaling = SimScaling(**from_flags(SimScaling, args)).config()
        return SimSpec(**from_flags(SimSpec, args), autoscale=scaling)

    assert spec() == SimSpec()
    got = spec("--executors", "3", "--placement", "maskaware,round-robin", "--cold-templates",
               "--autoscale", "1,4", "--target-s", "5", "--masks", "bimodal")  # fmt: skip
    assert got == SimSpec(
        executors=3,
        placements=("maskaware", "round-robin"),
        cold_templates=True,
        masks="bimodal",
        autoscale=AutoscalingConfig(1, 4, target_s=5.0),
    )
