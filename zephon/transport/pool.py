"""WorkerPool: spawn-context worker processes with channels and shared-memory arenas.

This is the process primitive the runners build on: it starts N workers, sends
each a task (any picklable payload), and returns results (zero-copy views into
the worker's arena) as they arrive. Ordering, retries and back-pressure
policies belong to the runners; this module guarantees delivery, errors and
clean lifecycle. The processes themselves are started, greeted, stopped and
reaped by :mod:`zephon.transport.supervisor` (the same code the jobs backend
uses); the pool adds the channels' traffic, the arenas and crash recovery.

Lifecycle
---------
``start()``: the handler (a picklable callable ``payload -> result``) is
pickled once, in the parent, before any process exists (an unpicklable
handler fails here). All N processes are started at once with the
``mp_context`` (spawn by default) and the pool waits for every READY within
``spawn_timeout_s``; a worker that cannot unpickle the handler reports why and
``start()`` raises it. Stale named segments of dead runs are swept first.

Running: ``submit(payload)`` encodes (frames from the caller's memory; views of
regions this process holds are forwarded by reference, and stay pinned until
the task's result or error arrives) and sends a TASK to the least-loaded live
worker. ``get()`` waits on every worker channel plus a wake-up pipe: a lease
whose last view died queues a FREE for its owner and writes to that pipe, so
frees are delivered even while ``get()`` blocks (a worker waiting for arena
space is never starved by its own consumer). ``get()`` returns
:class:`TaskResult` or raises: the task's own exception (its worker traceback
as ``__cause__``), a :class:`~zephon.errors.SerializationError` (a result that cannot
be rebuilt here), or
:class:`~zephon.errors.WorkerCrashedError` naming the worker, its exit signal
and the tasks it had in flight. A crashed worker's slabs are released (views
the consumer still holds stay valid until dropped); the other workers go on.
``get(failures=True)`` (the stage executors') returns a failed task as a result whose
value is its :class:`~zephon.transport.failure.UnitFailure` (the error, the records
the task made before it, the task id) instead of raising its error.

Resizing (the autotune controller's "grow by one" and "shrink by one"):
``add_worker()`` launches one more worker without waiting for it (in a slot a
retired worker left, with a fresh slab range, else in a new slot): it boots
while ``get()`` serves the others, and ``submit()`` gives it tasks from the
moment ``get()`` has read its READY. One that dies or fails while booting is
logged and forgotten (never a crash: it held no task). ``retire_worker(k)``
takes a live worker out of ``submit()``'s choice; it finishes the tasks it has
in flight (their results come back as any others) and is sent STOP once it has
none, marked stopped first, so its exit is never reported as a crash and
nothing of it is re-dispatched. ``close()`` stops booting and retiring workers
with the rest.

Deaths: the pool's :class:`~zephon.transport.deaths.DeathWatch` (the detector
the jobs backend uses too) notices a worker's exit as it happens, even while
nobody is in ``get()`` or a process an op forked holds the worker's sentinel and
channel open, logs it with its exit status (``exited``, ``wait_for_exit()``) and
wakes ``get()``, which reads what the dead worker had sent without waiting for
an EOF that such a process may hold back, then reports the crash.

Back-pressure: a result's regions come from the worker's arena, all at once
(see :mod:`zephon.transport.arena`). When the consumer holds the whole arena
(it keeps results: ``list(pipe)``, a list of batches), the worker waits once,
briefly (``arena_wait_timeout_s``, 1 s), then sends results in-band, copied
through the channel, until a region comes back: never a deadlock, never a long
stall. The first such result makes ``get()`` issue one ``RuntimeWarning`` per
pool naming the bytes held, the bound and the remedies; the same happens, with
its own warning, when no shared segment can be created (a full /dev/shm).

Worker side (:mod:`zephon.transport.worker`): a control thread receives TASK,
FREE and STOP while the main thread runs tasks in order; a send that fails
before any byte left reaches the consumer as a
:class:`~zephon.errors.TransportError` for that task, naming the worker (not as
a death). Workers ignore SIGINT: Ctrl-C in a terminal reaches the whole process
group, and it is the parent's to handle (one ``KeyboardInterrupt`` in the main
process; then its exit closes the pool). They are started with SIGINT blocked,
so not even their start-up prints a traceback (``start()`` starts
``multiprocessing``'s resource tracker first: starting it unblocks SIGINT in the
thread that does). So a ``KeyboardInterrupt`` a task raises is its handler's own:
it is that task's error, as any exception (a ``SystemExit`` too), and the worker
goes on.

``close()`` (idempotent; also from ``__del__`` and at interpreter exit), by
``shutdown_mode``:

- ``"immediate"`` (the default): a worker with a task in flight is killed at once
  with its process group and every descendant (its result is not wanted: the op
  is abandoned, whatever it is doing); idle workers get STOP and 0.3 s to exit,
  then are killed the same way. Back in well under a second.
- ``"hard"``: STOP to every worker, 0.5 s, then terminate, then kill.
- ``"graceful"``: STOP to every worker; what they still send is read and dropped
  while they finish their current task (a pipeline stage's task stops at the next
  sample: :mod:`zephon.transport.stopping`) for up to 10 s (2 s at interpreter
  exit), then terminate, then kill.

Under every mode a worker still starting up (holding no task; it would read STOP
only once its interpreter is up) is killed at once. A Ctrl-C while ``close()``
waits (a second one, typically: the first one started the stop) kills every
worker left at once, and later ones are held until the rest is done (channels,
regions, names): a stop is never left half done, which would leave workers
running and names in /dev/shm.

Each worker leads a process group of its own, so the processes its ops started
go with it: after the workers, what is left in their groups is ended too. Every
child is reaped, channels closed, the arenas' memfds closed, and the segment
names of this pool's workers swept. Workers stopped this way are never
reported as crashes: ``get()`` (in any thread) raises ``TransportError("...
was closed")`` and the watchdog stays silent, so runners never re-dispatch
their tasks. A worker that dies by itself has the rest of its process group
killed when its crash is reported.

Exit: interpreter exit never waits on a worker. Workers are not daemons (an op
may start processes of its own, a ``multiprocessing.Pool`` included; daemons
may not), so live pools are closed from a ``threading`` exit hook, which runs
before non-daemon threads are joined and before every ``atexit`` callback, in
particular before multiprocessing's own, which would join non-daemon workers
forever. A plain ``atexit`` callback remains as a fallback. Only the process
that made a pool stops it: its copy in a process forked from there (the workers
of an op's ``multiprocessing.Pool`` run the exit hooks as they end) does nothing.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import os
import pickle
import selectors
import signal
import sys
import threading
import time
import warnings
import weakref
from multiprocessing import resource_tracker
from typing import Any, NamedTuple, cast

from zephon.errors import (
    ResultTimeoutError,
    SerializationError,
    TransportError,
    WorkerCrashedError,
    ZephonConfigError,
)
from zephon.transport.arena import (
    LeaseTable,
    SlabRegistry,
    memfd_available,
    sweep_segments_of,
    sweep_stale_segments,
)
from zephon.transport.budget import SLABS_PER_GENERATION
from zephon.transport.channel import ChannelClosed
from zephon.transport.codec import Decoder, Encoder, PeerState
from zephon.transport.config import PoolConfig
from zephon.transport.deaths import DeathWatch, death_text
from zephon.transport.failure import UnitFailure
from zephon.transport.remote_errors import decode_exception
from zephon.transport.spawn_guard import refuse_in_spawn_bootstrap
from zephon.transport.supervisor import (
    REAP_JOIN_S,
    Child,
    InterruptGuard,
    MsgKind,
    ShutdownPolicy,
    await_ready,
    crash_error,
    exit_text,
    handshake,
    kill_children,
    stop_children,
    sweep_groups,
)
from zephon.transport.tokens import MAX_OWNER, SLAB_INDICES, slab_index, token_slab
from zephon.transport.tree import signal_group
from zephon.transport.worker import worker_entry

__all__ = ["TaskResult", "WorkerPool"]

log = logging.getLogger("zephon.transport.pool")

_live_pools: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


def _close_live_pools() -> None:
    """Close every live pool at interpreter exit (see "Exit" in the module docstring); a
    Ctrl-C meanwhile is held and dropped (the interpreter is exiting already): one
    arriving between two pools would leave the rest running, joined for ever by
    ``multiprocessing``'s own exit handler."""
    with InterruptGuard(hold=True, raise_held=False):
        for pool in list(_live_pools):
            try:
                pool.close(exiting=True)
            except Exception:
                log.debug("closing pool %r at exit failed", pool.name, exc_info=True)


