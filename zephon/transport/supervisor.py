"""The supervisor: the one owner of zephon's child processes, from spawn to reap.

Both faces start processes through this module: the pipeline's
:class:`~zephon.transport.pool.WorkerPool` and the jobs process backend
(:mod:`zephon.jobs.process`). Their policies differ (a pool re-dispatches a
crashed worker's tasks, a job run judges timeouts and backs off on OOM); the
mechanics are here, once.

Lifecycle of a :class:`Child`
-----------------------------
1. **Start** (:meth:`Child.spawn`): a channel pair is made, the target runs in a
   ``mp_context`` process (spawn by default) as ``target(channel, *args)``,
   started with SIGINT blocked so that a Ctrl-C during the child's interpreter
   start-up stays pending (the child then ignores it: Ctrl-C to the process
   group is the parent's to handle). The parent closes its copy of the child's
   end at once. The target and its arguments travel as the channel's first
   message (parent to child), not in the spawn preparation data: a child that
   dies while spawn prepares it (a script re-run without its ``__main__`` guard
   exits there) never reads that data, and the parent, which keeps the read end
   of that pipe open, would block for ever writing arguments larger than a pipe
   holds (a worker's pickled stage program with its tokenizer). On the channel a
   dead child is an error on the write (ignored: its death is reported as every
   death is).
2. **Handshake**: the child's first message is READY (``{"k": "ready", "pid"}``)
   or FAIL (``{"k": "fail", "tb"}`` and the pickled exception) when it could not
   set itself up. :func:`await_ready` waits for a set of children within a
   deadline; :func:`handshake` reads one message for a caller that multiplexes
   start-up with other work. A child that dies before READY with
   :data:`~zephon.transport.spawn_guard.EXIT_UNGUARDED_MAIN` is reported as the
   missing ``__main__`` guard (:func:`startup_death_error`).
3. **Parent-death watch** (child side, :func:`watch_parent`): a daemon thread
   polls the parent pid every :data:`PARENT_POLL_S`; when it changes the child
   runs its clean-up (unlink its segments, kill its group) and exits. EOF on the
   channel means the same thing to a child blocked reading it.
4. **Stop -> terminate -> kill -> reap** (:func:`stop_children`): STOP to every
   child at once (or SIGTERM at once to a child that cannot read it), one shared
   grace of the :class:`ShutdownPolicy` while a ``drain`` callback reads and drops
   what they still send, SIGTERM to stragglers, ``terminate_wait_s``, SIGKILL,
   then every child is joined. A child that leads its own process group
   (``group=True``) is signalled with its whole group: the processes it started
   go with it. :func:`sweep_groups` then ends what is left of those groups
   (SIGTERM, the rest of the grace, SIGKILL) and waits until none of their
   members is alive; the child side ends descendants that left its group via
   :func:`~zephon.transport.tree.end_descendants` (it is a child subreaper).
   A policy that *abandons* (``shutdown_mode="immediate"``) skips the wait for a
   busy child: it is killed at once with its group and every descendant
   (:func:`kill_tree`), and so is an idle one that has not exited when the
   short grace ends. :func:`kill_children` skips every wait: SIGKILL to each
   child's tree and to every group, then the reaping (what an owner does when a
   second Ctrl-C cuts its graceful stop short).
5. **Deaths** (:mod:`zephon.transport.deaths`, owned here): one detector thread per
   owner notices every exit as it happens, reaps it, and wakes whoever waits (a
   ``select`` on its wake-up pipe, an event); its module docstring tables how a
   death is seen, who reaps it and how a stopped child is reported.
6. **Crash reports** (:func:`crash_error`): a child that died by itself becomes a
   :class:`~zephon.errors.WorkerCrashedError` with the worker's slot index
   (``worker``), its ``pid``, its exit signal and the ``tasks`` it had in flight,
   all constructor arguments (the error pickles with them). A child stopped by
   the supervisor (``Child.stopped``) is never reported as a crash.

Ctrl-C during a stop
--------------------
A stop is code that must run to its end or leave processes behind (a
multiprocessing child that is not a daemon is then joined for ever at
interpreter exit). :class:`InterruptGuard` (main thread; it changes nothing
where Python's own SIGINT handler is not installed) lets the first Ctrl-C inside
it raise ``KeyboardInterrupt`` as usual, so an owner can switch from its
graceful stop to :func:`kill_children`, and holds every later one until the
block ends, so that switch is never cut short in turn. Guards nest: the
innermost decides, an inner guard holds where its outer one holds, and what it
held goes to the outer one. A stop whose guard takes held Ctrl-Cs
(``take_held``) is cut short by a Ctrl-C that an outer guard held before the stop
began (:meth:`InterruptGuard.arm`): an owner that guards a whole loop holds a
second Ctrl-C that lands between the first one's raise and its stop, and the
stop then kills at once instead of the second being lost or skipping the stop.

Shutdown policy
---------------
One object, :class:`ShutdownPolicy`, says how long each step of 4 may take.
The public options map onto it: ``RuntimeOptions.shutdown_mode`` (pipelines,
:meth:`ShutdownPolicy.for_shutdown_mode`: immediate, hard or graceful) and ``RunPolicy.graceful_shutdown_sec``
(jobs, :meth:`ShutdownPolicy.for_grace`).

Message kinds (the ``"k"`` of every header) are the constants of
:class:`MsgKind`; every deadline and poll interval of the supervisor, the pool
and the jobs backend is a named constant here.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # the C module under signal
import dataclasses
import os
import pickle
import selectors
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from zephon.errors import TransportError, WorkerCrashedError
from zephon.transport.channel import ChannelClosed, channel_pair
from zephon.transport.remote_errors import decode_exception
from zephon.transport.spawn_guard import EXIT_UNGUARDED_MAIN, unguarded_main_error
from zephon.transport.tree import (
    become_group_leader,
    become_subreaper,
    descendants,
    end_descendants,
    live_groups,
    signal_group,
)

__all__ = [
    "DEATH_POLL_S",
    "EXITING_S",
    "EXIT_POLL_S",
    "GRACEFUL_S",
    "HANDSHAKE_POLL_S",
    "HARD_S",
    "HARD_TERMINATE_WAIT_S",
    "IMMEDIATE_S",
    "KILL_WAIT_S",
    "PARENT_POLL_S",
    "REAP_JOIN_S",
    "TERMINATE_WAIT_S",
    "Child",
    "InterruptGuard",
    "MsgKind",
    "ShutdownPolicy",
    "await_ready",
    "crash_error",
    "exit_text",
    "handshake",
    "ignore_sigint",
    "kill_children",
    "kill_tree",
    "lead_process_tree",
    "parent_changed",
    "startup_death_error",
    "stop_children",
    "sweep_groups",
    "wait_gone",
    "watch_parent",
]


class MsgKind:
    """The ``"k"`` value of every message header between a parent and its children.

    Plain strings (headers travel as msgpack), named once here.
    """

    READY: Final = "ready"      # child -> parent: set up, ready for work ({"pid"})
    FAIL: Final = "fail"        # child -> parent: could not set up ({"tb"} + exception)
    STOP: Final = "stop"        # parent -> child: finish the current task, clean up, exit
    TASK: Final = "task"        # parent -> child: one unit of work ({"id"})
    FREE: Final = "free"        # parent -> pool worker: arena regions given back
    RESULT: Final = "result"    # pool worker -> parent: a task's value
    ERROR: Final = "error"      # child -> parent: a task raised ({"id", "tb"})
    STARTED: Final = "started"  # job worker -> parent: a subject started ({"id", "t"})
    DONE: Final = "done"        # job worker -> parent: a subject returned ({"id", "d"})


#: How often a handshake wait wakes up to check its deadline (seconds).
HANDSHAKE_POLL_S: Final = 1.0
#: How often a child checks whether its parent is still the one that started it.
PARENT_POLL_S: Final = 0.5
#: How often the death detector (:mod:`zephon.transport.deaths`) asks the kernel for the
#: exit status of every child it watches (a sentinel a grandchild holds open never fires).
DEATH_POLL_S: Final = 0.25
#: How often a child known to be going is checked for exit.
EXIT_POLL_S: Final = 0.02
#: How long a parent waits to reap a child whose channel just closed.
REAP_JOIN_S: Final = 2.0
#: After SIGKILL: how long a child (or a process group) may take to disappear.
KILL_WAIT_S: Final = 5.0


#: ``shutdown_mode="immediate"`` (the default): how long an idle child told to STOP may
#: take to exit before it is killed (a busy one is killed at once, see
#: :attr:`ShutdownPolicy.abandon`).
IMMEDIATE_S: Final = 0.3
#: ``shutdown_mode="graceful"``: workers finish their current task.
GRACEFUL_S: Final = 10.0
#: ``shutdown_mode="hard"``: workers get half a second.
HARD_S: Final = 0.5
#: At interpreter exit nothing waits long on a worker.
EXITING_S: Final = 2.0
#: SIGTERM -> SIGKILL after a graceful stop.
TERMINATE_WAIT_S: Final = 2.0
#: SIGTERM -> SIGKILL after a hard stop or at interpreter exit.
HARD_TERMINATE_WAIT_S: Final = 0.2


@dataclasses.dataclass(frozen=True)
class ShutdownPolicy:
    """How long each step of stopping children may take.

    Attributes:
        grace_s: from STOP (or SIGTERM) until stragglers are terminated.
        terminate_wait_s: from SIGTERM to stragglers until SIGKILL.
        kill_wait_s: after SIGKILL, how long to wait for them to disappear.
        abandon: a child that is busy (cannot read STOP), or still alive at the end of
            the grace, is killed at once with its process tree (:func:`kill_tree`): what
            it is doing is not waited for.

    Examples:
        >>> ShutdownPolicy.for_shutdown_mode("hard").grace_s
        0.5
        >>> ShutdownPolicy.for_shutdown_mode("immediate").abandon
        True
        >>> ShutdownPolicy.for_grace(3.0).terminate_wait_s
        3.0
    """

    grace_s: float
    terminate_wait_s: float
    kill_wait_s: float = KILL_WAIT_S
    abandon: bool = False

    @classmethod
    def for_shutdown_mode(cls, mode: str, *, exiting: bool = False) -> "ShutdownPolicy":
        """The policy of a pipeline's ``RuntimeOptions.shutdown_mode``.

        Args:
            mode: ``"immediate"`` (busy children are killed at once with their process
                trees, idle ones get :data:`IMMEDIATE_S` to exit), ``"hard"`` or
                ``"graceful"``.
            exiting: at interpreter exit (shorter deadlines).
        """
        if mode == "immediate":
            return cls(IMMEDIATE_S, 0.0, abandon=True)
        if mode == "hard":
            return cls(HARD_S, HARD_TERMINATE_WAIT_S)
        if exiting:
            return cls(EXITING_S, HARD_TERMINATE_WAIT_S)
        return cls(GRACEFUL_S, TERMINATE_WAIT_S)

    @classmethod
    def for_grace(cls, grace_s: float) -> "ShutdownPolicy":
        """The policy of a job run's ``RunPolicy.graceful_shutdown_sec``: one grace from
        STOP (to an idle worker) or SIGTERM (to a busy one, which cannot read STOP) until
        SIGKILL; a timed-out subject's worker gets the same grace from SIGTERM to SIGKILL."""
        return cls(grace_s, 0.0)


