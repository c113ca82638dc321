"""What a new, restarted or woken executor is sent (``Deployments.push_all``): every
function of its model it does not hold at the current generation; a drop only for what
this gateway deleted or moved after the generation the executor holds, never for a name
the gateway has no record of (a gateway starting up before its registry is loaded, or a
function another gateway sharing the executor deployed)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from retouch.functions.errors import Unavailable
from retouch.functions.spec import load_spec_file
from retouch.platform.fleet.deployments import Deployments
from retouch.platform.fleet.executorlink import ExecutorHandle
from retouch.platform.state.registry import StoredFunction
from tests.support import EXAMPLES


class Process:
    def __init__(self, name: str) -> None:
        self.name, self.device, self.url, self.node = name, "cpu", "http://unused", "here"
        self.alive, self.exit_code = True, None


class Calls:
    """An executor link that records each call (method and path)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def call(self, handle: Any, method: str, path: str, body: Any = None, **_: Any) -> dict:
        self.seen.append((method, path.split("?")[0]))
        return {}


def stored(name: str, model: str = "retouch:tiny-sd") -> StoredFunction:
    spec, _ = load_spec_file(EXAMPLES / "tiny-sd.toml")
    return StoredFunction(dataclasses.replace(spec, name=name, model=model), {})


def run(deploys: Deployments, handle: ExecutorHandle, held: dict[str, int]) -> None:
    tasks: list[asyncio.Task] = []

    async def main() -> None:
        deploys.in_background = lambda work: tasks.append(asyncio.ensure_future(work))
        await deploys.push_all(handle, held)
        await asyncio.gather(*tasks)

    asyncio.run(main())


def deployments(link: Calls, handle: ExecutorHandle) -> Deployments:
    async def refresh(_: ExecutorHandle) -> None:
        return None

    return Deployments([handle], link, refresh, lambda: None, lambda _: None)  # type: ignore[arg-type]


def test_a_woken_executor_gets_only_what_changed_and_loses_what_was_deleted() -> None:
    link, handle = Calls(), ExecutorHandle(Process("exec-0"), model="retouch:tiny-sd")
    deploys = deployments(link, handle)
    for name, generation in (("kept", 3), ("changed", 7), ("added", 9)):
        deploys.functions[name] = stored(name)
        deploys.generations[name] = generation
    deploys.functions["moved"] = stored("moved", model="retouch:tiny-flux")
    deploys.generations.update({"moved": 8, "deleted": 6})
    held = {"kept": 3, "changed": 5, "deleted": 4, "moved": 2, "someone-elses": 1}
    run(deploys, handle, held)
    assert sorted(link.seen) == [
        ("DELETE", "/functions/deleted"),
        ("DELETE", "/functions/moved"),
        ("PUT", "/functions/added"),
        ("PUT", "/functions/changed"),
    ]  # "kept" is held at its generation; "someone-elses" is not this gateway's to drop
    assert {"kept", "changed", "added"} <= handle.functions


def test_a_gateway_that_has_not_loaded_its_registry_drops_nothing() -> None:
    link, handle = Calls(), ExecutorHandle(Process("exec-0"))
    run(deployments(link, handle), handle, {"a": 4, "b": 9})
    assert link.seen == []


class Failing(Calls):
    """A link whose pushes of ``broken`` fail, and whose push of ``trigger`` redeploys
    ``redeployed`` meanwhile (a deploy while a woken executor is still being pushed)."""

    def __init__(self, deploys: Deployments | None = None) -> None:
        super().__init__()
        self.deploys = deploys

    async def call(self, handle: Any, method: str, path: str, body: Any = None, **_: Any) -> dict:
        await super().call(handle, method, path, body)
        if path.startswith("/functions/broken"):
            raise Unavailable("the executor could not load it")
        if path.startswith("/functions/trigger") and self.deploys is not None:
            self.deploys.generations["redeployed"] += 1
        return {}


def test_a_woken_executor_never_serves_a_deploy_it_failed_to_take() -> None:
    """Its older copy stays on the executor, so the gateway must stop sending it that
    function: a push that fails takes the name off the executor, tried once."""
    link, handle = Failing(), ExecutorHandle(Process("exec-0"), model="retouch:tiny-sd")
    deploys = deployments(link, handle)
    for name, generation in (("broken", 7), ("kept", 3)):
        deploys.functions[name] = stored(name)
        deploys.generations[name] = generation
    handle.functions |= {"broken", "kept"}  # what it served before it slept
    run(deploys, handle, {"broken": 5, "kept": 3})
    assert link.seen == [("PUT", "/functions/broken")]
    assert handle.functions == {"kept"}


def test_a_deploy_made_while_a_woken_executor_is_pushed_reaches_it() -> None:
    link, handle = Failing(), ExecutorHandle(Process("exec-0"), model="retouch:tiny-sd")
    deploys = deployments(link, handle)
    link.deploys = deploys
    for name, generation in (("redeployed", 3), ("trigger", 4)):
        deploys.functions[name] = stored(name)
        deploys.generations[name] = generation
    run(deploys, handle, {"redeployed": 3})  # held current when push_all began
    assert link.seen == [("PUT", "/functions/trigger"), ("PUT", "/functions/redeployed")]
    assert handle.functions == {"redeployed", "trigger"}