def _start_resource_tracker(mp_context) -> None:
    """Start ``multiprocessing``'s resource tracker now, under a start method that uses
    one (spawn, forkserver), before any worker. It is started at the first such process
    otherwise, and starting it unblocks SIGINT in the calling thread: inside
    :meth:`~zephon.transport.supervisor.Child.spawn`, which blocks SIGINT so that a worker
    starts with it blocked, the first worker of a program then started with SIGINT
    deliverable, and a Ctrl-C during its start-up killed it with a "Fatal Python error"
    traceback. (Once running, the tracker is not started again.)"""
    method = getattr(mp_context, "get_start_method", lambda: None)()
    if method in ("spawn", "forkserver"):
        resource_tracker.ensure_running()


def _interrupted() -> bool:
    """Whether a ``KeyboardInterrupt`` is being handled (raised and not yet caught
    further up): a Ctrl-C held while a stop runs is the same request, not a new one."""
    return isinstance(sys.exc_info()[1], KeyboardInterrupt)


# threading's exit hooks run before non-daemon threads are joined and before any atexit
# handler, so before multiprocessing's own exit handler (registered when the first process
# starts, so it runs before ours would) joins non-daemon children (the MTP subprocess) or
# terminates daemon ones under a get() in flight. atexit stays as a fallback for
# interpreters without the hook; close() is idempotent.
try:
    threading._register_atexit(_close_live_pools)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # not CPython, or imported during shutdown
    pass