def exit_text(exitcode: int | None) -> str:
    """A child's exit status in words: ``"signal SIGKILL"``, ``"exit code 3"``.

    Examples:
        >>> exit_text(-9)
        'signal SIGKILL'
    """
    if exitcode is None:
        return "an unknown cause"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


#: Child side: the pid of the process that started this one, noted first thing by
#: :func:`_spawned` (None in a process zephon did not start). Under ``spawn`` that is the
#: zephon parent; under ``forkserver`` it is ``multiprocessing``'s fork server, which
#: exits when the zephon parent does (its end of the server's alive pipe closes).
_STARTED_BY: int | None = None


def _leave_fork_server() -> None:
    """Under ``forkserver``: close this child's copy of the fork server's alive pipe.

    ``multiprocessing`` hands every child of its fork server the write end of the pipe
    whose end-of-file tells the server that its last client is gone (so that a child
    could start processes through the same server). A zephon worker holding it kept
    the server alive after the zephon parent died, and the server, still the worker's
    parent, kept the worker from seeing that it was orphaned: both lived for ever. The
    child's view of the fork server is reset to a spawned child's (none started), so an
    op that uses ``forkserver`` itself starts a server of its own."""
    from multiprocessing import forkserver

    server: Any = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if server is None or fd is None or getattr(server, "_forkserver_pid", None) is not None:
        return  # not a child of a fork server (or this process runs one itself)
    try:
        os.close(fd)
    except OSError:
        pass
    server._forkserver_alive_fd = None
    server._forkserver_address = None


