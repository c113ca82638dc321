"""A process forked by a zygote (``runtime/executor/zygote.py``): an executor by the
executor zygote, or a test's gateway by the tests' (``tests/gatewayzygote.py``), handled as
a ``subprocess.Popen`` is: ``pid``, ``poll()``, ``wait()``, ``terminate()``, ``kill()``,
``send_signal()``, ``returncode``.

The zygote, not this process, is the child's parent, so its end is learnt from the
zygote: one Unix-socket connection per child carries the request, the pid, and at the end
the exit code. Holding the connection open is what keeps the child alive: closing it (this
process ends, even by SIGKILL) makes the zygote stop the child. Torch-free: the gateway
imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import threading
import time
from pathlib import Path

CONNECT_TIMEOUT_S = 5.0
READ_SLICE_S = 0.5  # the longest a blocking read holds the handle


class ZygoteRefused(Exception):
    """The zygote cannot fork this process (it is absent, or an import-time variable of
    the request differs from its own): start a fresh process instead."""


class ForkedProcess:
    """A Popen-like handle on a process a zygote forked (see the module docstring)."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn = conn
        self.pid = pid
        self.returncode: int | None = None
        self._buffer = b""
        self._orphaned = False  # the zygote went away before reporting an exit
        # One reader at a time: a Ray actor's threads wait() and stop() on one handle. A
        # blocking read waits in slices (select), never holding it for long.
        self._reading = threading.Lock()

    @classmethod
    def start(
        cls,
        zygote: Path,
        argv: list[str],
        env: dict[str, str],
        log_path: Path,
        parent_flag: str | None = None,
    ) -> ForkedProcess:
        """Ask the zygote at ``zygote`` to fork a process with ``argv`` and ``env``,
        writing to ``log_path``; :class:`ZygoteRefused` when it cannot. ``parent_flag``:
        a flag the child takes the pid of the parent it watches from (``retouch serve
        --exit-with-parent PID``), given the zygote's, which only the connection tells."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(CONNECT_TIMEOUT_S)
        try:
            conn.connect(str(zygote))
            if parent_flag is not None:
                argv = [*argv, parent_flag, str(_peer_pid(conn))]
            request = {"argv": argv, "env": env, "log": str(log_path), "cwd": os.getcwd()}
            conn.sendall(json.dumps(request).encode() + b"\n")
            answer = cls._line(conn, b"")[0]
        except (OSError, ValueError) as exc:
            conn.close()
            raise ZygoteRefused(f"zygote at {zygote}: {exc}") from exc
        if "pid" not in answer:
            conn.close()
            raise ZygoteRefused(f"zygote at {zygote}: {answer.get('error', answer)}")
        conn.setblocking(False)
        return cls(conn, int(answer["pid"]))

    @staticmethod
    def _line(conn: socket.socket, buffer: bytes) -> tuple[dict, bytes]:
        """One JSON line from ``conn`` (blocking as the socket is), and what follows it."""
        while b"\n" not in buffer:
            chunk = conn.recv(4096)
            if not chunk:
                raise ValueError("the zygote closed the connection")
            buffer += chunk
        line, _, rest = buffer.partition(b"\n")
        return json.loads(line), rest

    def poll(self) -> int | None:
        """The exit code once the child has ended, else None (never blocks: the
        gateway's event loop calls it)."""
        if self.returncode is None and not self._orphaned:
            self._read(block=False)
        if self.returncode is None and self._orphaned and not _exists(self.pid):
            self.returncode = -signal.SIGTERM  # it stopped itself: its parent is gone
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, waiting up to ``timeout`` seconds (``TimeoutError`` after it, as
        ``subprocess.TimeoutExpired`` is one)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"process {self.pid} still running after {timeout} s")
            if self._orphaned:
                time.sleep(min(0.1, left if left is not None else 0.1))
            else:
                self._read(block=True, timeout=left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """``sig`` to the child unless its end has been reported (polled first: the
        zygote reaps an ended child at once, and its pid may be reused)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, block: bool, timeout: float | None = None) -> None:
        """Take what the zygote sent; ``block``: wait for it up to ``timeout`` (at most
        ``READ_SLICE_S``, the caller loops). Without ``block`` it never waits, not even for
        another thread's read (the gateway's event loop polls)."""
        if not self._reading.acquire(blocking=block):
            return
        try:
            if self.returncode is not None or self._orphaned:
                return
            if block:
                wait = READ_SLICE_S if timeout is None else max(0.0, min(timeout, READ_SLICE_S))
                if not select.select([self._conn], [], [], wait)[0]:
                    return
            try:
                chunk = self._conn.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:  # the zygote is gone without a word: its child stops by itself
                self._orphaned = True  # (``--exit-with-parent 0``): poll() watches the pid
                self._conn.close()
                return
            self._buffer += chunk
            if b"\n" in self._buffer:
                message, self._buffer = self._line(self._conn, self._buffer)
                self._ended(int(message.get("exit", 1)))
        finally:
            self._reading.release()

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._conn.close()


def _peer_pid(conn: socket.socket) -> int:
    """The pid of the process at the other end of a connected Unix socket (Linux's
    ``SO_PEERCRED``: pid, uid, gid)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def _exists(pid: int) -> bool:
    """Whether ``pid`` still runs (an orphan's zombie is reaped by init at once)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
