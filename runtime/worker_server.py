"""The pre/post worker process: loads the models it is asked for (without their denoiser;
post workers also without text encoders) and runs one job at a time for its pool
(:mod:`retouch.runtime.workers`, the engine process's side).

A job arrives as a msgpack header over the pipe plus a shared-memory block of tensors
(:mod:`retouch.runtime.shm`); the reply goes back the same way, into the block the pool
named. A job that raises becomes an error reply and the worker keeps serving.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from retouch.functions.adapters import parse_adapters
from retouch.functions.errors import RetouchError
from retouch.functions.imaging import composite, encode_image
from retouch.functions.wire.codec import pack, unpack
from retouch.runtime import shm
from retouch.runtime.maskaware.editor import MaskAwareEditor, OutputSize
from retouch.runtime.maskaware.request import EditRequest
from retouch.runtime.models import ModelCache
from retouch.runtime.textadapters import TextAdapters

log = logging.getLogger(__name__)

PRE, POST = "pre", "post"
LEFT_OUT = {PRE: ("denoiser",), POST: ("denoiser", "text")}  # what each role loads without


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to start (plain values: they cross the spawn)."""

    role: str
    index: int
    models_dir: str
    device: str
    threads: int | None
    log_level: int
    nice: int = 0  # added to the worker's niceness (its main thread, and threads it starts)

    @property
    def name(self) -> str:
        return f"{self.role} worker {self.index}"


def serve(spec: WorkerSpec, conn: Connection) -> None:
    """A worker process's main loop: one job at a time until "stop" or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the pool's to handle: it closes us
    logging.basicConfig(
        level=spec.log_level, format="%(asctime)s %(processName)s %(name)s %(message)s"
    )
    if spec.nice:  # first: threads torch starts from here on inherit it (Linux: per thread)
        os.nice(spec.nice)
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    worker = _Server(spec)
    try:
        conn.send_bytes(pack({"op": "ready", "pid": os.getpid()}))
        while (message := unpack(conn.recv_bytes())).get("op") != "stop":
            conn.send_bytes(pack(worker.handle(message)))
    except (EOFError, OSError):
        log.info("%s: the pool's process is gone; exiting", spec.name)


class _Server:
    """The models of one worker process and its job handlers."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        models_dir = Path(spec.models_dir)
        self.models = ModelCache(models_dir, self.device, without=LEFT_OUT[spec.role])
        self.editors: dict[tuple[str, str, str], MaskAwareEditor] = {}
        self.text: dict[str, TextAdapters] = {}  # per model: its LoRAs' text-encoder parts

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        """Run one job; a failure becomes an error reply (the worker keeps serving)."""
        try:
            items = shm.take_tensors(message["items"])
            started = time.perf_counter()
            handler = getattr(self, f"_{message['op']}", None)
            if handler is None:
                raise ValueError(f"unknown job {message['op']!r}")
            meta, out = handler(message["meta"], items)
            compute = time.perf_counter() - started
            header = shm.put_tensors(out, message["reply"])
        except RetouchError as exc:  # the caller's input (a LoRA that does not fit): as is
            log.warning("%s: %s job refused: %s", self.spec.name, message.get("op"), exc)
            return {"ok": False, **exc.to_wire(), "status": exc.status}
        except Exception as exc:
            log.exception("%s: %s job failed", self.spec.name, message.get("op"))
            return {"ok": False, "kind": type(exc).__name__, "error": str(exc)}
        return {"ok": True, "meta": meta, "items": header, "compute_s": compute}

    # -- handlers: (meta, items) -> (reply meta, reply items) -------------------------------

    def _encode(self, meta: dict[str, Any], items: dict[str, Any]) -> tuple[dict, dict]:
        editor = self._editor(meta["model"], meta["family"], meta["scheduler"])
        request = EditRequest.from_wire(meta["request"], items)
        adapters = parse_adapters(meta.get("adapters", []))
        with self._text(meta["model"], meta["family"]).encoding(adapters):
            encoded = editor.encode(request, items.get("template_latents"))
        reply = {"family": encoded.family, "height": encoded.height, "width": encoded.width}
        return reply, encoded.tensors

    def _decode(self, meta: dict[str, Any], items: dict[str, Any]) -> tuple[dict, dict]:
        editor = self._editor(meta["model"], meta["family"], None)
        image = editor.decode(items["latents"], OutputSize(meta["height"], meta["width"]))
        if "feather_px" in meta:
            template = Image.fromarray(np.asarray(items["image"]))
            image = composite(image, template, np.asarray(items["mask"]), meta["feather_px"])
        data = encode_image(image, meta["format"])
        return {"width": image.width, "height": image.height}, {"image": data}

    def _load(self, meta: dict[str, Any], items: dict[str, Any]) -> tuple[dict, dict]:
        self.models.get(meta["model"], meta["family"])
        if self.spec.role == PRE:
            self._text(meta["model"], meta["family"]).load(parse_adapters(meta.get("adapters", [])))
        return {}, {}

    def _echo(self, meta: dict[str, Any], items: dict[str, Any]) -> tuple[dict, dict]:
        return {}, items

    # -- models -----------------------------------------------------------------------------

    def _text(self, model: str, family: str) -> TextAdapters:
        """The text-encoder adapters of ``model`` (shared by its editors' pipelines)."""
        text = self.text.get(model)
        if text is None:
            text = self.text[model] = TextAdapters(self.models.get(model, family).pipe)
        return text

    def _editor(self, model: str, family: str, scheduler: str | None) -> MaskAwareEditor:
        """One editor per (model, scheduler); decode does not depend on the scheduler."""
        key = (model, family, scheduler or "")
        editor = self.editors.get(key)
        if editor is None:
            loaded = self.models.get(model, family)
            pipe = loaded.pipe if scheduler is None else loaded.pipeline_for(scheduler)
            editor = self.editors[key] = MaskAwareEditor(pipe, family, self.device)
        return editor
