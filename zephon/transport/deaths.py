"""The death detector: one thread that notices, as it happens, that a supervised child exited.

Owned by :mod:`zephon.transport.supervisor` (it watches :class:`~.supervisor.Child`
objects) and used by both faces: the pipeline's
:class:`~zephon.transport.pool.WorkerPool` and the jobs process backend
(:mod:`zephon.jobs.process`). What a death *means* stays with them (a pool
re-dispatches the dead worker's tasks, a job run judges the subject it was
running); noticing it, reaping it and waking whoever waits is done here, once.

What it guarantees
------------------
- **Every exit is seen, promptly.** The thread waits on the sentinels of the
  children it watches (woken the moment one exits) and, every
  :data:`~.supervisor.DEATH_POLL_S`, asks the kernel for the exit status of each
  one still live (``waitpid(WNOHANG)``): a process the child forked inherits the
  write end of its sentinel pipe and holds it open, so a sentinel alone can miss
  a death for as long as that grandchild lives.
- **One waitpid at a time.** Reaping goes through :meth:`Child.exitcode
  <.supervisor.Child.exitcode>`, which holds the child's own lock: the detector,
  ``stop_children`` and an owner's loop never race for a status (a lost race
  means ``ECHILD`` and a death never reported).
- **Everyone waiting wakes.** A death is queued as a :class:`Death` (take them
  with :meth:`DeathWatch.take`), and a byte is written to the detector's wake-up
  pipe (:meth:`DeathWatch.fileno`, for a loop that waits in ``select`` on its
  channels: the pool's ``get()``, the jobs loop); a death that is a crash (the
  child was not ``stopped`` by its owner) also sets an event
  (:meth:`DeathWatch.wait`, for threads with nothing else to wait on) and is kept
  in :meth:`DeathWatch.crashed` (slot -> exit code).
- **A crash is logged when it happens** (with ``logger``): "worker 1 (pid 4321)
  of pool 'p' exited by signal SIGKILL", even while nobody waits.
- **A stopped child is never a crash.** Its exit is queued (``stopped=True``:
  the jobs backend waits for the workers it stopped), never logged, never sets
  the event. The owner marks a child stopped before it sends STOP or a signal.

How a death is handled
----------------------
======================  ===========================================================
question                answer
======================  ===========================================================
how a death is seen     sentinels, plus the exit status of every live child each
                        :data:`~.supervisor.DEATH_POLL_S`
who is woken            the wake-up pipe always; the event for a crash
who reaps               anyone, through the child's lock
a stopped child         reported as ``stopped``; the others stay watched
exit status             the raw code; the owner interprets it
what it sent before     read by the owner without blocking
======================  ===========================================================

Exit status: :attr:`Death.exitcode` is multiprocessing's (negative: the signal);
:meth:`Death.describe` words it the same way for both faces. Any exit of a child
its owner did not stop is a crash, 0 included (a worker never leaves by itself).
Reading a SIGKILL of a busy job worker as the kernel's OOM killer is the jobs
policy (``oom_backoff``); a pool re-dispatches whatever the cause.

The rest of a dead child's process group is its owner's to end: the
pool SIGKILLs it when it reports the crash (what the worker's op started serves
nobody once it is gone), the jobs backend SIGTERMs it and SIGKILLs it after
``graceful_shutdown_sec`` (the grace ``RunPolicy`` promises a subject's
processes). What the child sent before it died is already in its channel: owners
read it without blocking before they report the death (waiting for an EOF could
be forever: a grandchild may hold the child's end open).

Lifecycle: ``DeathWatch(where)``; :meth:`~DeathWatch.watch` each child once it
is started (the thread starts with the first); :meth:`~DeathWatch.close` stops
the thread, after which nothing is reported (an owner closes it first thing in
its own shutdown, so children it is stopping are never crashes).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Hashable
from multiprocessing.connection import wait
from typing import NamedTuple

from zephon.transport.supervisor import DEATH_POLL_S, Child, exit_text

__all__ = ["Death", "DeathWatch", "death_text"]

#: How long ``close()`` waits for the detector thread to finish.
_JOIN_S = 5.0


class Death(NamedTuple):
    """One child's exit, as the detector saw it.

    Attributes:
        slot: the owner's label of the child (its slot index in a pool or backend).
        child: the child.
        exitcode: its exit code (negative: the signal that killed it).
        stopped: its owner had stopped it: an expected exit, not a crash.
    """

    slot: Hashable
    child: Child
    exitcode: int | None
    stopped: bool

    @property
    def pid(self) -> int:
        return self.child.pid

    @property
    def signal(self) -> int | None:
        """The signal that killed the child (None: it exited with a code)."""
        return -self.exitcode if self.exitcode is not None and self.exitcode < 0 else None

    def describe(self, where: str) -> str:
        """The death in words, the same for every owner.

        Example: ``"worker 1 (pid 4321) of pool 'p' died by signal SIGKILL"``.
        """
        return death_text(self.slot, self.pid, where, self.exitcode)


def death_text(slot: Hashable, pid: int, where: str, exitcode: int | None) -> str:
    """How every crash report starts, whichever face: which worker, which pid, of what,
    how it died.

    Examples:
        >>> death_text(1, 4321, "pool 'p'", -9)
        "worker 1 (pid 4321) of pool 'p' died by signal SIGKILL"
    """
    return f"worker {slot} (pid {pid}) of {where} died by {exit_text(exitcode)}"


class DeathWatch:
    """Watches children and reports each exit once (see the module docstring).

    Args:
        where: what the children belong to, for the log ("pool 'p'").
        logger: where crashes are logged as they happen (None: not logged).
    """

    def __init__(self, where: str, logger: logging.Logger | None = None) -> None:
        self.where, self.logger = where, logger
        self._lock = threading.Lock()
        self._watched: dict[Child, Hashable] = {}
        self._queue: list[Death] = []
        self._crashed: dict[Hashable, int | None] = {}
        self._event = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # a death: for owners that select
        self._ctl_r, self._ctl_w = os.pipe()  # a new child, or close(): for the thread
        for fd in (self._wake_r, self._wake_w, self._ctl_r, self._ctl_w):
            os.set_blocking(fd, False)
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- owner side ----------------------------------------------------------------------
    def watch(self, slot: Hashable, child: Child) -> None:
        """Watch ``child`` (labelled ``slot``) until it exits."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the death watch of {self.where} is closed")
            self._watched[child] = slot
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"zephon-deaths-{self.where}")
                self._thread.start()
            _poke(self._ctl_w)

    def take(self) -> list[Death]:
        """The exits seen since the last call, oldest first (each is returned once)."""
        with self._lock:
            deaths, self._queue = self._queue, []
        return deaths

    def crashed(self) -> dict[Hashable, int | None]:
        """Every crash seen so far: slot -> exit code (the latest per slot)."""
        with self._lock:
            return dict(self._crashed)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until some child crashed (or ``timeout``); True once one has."""
        return self._event.wait(timeout)

    def fileno(self) -> int:
        """A descriptor that turns readable when an exit is queued (clear with
        :meth:`clear_wake`)."""
        return self._wake_r

    def clear_wake(self) -> None:
        """Read the wake-up pipe empty (the exits themselves stay queued for :meth:`take`)."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    @property
    def running(self) -> bool:
        """True while the detector thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stop watching (idempotent): once this returns nothing more is reported."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            _poke(self._ctl_w)
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)
        with self._lock:  # a thread that outlived the join writes to -1, never a reused fd
            fds = (self._wake_r, self._wake_w, self._ctl_r, self._ctl_w)
            self._wake_r = self._wake_w = self._ctl_r = self._ctl_w = -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    # -- the detector thread -------------------------------------------------------------
    def _run(self) -> None:
        muted: set[Child] = set()  # sentinel readable, status not yet: rely on the poll
        while True:
            with self._lock:
                if self._closed:
                    return
                watched, ctl = dict(self._watched), self._ctl_r
            sentinels = [c.process.sentinel for c in watched if c not in muted]
            try:
                ready = wait([ctl, *sentinels], timeout=DEATH_POLL_S)
            except (OSError, ValueError):  # closed under the wait
                return
            if ctl in ready:
                _drain(ctl)
            for child, slot in watched.items():
                code = child.exitcode  # waitpid(WNOHANG), under the child's lock
                if code is None:
                    if child.process.sentinel in ready:
                        muted.add(child)  # another reaper is mid-way: the poll will see it
                    continue
                muted.discard(child)
                self._report(Death(slot, child, code, child.stopped))

    def _report(self, death: Death) -> None:
        with self._lock:
            if self._closed:
                return
            self._watched.pop(death.child, None)
            self._queue.append(death)
            if not death.stopped:
                self._crashed[death.slot] = death.exitcode
            _poke(self._wake_w)
        if not death.stopped:
            self._event.set()
            if self.logger is not None:
                self.logger.error("worker %s (pid %s) of %s exited by %s", death.slot,
                                  death.pid, self.where, exit_text(death.exitcode))


def _poke(fd: int) -> None:
    if fd < 0:
        return
    try:
        os.write(fd, b"\0")
    except OSError:
        pass  # already awake (the pipe is full), or closed


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
