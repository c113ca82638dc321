"""The deployment files in ``deploy/`` say what retouch relies on (none of them can be run
on the development machine: no container runtime, no cluster; see docs/deploy.md). The
Kubernetes manifests are checked in tests/deploy/test_kubernetes.py."""

from __future__ import annotations

import re

import pytest

from retouch.platform.config import ServeConfig
from tests.support import REPO

yaml = pytest.importorskip("yaml", reason="PyYAML comes with the ray extra")

DEPLOY = REPO / "deploy"


def _known_flags() -> set[str]:
    import argparse

    from retouch.platform.cli import build_parser

    parser: argparse.ArgumentParser = build_parser()
    serve = next(
        a for a in parser._subparsers._group_actions if isinstance(a, argparse._SubParsersAction)
    ).choices["serve"]
    return {flag for action in serve._actions for flag in action.option_strings}


def test_the_dockerfile_installs_as_make_does() -> None:
    docker = (DEPLOY / "docker" / "Dockerfile").read_text()
    make = (REPO / "Makefile").read_text()
    pin = re.search(r"torch==[\d.]+", make).group(0)  # make's first step
    steps = [line for line in docker.splitlines() if line.startswith("RUN python -m pip")]
    assert steps and pin in steps[0], steps  # torch first, pinned as in the Makefile
    assert '".[ray]"' in steps[1]  # then retouch with the Ray extra
    assert 'ENTRYPOINT ["retouch"]' in docker


def test_the_compose_file_serves_with_known_options() -> None:
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    service = compose["services"]["retouch"]
    flags = [w for w in service["command"] if w.startswith("--")]
    assert set(flags) <= _known_flags()
    assert service["ports"] == ["8000:8000"] and service["shm_size"]
    assert ServeConfig().port == 8000
