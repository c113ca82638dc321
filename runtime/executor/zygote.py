"""A warm template for executor processes: the imports paid once, each executor forked.

An executor process imports torch, diffusers and its own code before it can serve: 7-8 s
of CPU on a 2-core machine, on the path of every start (a gateway's first deploy, a
scale-up, a replacement for a dead executor). The zygote (``python -m
retouch.runtime.executor.zygote --socket PATH``) imports all of that once, then forks an
executor per request from gateways on the same machine (``retouch serve --executor-zygote
PATH``): a start costs milliseconds of CPU and shares the imported pages copy-on-write, as
Android's zygote does for apps and CPython's fork server does for the pre/post workers.

The protocol, one Unix-socket connection per executor: the gateway sends one JSON line
(``argv``, ``env``, ``log``, ``cwd``); the zygote answers ``{"pid": N}`` (or ``{"error":
...}``) and, once the executor has ended, ``{"exit": code}`` (negative: the signal, as
``subprocess`` reports it). The connection is the executor's lifeline: when the gateway
closes it or dies, the zygote sends the executor SIGTERM (a gateway's executors never
outlive it); when the zygote dies, its executors see their parent gone (``--exit-with-parent
0``) and stop, and the zygote stops when the process that started it is gone, sending its
children SIGTERM.

The loop (:class:`Zygote`, :func:`run_zygote`) forks any command whose ``main`` it was
given: the tests fork their gateways from a zygote of the ``retouch`` command
(``tests/gatewayzygote.py``).

Forking is only safe from a single-threaded process that has computed nothing: the zygote
runs one thread and never calls into torch. Variables read when torch and its libraries
load (``IMPORT_ENV``) cannot change in a fork: a request whose values differ is refused,
and the gateway starts that executor as a fresh process. CPU executors only: CUDA
executors are started fresh (their workers are spawned; see ``runtime/forkserver.py``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Variables read as torch, MKL, OpenMP, Python and the Hugging Face libraries load (the hub
# cache and offline mode are constants from then on): fixed in a fork.
IMPORT_ENV = ("ATEN_", "MKL_", "OMP_", "KMP_", "DNNL_", "ONEDNN_", "PYTORCH_", "TORCH_",
              "PYTHON", "LD_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DIFFUSERS_", "XDG_",
              "HOME")  # fmt: skip
# ...except those read on each use, which the forked executor takes from its request's env
# (Ray's driver sets PYTHONBREAKPOINT in every process that calls ``ray.init``).
READ_ON_USE = frozenset({"PYTHONBREAKPOINT"})
REAP_S = 0.1  # how often ended executors are reaped and reported


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` that is fixed once torch is imported (``IMPORT_ENV``)."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_ENV) and k not in READ_ON_USE}


@dataclass
class _Child:
    pid: int
    conn: socket.socket | None  # None once the gateway closed it


@dataclass
class Zygote:
    """The zygote's loop: accepts requests, forks, reaps, reports (one thread, no torch).
    Each child runs ``entry`` (a command's ``main``) on its request's ``argv``: here the
    executor's; the tests fork their gateways from another zygote with the ``retouch``
    command's (``tests/gatewayzygote.py``)."""

    listener: socket.socket
    parent: int  # the process that started the zygote: it stops when that one is gone
    entry: Callable[[list[str]], None]  # the command each child runs, imported already
    child_argv0: str  # the children's sys.argv[0]
    children: dict[int, _Child] = field(default_factory=dict)
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)

    def serve(self) -> None:
        """Until the starter is gone; whatever ends it (SIGTERM's ``SystemExit`` too),
        its children are sent SIGTERM on the way out."""
        self.selector.register(self.listener, selectors.EVENT_READ)
        try:
            while os.getppid() == self.parent:
                for key, _ in self.selector.select(REAP_S):
                    if key.fileobj is self.listener:
                        conn, _ = self.listener.accept()
                        self._request(conn)
                    else:
                        self._lifeline(key.fileobj, key.data)  # type: ignore[arg-type]
                self._reap()
            log.info("the process that started the zygote is gone")
        finally:
            for child in self.children.values():
                _signal(child.pid, signal.SIGTERM)

    def _request(self, conn: socket.socket) -> None:
        try:
            request = json.loads(_read_line(conn))
            refused = self._refusal(request)
            if refused:
                conn.sendall(json.dumps({"error": refused}).encode() + b"\n")
                conn.close()
                return
        except (OSError, ValueError) as exc:
            conn.close()
            log.warning("a bad request to the zygote: %s", exc)
            return
        pid = os.fork()
        if pid == 0:
            self._become(request, conn)
        self.children[pid] = _Child(pid, conn)
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:  # the starter left mid-request: its child goes too
            self._let_go(conn, pid)
            return
        self.selector.register(conn, selectors.EVENT_READ, pid)

    @staticmethod
    def _refusal(request: dict[str, Any]) -> str:
        """Why a request cannot be forked ("" when it can)."""
        if not isinstance(request.get("argv"), list) or not isinstance(request.get("env"), dict):
            return "a request names argv (a list) and env (an object)"
        differs = sorted(
            set(import_env(request["env"]).items()) ^ set(import_env(dict(os.environ)).items())
        )
        if differs:
            return f"{differs[0][0]} differs from the zygote's (fixed once torch is imported)"
        return ""

    def _lifeline(self, conn: socket.socket, pid: int) -> None:
        """The starter closed its connection (it stopped, or died): its child stops."""
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        if data:
            return  # nothing is expected from the starter after its request
        self.selector.unregister(conn)
        self._let_go(conn, pid)

    def _let_go(self, conn: socket.socket, pid: int) -> None:
        """``pid``'s starter is gone: SIGTERM it; its exit is reaped, reported to nobody."""
        conn.close()
        child = self.children.get(pid)
        if child is not None:
            child.conn = None
            _signal(pid, signal.SIGTERM)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None or child.conn is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):
                child.conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
            self.selector.unregister(child.conn)
            child.conn.close()

    def _become(self, request: dict[str, Any], conn: socket.socket) -> None:
        """In the forked child: the command's own process from here on; never returns."""
        code = 1
        try:
            self.selector.close()
            self.listener.close()
            conn.close()
            for other in self.children.values():
                if other.conn is not None:
                    other.conn.close()
            for sig in (signal.SIGTERM, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            _redirect(request.get("log"))
            os.chdir(request.get("cwd") or os.getcwd())
            os.environ.clear()
            os.environ.update(request["env"])
            logging.root.handlers.clear()  # the command configures its own logging
            sys.argv = [self.child_argv0, *request["argv"]]
            self.entry(request["argv"])
            code = 0
        except SystemExit as exc:  # as the interpreter ends on it: a message goes to stderr
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            if isinstance(exc.code, str):
                sys.stderr.write(f"{exc.code}\n")
        except BaseException:
            traceback.print_exc()
        finally:
            try:  # nothing may unwind from here into the zygote's own code
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the executor is ending
                atexit._run_exitfuncs()  # what a normal interpreter exit would run
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)


