"""The gateway's memory under hostile use, measured on a real ``retouch serve`` process.

Encoded images are small and their pixels may be huge, and finished jobs are kept for a
day: this bench sends what a hostile tenant would and reads the gateway process's resident
memory (``/proc/<pid>/status``: VmRSS, sampled every 20 ms) against its idle figure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

from retouch.functions.wire.codec import pack, unpack
from retouch.platform.api.client import Client, read_spec_file
from retouch.platform.api.imagegate import BYTES_PER_PIXEL
from retouch.platform.api.limits import logged_decode_budget
from retouch.platform.api.server import ServerProcess
from retouch.platform.fleet.tls import tls_context
from retouch.platform.lab.demo import find_examples


def zero_png(width: int, height: int) -> bytes:
    """A genuine all-zero 16-bit RGBA PNG of ``width`` x ``height``: 130 KB for
    4096 x 4096, which decodes to hundreds of MB."""
    row = b"\0" * (1 + width * 8)  # filter byte, then 8 bytes a pixel
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 16, 6, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


ADMIN, INVOKE = "bench-admin-token", "bench-invoke-token"
SAMPLE_S = 0.02
MiB = 1 << 20


class RssSampler:
    """The peak resident memory of a process while a phase runs (``/proc``, every 20 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for process {self.pid}")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(SAMPLE_S)

    def __enter__(self) -> RssSampler:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def padded_empty_mask(size: int, nbytes: int) -> bytes:
    """An empty (all black) mask PNG of ``size``², padded to ``nbytes`` with a private
    ancillary chunk: a cheap job with a large payload."""
    buf = io.BytesIO()
    Image.new("L", (size, size)).save(buf, format="PNG")
    png = buf.getvalue()
    pad = _chunk(b"prVt", b"\0" * max(0, nbytes - len(png) - 12))
    return png[:33] + pad + png[33:]  # after the signature and IHDR


def gradient_png(side: int, seed: int) -> bytes:
    """A genuine 8-bit RGB PNG of ``side``² whose rows repeat one colour gradient (a
    photo-sized upload that compresses to tens of KB: 4096² in ~57 KiB)."""
    ramp = np.linspace(0, 255, side).astype(np.uint8)
    row = np.stack([ramp, np.full_like(ramp, (40 * seed) % 256), 255 - ramp], -1)
    first = b"\0" + row.tobytes()  # filter byte (none), then the pixels
    same = b"\2" + bytes(row.nbytes)  # filter "up": the row above again
    comp = zlib.compressobj(9)
    idat = comp.compress(first) + b"".join(comp.compress(same) for _ in range(side - 1))
    idat += comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )


