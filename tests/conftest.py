"""Suite-wide guards.

At the end of the session the suite fails if it left anything behind: a new
zephon segment in /dev/shm (a name with the arena's ``SEGMENT_PREFIX``; what
other programs on the machine create and remove meanwhile is theirs), or a live
child process of the pytest process. Tests that start processes or create
segments must clean up even when they fail; this is the net that catches the
ones that do not.
"""

from __future__ import annotations

import os

import pytest

SHM_DIR = "/dev/shm"


def zephon_shm_entries() -> set[str]:
    """The names in /dev/shm that zephon's arena made (another program's are not ours)."""
    from zephon.transport.arena import SEGMENT_PREFIX

    try:
        return {e for e in os.listdir(SHM_DIR) if e.startswith(SEGMENT_PREFIX)}
    except FileNotFoundError:
        return set()


# multiprocessing's own helpers live as long as the interpreter (spawn starts the
# resource tracker on first use) and exit when it does: not leftovers of a test.
_INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def live_children(pid: int | None = None) -> list[tuple[int, str]]:
    """(pid, command line) of every live, non-zombie child of ``pid`` (default: us),
    multiprocessing's interpreter-lifetime helpers excepted."""
    pid = os.getpid() if pid is None else pid
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        # Fields after the parenthesised command name: state, ppid, ...
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z" and not any(h in cmd for h in _INTERPRETER_HELPERS):
            out.append((int(entry), cmd))
    return out


def pytest_sessionstart(session):
    session.config._zephon_shm_before = zephon_shm_entries()


def pytest_sessionfinish(session, exitstatus):
    import gc
    import multiprocessing
    import time

    gc.collect()  # pipelines dropped inside reference cycles close their pools here
    deadline = time.monotonic() + 10.0
    while live_children() and time.monotonic() < deadline:
        multiprocessing.active_children()  # reaps children that finished exiting
        time.sleep(0.1)
    before = getattr(session.config, "_zephon_shm_before", set())
    leaked = sorted(zephon_shm_entries() - before)
    children = live_children()
    if leaked or children:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = []
        if leaked:
            lines.append(f"zephon /dev/shm segments created by the suite and left behind: "
                         f"{leaked}")
        if children:
            lines.append(f"child processes still alive after the suite: {children}")
        for line in lines:
            if reporter is not None:
                reporter.write_line(f"LEAK: {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def clusters():
    """The session's Ray clusters (``tests/_ray_clusters.py``); Ray's tests skip without
    it, so this is only made where Ray is installed."""
    from _ray_clusters import RayClusters

    c = RayClusters()
    yield c
    c.close()
