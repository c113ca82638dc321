"""A real PostgreSQL server for the tests of the shared state store.

Debian's ``postgresql`` package (``make test`` installs it when missing, as root) gives
``initdb`` and ``postgres``; the server runs on a free loopback port with its data in a
fresh folder, trusting local connections. PostgreSQL refuses to run as root, so as root
the folder is handed to the ``postgres`` user and the server runs as that user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from retouch.platform.api.server import free_port
from tests.support import reap


def bin_dir() -> Path | None:
    """The newest installed PostgreSQL's programs, or None when none is installed."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _version(path: str) -> int:
    try:
        return int(Path(path).parts[-3])
    except ValueError:
        return 0


class PostgresServer:
    """``initdb`` + ``postgres`` in a temporary folder; :meth:`database` makes a fresh
    database and returns its URL."""

    def __init__(self, programs: Path) -> None:
        self.programs = programs
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="retouch-pg-"))
        self.root.chmod(0o755)
        self.data = self.root / "data"
        self.process: subprocess.Popen | None = None
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            self.data.mkdir()
            os.chown(self.data, user.pw_uid, user.pw_gid)
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    def start(self, timeout_s: float = 60.0) -> PostgresServer:
        subprocess.run(
            [*self._as, str(self.programs / "initdb"), "-D", str(self.data), "-U", "postgres",
             "--auth=trust", "--no-sync", "-E", "UTF8"],
            check=True, capture_output=True,
        )  # fmt: skip
        log = (self.root / "postgres.log").open("ab")
        self.process = subprocess.Popen(
            [*self._as, str(self.programs / "postgres"), "-D", str(self.data),
             "-p", str(self.port), "-k", str(self.root), "-c", "listen_addresses=127.0.0.1",
             "-c", "fsync=off", "-c", "max_connections=200"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready = subprocess.run(
                [str(self.programs / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                capture_output=True,
            )
            if ready.returncode == 0:
                return self
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"PostgreSQL did not start; see {self.root / 'postgres.log'}")

    def database(self) -> str:
        """A new empty database on the server: its URL."""
        import psycopg

        name = f"retouch_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            # "fast" shutdown (SIGTERM would wait for clients), sent to the server itself:
            # runuser, when it started it, does not pass signals on
            try:
                pid = int((self.data / "postmaster.pid").read_text().split()[0])
                os.kill(pid, signal.SIGINT)
            except (OSError, ValueError, IndexError):
                self.process.kill()
            reap(self.process)
        shutil.rmtree(self.root, ignore_errors=True)
