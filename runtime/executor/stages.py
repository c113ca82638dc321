"""Pre- and post-processing of the executor's invocations in the pool's worker processes.

A worker process may die mid-job (killed for memory, a crash in a native library); edits
are deterministic, so the job is simply run again on the restarted worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from retouch.functions.adapters import AdapterSpec
from retouch.runtime.maskaware.request import EditRequest
from retouch.runtime.work import Work
from retouch.runtime.workers import PrePostPool, WorkerDied

log = logging.getLogger(__name__)

STAGE_ATTEMPTS = 3  # a pre/post job whose worker died is re-run on the restarted worker


def _retrying(submit: Callable[[], Future], attempts: int, what: str) -> Future:
    """``submit()``, re-submitted when its worker process died (the pool restarts it);
    any other failure, or the last death, fails the returned future."""
    result: Future = Future()

    def attempt(left: int) -> None:
        try:
            inner = submit()
        except Exception as exc:
            result.set_exception(exc)
            return

        def done(f: Future) -> None:
            exc = f.exception()
            if isinstance(exc, WorkerDied) and left > 1:
                log.warning("%s: %s; retrying on the restarted worker", what, exc)
                attempt(left - 1)
            elif exc is not None:
                result.set_exception(exc)
            else:
                result.set_result(f.result())

        inner.add_done_callback(done)

    attempt(attempts)
    return result


@dataclass
class WorkerStages:
    """Pre/post-processing of the engine's invocations in the pool's worker processes.

    Edits are deterministic, so a job whose worker was killed is simply run again."""

    pool: PrePostPool
    attempts: int = STAGE_ATTEMPTS

    def encode(self, work: Work) -> Future:
        pipeline = (work.model, work.family, work.scheduler)
        return self.encode_request(pipeline, work.request, adapters=work.text_adapters)

    def encode_request(
        self,
        pipeline: tuple[str, str, str],
        request: EditRequest,
        latents: Any = None,
        adapters: tuple[AdapterSpec, ...] = (),
    ) -> Future:
        """``editor.encode`` of any request (an invocation's, a bake's, a profile's) on the
        ``(model, family, scheduler)`` pipeline with ``adapters``' text-encoder part;
        ``latents``: the template's, if cached."""
        return _retrying(
            lambda: self.pool.encode(*pipeline, request, latents, adapters),
            self.attempts,
            "encode",
        )

    def decode(self, work: Work, latents: torch.Tensor) -> Future:
        request = work.request
        return _retrying(
            lambda: self.pool.decode(
                work.model,
                work.family,
                latents,
                request.height,
                request.width,
                work.fmt,
                over=request if work.feather_px is not None else None,
                feather_px=work.feather_px or 0,
            ),
            self.attempts,
            "decode",
        )
