"""Concurrent PUT and DELETE of one function name: after any interleaving the gateway, the
durable registry and the executors agree, and a restarted gateway shows the last
acknowledged operation."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from retouch.functions.wire.codec import pack
from retouch.platform.api.client import Client, read_spec_file
from retouch.platform.api.server import ServerProcess
from retouch.platform.fleet.tls import tls_context

pytestmark = pytest.mark.slow

NAME = "race"
ROUNDS = 3
OPS_PER_ROUND = 8


def put(url: str, body: bytes) -> int:
    resp = httpx.put(
        f"{url}/v1/functions/{NAME}",
        content=body,
        headers={"content-type": "application/msgpack"},
        timeout=120,
        verify=tls_context(),
    )
    return resp.status_code


def delete(url: str) -> int:
    return httpx.delete(f"{url}/v1/functions/{NAME}", timeout=120, verify=tls_context()).status_code


def settled(client: Client) -> dict | None:
    """The function once no deploy of it is in flight (None when it does not exist)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            doc = client.get(NAME)
        except Exception as exc:  # 404: deleted
            assert getattr(exc, "code", "") == "function_not_found", exc
            return None
        if doc["status"] != "deploying":
            return doc
        time.sleep(0.2)
    raise AssertionError("deploy never settled")


def registry_steps(data: Path) -> int | None:
    spec = data / "functions" / NAME / "spec.json"
    return json.loads(spec.read_text())["steps"] if spec.exists() else None


def executor_generations(client: Client) -> list[int | None]:
    """The generation of the function's deploy on every executor (None: not loaded)."""
    deadline = time.monotonic() + 60
    while True:
        executors = client.executors()["executors"]
        if all(e["state"] for e in executors) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return [(e["state"] or {}).get("generations", {}).get(NAME) for e in executors]


def assert_consistent(client: Client, data: Path) -> dict | None:
    doc = settled(client)
    steps = registry_steps(data)
    if doc is None:
        assert steps is None, "deleted from the gateway but still in the registry"
        assert executor_generations(client) == [None, None]
    else:
        assert doc["status"] == "ready", doc
        assert steps == doc["steps"], "the registry holds another version than the gateway"
        assert executor_generations(client) == [doc["generation"]] * 2
    return doc


def test_concurrent_put_and_delete_agree_everywhere(tmp_path: Path, examples: Path) -> None:
    spec, images = read_spec_file(examples / "tiny-flux.toml")  # the model's lightest bakes
    data = tmp_path / "data"
    rng = random.Random(3)
    with ServerProcess(data, executors=2) as server, Client(server.url) as client:
        client.deploy(dataclasses.replace(spec, name=NAME), images)  # model loaded once
        last = None
        for round_ in range(ROUNDS):
            ops = []
            for i in range(OPS_PER_ROUND):
                if rng.random() < 0.5:
                    version = dataclasses.replace(
                        spec, name=NAME, steps=1 + round_ * OPS_PER_ROUND + i
                    )
                    body = pack({"spec": version.to_dict(), "templates": images})
                    ops.append(lambda b=body: put(server.url, b))
                else:
                    ops.append(lambda: delete(server.url))
            with ThreadPoolExecutor(OPS_PER_ROUND) as pool:
                statuses = list(pool.map(lambda op: op(), ops))
            assert set(statuses) <= {200, 202, 404}, statuses  # 404: deleted twice
            last = assert_consistent(client, data)
    expected_steps = None if last is None else last["steps"]
    with ServerProcess(data, executors=2) as server, Client(server.url) as client:
        doc = assert_consistent(client, data)
        assert (None if doc is None else doc["steps"]) == expected_steps
