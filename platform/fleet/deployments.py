"""Which functions the executors hold: every deploy and delete pushed to each executor of
the function's model pool, numbered by the gateway's generation (an executor drops a deploy
overtaken by a later deploy or delete), and every function pushed to a new executor before
it opens to invocations."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import httpx

from retouch.functions.errors import RetouchError, Unavailable
from retouch.platform.fleet.executorlink import ExecutorHandle, ExecutorLink
from retouch.platform.state.registry import StoredFunction

log = logging.getLogger(__name__)


class Deployments:
    """The deployed functions and their push to the fleet's executors (owned by the
    fleet; event-loop state, no lock)."""

    def __init__(
        self,
        executors: list[ExecutorHandle],
        link: ExecutorLink,
        refresh: Callable[[ExecutorHandle], Awaitable[None]],
        on_capacity: Callable[[], None],
        in_background: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.executors = executors  # the fleet's list (it adds and removes; never replaces)
        self.link = link
        self.refresh = refresh
        self.on_capacity = on_capacity
        self.in_background = in_background
        self.functions: dict[str, StoredFunction] = {}
        self.generations: dict[str, int] = {}  # latest control operation per function name

    async def load(self, stored: StoredFunction, generation: int) -> None:
        """Push a function to every ready executor; raise if none could load it.

        ``generation`` numbers the control operations on the name (the gateway's
        sequence): executors drop a deploy overtaken by a later deploy or delete."""
        self.functions[stored.spec.name] = stored
        self.generations[stored.spec.name] = generation
        model = stored.spec.model
        # A replaced function may have changed model: executors of the old model drop it.
        for e in self.executors:
            if stored.spec.name in e.functions and not e.serves(model):
                e.functions.discard(stored.spec.name)
                self._drop_from(e, stored.spec.name, generation)
        targets = [e for e in self.executors if e.healthy and e.serves(model)]
        results = await asyncio.gather(
            *(self._push(e, stored) for e in targets), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and len(errors) == len(targets):
            raise errors[0] if isinstance(errors[0], RetouchError) else Unavailable(str(errors[0]))

    async def unload(self, name: str, generation: int) -> None:
        """Remove a function from every executor."""
        self.functions.pop(name, None)
        self.generations[name] = generation
        for e in self.executors:
            e.functions.discard(name)
        path = f"/functions/{name}?generation={generation}"
        await asyncio.gather(
            *(self.link.call(e, "DELETE", path) for e in self.executors if e.healthy),
            return_exceptions=True,
        )

    def _drop_from(self, handle: ExecutorHandle, name: str, generation: int) -> None:
        """Remove ``name`` from one executor, in the background (best effort: an executor
        that misses it keeps a copy placement never sends work to)."""

        async def drop() -> None:
            with contextlib.suppress(RetouchError, httpx.HTTPError):
                path = f"/functions/{name}?generation={generation}"
                await self.link.call(handle, "DELETE", path)

        self.in_background(drop())

    async def push_all(self, handle: ExecutorHandle, held: Mapping[str, int] | None = None) -> None:
        """Every function of ``handle``'s model pool, onto a new, restarted or woken
        executor; a failed push is logged (the executor serves the others). ``held``: the
        generations the executor reports holding (a woken one's): those still current are
        not pushed again, and those this gateway deleted or moved to another model after
        the generation held are dropped from it. A name this gateway has no record of is
        left alone (another gateway's, or this one's registry not loaded yet)."""
        held = held or {}
        for name, generation in held.items():
            latest = self.generations.get(name, 0)
            stored = self.functions.get(name)
            moved = stored is not None and not handle.serves(stored.spec.model)
            if latest > generation and (stored is None or moved):
                self._drop_from(handle, name, latest)
        for stored in list(self.functions.values()):
            name = stored.spec.name
            if not handle.serves(stored.spec.model):
                continue  # another model pool's function: this executor never loads it
            if held.get(name) == self.generations.get(name, 0):
                handle.functions.add(name)  # it holds this very deploy
                continue
            try:
                await self._push(handle, stored)
            except (RetouchError, httpx.HTTPError) as exc:
                log.error("pushing %s to %s failed: %s", stored.spec.name, handle.name, exc)

    async def _push(self, handle: ExecutorHandle, stored: StoredFunction) -> None:
        generation = self.generations.get(stored.spec.name, 0)
        body = {
            "spec": stored.spec.to_dict(),
            "templates": stored.templates,
            "generation": generation,
        }
        await self.link.call(handle, "PUT", f"/functions/{stored.spec.name}", body)
        await self.refresh(handle)  # its cost model and templates, now deployed
        if self.functions.get(stored.spec.name) is stored:  # not deleted or replaced meanwhile
            handle.functions.add(stored.spec.name)
            self.on_capacity()
