"""The ``retouch`` CLI against a real server: commands work and user errors print one line."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from retouch.functions.imaging import encode_mask
from retouch.platform.api.server import ServerProcess
from tests.support import CliRun, run_cli


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliRun]:
    """``retouch ARGS --url URL --token TOKEN`` in this process (``tests.support.run_cli``)."""

    def run(*args: str, token: str | None = None, url: str | None = None) -> CliRun:
        flags = [*(["--url", url] if url else []), *(["--token", token] if token else [])]
        return run_cli(capsys, *args, *flags)

    return run


def test_cli_round_trip(
    cli: Callable[..., CliRun],
    server: ServerProcess,
    data_dir: Path,
    tokens: dict[str, str],
    examples: Path,
    tmp_path: Path,
) -> None:
    admin = tokens["RETOUCH_ADMIN_TOKEN"]
    out = cli("deploy", str(examples / "tiny-sd.toml"), url=server.url, token=admin)
    assert out.returncode == 0, out.stderr
    assert "tiny-sd: ready" in out.stdout

    listing = cli("ls", url=server.url, token=admin)
    assert (
        listing.returncode == 0
        and "tiny-sd" in listing.stdout
        and re.search(r"street \((unbaked|queued|baking|baked)\), poster \(", listing.stdout)
        and "DTYPE" in listing.stdout
    )

    mask = np.zeros((128, 128), bool)
    mask[10:60, 10:60] = True
    (tmp_path / "mask.png").write_bytes(encode_mask(mask))
    result_path = tmp_path / "edited.png"
    out = cli(
        "invoke",
        "tiny-sd",
        "--template",
        "street",
        "--mask",
        str(tmp_path / "mask.png"),
        "--prompt",
        "a tree",
        "--steps",
        "2",
        "-o",
        str(result_path),
        url=server.url,
        token=admin,
    )
    assert out.returncode == 0, out.stderr
    assert "mask_ratio=0.153" in out.stdout
    assert Image.open(result_path).size == (128, 128)
    edit = ["invoke", "tiny-sd", "--template", "street", "--mask", str(tmp_path / "mask.png")]
    edit += ["--prompt", "a tree", "--steps", "2", "-o", str(result_path)]
    out = cli(*edit, "--json", url=server.url, token=admin)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["mask_ratio"] == pytest.approx(0.1526, abs=1e-3) and "image" not in doc
    assert doc["output"] == str(result_path)

    # -n images of one request, each written beside the output name with its seed
    out = cli(*edit, "--seed", "5", "-n", "2", url=server.url, token=admin)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        str(result_path.with_name("edited-0.png")),
        str(result_path.with_name("edited-1.png")),
    ]
    assert "seed=5 " in lines[0] and "seed=6 " in lines[1]
    first, second = (Image.open(result_path.with_name(f"edited-{i}.png")) for i in (0, 1))
    assert first.size == second.size == (128, 128) and first.tobytes() != second.tobytes()
    out = cli(*edit, "-n", "2", "--async", url=server.url, token=admin)
    assert out.returncode == 2 and "a job makes one image" in out.stderr

    # A script captures a job's id alone: JID=$(retouch invoke ... --async)
    out = cli(*edit, "--async", url=server.url, token=admin)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"[0-9a-f]{32}\n", out.stdout), out.stdout
    assert out.stderr.split()[0] in ("queued", "running", "succeeded"), out.stderr

    # The store's counters: the server's executors' (--url), or a data dir's, with the
    # --data-dir flag before or after the subcommand.
    out = cli("cache", "stats", "--json", url=server.url, token=admin)
    assert out.returncode == 0, out.stderr
    (executor,) = json.loads(out.stdout).values()
    assert executor["bakes"] >= 1 and executor["host_templates"] >= 1
    out = cli("cache", "stats", url=server.url, token=admin)
    assert out.returncode == 0 and re.search(r"^\s+bakes\s+\d+$", out.stdout, re.M), out.stdout
    after = cli("cache", "stats", "--data-dir", str(data_dir))
    before = cli("cache", "--data-dir", str(data_dir), "stats")
    assert after.returncode == before.returncode == 0, after.stderr + before.stderr
    names = [[line.split()[0] for line in out.stdout.splitlines()] for out in (after, before)]
    assert names[0] == names[1] and "host_templates" in names[0]  # values move as it works
    assert not after.stdout.lstrip().startswith("{")

    out = cli("rm", "tiny-sd", "--json", url=server.url, token=admin)
    assert out.returncode == 0 and json.loads(out.stdout) == {"deleted": "tiny-sd"}, out.stderr
    assert "tiny-sd" not in cli("ls", url=server.url, token=admin).stdout


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [
        (["rm", "does-not-exist"], "error: function_not_found", 1),
        (
            ["invoke", "x", "--template", "t", "--mask", "/no/such/mask.png", "--prompt", "p"],
            "error: retouch invoke: argument --mask: no such file",
            2,
        ),
        (["deploy", "/no/such/spec.toml"], "error: retouch deploy: argument spec: no such file", 2),
    ],
)
def test_cli_user_errors_without_traceback(
    cli: Callable[..., CliRun],
    server: ServerProcess,
    tokens: dict[str, str],
    args: list[str],
    message: str,
    code: int,
) -> None:
    """The gateway's answers exit 1; a bad value or missing local file exits 2."""
    out = cli(*args, url=server.url, token=tokens["RETOUCH_ADMIN_TOKEN"])
    assert out.returncode == code
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_errors_for_bad_token_and_unreachable_server(
    cli: Callable[..., CliRun], server: ServerProcess, tmp_path: Path
) -> None:
    out = cli("ls", url=server.url, token="wrong")
    assert (
        out.returncode == 1
        and "error: invalid_token" in out.stderr
        and "Traceback" not in out.stderr
    )
    out = cli("ls", url="http://127.0.0.1:9")
    assert (
        out.returncode == 1 and "error: unreachable" in out.stderr and "Traceback" not in out.stderr
    )


def test_cli_invalid_spec_file(
    cli: Callable[..., CliRun], server: ServerProcess, tokens: dict[str, str], tmp_path: Path
) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text(
        'name = "bad"\nmodel = "retouch:tiny-sd"\nfamily = "sd-inpaint"\nresolution = 128\nsteps = -1\n'
    )
    out = cli("deploy", str(spec), url=server.url, token=tokens["RETOUCH_ADMIN_TOKEN"])
    assert out.returncode == 2
    assert "error: invalid_spec" in out.stderr and "(field: steps)" in out.stderr
    spec.write_text("name = [unclosed")
    out = cli("deploy", str(spec), url=server.url, token=tokens["RETOUCH_ADMIN_TOKEN"])
    assert out.returncode == 2 and "not valid TOML" in out.stderr and "Traceback" not in out.stderr
