"""The ``retouch`` command line: every option has a help text, user mistakes end in one line
and exit status 2 (no traceback), every knob of ``serve`` reaches the executors."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from retouch.functions.knobs import to_flags
from retouch.platform.api.config import ServeConfig
from retouch.platform.cli.common import print_table
from retouch.platform.cli.main import build_parser, main
from retouch.platform.cli.serve import config_of
from retouch.runtime.executor.app import TOKEN_ENV
from retouch.runtime.executor.main import parse_args as executor_args
from retouch.runtime.executor.options import ExecutorOptions
from tests.support import cli_refusal


def _parsers(parser: argparse.ArgumentParser, path: str = "retouch"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_option_of_every_subcommand_has_a_help_text() -> None:
    missing = []
    commands = 0
    for path, parser in _parsers(build_parser()):
        commands += 1
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if not (action.help or "").strip():
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert commands > 20
    assert missing == []


def _spec(tmp_path: Path, **fields: str) -> Path:
    (tmp_path / "t.png").write_bytes(b"")
    lines = [f"{k} = {v}" for k, v in fields.items()]
    spec = tmp_path / "spec.toml"
    spec.write_text("\n".join([*lines, "[templates.a]", 'image = "t.png"', ""]))
    return spec


BAD = [
    (["bench", "engine", "--model", "retouch:small-flux,retouch:small-sd"], "unknown built-in"),
    (["bench", "engine", "--batch", "0"], "--batch"),
    (["bench", "engine", "--mask-ratios", "0.2,x"], "--mask-ratios"),
    (["bench", "fidelity", "--model", "/no/such/folder"], "--model"),
    (["bench", "edits", "--model", "/no/such/folder"], "no such model folder"),
    (["bench", "load", "--mask-file", "/no/such/file"], "no such file"),
    (["bench", "gateway", "--examples", "/no/such/folder"], "no such folder"),
    (["bench", "plan", "--mask-ratio", "1.5"], "--mask-ratio"),
    (["serve", "--max-batch", "0"], "max_batch"),
    (["serve", "--port", "http"], "--port"),
    (["serve", "--engine", "fast"], "--engine"),
    (["serve", "--placement", "nearest"], "placement"),
    (["deploy", "/no/such/spec.toml"], "no such file"),
    (["invoke", "f", "--template", "t", "--mask", "/no/such.png", "--prompt", "p"], "--mask"),
    (["invoke", "f", "--template", "t"], "required"),
    (["jobs", "ls", "--limit", "-1"], "--limit"),
    (["train-demo", "--batch", "x"], "--batch"),
    (["nonsense"], "invalid choice"),
]


@pytest.mark.parametrize(("argv", "says"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_value_or_missing_file_is_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert says in err


def test_a_misspelt_spec_field_is_named_with_a_suggestion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(
        tmp_path, name='"f"', modell='"retouch:tiny-sd"', family='"sd-inpaint"', resolution="128"
    )
    with pytest.raises(SystemExit) as exc:
        main(["deploy", str(spec), "--url", "http://127.0.0.1:9"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "unknown field 'modell' — did you mean 'model'?" in err and "\n" not in err


def test_the_entry_point_runs_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    run = [sys.executable, "-m", "retouch.platform.cli.main"]
    out = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "serve" in out.stdout
    code, err = cli_refusal(capsys, "bench", "engine", "--steps", "0")
    assert code == 2 and "error" in err


def test_every_executor_knob_is_reachable_from_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RETOUCH_THREADS", raising=False)  # tests/conftest.py's, under xdist
    wanted = replace(ExecutorOptions(), maskaware=False, engine="static", max_batch=3)
    wanted = replace(wanted, deterministic=True)
    wanted = replace(wanted, pre_workers=2, post_workers=3, worker_threads=2, threads=4)
    args = build_parser().parse_args(["serve", *to_flags(wanted)])
    config = config_of(args)
    assert config.executor == wanted
    started = executor_args(
        ["--name", "e", "--data-dir", "d", "--port-file", "p", *config.executor_args()]
    )
    assert started.options == ExecutorOptions(**{**vars(wanted), "threads": 0})

    monkeypatch.setenv("RETOUCH_MAX_BATCH", "5")
    monkeypatch.setenv("RETOUCH_PRE_WORKERS", "2")
    assert ServeConfig.from_env().executor.max_batch == 5
    assert ServeConfig.from_env(max_batch=6).executor.pre_workers == 2
    assert ServeConfig.from_env(max_batch=6).executor.max_batch == 6
    monkeypatch.setenv("RETOUCH_MAX_BATCH", "many")
    with pytest.raises(ValueError, match="RETOUCH_MAX_BATCH"):
        ServeConfig.from_env()


def test_admission_and_cpu_niceness_settings_out_of_range_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="admission_quantile"):
        ServeConfig.from_env(admission_quantile=1.5).check()
    with pytest.raises(ValueError, match="cpu_nice"):
        replace(ExecutorOptions(), cpu_nice=-3).check()
    assert ServeConfig.from_env(admission_quantile=0.95).admission_quantile == 0.95


def test_tables_fit_their_contents(capsys: pytest.CaptureFixture[str]) -> None:
    """``retouch ls``, ``jobs ls`` and ``cache ls``: each column as wide as its widest cell,
    so a long name or four templates never push the next column out of line."""
    long = "a-function-with-a-rather-long-name"
    print_table(
        ["NAME", "MB", "TEMPLATES"],
        [[long, 12.5, "a (baked), b (baked), c (baking), d (queued)"], ["x", 3, "t (baked)"]],
    )
    header, first, second = capsys.readouterr().out.splitlines()
    right = header.index("MB") + len("MB")  # numbers are right-aligned under their header
    assert first.index("12.5") + len("12.5") == right == second.index(" 3 ") + 2
    assert header.index("TEMPLATES") == first.index("a (baked)") == second.index("t (baked)")
    assert header.startswith("NAME" + " " * (len(long) - 4 + 2))


def test_url_and_token_go_before_or_after_the_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RETOUCH_TOKEN", "from-env")
    parse = build_parser().parse_args
    assert parse(["--url", "http://a", "ls"]).url == "http://a"
    assert parse(["ls", "--url", "http://b"]).url == "http://b"
    assert parse(["--url", "http://a", "ls", "--url", "http://b"]).url == "http://b"
    bare = parse(["jobs", "ls"])
    assert bare.url is None and bare.token == "from-env"
    assert parse(["--token", "t", "cache", "stats", "--url", "http://c"]).token == "t"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--provider", "attach"], "--provider attach needs --executor-urls"),
        (
            ["--provider", "attach", "--executor-urls", "http://e0:9000", "--autoscale"],
            "--autoscale cannot start or stop attached executors",
        ),
        (["--provider", "attach", "--executor-urls", "e0:9000"], "must be http://host:port"),
        (["--provider", "attach", "--executor-urls", "http://e0"], "must be http://host:port"),
        (
            ["--provider", "attach", "--executor-urls", "http://e0:9000,http://e0:9000"],
            "lists a URL twice",
        ),
        (["--executor-urls", "http://e0:9000"], "read only with --provider attach"),
    ],
)
def test_attach_provider_knobs_are_checked(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], message: str
) -> None:
    """A misconfigured attach provider is one line and exit 2, before anything starts."""
    code, err = cli_refusal(capsys, "serve", "--data-dir", str(tmp_path), *args)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_attach_without_a_token_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    attach = ["--provider", "attach", "--executor-urls", "http://127.0.0.1:9"]
    code, err = cli_refusal(capsys, "serve", "--data-dir", str(tmp_path), *attach)
    assert code == 2 and f"no internal executor token: {TOKEN_ENV} is not set" in err
    empty = tmp_path / "token"
    empty.write_text("\n")
    args = ["--data-dir", str(tmp_path), *attach, "--executor-token-file", str(empty)]
    code, err = cli_refusal(capsys, "serve", *args)
    assert code == 2 and f"{empty} is empty" in err


def test_a_standalone_executor_needs_a_port_and_a_token(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    code, err = cli_refusal(capsys, "executor", "--data-dir", str(tmp_path))
    assert code == 2 and "give --port, or --port-file" in err
    code, err = cli_refusal(capsys, "executor", "--data-dir", str(tmp_path), "--port", "9")
    assert code == 2 and "no internal executor token" in err
