"""Process helpers shared by the tests that kill and watch real processes."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable

#: How long a test waits for something that should happen at once before it fails (a
#: hang guard on a shared, loaded machine, never a measure of speed).
HANG_S = 60.0


def live_processes() -> list[tuple[int, int, int, str]]:
    """(pid, process group, session, command line) of every live, non-zombie process
    (Linux /proc; one that vanishes while it is read is left out)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ProcessLookupError):
            continue
        if fields[0] != "Z":
            out.append((int(entry), int(fields[2]), int(fields[3]), cmd))
    return out


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, also while /proc is read
        return False


def wait_gone(pid_or_pids: int | Iterable[int], timeout: float) -> list[int]:
    """Wait until every pid is gone (dead, zombies included) or ``timeout`` seconds passed;
    returns the pids still alive (empty: all gone), so ``assert not wait_gone(...)``."""
    pids = [pid_or_pids] if isinstance(pid_or_pids, int) else list(pid_or_pids)
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if alive(p)]
    return left


def wait_until_blocked_in(thread: threading.Thread, function: str,
                          timeout: float = HANG_S) -> None:
    """Wait until ``thread`` is inside ``function`` (its Python stack says so): a barrier
    on where the thread really is, not a sleep."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
        while frame is not None:
            if frame.f_code.co_name == function:
                return
            frame = frame.f_back
        if not thread.is_alive():
            break
        time.sleep(0.005)
    raise AssertionError(f"{thread.name} never reached {function}()")