def _spawned(channel) -> None:
    """Every child's process entry: its target and arguments are the channel's first
    message (see the module docstring, step 1), then ``target(channel, *args)``."""
    global _STARTED_BY
    _STARTED_BY = os.getppid()
    _leave_fork_server()
    _, frames, _ = channel.recv()
    target, args = pickle.loads(frames[0])
    target(channel, *args)


class Child:
    """One supervised child process and the parent's end of its channel.

    Attributes:
        process: the ``multiprocessing`` process.
        channel: the parent's end of the channel.
        pid: the child's pid (kept after it is reaped).
        group: the child makes itself a process-group leader; signals go to its group.
        stopped: the supervisor stopped it: its exit is not a crash.

    Thread-safe reaping: the exit status is asked for (``waitpid``) under the child's own
    lock, so a death detector thread, :func:`stop_children` and an owner's loop may all
    ask at once (two concurrent ``waitpid`` calls would leave one with ``ECHILD`` and no
    status).
    """

    __slots__ = ("_lock", "channel", "group", "pid", "process", "stopped")

    def __init__(self, process, channel, *, group: bool = False) -> None:
        self.process, self.channel, self.group = process, channel, group
        self.pid: int = process.pid
        self.stopped = False
        self._lock = threading.Lock()

    @classmethod
    def spawn(cls, mp_context, target: Callable, args: Sequence[Any] = (), *,
              transport: str = "socketpair", buffer_bytes: int = 1 << 20, name: str,
              daemon: bool = True, group: bool = False) -> "Child":
        """Start ``target(channel, *args)`` in a new process with SIGINT blocked.

        Args:
            mp_context: a ``multiprocessing`` context (spawn).
            target: a module-level function (spawn imports it).
            args: its arguments after the channel: plain picklable values (they are
                pickled here and sent as the channel's first message, so a socket or a
                file descriptor among them does not travel; pass those on the channel).
            transport, buffer_bytes: the channel (see :func:`channel_pair`).
            name: the process name.
            daemon: a daemon process cannot start processes of its own.
            group: the child makes itself a process-group leader (see :class:`Child`).
        """
        entry = pickle.dumps((target, tuple(args)), protocol=5)
        parent_end, child_end = channel_pair(transport, buffer_bytes)
        process = mp_context.Process(target=_spawned, args=(child_end,), name=name,
                                     daemon=daemon)
        # The child inherits the signal mask through exec: SIGINT stays blocked until it
        # has set it to ignored (ignore_sigint), so a Ctrl-C during its start-up prints no
        # traceback. A SIGINT meanwhile stays pending here, never lost.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            process.start()
        except BaseException:
            parent_end.close()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            child_end.close()  # the child has its own copy now
        try:
            parent_end.send({"k": "entry"}, [entry])
        except (OSError, ChannelClosed):  # it died starting: reported as every death is
            pass
        return cls(process, parent_end, group=group)

    @property
    def exitcode(self) -> int | None:
        """The exit code once the child has exited (negative: the signal), else None (it
        reaps the child: ``waitpid(WNOHANG)`` under the child's lock)."""
        with self._lock:
            return self.process.exitcode

    def is_alive(self) -> bool:
        """True while the child runs."""
        return self.exitcode is None

    def send_stop(self) -> bool:
        """Mark the child stopped and send it STOP; False when its channel is gone."""
        self.stopped = True
        try:
            self.channel.send({"k": MsgKind.STOP})
            return True
        except (ChannelClosed, OSError):
            return False

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the child (with its process group when it leads one).

        Only while the child is unreaped is it signalled alone: a reaped pid may already
        belong to someone else. Returns True when some process got the signal.
        """
        if self.group and signal_group(self.pid, sig):
            return True
        if self.exitcode is None:
            try:
                os.kill(self.pid, sig)
                return True
            except ProcessLookupError:
                pass
        return False

    def reap(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds (None: for ever) for the child to exit; its exit
        code (None: still alive). The wait is on the sentinel and, every
        :data:`EXIT_POLL_S`, on the exit status: a process the child forked may hold the
        sentinel open after the child is gone (``Process.join`` would wait it out)."""
        from multiprocessing.connection import wait

        deadline = None if timeout is None else time.monotonic() + timeout
        sentinel = [self.process.sentinel]
        while True:
            code = self.exitcode
            remaining = None if deadline is None else deadline - time.monotonic()
            if code is not None or (remaining is not None and remaining <= 0):
                return code
            slice_s = EXIT_POLL_S if remaining is None else min(remaining, EXIT_POLL_S)
            if sentinel and wait(sentinel, slice_s):
                sentinel = []  # readable: the status follows (another reaper may hold it)
            elif not sentinel:
                time.sleep(slice_s / 4)

    def close_channel(self) -> None:
        """Close the parent's end of the channel (idempotent)."""
        self.channel.close()


