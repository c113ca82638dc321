"""A command that starts servers leaves none running when it is stopped.

``retouch bench load`` is started with the smallest settings that get its server up (a
gateway, an executor and the executor's pre/post workers), and stopped mid-run: SIGTERM
(what a service manager or ``timeout`` sends), SIGINT (Ctrl-C sent to it alone) or SIGKILL
(no clean-up runs at all: its servers must notice on their own). Within
:data:`STOP_S` no process of it may be left and the ports its servers served must not
answer.

Leftovers cannot slip past: the process trees are read from ``/proc`` before the signal
(pid and start time, so a reused pid is not mistaken for a survivor): the command's, and
each executor's with its workers (the suite's executors fork from its zygote, so they are
the zygote's children, not the gateway's: ``tests/e2e/test_zygote.py``); every process
the command started itself is also found by a mark in its environment, which all its
descendants inherit, including any started after that reading.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from retouch.platform.api.server import GATEWAY_ZYGOTE_ENV
from retouch.platform.fleet.tls import tls_context
from tests.support import wait_for

pytestmark = pytest.mark.slow

STOP_S = 30.0  # for everything the command started to be gone
MARK = "RETOUCH_TEST_PROCESS_TREE"


@dataclass(frozen=True)
class Proc:
    pid: int
    started: int  # clock ticks after boot (/proc/<pid>/stat field 22): tells a reused pid
    cmdline: str

    def alive(self) -> bool:
        """Still this process (same start time), and not a zombie waiting to be reaped."""
        stat = read_stat(self.pid)
        return stat is not None and stat[2] == self.started and stat[1] != "Z"


def read_stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of ``pid``; None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), fields[0], int(fields[19])


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def tree(root: int) -> list[Proc]:
    """``root`` and all its descendants, as ``/proc`` shows them now."""
    stats = {pid: stat for pid in pids() if (stat := read_stat(pid)) is not None}
    found, frontier = [root], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, stat in stats.items() if stat[0] == parent]
        found += children
        frontier += children
    return [Proc(pid, stats[pid][2], cmdline(pid)) for pid in found if pid in stats]


def marked(value: str) -> list[Proc]:
    """Every live process whose environment carries ``MARK=value``."""
    needle = f"{MARK}={value}".encode()
    out = []
    for pid in pids():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        stat = read_stat(pid)
        if needle in environ.split(b"\0") and stat is not None and stat[1] != "Z":
            out.append(Proc(pid, stat[2], cmdline(pid)))
    return out


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return True
    except OSError:
        return False


def flag(command: str, name: str) -> str:
    words = command.split()
    return words[words.index(name) + 1]


def bench_load(data: Path, mark: str) -> subprocess.Popen:
    """The smallest ``bench load`` (its own log beside ``data``), carrying ``mark``."""
    cmd = [
        sys.executable, "-m", "retouch.platform.cli.main", "bench", "load",
        "--model", "retouch:tiny-sd", "--compare", "continuous", "--rate", "1",
        "--requests", "2", "--warmup", "0", "--steps", "2", "--templates", "1",
        "--max-batch", "1", "--data-dir", str(data),
    ]  # fmt: skip
    data.mkdir(parents=True)
    with (data / "bench.log").open("wb") as log:
        return subprocess.Popen(
            cmd,
            # its gateway started as the command starts it, not forked from the tests' zygote
            env={**{k: v for k, v in os.environ.items() if k != GATEWAY_ZYGOTE_ENV}, MARK: mark},
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def serving(bench: subprocess.Popen) -> tuple[int, list[int], list[int]] | None:
    """The gateway's port, its executors' ports and their pids once an executor and its
    workers run."""
    if bench.poll() is not None:
        raise AssertionError(f"bench load exited with {bench.returncode} before its servers ran")
    gateway = next((p for p in tree(bench.pid) if " serve " in p.cmdline), None)
    if gateway is None:
        return None
    port = int(flag(gateway.cmdline, "--port"))
    try:
        rows = httpx.get(
            f"http://127.0.0.1:{port}/v1/executors", timeout=10, verify=tls_context()
        ).json()["executors"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    running = [r for r in rows if r["healthy"] and len((r["state"] or {}).get("workers", {})) >= 2]
    if not running:
        return None
    ports = [int(r["url"].rsplit(":", 1)[1]) for r in running]
    return port, ports, [int(r["state"]["pid"]) for r in running]


def describe(procs: list[Proc]) -> str:
    return "; ".join(f"{p.pid}: {p.cmdline[:120]}" for p in procs) or "none"


@dataclass
class Run:
    """One ``bench load``, the signal it gets and what it had running before."""

    sig: signal.Signals
    code: int  # its exit status after the signal
    mark: str
    bench: subprocess.Popen
    before: list[Proc] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)

    def record(self) -> bool:
        """Once its servers run: its process tree, its executors' and their ports (False:
        not yet)."""
        up = serving(self.bench)
        if up is None:
            return False
        self.before = [p for root in (self.bench.pid, *up[2]) for p in tree(root)]
        self.ports = [up[0], *up[1]]
        return True

    def left(self) -> list[str]:
        """What is still there of it: a process (recorded, or carrying its mark) or an
        answering port."""
        procs = {p.pid: p for p in [*self.before, *marked(self.mark)] if p.alive()}
        return [f"{p.pid}: {p.cmdline[:120]}" for p in procs.values()] + [
            f"port {port} answers" for port in self.ports if answers(port)
        ]

    def kill_all(self) -> None:
        """A failed run leaves nothing either (only processes of this run: its mark)."""
        for proc in [*tree(self.bench.pid), *self.before, *marked(self.mark)]:
            if proc.alive():
                os.kill(proc.pid, signal.SIGKILL)
        self.bench.wait()


SIGNALS = {signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGINT: 130, signal.SIGKILL: -9}


def test_bench_load_stopped_mid_run_leaves_nothing_running(tmp_path: Path) -> None:
    """One run per signal, all at once (their start-ups overlap, the suite waits for one)."""
    runs = []
    try:
        for sig, code in SIGNALS.items():
            mark = uuid.uuid4().hex
            runs.append(Run(sig, code, mark, bench_load(tmp_path / sig.name, mark)))
        for run in runs:
            wait_for(
                f"bench load ({run.sig.name} run): its gateway, executor and workers running",
                run.record,
                detail=lambda run=run: describe(tree(run.bench.pid)),
            )
            commands = " | ".join(p.cmdline for p in run.before)
            assert " serve " in commands and "retouch.runtime.executor" in commands, commands
            # bench, gateway, executor, its 2 workers (and their fork server)
            assert len(run.before) >= 5, describe(run.before)
            assert all(answers(port) for port in run.ports), run.ports
        stopped = time.monotonic()
        for run in runs:
            os.kill(run.bench.pid, run.sig)
        wait_for(
            f"nothing of any bench load left {STOP_S:.0f} s after its signal",
            lambda: all(run.bench.poll() is not None and not run.left() for run in runs),
            STOP_S,
            0.2,
            detail=lambda: {r.sig.name: (r.bench.poll(), r.left()) for r in runs},
        )
        print(f"all gone {time.monotonic() - stopped:.1f} s after the signals")
        assert {r.sig: r.bench.returncode for r in runs} == SIGNALS
    finally:
        for run in runs:
            run.kill_all()