def noise_rgba16(size: int, seed: int) -> bytes:
    """A 16-bit RGBA PNG of random pixels (incompressible: its real bytes are sent)."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 1 << 16, (size, size * 4), dtype=np.uint16).astype(">u2")
    raw = b"".join(b"\0" + rows[i].tobytes() for i in range(size))
    ihdr = struct.pack(">IIBBBBB", size, size, 16, 6, 0, 0, 0)
    idat = zlib.compress(raw, 1)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )


async def _post(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], wait_s: float | None = None
) -> tuple[int, str, str | None]:
    """(status, error code or job status, Retry-After) of one msgpack POST."""
    headers = {"content-type": "application/msgpack"}
    if wait_s is not None:
        headers["prefer"] = f"wait={wait_s:g}"
    resp = await client.post(url, content=pack(body), headers=headers)
    doc = unpack(resp.content)
    what = doc["error"]["code"] if "error" in doc and resp.status_code >= 400 else doc.get("status")
    return resp.status_code, str(what), resp.headers.get("retry-after")


async def _burst(
    base: str, path: str, bodies: list[dict[str, Any]], concurrency: int, wait_s: float | None
) -> Counter:
    """POST every body, ``concurrency`` at a time; the answers counted by (status, code)."""
    gate = asyncio.Semaphore(concurrency)
    headers = {"authorization": f"Bearer {INVOKE}"}
    async with httpx.AsyncClient(
        base_url=base, headers=headers, timeout=300, verify=tls_context()
    ) as client:

        async def one(body: dict[str, Any]) -> tuple[int, str, str | None]:
            async with gate:
                return await _post(client, path, body, wait_s)

        answers = await asyncio.gather(*(one(b) for b in bodies))
    counted: Counter = Counter(f"{status} {code}" for status, code, _ in answers)
    retry = sorted({r for status, _, r in answers if status == 429 and r is not None})
    if retry:
        counted["retry_after_s"] = retry  # type: ignore[assignment]
    return counted


async def _jobs_to_the_end(base: str, path: str, bodies: list[dict[str, Any]]) -> Counter:
    """Submit every body at once as a job and follow each to its end (long polls of 60 s,
    the most ``Prefer: wait`` allows); the answers counted by (submit status, final
    status or error code)."""
    headers = {"authorization": f"Bearer {INVOKE}"}
    async with httpx.AsyncClient(
        base_url=base, headers=headers, timeout=300, verify=tls_context()
    ) as client:

        async def one(body: dict[str, Any]) -> str:
            resp = await client.post(
                path,
                content=pack(body),
                headers={"content-type": "application/msgpack", "prefer": "wait=60"},
            )
            doc = unpack(resp.content)
            if resp.status_code >= 400:
                return f"{resp.status_code} {doc['error']['code']}"
            while doc["status"] in ("queued", "running"):
                polled = await client.get(f"/v1/jobs/{doc['id']}", headers={"prefer": "wait=60"})
                doc = polled.json()
            return f"{resp.status_code} {doc['status']}"

        return Counter(await asyncio.gather(*(one(b) for b in bodies)))


def _deploy(url: str, name: str, size: int, steps: int) -> None:
    spec, _ = read_spec_file(find_examples(None) / "tiny-sd.toml")
    template = io.BytesIO()
    Image.new("RGB", (size, size), (90, 120, 150)).save(template, format="PNG")
    spec = dataclasses.replace(
        spec,
        name=name,
        width=size,
        height=size,
        steps=steps,
        templates={"street": spec.templates["street"]},
    )
    with Client(url, ADMIN) as admin:
        admin.deploy(spec, {"street": template.getvalue()})


def _journal_bytes(data_dir: Path) -> int:
    return sum(p.stat().st_size for p in (data_dir / "jobs").glob("*.job"))


def _phase(server: ServerProcess, run: Callable[[], Counter]) -> dict[str, Any]:
    """Run a phase with the gateway's RSS sampled: its answers, idle and peak RSS (MiB)."""
    sampler = RssSampler(server.process.pid)  # type: ignore[union-attr]
    idle = sampler.rss()
    with sampler:
        answers = run()
    return {
        "answers": dict(answers),
        "idle_rss_mib": round(idle / MiB, 1),
        "peak_rss_mib": round(sampler.peak / MiB, 1),
        "peak_over_idle_mib": round((sampler.peak - idle) / MiB, 1),
    }


def run_default_budget_phase(data_dir: Path, uploads: int = 6, side: int = 4096) -> dict[str, Any]:
    """``uploads`` concurrent uploads of ``side``² (the default pixel limit), highly
    compressible PNGs, as jobs on a gateway with the default limits: its RSS growth next to
    the decode budget its start-up log states (acceptance: growth within it)."""
    server = ServerProcess(
        data_dir, env={"RETOUCH_ADMIN_TOKEN": ADMIN, "RETOUCH_INVOKE_TOKEN": INVOKE}
    )
    with server:
        budget = logged_decode_budget((data_dir / "gateway.log").read_text())
        if budget is None:
            raise RuntimeError(f"the gateway stated no decode budget; see {data_dir}/gateway.log")
        _deploy(server.url, "small", 128, 2)
        mask = io.BytesIO()
        selection = Image.new("L", (128, 128))
        selection.paste(255, (32, 32, 96, 96))  # the middle, resized to each upload's size
        selection.save(mask, format="PNG")
        bodies = [
            {"image": gradient_png(side, i), "mask": mask.getvalue(), "prompt": "", "seed": i}
            for i in range(uploads)
        ]
        path = "/v1/functions/small/jobs"
        phase = _phase(server, lambda: asyncio.run(_jobs_to_the_end(server.url, path, bodies)))
    growth = phase["peak_over_idle_mib"]
    return {
        "uploads": uploads,
        "concurrency": uploads,
        "image": f"{side}x{side} RGB8 PNG, one gradient per row",
        "png_kib_total": sum(len(b["image"]) for b in bodies) // 1024,
        "decode_budget_mib": round(budget / MiB, 1),
        **phase,
        "growth_within_decode_budget": growth <= budget / MiB,
    }