def startup_death_error(exitcode: int | None, where: str) -> TransportError | None:
    """The error for a child that exited with ``exitcode`` before READY because the main
    script has no ``__main__`` guard; None for any other exit."""
    if exitcode == EXIT_UNGUARDED_MAIN:
        return unguarded_main_error(where)
    return None


def handshake(header: dict, frames: list, where: str) -> bool:
    """Read one start-up message: True for READY, False for anything else.

    Raises:
        BaseException: the child's own set-up exception (its traceback as ``__cause__``)
            for FAIL.
    """
    kind = header.get("k")
    if kind == MsgKind.FAIL:
        raise decode_exception(frames[0], header.get("tb", ""), where)
    return kind == MsgKind.READY


def await_ready(children: dict[Any, Child], timeout: float, where: str) -> None:
    """Wait until every child of ``children`` (label -> child) has said READY.

    Raises:
        TransportError: one did not start within ``timeout`` seconds (the message names
            the late labels), died while starting (naming its exit status), or re-ran an
            unguarded main script.
        BaseException: a child's own set-up exception (FAIL).
    """
    deadline = time.monotonic() + timeout
    selector = selectors.DefaultSelector()
    for label, child in children.items():
        selector.register(child.channel.fileno(), selectors.EVENT_READ, label)
    try:
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(key.data for key in selector.get_map().values())
                raise TransportError(f"worker(s) {late} of {where} did not start within "
                                     f"{timeout} s")
            for key, _ in selector.select(timeout=min(remaining, HANDSHAKE_POLL_S)):
                child = children[key.data]
                try:
                    header, frames, _ = child.channel.recv()
                except ChannelClosed:
                    code = child.reap(REAP_JOIN_S)
                    error = startup_death_error(code, where)
                    if error is not None:
                        raise error from None
                    raise TransportError(f"worker {key.data} of {where} died while starting "
                                         f"({exit_text(code)})") from None
                if handshake(header, frames, "setting up the worker"):
                    selector.unregister(key.fd)
    finally:
        selector.close()


