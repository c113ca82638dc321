"""The CPU workers' fork server forked from the executor: workers start from it holding the
executor's imports, and it goes away with the executor."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from retouch.runtime import forkserver

pytestmark = pytest.mark.skipif(not forkserver.supported(), reason="this Python's fork server")

SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, sys
    import numpy  # stands in for torch: imported before the fork, never by the child
    from retouch.runtime import forkserver

    def child(queue):
        queue.put((os.getppid(), "numpy" in sys.modules))

    if __name__ == "__main__":
        assert forkserver.fork_from_here()
        server_pid = multiprocessing.forkserver._forkserver._forkserver_pid
        assert not forkserver.fork_from_here()  # once
        context = multiprocessing.get_context("forkserver")
        queue = context.Queue()
        p = context.Process(target=child, args=(queue,))
        p.start()
        parent, has_numpy = queue.get(timeout=30)
        p.join(10)
        print(server_pid, parent, has_numpy, p.exitcode)
    """
)


def test_workers_fork_from_a_fork_of_this_process(tmp_path) -> None:
    script = tmp_path / "fork.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    server_pid, parent, has_numpy, exitcode = out
    assert parent == server_pid  # forked by the server this process forked
    assert has_numpy == "True" and exitcode == "0"  # holding this process's imports


def test_refuses_while_other_threads_run(tmp_path) -> None:
    script = tmp_path / "threads.py"
    script.write_text(
        "import threading, time\n"
        "from retouch.runtime import forkserver\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
        "print(forkserver.fork_from_here())\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False"
