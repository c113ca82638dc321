"""The CPU workers' fork server, forked from the executor instead of started afresh.

CPU pre/post workers fork from :mod:`multiprocessing`'s fork server, which by default is a
new interpreter that imports torch, diffusers and the worker's code (``set_forkserver_preload``):
about 4-5 s of CPU and 3-4 s of wall time on every executor start, on the path of the first
deploy. The executor has imported all of that already. :func:`fork_from_here`, called
before the executor starts any thread, forks the executor into that fork server, so it
starts in milliseconds holding the same modules (shared pages, copy-on-write).

It relies on how CPython's ``multiprocessing.forkserver`` starts its server (the
``main(listener_fd, alive_r, preload, ...)`` entry point and the ``ForkServer`` fields that
``ensure_running`` sets); where that differs (other Python versions), nothing is done and
the fork server starts as usual. Never on CUDA: the workers are spawned there.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import threading
from multiprocessing import connection, forkserver, resource_tracker, util

log = logging.getLogger(__name__)

# forkserver.main's parameters where this works (CPython 3.8-3.12).
KNOWN_MAIN = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
FORK_SERVER_FIELDS = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_lock")


def supported() -> bool:
    """Whether this Python's fork server can be started by forking (see the module doc)."""
    server = getattr(forkserver, "_forkserver", None)
    return (
        list(inspect.signature(forkserver.main).parameters) == KNOWN_MAIN
        and server is not None
        and all(hasattr(server, name) for name in FORK_SERVER_FIELDS)
    )


def fork_from_here() -> bool:
    """Make this process's fork server a fork of this process; True when it did. Call it
    while this process has one thread: a fork copies only the calling thread, and locks
    other threads held would stay locked in the child."""
    if threading.active_count() > 1:
        log.warning("threads are running: the worker fork server starts as usual")
        return False
    if not supported():
        log.info("this Python's fork server cannot be forked; it starts as usual")
        return False
    server = forkserver._forkserver
    with server._lock:
        if server._forkserver_pid is not None:
            return False  # already running
        resource_tracker.ensure_running()  # as ensure_running: the workers share it
        listener = socket.socket(socket.AF_UNIX)
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server exits when every holder of alive_w has
        pid = os.fork()
        if pid == 0:  # the fork server: serves fork requests until this process is gone
            code = 0
            try:
                os.close(alive_w)
                forkserver.main(listener.fileno(), alive_r, [])
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(alive_r)
        listener.close()
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    log.info("worker fork server forked from this process (pid %d)", pid)
    return True