def parent_changed(parent_pid: int) -> bool:
    """Child side: True when the process that started this one is gone (re-parented).

    That process is the one that forked this child, noted at its start
    (:data:`_STARTED_BY`), else ``parent_pid``, the zephon parent. They differ under
    ``forkserver``: comparing with the zephon parent there read every worker as
    orphaned at its first idle second, and each killed its own process group."""
    started_by = parent_pid if _STARTED_BY is None else _STARTED_BY
    return os.getppid() != started_by


def watch_parent(parent_pid: int, on_gone: Callable[[], None],
                 poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """Child side: start a daemon thread that calls ``on_gone()`` once the parent is gone.

    ``on_gone`` should end the process (``os._exit``, ``os.killpg``). Returns the thread.
    """

    def watch() -> None:
        while not parent_changed(parent_pid):
            time.sleep(poll_s)
        on_gone()

    thread = threading.Thread(target=watch, name="zephon-parent-watch", daemon=True)
    thread.start()
    return thread


def ignore_sigint() -> None:
    """Child side: ignore SIGINT (Ctrl-C to the process group is the parent's to handle).

    The parent starts children with SIGINT blocked; ignoring it discards a pending one,
    then it is unblocked.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _kill_own_group() -> None:
    os.killpg(0, signal.SIGKILL)  # the parent is gone: take the child's processes too


def _end_tree_on_sigterm(grace: float):
    """A SIGTERM handler: end every descendant (those that left the process group
    included), then die of SIGTERM."""
    term = {signal.SIGTERM}

    def handler(signum, frame):
        signal.pthread_sigmask(signal.SIG_BLOCK, term)
        try:
            end_descendants(grace)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, term)
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(128 + signal.SIGTERM)

    return handler


def lead_process_tree(parent_pid: int, grace: float) -> None:
    """Child side, for a child started with ``group=True``: own every process it starts.

    It leads a new process group, becomes a child subreaper (Linux: descendants that
    leave the group are re-parented to it), ignores SIGINT, kills its whole group when
    its parent is gone (:func:`watch_parent`), and on SIGTERM ends every descendant
    (SIGTERM, ``grace``, SIGKILL) before it dies of SIGTERM. Call first thing in the
    child's main thread; a task that installs its own SIGTERM handler replaces that
    clean-up (the parent's SIGKILL to the group still ends the group).
    """
    become_group_leader()
    become_subreaper()
    ignore_sigint()  # Ctrl-C is the parent's to handle
    term = {signal.SIGTERM}
    # The watcher thread never takes a SIGTERM meant for the child (it inherits the mask).
    signal.pthread_sigmask(signal.SIG_BLOCK, term)
    watch_parent(parent_pid, _kill_own_group)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, term)
    signal.signal(signal.SIGTERM, _end_tree_on_sigterm(grace))


def _wait_exit(children: list[Child], deadline: float,
               drain: Callable[[list[Child], float], None] | None) -> None:
    """Wait until every child has exited or ``deadline``: on their sentinels (woken at
    once by an exit; the status is asked every :data:`DEATH_POLL_S` too, for a sentinel
    a grandchild holds open), or through ``drain``."""
    from multiprocessing.connection import wait

    while True:
        live = [c for c in children if c.exitcode is None]
        remaining = deadline - time.monotonic()
        if not live or remaining <= 0:
            return
        if drain is not None:
            drain(live, deadline)
        else:
            wait([c.process.sentinel for c in live], timeout=min(remaining, DEATH_POLL_S))


def kill_tree(child: Child) -> list[int]:
    """SIGKILL ``child`` with its process group and every live descendant of it, those
    that left its group included (read from /proc first: once the child is dead they are
    re-parented and no longer found below it).

    Returns:
        The descendants' pids (to wait for with :func:`wait_gone`).
    """
    below = descendants(child.pid) if child.exitcode is None else []
    child.signal(signal.SIGKILL)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return below


def kill_children(children: Iterable[Child], groups: Iterable[int] = (),
                  kill_wait_s: float = KILL_WAIT_S) -> list[int]:
    """Kill every child outright, no grace: SIGKILL to each child's process tree
    (:func:`kill_tree`, its group and the descendants that left it) and to every process
    of ``groups``; then reap the children and wait, at most ``kill_wait_s``, until none
    of them, of those descendants or of the groups is alive. Each child is marked
    ``stopped`` (never a crash).

    Returns:
        The groups that still have a live member (normally empty).
    """
    children, groups = list(children), list(groups)
    deadline = time.monotonic() + kill_wait_s
    orphans: list[int] = []
    for child in children:
        child.stopped = True
        orphans += kill_tree(child)
    for pgid in groups:
        signal_group(pgid, signal.SIGKILL)
    for child in children:
        child.reap(max(0.0, deadline - time.monotonic()))
    wait_gone(orphans, deadline)
    return live_groups(groups, deadline)


class InterruptGuard:
    """Ctrl-C around a stop that must not be left half done (see "Ctrl-C during a stop"
    in the module docstring).

    Inside the block the first Ctrl-C raises ``KeyboardInterrupt``, as Python's own
    handler would, unless the guard already holds; after that one, or after
    :meth:`hold`, every Ctrl-C is held (counted in ``held``): the code that handles the
    first one runs to its end. Leaving the block restores the previous handler; Ctrl-Cs
    held meanwhile are raised then as one ``KeyboardInterrupt`` when the block ended
    without an exception and ``raise_held`` is set (else they are dropped: an exception,
    typically that KeyboardInterrupt, is on its way already).

    Only in the main thread, and only over Python's own SIGINT handler: a program that
    installed its own handler keeps it. Guards nest (one handler serves them all, the
    innermost guard decides): an inner guard holds where its outer one holds (the
    first Ctrl-C of the outer block was raised already), unless ``take_held``; when it
    ends, what it held goes to the outer guard, and a Ctrl-C it held while the outer one
    did not hold yet is raised then (the outer one holds from then on). Not re-entrant:
    one ``with`` per guard.

    Args:
        hold: hold from the start (no Ctrl-C raises inside the block).
        raise_held: raise held Ctrl-Cs when the block ends without an exception (an
            outermost guard only).
        take_held: for a stop that a second Ctrl-C cuts short: once the block calls
            :meth:`arm`, its first Ctrl-C raises even where an outer guard holds, and one
            that an outer guard held before the block began counts as that first one
            (:meth:`arm` raises it).

    A guard kept in force across many short blocks (a run's iterator: each step is a
    block, the caller's code between them is not) costs one handler install, not one
    per block: :meth:`pause` makes it behave as Python's own handler (every Ctrl-C
    raises) and :meth:`resume` starts a fresh block (nothing held, nothing raised).

    Examples:
        >>> with InterruptGuard(hold=True) as guard:
        ...     pass  # a Ctrl-C here would be raised as the block ends
        >>> guard.held
        0
    """

    def __init__(self, *, hold: bool = False, raise_held: bool = True,
                 take_held: bool = False) -> None:
        self.holding, self.raise_held, self.take_held = hold, raise_held, take_held
        self.held = 0
        self.raised = False  # a Ctrl-C of this block was raised
        self._due = False  # a Ctrl-C taken from an outer guard, for arm() to raise
        self._previous: Any = None
        self._active = False
        self.paused = False

    def pause(self) -> None:
        """Between blocks: every Ctrl-C raises, as under Python's own handler."""
        self.paused = True

    def resume(self) -> None:
        """Start a fresh block: the first Ctrl-C raises, later ones are held."""
        self.paused = self.holding = self.raised = False
        self.held = 0

    def renew(self) -> bool:
        """:meth:`resume` if this guard is still :attr:`in_force` (one call per step of
        a run: a step costs this, not a handler install); False (nothing changed) if
        not."""
        if not self._active or _signal.getsignal(signal.SIGINT) is not _guards_on_sigint:
            return False
        self.paused = self.holding = self.raised = False
        self.held = 0
        return True

    @property
    def in_force(self) -> bool:
        """True while this guard's handler is the one Python calls on SIGINT."""
        # _signal's getsignal: signal.getsignal converts to an enum, 4 us a call
        return self._active and _signal.getsignal(signal.SIGINT) is _guards_on_sigint

    def hold(self) -> None:
        """From now on hold every Ctrl-C until the block ends."""
        self.holding = True

    def arm(self) -> None:
        """From now on let the first Ctrl-C raise; raise ``KeyboardInterrupt`` at once when
        one is held already (by this block, or taken from an outer guard with
        ``take_held``). Nothing changes once a Ctrl-C of this block was raised."""
        if self.raised:
            return
        if self.held or self._due:
            if self._due:
                self._due = False
            else:
                self.held -= 1
            self.holding = self.raised = True
            raise KeyboardInterrupt
        self.holding = False

    def _on_sigint(self) -> None:
        if self.paused:
            raise KeyboardInterrupt
        if self.holding:
            self.held += 1
            return
        self.holding = self.raised = True
        raise KeyboardInterrupt

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is not threading.main_thread():
            return self
        current = signal.getsignal(signal.SIGINT)
        if current is _guards_on_sigint and _guards:
            outer = _guards[-1]
            if self.take_held:
                self._due = _take_held()
            else:
                self.holding = self.holding or outer.holding
            _guards.append(self)
            self._active = True
        elif current is signal.default_int_handler:
            _guards.append(self)
            self._active = True
            self._previous = signal.signal(signal.SIGINT, _guards_on_sigint)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._active:
            return
        self._active = False
        if _guards and _guards[-1] is self:
            _guards.pop()
        elif self in _guards:  # (not left in order: still the innermost's rules)
            _guards.remove(self)
        held, self._due = self.held + self._due, False
        if self._previous is not None:  # the outermost guard
            if signal.getsignal(signal.SIGINT) is _guards_on_sigint:  # not replaced since
                signal.signal(signal.SIGINT, self._previous)
            self._previous = None
            if held and exc_type is None and self.raise_held:
                raise KeyboardInterrupt
            return
        if not _guards:
            return
        outer = _guards[-1]
        if self.raised:
            outer.holding = outer.raised = True
        elif held and exc_type is None and not outer.holding:
            outer.holding = outer.raised = True
            outer.held += held - 1
            raise KeyboardInterrupt
        outer.held += held


#: The guards in force, outermost first (main thread only): the innermost one decides.
_guards: list[InterruptGuard] = []


def _guards_on_sigint(signum, frame) -> None:
    """The SIGINT handler while a guard is in force."""
    if _guards:
        _guards[-1]._on_sigint()
    else:  # (every guard left without restoring: behave as Python's own)
        raise KeyboardInterrupt


def _take_held() -> bool:
    """Take one Ctrl-C held by a guard in force (the innermost holding one)."""
    for guard in reversed(_guards):
        if guard.held:
            guard.held -= 1
            return True
    return False


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False


def wait_gone(pids: Iterable[int], until: float) -> list[int]:
    """Wait until none of ``pids`` is alive (zombies are dead), or the monotonic time
    ``until``; returns those still alive."""
    live = list(pids)
    while live:
        live = [p for p in live if _pid_alive(p)]
        if not live or time.monotonic() >= until:
            break
        time.sleep(EXIT_POLL_S / 4)
    return live


def _stop_one(child: Child, policy: ShutdownPolicy, graceful: Callable[[Child], bool]
              ) -> list[int]:
    """The first step of :func:`stop_children` for one child: STOP, SIGTERM, or (policy
    ``abandon``, a busy child) :func:`kill_tree`; returns the descendants killed."""
    if child.stopped or child.exitcode is not None:
        child.stopped = True  # already exited, or already being stopped: let it go on
        return []
    if graceful(child) and child.send_stop():
        return []
    child.stopped = True
    if policy.abandon:
        return kill_tree(child)
    child.signal(signal.SIGTERM)
    return []


def stop_children(children: Iterable[Child], policy: ShutdownPolicy, *,
                  graceful: Callable[[Child], bool] = lambda child: True,
                  drain: Callable[[list[Child], float], None] | None = None) -> float:
    """Stop -> terminate -> kill -> reap every child, all at once, within ``policy``.

    With ``policy.abandon`` a child that is not ``graceful`` is killed at once with its
    process tree, and so is every child still alive when the grace runs out (no
    SIGTERM step); the descendants killed are waited for as the children are.

    Args:
        children: the children to stop (each is marked ``stopped``: never a crash). One
            already marked ``stopped`` (STOP or SIGTERM sent earlier) gets no new signal
            before the grace runs out.
        policy: the deadlines.
        graceful: whether a child gets STOP (True) or SIGTERM at once (False: it is busy
            and cannot read STOP).
        drain: called as ``drain(live_children, deadline)`` while waiting for the exits,
            to read and drop what they still send (it must return by ``deadline``); by
            default the wait is on the children's sentinels.

    Returns:
        The monotonic deadline of the grace (for a :func:`sweep_groups` that follows).
    """
    children = list(children)
    deadline = time.monotonic() + policy.grace_s
    orphans: list[int] = []
    for child in children:
        orphans += _stop_one(child, policy, graceful)
    _wait_exit(children, deadline, drain)
    stragglers = [c for c in children if c.exitcode is None]
    if policy.abandon:
        for child in stragglers:
            orphans += kill_tree(child)
        stragglers = []
    for child in stragglers:
        child.signal(signal.SIGTERM)
    kill_at = time.monotonic() + policy.terminate_wait_s
    for child in stragglers:
        child.reap(max(0.0, kill_at - time.monotonic()))
        if child.exitcode is None:
            child.signal(signal.SIGKILL)
    for child in children:
        child.reap(policy.kill_wait_s)
    wait_gone(orphans, time.monotonic() + policy.kill_wait_s)
    return deadline


def sweep_groups(groups: Iterable[int], deadline: float, policy: ShutdownPolicy) -> list[int]:
    """End every process of ``groups`` (group ids of children that led one): SIGTERM, wait
    until ``deadline``, SIGKILL, wait ``policy.kill_wait_s``.

    Returns:
        The groups that still have a live member (normally empty).
    """
    groups = list(groups)
    for pgid in groups:
        signal_group(pgid, signal.SIGTERM)
    groups = live_groups(groups, deadline)
    for pgid in groups:
        signal_group(pgid, signal.SIGKILL)
    return live_groups(groups, time.monotonic() + policy.kill_wait_s)


def crash_error(message: str, *, worker: int | None, pid: int | None,
                exitcode: int | None, tasks: Sequence[int] = (), seq: int | None = None,
                op: str | None = None) -> WorkerCrashedError:
    """The crash report of a child that died by itself.

    Args:
        message: the full sentence (say which worker, how it died, what was lost).
        worker: the worker's slot index in its pool or backend.
        pid: its process id.
        exitcode: its exit code (negative: the signal).
        tasks: the task ids it had in flight.
        seq: the sequence number in flight, if the caller knows one.
        op: the op, stage or pool name.
    """
    sig = -exitcode if exitcode is not None and exitcode < 0 else None
    return WorkerCrashedError(message, seq=seq, signal=sig, op=op, worker=worker, pid=pid,
                              tasks=tasks)
