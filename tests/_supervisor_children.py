"""Module-level child targets for tests/test_transport_supervisor.py (spawn imports them).

Each is called as ``target(channel, *args)`` by :meth:`zephon.transport.supervisor.Child.spawn`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from zephon.transport.remote_errors import encode_exception
from zephon.transport.supervisor import MsgKind, ignore_sigint, watch_parent
from zephon.transport.tree import become_group_leader


def never_ready(channel) -> None:
    """Never says READY and never reads its channel."""
    ignore_sigint()
    time.sleep(600)


def exits_at_once(channel, code: int) -> None:
    """Dies before the handshake with exit status ``code``."""
    os._exit(code)


def fails_setup(channel) -> None:
    """Reports a set-up failure instead of READY."""
    tb, blob = encode_exception(LookupError("no such model: 'tiny'"))
    channel.send({"k": MsgKind.FAIL, "tb": tb}, [blob])


def ignores_sigterm(channel) -> None:
    """Says READY, then ignores SIGTERM and STOP alike."""
    ignore_sigint()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel.send({"k": MsgKind.READY, "pid": os.getpid()})
    time.sleep(600)


def obeys_stop(channel) -> None:
    """Says READY and exits cleanly on STOP."""
    ignore_sigint()
    channel.send({"k": MsgKind.READY, "pid": os.getpid()})
    while True:
        header, _, _ = channel.recv()
        if header["k"] == MsgKind.STOP:
            return


def forks_grandchild(channel) -> None:
    """Leads its own process group, starts a long-lived grandchild in it, says READY with
    the grandchild's pid, and exits on STOP leaving the grandchild behind."""
    ignore_sigint()
    become_group_leader()
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    channel.send({"k": MsgKind.READY, "pid": os.getpid(), "grandchild": grandchild.pid})
    while True:
        header, _, _ = channel.recv()
        if header["k"] == MsgKind.STOP:
            os._exit(0)  # no clean-up of its own: the supervisor's group sweep must do it


def watches_parent(channel, parent_pid: int) -> None:
    """Says READY, then exits as soon as its parent is gone (never reads its channel)."""
    ignore_sigint()
    watch_parent(parent_pid, lambda: os._exit(0), poll_s=0.05)
    channel.send({"k": MsgKind.READY, "pid": os.getpid()})
    time.sleep(600)


def _orphaning_parent(pid_file: str, method: str) -> None:
    """Run as a script: start one ``watches_parent`` child (start method ``method``),
    write its pid, die abruptly."""
    import multiprocessing

    from zephon.transport.supervisor import Child, await_ready

    ctx = multiprocessing.get_context(method)
    child = Child.spawn(ctx, watches_parent, (os.getpid(),), name="zephon-test-orphan")
    await_ready({0: child}, 60.0, "the orphaning parent")
    with open(pid_file, "w") as fh:
        fh.write(str(child.pid))
    os._exit(0)  # no stop, no reap: the child must notice by itself


if __name__ == "__main__":
    _orphaning_parent(sys.argv[1], sys.argv[2])