atexit.register(_close_live_pools)


class TaskResult(NamedTuple):
    """A task's result; ``timing``: ``(op seconds, seconds placing and sending the
    result, bytes placed in the arena)`` as the worker measured them, when the pool's
    configuration times tasks (else None); ``busy_s``: the op seconds the worker measured,
    always (None only from a worker that did not send them)."""

    task_id: int
    worker: int
    value: Any
    timing: tuple | None = None
    busy_s: float | None = None


# ---------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------


class _WorkerHandle:
    """Slot ``index`` of a pool: its supervised child (``child.stopped``: zephon stopped
    it, its exit is not a crash) and the tasks it has in flight."""

    __slots__ = ("alive", "booting", "channel", "child", "exited", "generation", "index",
                 "inflight", "peer", "pid", "process", "retiring")

    def __init__(self, index: int, child: Child, peer) -> None:
        self.index, self.child, self.peer = index, child, peer
        self.process, self.channel, self.pid = child.process, child.channel, child.pid
        self.inflight: dict[int, list] = {}  # task id -> pinned leases
        self.alive = True
        self.exited = False  # the death watch saw the process die (get() has not reported it)
        self.generation = 0
        self.booting = False  # added by add_worker(), READY not read yet (not alive yet)
        self.retiring = False  # retire_worker(): no new tasks, STOP once it has none


class _Waker:
    """The wake-up pipe's write end: ``wake()`` writes one byte (nothing once closed; the
    lock keeps a write from reaching an fd number that :meth:`close` freed and another
    file took since)."""

    __slots__ = ("_fd", "_lock")

    def __init__(self, fd: int) -> None:
        self._fd, self._lock = fd, threading.RLock()  # (a finalizer may release inside)

    def wake(self) -> None:
        with self._lock:
            if self._fd < 0:
                return
            try:
                os.write(self._fd, b"\0")
            except OSError:
                pass  # already awake (the pipe is full)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