def run_memory_bench(
    data_dir: Path, hostile: int = 200, at_limit: int = 20, jobs: int = 1000, side: int = 512
) -> dict[str, Any]:
    """The gateway's RSS through hostile uploads, uploads at the pixel limit and a
    thousand finished jobs with 4 MiB payloads, then the caps' 429s; then, on a gateway
    with the default limits, six concurrent uploads at the default pixel limit."""
    budget = 4 * side * side * BYTES_PER_PIXEL  # room for four decodes at the limit
    server = ServerProcess(
        data_dir,
        env={"RETOUCH_ADMIN_TOKEN": ADMIN, "RETOUCH_INVOKE_TOKEN": INVOKE},
        extra_args=[
            "--max-image-pixels", str(side * side),
            "--decode-memory-bytes", str(budget),
            "--max-live-jobs-per-tenant", "32",
            "--max-retained-bytes-per-tenant", str(256 * MiB),
        ],
    )  # fmt: skip
    out: dict[str, Any] = {"gateway": "retouch serve, 1 CPU executor, tiny-sd"}
    with server:
        _deploy(server.url, "small", 128, 2)
        _deploy(server.url, "at-limit", side, 2)
        base, small = server.url, "/v1/functions/small/jobs"
        mask = padded_empty_mask(128, 0)
        for declared in (8192, 4096):
            body = {"image": zero_png(declared, declared), "mask": mask, "prompt": "", "seed": 1}
            out[f"uploads_declaring_{declared}x{declared}_rgba16"] = {
                "png_kib": len(body["image"]) // 1024,
                "requests": hostile,
                "concurrency": 20,
                **_phase(server, lambda b=body: asyncio.run(_burst(base, small, [b] * hostile, 20, None))),
            }  # fmt: skip
        limit_mask = padded_empty_mask(side, 0)
        bodies = [
            {"image": noise_rgba16(side, i), "mask": limit_mask, "prompt": "", "seed": i}
            for i in range(at_limit)
        ]
        phase = _phase(
            server,
            lambda: asyncio.run(_burst(base, "/v1/functions/at-limit/jobs", bodies, at_limit, 60)),
        )
        out[f"uploads_at_the_limit_{side}x{side}_rgba16"] = {
            "png_kib": len(bodies[0]["image"]) // 1024,
            "requests": at_limit,
            "concurrency": at_limit,
            "decode_budget_mib": round(budget / MiB, 1),
            **phase,
        }
        payload = padded_empty_mask(128, 4 * MiB)
        bodies = [
            {"template": "street", "mask": payload, "prompt": "", "seed": i} for i in range(jobs)
        ]
        phase = _phase(server, lambda: asyncio.run(_burst(base, small, bodies, 16, 60)))
        out["finished_jobs_with_4_mib_payloads"] = {
            "jobs": jobs,
            "concurrency": 16,
            "journal_mib": round(_journal_bytes(data_dir) / MiB, 1),
            "rss_after_mib": round(RssSampler(server.process.pid).rss() / MiB, 1),  # type: ignore[union-attr]
            **phase,
        }
        beyond = [
            {"template": "street", "mask": payload, "prompt": "", "seed": i} for i in range(64)
        ]
        out["burst_beyond_the_caps"] = {
            "requests": 64,
            "concurrency": 64,
            "caps": "32 live jobs, 256 MiB retained per tenant",
            **_phase(server, lambda: asyncio.run(_burst(base, small, beyond, 64, None))),
        }
    out["uploads_at_the_default_limits"] = run_default_budget_phase(data_dir / "defaults")
    return out
