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

PUSH_PASSES = 3  # passes of push_all over deploys made while it pushes


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
        executor; a failed push is logged, and that function's invocations go elsewhere
        (the executor serves the others, never an older deploy it still holds). ``held``:
        the generations the executor reports holding (a woken one's): those still current
        are not pushed again, and those this gateway deleted or moved to another model
        after the generation held are dropped from it. Deploys made meanwhile, which skip
        an executor not yet ready, are pushed too. A name this gateway has no record of is
        left alone (another gateway's, or this one's registry not loaded yet)."""
        held = dict(held or {})
        for name, generation in held.items():
            latest = self.generations.get(name, 0)
            stored = self.functions.get(name)
            moved = stored is not None and not handle.serves(stored.spec.model)
            if latest > generation and (stored is None or moved):
                self._drop_from(handle, name, latest)
        # A deploy while this runs skips the executor (not ready yet): a pass pushes what
        # changed since the last one, until nothing has (a few passes at most in practice).
        # A push that failed is not tried again at the same generation.
        tried: dict[str, int] = {}
        for _ in range(PUSH_PASSES):
            stale = [
                (stored, generation)
                for stored in list(self.functions.values())
                if handle.serves(stored.spec.model)
                and (generation := self.generations.get(stored.spec.name, 0))
                not in (held.get(stored.spec.name), tried.get(stored.spec.name))
            ]
            if not stale:
                break
            for stored, generation in stale:
                tried[stored.spec.name] = generation
                if await self._pushed(handle, stored):
                    held[stored.spec.name] = generation
        for stored in list(self.functions.values()):
            name = stored.spec.name
            if held.get(name) == self.generations.get(name, 0) and handle.serves(stored.spec.model):
                handle.functions.add(name)  # it holds this very deploy
            else:  # an older deploy (a woken executor's), or none: never serve from it
                handle.functions.discard(name)

    async def _pushed(self, handle: ExecutorHandle, stored: StoredFunction) -> bool:
        """Push ``stored``; whether ``handle`` took it (a failure is logged: the executor
        serves the others)."""
        try:
            await self._push(handle, stored)
        except (RetouchError, httpx.HTTPError) as exc:
            log.error("pushing %s to %s failed: %s", stored.spec.name, handle.name, exc)
            return False
        return True

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