class WorkerPool:
    """N worker processes running ``handler(payload) -> result`` (see the module docstring)."""

    def __init__(self, handler, num_workers: int, *, config: PoolConfig | None = None,
                 name: str = "pool", daemon: bool = False) -> None:
        """``config``: what the pool reads (:class:`~zephon.transport.config.PoolConfig`;
        None: the defaults). Workers are not daemons by default, so an op may start
        processes of its own (``multiprocessing.Pool`` included; the MTP engine starts
        worker pools): the pool stops and reaps them itself, in ``close()`` and from a
        ``threading`` exit hook before ``multiprocessing`` would join them (see "Exit")."""
        if not 1 <= num_workers <= MAX_OWNER:  # a worker's owner field in region tokens
            raise ZephonConfigError(f"num_workers must be in [1, {MAX_OWNER}] (a worker's "
                                    f"number is 7 bits of its region tokens), got {num_workers}",
                                    field="num_workers")
        self.config = config = config if config is not None else PoolConfig()
        self.handler, self.num_workers, self.name = handler, num_workers, name
        self.daemon = daemon
        self.transport = config.transport
        self.arena_kind = "memfd" if self.transport == "socketpair" and memfd_available() \
            else "named"
        self.arena_max_bytes = config.arena_bound
        self.spawn_timeout_s = config.spawn_timeout_s
        self.arena_wait_timeout_s = config.arena_wait_timeout_s
        self.policy = config.policy
        self.leases, self.registry = LeaseTable(), SlabRegistry()
        self.encoder = Encoder(self.policy, self.leases, self.registry, arena=None)
        self.decoder = Decoder(self.leases, self.registry, self._release_for,
                               borrow_forwarded=False)
        self.workers: list[_WorkerHandle] = []
        self._ids = itertools.count()
        self._frees: dict[int, collections.deque] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._waker = _Waker(self._wake_w)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._closed = False
        self._started = False
        self._ready = False
        self._turn = 0  # which ready result channel get() reads first (they take turns)
        self.crashes: list[WorkerCrashedError] = []
        self._deaths = DeathWatch(f"pool {name!r}", log)  # see zephon.transport.deaths
        self._selector.register(self._deaths.fileno(), selectors.EVENT_READ, None)
        self._warned: set[str] = set()  # in-band fallbacks already warned about
        self._worker_pids: set[int] = set()  # every worker ever started (names to sweep)
        #: the process that made the pool: a copy of it in a child that process forked (an
        #: op's ``multiprocessing.Pool``, whose workers run the exit hooks) stops nothing
        self._pid = os.getpid()
        _live_pools.add(self)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self, wait: bool = True) -> "WorkerPool":
        """Launch the workers; with ``wait=False`` return at once and wait for their READY on
        first use (the caller overlaps its own set-up with the workers' start-up)."""
        if self._started:
            return self
        refuse_in_spawn_bootstrap(f"starting worker pool {self.name!r}")
        self._started = True
        if self.arena_kind == "named":
            sweep_stale_segments()
        try:
            handler_bytes = pickle.dumps(self.handler, protocol=5)
        except Exception as exc:
            raise SerializationError(
                f"the worker handler {self.handler!r} cannot be pickled for spawn workers: "
                f"{type(exc).__name__}: {exc}") from exc
        self._boot = {
            "parent_pid": os.getpid(), "transport": self.transport,
            "arena_kind": self.arena_kind, "arena_max_bytes": self.arena_max_bytes,
            "arena_wait_timeout_s": self.arena_wait_timeout_s, "policy": tuple(self.policy),
            "handler": handler_bytes,
            "log_level": logging.getLogger("zephon").getEffectiveLevel(),
            "timing": self.config.timing,
        }
        # the workers run these bytes: the object is not needed any more, and holding it
        # would keep what the handler references (a user's objects) alive with the pool
        self.handler = None
        _start_resource_tracker(self.config.mp_context)
        try:
            for k in range(self.num_workers):
                self.workers.append(self._launch(k, generation=0))
                self._frees[k + 1] = collections.deque()
        except BaseException:
            self.close()
            raise
        self._ready = False
        if wait:
            self._ensure_ready()
        return self

    def _ensure_ready(self) -> None:
        if self._ready:
            return
        try:
            self._await_ready(self.workers)
        except BaseException:
            self.close()
            raise
        for handle in self.workers:
            self._selector.register(handle.channel.fileno(), selectors.EVENT_READ, handle)
        for handle in self.workers:
            self._deaths.watch(handle.index, handle.child)
        self._ready = True

    def _launch(self, k: int, generation: int) -> "_WorkerHandle":
        boot = dict(self._boot, slab_base=generation * SLABS_PER_GENERATION)
        child = Child.spawn(self.config.mp_context, worker_entry, (k, boot),
                            transport=self.transport,
                            buffer_bytes=self.config.buffer_bytes,
                            name=f"zephon-{self.name}-{k}", daemon=self.daemon, group=True)
        self._worker_pids.add(child.pid)
        handle = _WorkerHandle(k, child, PeerState(can_map_fds=self.transport == "socketpair"))
        handle.generation = generation
        return handle

    @property
    def exited(self) -> dict[int, int | None]:
        """Every worker that died by itself so far: slot index -> exit code (negative: the
        signal), as the death watch saw it, even while nobody is in ``get()``."""
        return cast("dict[int, int | None]", self._deaths.crashed())

    def runs(self, handler) -> bool:
        """Whether the workers run ``handler``: it pickles to the very bytes they were
        started with (a handler whose objects changed since does not)."""
        try:
            return pickle.dumps(handler, protocol=5) == getattr(self, "_boot", {}).get("handler")
        except Exception:  # noqa: BLE001 - one that cannot be pickled is not what they run
            return False

    def all_running(self) -> bool:
        """Whether the pool is open and every worker in service (not retiring) is running:
        none died, not even one the pool has not noticed yet."""
        return not self._closed and all(
            h.child.exitcode is None for h in self.workers if h.alive and not h.retiring)

    def wait_for_exit(self, timeout: float | None = None) -> dict[int, int | None]:
        """Block until some worker has died by itself (or ``timeout``); returns ``exited``."""
        self._deaths.wait(timeout)
        return self.exited

    def restart(self, k: int) -> None:
        """Start a new process in slot ``k`` after its worker died (crash retries). Its slabs
        take a fresh index range, so regions the consumer still holds from the dead worker
        can never be confused with the new worker's. A worker that was retiring
        (:meth:`retire_worker`) is not restarted: its slot stays free for
        :meth:`add_worker`."""
        if self._closed:
            raise TransportError(f"pool {self.name!r} is closed")
        old = self.workers[k]
        if old.alive:
            raise TransportError(f"worker {k} of pool {self.name!r} is still alive")
        if old.retiring:
            return
        generation = old.generation + 1
        if generation * SLABS_PER_GENERATION >= SLAB_INDICES:
            raise TransportError(f"worker slot {k} of pool {self.name!r} restarted too often")
        handle = self._launch(k, generation)
        self.workers[k] = handle
        try:
            self._await_ready([handle])
        except BaseException:
            handle.alive = False
            handle.child.stopped = True
            handle.child.signal(signal.SIGKILL)
            handle.child.reap()
            handle.child.close_channel()
            raise
        self._selector.register(handle.channel.fileno(), selectors.EVENT_READ, handle)
        self._deaths.watch(k, handle.child)

    # -- resizing (see "Resizing") -------------------------------------------------------
    @property
    def booting(self) -> int:
        """Workers added by :meth:`add_worker` whose READY has not been read yet."""
        return sum(1 for h in self.workers if h.booting)

    def add_worker(self) -> int:
        """Launch one more worker without waiting for its start-up; returns its slot.

        Raises:
            TransportError: the pool is not running, or it has no slot left.
        """
        if self._closed or not self._started:
            raise TransportError(f"pool {self.name!r} is not running")
        self._ensure_ready()
        slot = next((h.index for h in self.workers
                     if h.retiring and not h.alive and not h.booting), None)
        if slot is None:
            if len(self.workers) >= MAX_OWNER:
                raise TransportError(f"pool {self.name!r} has no worker slot left")
            slot, generation = len(self.workers), 0
        else:
            old = self.workers[slot]
            generation = old.generation + 1
            if generation * SLABS_PER_GENERATION >= SLAB_INDICES:
                raise TransportError(f"worker slot {slot} of pool {self.name!r} reused too "
                                     "often")
            self._forget(old)
        handle = self._launch(slot, generation)
        handle.alive, handle.booting = False, True
        if slot == len(self.workers):
            self.workers.append(handle)
            self._frees[slot + 1] = collections.deque()
        else:
            self.workers[slot] = handle
        self.num_workers += 1
        self._selector.register(handle.channel.fileno(), selectors.EVENT_READ, handle)
        log.debug("pool %s: worker %d booting", self.name, slot)
        return slot

    def retire_worker(self, k: int) -> None:
        """Take live worker ``k`` out of service: no new task goes to it; it is stopped
        (never a crash) once the tasks it has in flight have come back."""
        handle = self.workers[k]
        if not handle.alive or handle.retiring:
            raise TransportError(f"worker {k} of pool {self.name!r} is not in service")
        handle.retiring = True
        self.num_workers -= 1
        self._retire_if_idle(handle)

    def _retire_if_idle(self, handle: _WorkerHandle) -> None:
        """STOP a retiring worker that has nothing in flight (its exit is no crash)."""
        if not handle.retiring or not handle.alive or handle.inflight:
            return
        handle.alive = False
        handle.child.send_stop()  # marks it stopped first: the death watch stays silent
        try:
            self._selector.unregister(handle.channel.fileno())
        except (KeyError, ValueError):
            pass
        # its slabs are unmapped here as their last view goes (views held stay valid)
        self.registry.drop_owner(handle.index + 1)
        self._frees.get(handle.index + 1, collections.deque()).clear()
        log.debug("pool %s: worker %d retired", self.name, handle.index)

    def _forget(self, old: _WorkerHandle) -> None:
        """Reap a retired worker whose slot is taken again, with what it left behind."""
        if old.child.reap(REAP_JOIN_S) is None:
            old.child.signal(signal.SIGKILL)
            old.child.reap(REAP_JOIN_S)
        if old.child.group:
            signal_group(old.pid, signal.SIGKILL)
        old.channel.close()
        self.registry.drop_owner(old.index + 1)  # views still held stay valid
        self._frees.get(old.index + 1, collections.deque()).clear()

    def _booted(self, handle: _WorkerHandle, header, frames) -> None:
        """A booting worker's start-up message: READY puts it in service; a failure is
        logged and the worker forgotten (it held no task: nothing is lost)."""
        try:
            ready = handshake(header, frames, "setting up the worker")
        except Exception as exc:  # noqa: BLE001 - a failed grow, not the run's error
            log.warning("pool %s: worker %d failed to start: %s", self.name, handle.index,
                        exc)
            ready = False
        if ready:
            handle.booting, handle.alive = False, True
            self._deaths.watch(handle.index, handle.child)
            log.debug("pool %s: worker %d ready", self.name, handle.index)
            return
        self._boot_failed(handle)

    def _boot_failed(self, handle: _WorkerHandle) -> None:
        handle.booting, handle.alive, handle.retiring = False, False, True
        handle.child.stopped = True
        try:
            self._selector.unregister(handle.channel.fileno())
        except (KeyError, ValueError):
            pass
        self.num_workers -= 1
        log.warning("pool %s: worker %d died while starting (%s); the stage goes on without "
                    "it", self.name, handle.index, exit_text(handle.child.reap(REAP_JOIN_S)))

    def _await_ready(self, handles) -> None:
        await_ready({h.index: h.child for h in handles}, self.spawn_timeout_s,
                    f"pool {self.name!r}")

    def close(self, *, exiting: bool = False) -> None:
        """Stop every worker and release everything (idempotent).

        Under ``shutdown_mode="immediate"`` (the default) a worker with a task in flight
        is killed at once with its process tree and idle ones get STOP and 0.3 s; under
        ``"hard"``/``"graceful"`` every worker gets STOP and whatever they still send is
        read and dropped (a worker blocked sending a result can always finish) until a
        shared deadline (0.5 s / 10 s; at interpreter exit at most 2 s), then stragglers
        are terminated, then killed. The rest of the workers' process groups is ended,
        every child reaped, channels closed and the named segments of this run swept.
        Workers stopped here are never reported as crashes and their tasks are never
        re-dispatched: from the first line on, ``get()`` raises
        :class:`~zephon.errors.TransportError` ("closed") and the watchdog stays silent.
        A worker still starting up (its READY not read) holds no task and could read
        STOP only once its interpreter is up: it is killed at once, under every mode.

        A Ctrl-C while it runs (a second one, typically: the first one started it) cuts
        the wait short: every worker left is killed at once with its process group
        (:func:`~zephon.transport.supervisor.kill_children`), and every later Ctrl-C is
        held until the rest of the stop is done
        (:class:`~zephon.transport.supervisor.InterruptGuard`); it is then raised, unless
        a ``KeyboardInterrupt`` was on its way already (the same request) or the
        interpreter is exiting. A stop cut short anywhere else would leave workers
        running (``multiprocessing`` joins them for ever at exit) and names in /dev/shm.

        Args:
            exiting: called at interpreter exit (shorter deadline).
        """
        if self._closed or os.getpid() != self._pid:
            return  # (a forked copy: the workers are its parent's to stop)
        quiet = exiting or _interrupted()  # a Ctrl-C here is not a new request
        cut: KeyboardInterrupt | None = None
        with InterruptGuard(raise_held=not quiet) as guard:
            try:
                self._stop_workers(exiting)
            except KeyboardInterrupt as exc:  # stop waiting: kill what is left
                guard.hold()
                cut = exc
                kill_children([h.child for h in self.workers],
                              [h.pid for h in self.workers if h.child.group])
            guard.hold()
            self._release()
        if cut is not None and not quiet:
            raise cut

    def _stop_workers(self, exiting: bool) -> None:
        """The part of :meth:`close` that waits: stop the workers by the shutdown policy."""
        self._closed = True
        _live_pools.discard(self)
        self._deaths.close()  # silent from here on: the workers stopped now are no crashes
        self._wake()  # a get() blocked in another thread returns now
        policy = ShutdownPolicy.for_shutdown_mode(self.config.shutdown_mode, exiting=exiting)
        # STOP to the workers that can read it; under a policy that abandons, a worker
        # with a task in flight is killed at once (its result is not wanted), and under
        # every policy one still starting up (it holds no task, and would read STOP only
        # once its interpreter is up: a second or more)
        idle = {id(h.child) for h in self.workers
                if h.alive and self._ready and not (policy.abandon and h.inflight)}
        self._drained: set[int] = set()
        deadline = stop_children([h.child for h in self.workers], policy,
                                 graceful=lambda child: id(child) in idle, drain=self._drain)
        # what the ops left in the workers' process groups goes with them
        sweep_groups([h.pid for h in self.workers if h.child.group],
                     time.monotonic() if policy.abandon else deadline, policy)

    def _release(self) -> None:
        """The rest of :meth:`close`, once the workers are gone: channels, the wake-up
        pipe, the regions, the segment names."""
        self._closed = True
        _live_pools.discard(self)
        self._deaths.close()
        for handle in self.workers:
            handle.alive = False
            handle.channel.close()
        try:
            self._selector.close()
        finally:
            # the write end is closed by the waker, under its lock: a release of a region
            # the consumer drops after the close writes nothing (the fd number may belong
            # to another file by then)
            read, self._wake_r, self._wake_w = self._wake_r, -1, -1
            self._waker.close()
            try:
                if read >= 0:
                    os.close(read)
            except OSError:
                pass
        self.registry.close_all()
        if self.arena_kind == "named" and self._started:
            sweep_segments_of(os.getpid(), self._worker_pids)
            sweep_stale_segments()

    def _wake(self) -> None:
        """Wake a ``get()`` blocked in another thread (the wake-up pipe)."""
        self._waker.wake()

    def _drain(self, children: list[Child], deadline: float) -> None:
        """One wait of ``close()`` for the workers to exit, reading and dropping what they
        still send (raw bytes: a get() interrupted mid-message may have left a channel
        mid-stream)."""
        from multiprocessing.connection import wait

        sentinels = {c.process.sentinel: c for c in children}
        readers = {c.channel.fileno(): c for c in children
                   if not c.channel.closed and c.pid not in self._drained}
        remaining = max(0.0, deadline - time.monotonic())
        for ready in wait(list(sentinels) + list(readers), timeout=min(remaining, 0.5)):
            child = sentinels.get(ready)
            if child is not None:
                child.reap(0.5)
            elif not readers[ready].channel.discard_pending():
                self._drained.add(readers[ready].pid)

    def __enter__(self) -> "WorkerPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    # -- frees -------------------------------------------------------------------------
    def _release_for(self, owner: int):
        queue = self._frees.get(owner)
        if queue is None:
            return None
        waker = self._waker

        def release(token: int) -> None:
            queue.append(token)
            waker.wake()

        return release

    def _flush_frees(self) -> None:
        for owner, queue in self._frees.items():
            if not queue:
                continue
            tokens = []
            while queue:
                tokens.append(queue.popleft())
            handle = self.workers[owner - 1]
            base = handle.generation * SLABS_PER_GENERATION
            tokens = [t for t in tokens if slab_index(token_slab(t)) >= base]
            if handle.alive and tokens:
                try:
                    handle.channel.send({"k": MsgKind.FREE, "t": tokens})
                except ChannelClosed:
                    pass

    # -- tasks -------------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        return sum(len(h.inflight) for h in self.workers)

    def live_workers(self) -> list[int]:
        return [h.index for h in self.workers if h.alive]

    def submit(self, payload: Any, *, worker: int | None = None) -> int:
        """Send ``payload`` to a worker (least loaded if None); returns the task id."""
        if self._closed or not self._started:
            raise TransportError(f"pool {self.name!r} is not running")
        self._ensure_ready()
        if worker is None:
            live = [h for h in self.workers if h.alive and not h.retiring]
            if not live:
                raise TransportError(f"pool {self.name!r} has no live worker")
            handle = min(live, key=lambda h: len(h.inflight))
        else:
            handle = self.workers[worker]
            if not handle.alive:
                raise TransportError(f"worker {worker} of pool {self.name!r} is not alive")
        header, frames, fds, pins = self.encoder.encode(payload, handle.peer)
        task_id = next(self._ids)
        header["k"], header["id"] = MsgKind.TASK, task_id
        handle.inflight[task_id] = pins
        self._flush_frees()  # before the task: the space it may need is back first
        try:
            handle.channel.send(header, frames, fds)
        except ChannelClosed:
            pass  # the crash is reported by get(), with this task among the in-flight ones
        except OSError as exc:  # nothing was sent: the caller's payload cannot travel
            del handle.inflight[task_id]
            raise TransportError(f"pool {self.name!r} could not send task {task_id} to worker "
                                 f"{handle.index}: {type(exc).__name__}: {exc}") from exc
        return task_id

    def get(self, timeout: float | None = None, *, failures: bool = False) -> TaskResult:
        """The next result from any worker, in completion order (``task_id`` says which
        submitted task it answers; see the module docstring for what it raises).

        ``failures``: a task that failed (its handler raised, or its result cannot be
        rebuilt here) comes back as a result whose value is its
        :class:`~zephon.transport.failure.UnitFailure` (the error, what the task made
        before it, the task id) instead of raising the error."""
        result = self._next(timeout)
        if not failures and type(result.value) is UnitFailure:
            raise result.value.error
        return result

    def _next(self, timeout: float | None) -> TaskResult:
        """:meth:`get`'s wait: a task's failure comes as its result."""
        if not self._started or self._closed:
            raise TransportError(f"pool {self.name!r} is not running")
        self._ensure_ready()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._flush_frees()
            self._note_deaths()
            dead = next((h for h in self.workers if h.exited and h.alive), None)
            if dead is not None:
                return self._receive_from_dead(dead)
            if not any(h.alive for h in self.workers):
                raise TransportError(f"pool {self.name!r} has no live worker")
            if not self.inflight:
                raise TransportError(f"get() on pool {self.name!r} with no task in flight")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ResultTimeoutError(f"no result from pool {self.name!r} within {timeout} s",
                                         timeout_s=timeout)
            try:
                events = self._selector.select(timeout=remaining)
            except (OSError, ValueError, KeyError):
                if self._closed:  # closed by another thread under this select
                    raise self._closed_error() from None
                raise
            if self._closed:
                raise self._closed_error()
            result = self._receive_ready([key.data for key, _ in events])
            if result is not None:
                return result

    def _receive_ready(self, handles: list) -> TaskResult | None:
        """Read the channels ``select`` found ready (None: the wake-up pipes) until one
        gives a result. Wake-ups and booting workers' READYs first: a result returns at
        once, so a channel behind one that always has a result waiting (a busy worker, a
        slow consumer) would never be read, and a grown worker never served. The result
        channels then take turns at being read first."""
        if len(handles) == 1:  # (the common case: nothing to order)
            return self._receive(handles[0])
        first = [h for h in handles if h is None or h.booting]
        for handle in first:
            self._receive(handle)
        ready = [h for h in handles if h not in first]
        if not ready:
            return None
        self._turn = (self._turn + 1) % len(ready)
        for handle in ready[self._turn:] + ready[:self._turn]:
            result = self._receive(handle)
            if result is not None:
                return result
        return None

    def _note_deaths(self) -> None:
        """Mark the workers the death watch saw die by themselves: ``get()`` reads what
        each had sent, then reports its crash."""
        for death in self._deaths.take():
            handle = next((h for h in self.workers if h.child is death.child), None)
            if handle is not None and not death.stopped:
                handle.exited = True

    def _receive(self, handle: _WorkerHandle | None) -> TaskResult | None:
        """Read one ready channel of ``get()``: None for the wake-up pipes (``handle`` None:
        the pool's own, for frees and close(), and the death watch's, whose deaths the loop
        notes first thing)."""
        if handle is None:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
            self._deaths.clear_wake()
            return None
        try:
            header, frames, fds = handle.channel.recv()
        except (ChannelClosed, OSError, ValueError):
            if self._closed:  # stopped by close(): not a crash
                raise self._closed_error() from None
            if handle.booting:  # a grow that failed: it held no task
                self._boot_failed(handle)
                return None
            if handle.child.stopped:
                raise self._closed_error() from None
            raise self._worker_died(handle) from None
        if handle.booting:
            self._booted(handle, header, frames)
            return None
        try:
            return self._handle_message(handle, header, frames, fds)
        finally:
            self._retire_if_idle(handle)

    def _receive_from_dead(self, handle: _WorkerHandle) -> TaskResult:
        """One message a worker the watchdog saw die had sent, or its crash report.

        Everything it sent is in the channel already, so the channel is read without
        blocking: a whole message is returned (or its error raised); nothing left, or a
        message cut short, is the crash. EOF is not waited for: a process the worker's op
        forked may hold the worker's end open for ever."""
        try:
            os.set_blocking(handle.channel.fileno(), False)
        except OSError:
            pass  # closed already: recv says so
        result = self._receive(handle)
        assert result is not None  # a worker's channel, not the wake-up pipe
        return result

    def _closed_error(self) -> TransportError:
        return TransportError(f"pool {self.name!r} was closed")

    def _handle_message(self, handle: _WorkerHandle, header, frames, fds) -> TaskResult:
        kind = header.get("k")
        task_id = header.get("id")
        pins = handle.inflight.pop(task_id, None)
        try:
            if kind == MsgKind.RESULT:
                if "w" in header:
                    self._warn_fallback(header["w"])
                try:
                    value = self.decoder.decode(header, frames, fds)
                except Exception as exc:  # noqa: BLE001 - it came but cannot be rebuilt here
                    return TaskResult(task_id, handle.index,
                                      UnitFailure(exc, task_id=task_id))
                return TaskResult(task_id, handle.index, value, header.get("t"),
                                  header.get("b"))
            if kind == MsgKind.ERROR:
                return TaskResult(task_id, handle.index,
                                  self._failure(task_id, handle, header, frames, fds))
            raise TransportError(f"unexpected message {kind!r} from worker {handle.index}")
        finally:
            del pins  # forwarded regions of the task input may be recycled from here on

    def _failure(self, task_id: int, handle: _WorkerHandle, header, frames,
                 fds) -> UnitFailure:
        """The failure an ERROR message carries: the error rebuilt link by link
        (:func:`~zephon.transport.remote_errors.decode_exception`), what the task made
        before it (the header's ``done``, its frames after the error's) and whether its
        result could not be sent (``u``)."""
        error = decode_exception(frames[0], header.get("tb", ""),
                                 f"task {task_id} on worker {handle.index}")
        done = None
        if "done" in header:
            done = self.decoder.decode(header["done"], frames[1:], fds)
        return UnitFailure(error, done, unsendable=bool(header.get("u")), task_id=task_id)

    def _warn_fallback(self, why: list) -> None:
        """One warning per pool and cause when results travel in-band for lack of arena
        space (the worker says why in the message header)."""
        kind = why[0]
        if kind in self._warned:
            return
        self._warned.add(kind)
        if kind == "starved":
            _, owner, held, bound, waited = why
            message = (
                f"zephon: the consumer holds {held} bytes of the {bound}-byte shared-memory "
                f"arena of worker {owner - 1} of pool {self.name!r} (results it has not "
                f"dropped yet) and none came back within {waited:g} s: results now travel by "
                "copy through the channel, which is slower, until it drops some. Drop each "
                "batch when done with it, or copy the ones you keep (np.array(x), "
                "tensor.clone()); to hold more at once raise RuntimeOptions.prefetch_batches "
                "or shm_max_coalesced_bytes (the arena bound per worker is (tasks in flight "
                "+ prefetch_batches // 2) x shm_max_coalesced_bytes, at least 64 MiB, plus "
                "a quarter for the worker's shared heap), or give"
                " WorkerPool a PoolConfig(arena_bytes=...).")
        else:
            _, owner, reason = why
            message = (f"zephon: worker {owner - 1} of pool {self.name!r} cannot create "
                       f"shared memory: {reason}. Results now travel by copy through the "
                       "channel, which is slower.")
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _worker_died(self, handle: _WorkerHandle) -> WorkerCrashedError:
        """Record a worker that died by itself (never one stopped by close())."""
        handle.alive = False
        try:
            self._selector.unregister(handle.channel.fileno())
        except (KeyError, ValueError):
            pass
        handle.channel.close()
        code = handle.child.reap(REAP_JOIN_S)
        if handle.child.group:  # what its ops left in its process group is orphaned
            signal_group(handle.pid, signal.SIGKILL)
        tasks = sorted(handle.inflight)
        handle.inflight.clear()
        released = self.registry.drop_owner(handle.index + 1)
        self._frees.get(handle.index + 1, collections.deque()).clear()
        if self.arena_kind == "named":  # a worker killed by a signal could not unlink its own
            sweep_segments_of(os.getpid(), [handle.pid])
            sweep_stale_segments()
        error = crash_error(
            f"{death_text(handle.index, handle.pid, f'pool {self.name!r}', code)} with "
            f"task(s) {tasks} in flight; its arena ({released} slab(s)) was released",
            worker=handle.index, pid=handle.pid, exitcode=code, tasks=tasks,
            seq=tasks[0] if tasks else None, op=self.name)
        log.error("%s", error)
        self.crashes.append(error)
        return error