def _read_line(conn: socket.socket, limit: int = 1 << 20) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk or len(data) > limit:
            raise ValueError("the request ended before its newline")
        data += chunk
    return data


def _redirect(path: str | None) -> None:
    """stdout and stderr to the executor's log file (appended), stdin from /dev/null."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def run_zygote(
    name: str,
    argv: list[str] | None,
    load: Callable[[], Callable[[list[str]], None]],
    child_argv0: str,
) -> None:
    """The zygote command ``name`` (``--socket PATH [--ready-file PATH]``): ``load()``
    imports the command its children run and returns its ``main``; then each request on
    the socket (this user's only) forks a child running it as ``child_argv0``, until the
    starter is gone or SIGTERM comes."""
    parser = argparse.ArgumentParser(prog=name)
    parser.add_argument("--socket", type=Path, required=True, help="the Unix socket to serve")
    parser.add_argument("--ready-file", type=Path, help="written once the imports are done")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("RETOUCH_LOG_LEVEL", "INFO"))
    parent = os.getppid()  # before the imports: a starter gone meanwhile is seen
    entry = load()
    args.socket.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(args.socket))
    listener.listen(64)
    os.chmod(args.socket, 0o600)  # this user's processes only
    if args.ready_file is not None:
        args.ready_file.write_text(str(os.getpid()))
    log.info("%s ready on %s (pid %d)", name, args.socket, os.getpid())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        Zygote(listener, parent, entry, child_argv0).serve()
    finally:
        listener.close()
        args.socket.unlink(missing_ok=True)


def _executor_main() -> Callable[[list[str]], None]:
    from retouch.runtime.executor.main import main  # every executor's imports

    return main


def main(argv: list[str] | None = None) -> None:
    run_zygote("retouch-executor-zygote", argv, _executor_main, "retouch-executor")


if __name__ == "__main__":
    main()
