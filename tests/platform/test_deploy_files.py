"""The Kubernetes files in ``deploy/`` say what retouch relies on (none of them can be run
on the development machine: no cluster; see docs/deploy.md). The images' files are
tests/deploy/test_images.py's."""

from __future__ import annotations

import shlex

import pytest

from tests.support import REPO

yaml = pytest.importorskip("yaml", reason="PyYAML comes with the ray extra")

DEPLOY = REPO / "deploy"


def _serve_flags(command: str) -> list[str]:
    """The ``--flags`` of the ``retouch serve`` in a shell command line."""
    words = shlex.split(command)
    start = words.index("serve")
    return [w for w in words[start + 1 :] if w.startswith("--")]


def _known_flags() -> set[str]:
    import argparse

    from retouch.platform.cli import build_parser

    parser: argparse.ArgumentParser = build_parser()
    serve = next(
        a for a in parser._subparsers._group_actions if isinstance(a, argparse._SubParsersAction)
    ).choices["serve"]
    return {flag for action in serve._actions for flag in action.option_strings}


def test_the_raycluster_runs_the_gateway_on_the_head_and_executors_on_gpus() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "raycluster.yaml").read_text()))
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["spec"]["enableInTreeAutoscaling"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    command = " ".join(head["args"])
    flags = _serve_flags(command)
    assert {"--provider", "--ray-address", "--autoscale", "--data-dir"} <= set(flags)
    assert set(flags) <= _known_flags(), set(flags) - _known_flags()  # no misspelt option
    assert shlex.split(command)[shlex.split(command).index("--provider") + 1] == "ray"
    assert head["readinessProbe"]["httpGet"]["path"] == "/readyz"
    mounts = {m["mountPath"] for m in head["volumeMounts"]}
    assert "/data" in mounts  # the registry and jobs survive the head pod
    worker = cluster["spec"]["workerGroupSpecs"][0]
    container = worker["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["rayStartParams"]["num-gpus"] == "1"
    assert worker["minReplicas"] == 0 < worker["maxReplicas"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["RETOUCH_DATA_DIR"].startswith("/nvme")  # the node's store on local NVMe
    assert {d["kind"] for d in docs} == {"RayCluster", "PersistentVolumeClaim", "Service"}
