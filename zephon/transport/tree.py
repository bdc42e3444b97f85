"""The process tree of a supervised child: process groups, the child subreaper, descendants.

What this module owns:

- :func:`signal_group` / :func:`group_alive`: signal a whole process group and ask
  whether any member of it is still alive (zombies do not count: they are dead,
  only not yet reaped by whoever is their parent now).
- :func:`become_subreaper`: ``prctl(PR_SET_CHILD_SUBREAPER)`` through ctypes (Linux
  only; a no-op returning False elsewhere). A subreaper receives the orphaned
  descendants of its subtree instead of init, so a job worker still sees the
  double-forked daemon a subject left behind.
- :func:`descendants` / :func:`end_descendants`: every live process below a pid
  (read from ``/proc``), and ending them all (or all but some subtrees kept):
  SIGTERM, a grace, SIGKILL, then reaping the ended ones that became this
  process's zombies.

A process group id is not reused while any member of the group exists, so
signalling the group of a worker that has already exited reaches exactly the
processes it left behind (or nobody: ``ProcessLookupError``).

Standard library only; Linux gives the full behaviour, other POSIX systems the
process-group part.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import time

__all__ = [
    "become_group_leader",
    "become_subreaper",
    "descendants",
    "end_descendants",
    "group_alive",
    "live_groups",
    "signal_group",
]

_PR_SET_CHILD_SUBREAPER = 36
_HAS_PROC = os.path.isdir("/proc/self")


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; True when the group had a member."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _proc_table() -> list[tuple[int, int, int, str]]:
    """(pid, ppid, pgid, state) of every process in /proc."""
    rows = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        rows.append((int(entry), int(fields[1]), int(fields[2]), fields[0]))
    return rows


def group_alive(pgid: int) -> bool:
    """True while process group ``pgid`` has a member that is not a zombie."""
    if not _HAS_PROC:
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    return any(g == pgid and state != "Z" for _, _, g, state in _proc_table())


def live_groups(groups, until: float, poll_s: float = 0.01) -> list[int]:
    """Wait until no group in ``groups`` has a live member, or the monotonic time ``until``.

    Returns:
        The groups that still have a live member (empty when all are gone).
    """
    live = list(groups)
    while live:
        live = [g for g in live if group_alive(g)]
        if not live or time.monotonic() >= until:
            break
        time.sleep(poll_s)
    return live


def become_group_leader() -> bool:
    """Make this process the leader of a new process group; True when it is one."""
    try:
        os.setpgid(0, 0)
        return True
    except OSError:
        return False


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux); True when it is one."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _has_no_children(pid: int) -> bool:
    """True when /proc says ``pid`` has no child at all (False when it cannot tell)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        for tid in tids:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                if fh.read().strip():
                    return False
        return True
    except OSError:
        return False


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, pgid, state) of ``pid`` from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().decode(errors="replace").rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[2]), fields[0]


def _children(pid: int) -> list[int] | None:
    """Direct children of ``pid`` from its threads' /proc ``children`` files (None when
    the kernel has none: then the whole process table is read)."""
    try:
        out: list[int] = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                out.extend(int(c) for c in fh.read().split())
        return out
    except FileNotFoundError:
        return None if not os.path.exists(f"/proc/{pid}") else []
    except OSError:
        return []


def _subtree(pid: int, keep) -> list[tuple[int, int, str]] | None:
    """(pid, pgid, state) of every process below ``pid`` except the subtrees of ``keep``,
    walking only that subtree (its cost does not grow with the rest of the machine)."""
    top = _children(pid)
    if top is None:
        return None
    out, todo = [], [c for c in top if c not in keep]
    while todo:
        p = todo.pop()
        st = _stat(p)
        if st is None:
            continue
        out.append((p, st[1], st[2]))
        kids = _children(p) or []
        todo.extend(c for c in kids if c not in keep)
    return out


def descendants(pid: int, keep=(), *, outside_group: int | None = None) -> list[int]:
    """Live (non-zombie) processes below ``pid``, read from /proc (empty without it);
    the pids in ``keep`` and everything below them are left out, and with
    ``outside_group`` only those whose process group is not that one are listed."""
    if not _HAS_PROC or _has_no_children(pid):
        return []
    rows = _subtree(pid, keep)
    if rows is None:  # no children files: the whole table
        table = _proc_table()
        children: dict[int, list[int]] = {}
        info = {}
        for p, ppid, pgid, st in table:
            children.setdefault(ppid, []).append(p)
            info[p] = (pgid, st)
        rows, todo = [], [p for p in children.get(pid, ()) if p not in keep]
        while todo:
            p = todo.pop()
            rows.append((p, *info[p]))
            todo.extend(c for c in children.get(p, ()) if c not in keep)
    return [p for p, pgid, st in rows
            if st != "Z" and (outside_group is None or pgid != outside_group)]


def _reap(pids) -> None:
    """Reap those of ``pids`` that are this process's exited children (orphans a
    subreaper adopted included); a pid that is not our child is skipped."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def end_descendants(grace: float, keep=(), *, outside_group: int | None = None,
                    reap: bool = True) -> None:
    """End every descendant of this process except ``keep`` and their subtrees (with
    ``outside_group``: only those that left that process group): SIGTERM, up to
    ``grace`` seconds for them to go, SIGKILL to what is left (and to what they started
    meanwhile). With ``reap``, the ended processes that were our children are reaped,
    by pid; without it they stay zombies for whoever owns them (a ``Popen`` object of
    the caller must still be able to wait for its child)."""
    me = os.getpid()

    def left() -> list[int]:
        return descendants(me, keep, outside_group=outside_group)

    pids = left()
    if not pids:
        return
    ended = set(pids)
    for pid in pids:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if reap:
            _reap(ended)
        pids = left()
        if not pids:
            return
        ended.update(pids)
        time.sleep(0.01)
    for _ in range(3):
        pids = left()
        if not pids:
            break
        ended.update(pids)
        for pid in pids:
            _kill(pid, signal.SIGKILL)
        time.sleep(0.01)
        if reap:
            _reap(ended)
    if reap:
        _reap(ended)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
