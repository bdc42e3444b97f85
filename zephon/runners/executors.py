"""Stage executors: where a parallel stage's units run. Each implements the contract
of :mod:`zephon.runners.contract` (:class:`~zephon.runners.contract.StageExecutor`; the
adaptive one :class:`~zephon.runners.contract.MovableExecutor` too).

``submit(lane, seq, payload)`` starts ``program(payload)``; ``get(lane)`` blocks for
*some* finished unit of that lane and returns ``(seq, result, busy_s)``: ``busy_s`` is
the seconds the program took on that unit where it ran (measured by the worker thread
or process with :class:`~zephon.transport.optime.OpClock`, always, with or without
execution tracking: the dispatch sizes its parts by it, since the time from submit to
result also counts the unit's wait in queues; None when unknown, e.g. a unit lost to a
crash). Results of other lanes that arrive while a lane waits are kept for them.
Ordering is not the executor's job: the engine puts results back in sequence order
(the ReorderBuffer kernel). A unit whose program failed comes back as a
:class:`~zephon.transport.failure.UnitFailure` in its place, so the engine raises the
error where the unit sits in the stream, as the inline runner does, not when it
happens to finish first. That holds for whatever the program raised,
``BaseException`` included: an op's ``SystemExit`` (its code kept) or
``KeyboardInterrupt`` is the unit's error like any other, on every runner: the
records before it are handed on, then it is raised as itself, and the op ran once (a
process worker ignores SIGINT, so one raised there is the op's, sent back as its
task's failure; the worker goes on, never a crash to retry). Inline, the op runs in
the consumer's thread, where a real Ctrl-C may land in it: that one is handed on in
the same place, after the records its unit made before it.

- :class:`InlineExecutor`: runs the unit on ``submit``, in the calling thread.
- :class:`ThreadExecutor`: daemon threads, as many as the stage's worker cap.
  ``close()`` never waits for an op: a thread cannot be stopped, so one busy in
  an op finishes it in the background (its result dropped) and then ends, and
  at interpreter exit it is abandoned.
- :class:`ProcessExecutor`: a :class:`~zephon.transport.WorkerPool` (spawn
  workers, shared-memory results). When a worker dies by a signal every unit it
  had in flight is re-dispatched to a restarted worker; only the unit it was
  running (the oldest) is charged a retry. Past ``max_worker_retries`` the unit
  fails with :class:`~zephon.errors.WorkerCrashedError` naming the sequence, the
  signal and the stage; with ``deterministic=False`` it is dropped with a
  warning instead (an empty result). Workers stopped by the executor's own
  ``close()`` (or at interpreter exit) are not crashes: ``get()`` then raises
  :class:`~zephon.errors.TransportError` ("closed") and nothing is re-dispatched.
- :class:`AdaptiveExecutor`: an *adaptive* stage (``Stage.mode == "adaptive"``): its
  units run inline, as :class:`InlineExecutor` runs them, until the autotune
  controller moves it to process workers (:meth:`~AdaptiveExecutor.to_process`), and
  back (:meth:`~AdaptiveExecutor.to_inline`). Nothing is spawned before the first
  move. A move to processes starts a :class:`ProcessExecutor` whose workers boot while
  the units go on running inline; the stage submits to them once every one of them is
  ready (``booting`` counts them until then). A move back parks the pool: nothing new
  goes to it, the units it has in flight come back through ``get()`` as any others
  (recorded as parked), and a move to processes while it is parked takes it back at
  once; :meth:`~AdaptiveExecutor.release` stops it (once its units are back).
  ``runner`` is the mode now (``"inline"`` or ``"process"``), ``workers`` the process
  workers in process mode, 1 (the engine's thread) inline. A stage whose pool cannot
  start (an op that cannot be pickled, a worker that fails to start or is not ready
  within the pool's spawn timeout), or whose input or output samples cannot be pickled
  (a sample of each is checked on the first inline units that have one), stays inline
  for the rest of the run (``unable`` says why). A unit that fails in a worker (a
  sample the check did not see that cannot cross, or the op's own error) runs again
  inline: if it passes there, the stage goes back inline for the rest of the run; if
  it fails there too, that failure is handed on, as the inline runner hands it on (an
  op's ``SystemExit`` or ``KeyboardInterrupt`` is handed on as it is, the op not run
  again: see above). Such a fall-back is listed in ``fallen`` for the controller to
  record. Units of both modes come back as ``(seq, result, busy_s)``; the engine
  re-orders them by ``seq``, so the stream is the one any runner gives, whatever the
  moves.

Resizing (the autotune controller, :mod:`zephon.pipeline.autotune`): thread and
process executors grow and shrink by one worker (inline ones stay at one). A shrunk
thread ends after the units queued before its stop; a shrunk process worker finishes
its tasks in flight and is then stopped (never a crash, nothing re-dispatched); a
grown process worker boots while the others work (``booting`` counts those not ready
yet). ``workers`` is the current count, ``max_workers`` the most the executor may be
grown to (the controller sets it before the run's first unit).

**The meter.** Every executor writes what its units cost to its one
:class:`~zephon.runners.contract.StageMeter` (given at construction, or its own), in the
engine's thread, when ``get()`` (inline: ``submit()``) takes the result: the op time a
process or thread worker measured and returned with the result (no extra messages; a
process worker's blocked seconds and placed bytes when its pool times tasks), an
adaptive stage's inline CPU demand, and the workers' start, stop and restart events.
An adaptive stage's inline executor and pool write to the stage's meter. With
execution tracking on, the run statistics observe the meter
(:attr:`StageMeter.observer <zephon.runners.contract.StageMeter.observer>`).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import queue
import select
import threading
import time
import warnings
from typing import Any, Callable

from zephon.errors import SerializationError, TransportError, WorkerCrashedError
from zephon.runners.contract import Runner, StageMeter
from zephon.transport import WorkerPool
from zephon.transport.codec import find_unpicklable
from zephon.transport.config import PoolConfig
from zephon.transport.failure import UnitFailure, Unwind
from zephon.transport.optime import OpClock

__all__ = ["AdaptiveExecutor", "InlineExecutor", "ProcessExecutor", "ThreadExecutor",
           "UnitFailure"]

log = logging.getLogger("zephon.runners")


class InlineExecutor:
    """A stage run in the engine's thread: ``submit`` runs the unit there and then.
    ``measures_demand`` (an adaptive stage's, for the autotune controller): each unit's
    CPU demand goes to the meter too, the process's CPU time while it ran plus the time
    this thread waited for a core meanwhile (what a CPU-bound op asks of the machine
    however loaded it is; an op that waits on storage asks little)."""

    runner: Runner = "inline"
    adaptive = False
    cpu_pool: int | None = None
    workers = max_workers = 1
    booting = 0

    def __init__(self, program: Callable, name: str = "stage", *,
                 meter: StageMeter | None = None, measures_demand: bool = False) -> None:
        self.program, self.name = program, name
        self.meter = meter if meter is not None else StageMeter()
        self.measures_demand = measures_demand
        self._done: dict[Any, collections.deque] = collections.defaultdict(collections.deque)
        self._stopped = False

    def pids(self) -> list[int]:
        return []

    def grow(self) -> None:
        """Fixed at one worker (the engine's thread)."""

    def shrink(self) -> None:
        """Fixed at one worker (the engine's thread)."""

    def submit(self, lane, seq: int, payload) -> None:
        cpu = time.process_time() if self.measures_demand else 0.0
        clock = OpClock()
        result = _run(self.program, payload)
        wall, busy = time.perf_counter() - clock.started, clock.seconds()
        if self.measures_demand:
            self.meter.ran(wall, demand_s=time.process_time() - cpu + (wall - busy))
        else:
            self.meter.ran(wall)
        self._done[lane].append((seq, result, busy))

    def get(self, lane):
        return self._done[lane].popleft()

    def close(self) -> None:
        self._done.clear()
        _stopped(self)


def _run(program: Callable, payload):
    """``program(payload)``, or the :class:`UnitFailure` of what it raised (a stage
    program returns its failures; any other program may raise)."""
    try:
        return program(payload)
    except Unwind as unwind:
        return unwind.failure
    except BaseException as exc:  # noqa: BLE001 - raised by the engine in stream order
        return UnitFailure(exc)


class _DaemonThreads:
    """A fixed set of daemon threads running submitted calls into futures.

    Not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined at interpreter
    exit (and by ``shutdown(wait=True)``), so an op stuck for minutes would hold the exit
    for as long. These are daemons and nothing joins them: ``close()`` cancels what has
    not started and returns; a thread in an op finishes that op in the background (its
    result is dropped), then ends; at interpreter exit it is abandoned."""

    def __init__(self, workers: int, prefix: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers, self._prefix = workers, prefix
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.closed = False

    def submit(self, fn: Callable, arg) -> cf.Future:
        future: cf.Future = cf.Future()
        with self._lock:
            if self.closed:
                raise RuntimeError("submit after close")
            if len(self._threads) < self._workers:
                thread = threading.Thread(target=self._run, daemon=True,
                                          name=f"{self._prefix}_{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
        self._queue.put((future, fn, arg))
        return future

    def resize(self, workers: int) -> None:
        """``workers`` threads from now on: more start on the next submits; each one fewer
        ends after the calls queued before its stop (nothing queued is lost)."""
        with self._lock:
            fewer = max(0, len(self._threads) - workers)
            self._workers = workers
        for _ in range(fewer):
            self._queue.put(None)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None or self.closed:
                with self._lock:
                    if threading.current_thread() in self._threads:
                        self._threads.remove(threading.current_thread())
                return
            future, fn, arg = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(arg))
            except BaseException as exc:  # noqa: BLE001 - the future carries it
                future.set_exception(exc)
            del job, future, arg  # hold nothing of the unit between units

    def close(self) -> None:
        with self._lock:
            self.closed = True
        while True:  # what has not started never will
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self._threads:
            self._queue.put(None)


class _Timed:
    """A thread worker's result with its op time: ``wall_s`` for the meter,
    ``busy_s`` (less the thread's wait for a CPU, :class:`~zephon.transport.optime.OpClock`)
    for the dispatch."""

    __slots__ = ("busy_s", "value", "wall_s")

    def __init__(self, value, wall_s: float, busy_s: float) -> None:
        self.value, self.wall_s, self.busy_s = value, wall_s, busy_s


class ThreadExecutor:
    """A stage on daemon threads (see :class:`_DaemonThreads`). ``close()`` returns at
    once: a ``get()`` blocked in another thread raises
    :class:`~zephon.errors.TransportError` ("closed"), queued units are cancelled, and
    a thread busy in an op is not waited for (a Python thread cannot be stopped; it
    finishes the op in the background and its result is dropped)."""

    runner: Runner = "threads"
    adaptive = False
    cpu_pool: int | None = None
    booting = 0

    def __init__(self, program: Callable, workers: int, name: str = "stage", *,
                 meter: StageMeter | None = None) -> None:
        self.program, self.name = program, name
        self.meter = meter if meter is not None else StageMeter()
        self.pool = _DaemonThreads(workers, f"zephon-{name}")
        self._pending: dict[Any, dict] = collections.defaultdict(dict)
        self._closed: cf.Future = cf.Future()  # done once close() ran: wakes get()
        self.workers = self.max_workers = workers
        self._stopped = False

    def pids(self) -> list[int]:
        return []

    def submit(self, lane, seq: int, payload) -> None:
        self._pending[lane][self.pool.submit(self._timed, payload)] = seq

    def _timed(self, payload) -> "_Timed":
        """``program(payload)`` with its op time, which the engine's thread records in
        the meter when it takes the result (a worker thread never touches the meter) and
        hands to the dispatch."""
        clock = OpClock()
        value = _run(self.program, payload)
        return _Timed(value, time.perf_counter() - clock.started, clock.seconds())

    def grow(self) -> None:
        """One thread more (started on the next submit)."""
        self.workers += 1
        self.pool.resize(self.workers)

    def shrink(self) -> None:
        """One thread fewer (it ends after the units queued before its stop)."""
        if self.workers > 1:
            self.workers -= 1
            self.pool.resize(self.workers)

    def get(self, lane):
        pending = self._pending[lane]
        done, _ = cf.wait([*pending, self._closed], return_when=cf.FIRST_COMPLETED)
        if self._closed.done():
            raise TransportError(f"stage {self.name!r} was closed")
        future = next(iter(done))
        seq = pending.pop(future)
        try:
            timed = future.result()
        except BaseException as exc:  # noqa: BLE001 - raised by the engine in stream order
            return seq, UnitFailure(exc), None
        self.meter.ran(timed.wall_s)
        return seq, timed.value, timed.busy_s

    def close(self) -> None:
        self.pool.close()
        if not self._closed.done():
            self._closed.set_result(True)
        _stopped(self)


class ProcessExecutor:
    """A stage on a :class:`~zephon.transport.WorkerPool` made with ``config`` (its start
    method, arena bound, tasks in flight, timing: :class:`~zephon.transport.config.PoolConfig`).
    ``parked`` (set by the adaptive stage that owns it): its units are recorded as a
    parked pool's."""

    runner: Runner = "process"
    adaptive = False
    cpu_pool: int | None = None

    def __init__(self, program: Callable, workers: int, *, config: PoolConfig | None = None,
                 name: str = "stage", max_retries: int = 3, deterministic: bool = True,
                 meter: StageMeter | None = None) -> None:
        self.name, self.max_retries, self.deterministic = name, max_retries, deterministic
        self.meter = meter if meter is not None else StageMeter()
        self.pool = WorkerPool(program, workers, config=config, name=name)
        self.pool.start(wait=False)  # READY is awaited on first use: the engine overlaps
        self._boot_started = time.monotonic()  # ready_now's deadline counts from here
        self._task: dict[int, tuple] = {}  # task id -> (lane, seq, payload)
        self._retries: collections.Counter = collections.Counter()
        self._done: dict[Any, collections.deque] = collections.defaultdict(collections.deque)
        self.workers = self.max_workers = workers
        self.parked = False
        self._stopped = False

    @property
    def booting(self) -> int:
        """Workers grown and not ready yet."""
        return self.pool.booting

    def pids(self) -> list[int]:
        """The process ids of the workers in service or booting."""
        return [h.pid for h in self.pool.workers if (h.alive and not h.retiring) or h.booting]

    def grow(self) -> None:
        """One worker more: it boots while the others work (see WorkerPool.add_worker)."""
        slot = self.pool.add_worker()
        self.workers += 1
        self.meter.event("start", slot)

    def shrink(self) -> None:
        """One worker fewer: the live one with the least in flight (the highest slot on a
        tie) finishes its tasks and is stopped; nothing is re-dispatched."""
        live = [(len(h.inflight), -h.index) for h in self.pool.workers
                if h.alive and not h.retiring]
        if self.workers <= 1 or len(live) <= 1:
            return
        slot = -min(live)[1]
        self.pool.retire_worker(slot)
        self.workers -= 1
        self.meter.event("stop", slot)

    def submit(self, lane, seq: int, payload) -> None:
        task = self.pool.submit(payload)
        self._task[task] = (lane, seq, payload)

    def holds(self, lane) -> bool:
        """Whether a unit of ``lane`` is in flight here or its result waits to be taken."""
        return bool(self._done.get(lane)) or any(t[0] == lane for t in self._task.values())

    def oldest(self, lane) -> int | None:
        """The lowest sequence number of ``lane`` in flight here or waiting to be taken
        (None: none)."""
        seqs = [t[1] for t in self._task.values() if t[0] == lane]
        seqs += [r[0] for r in self._done.get(lane, ())]
        return min(seqs, default=None)

    @property
    def idle(self) -> bool:
        """Nothing in flight and no result waiting to be taken."""
        return not self._task and not any(self._done.values())

    def ready_now(self) -> bool:
        """Whether every worker of the pool is in service, without waiting: a freshly
        started pool is, once each worker's READY has arrived (read here), and a grown
        worker once ``get()`` has read its READY (``booting``).

        Raises:
            TransportError: a fresh pool's workers are not all ready ``spawn_timeout_s``
                after it started (a worker hangs in its set-up), or one failed to start.
        """
        pool = self.pool
        if not pool._ready:
            fds = [h.channel.fileno() for h in pool.workers]
            try:
                readable, _, _ = select.select(fds, [], [], 0)
            except (OSError, ValueError):
                readable = fds  # let _ensure_ready report what is wrong
            if len(readable) < len(fds):
                if time.monotonic() - self._boot_started < pool.spawn_timeout_s:
                    return False
                late = [h.index for h in pool.workers if h.channel.fileno() not in readable]
                raise TransportError(f"worker(s) {late} of pool {pool.name!r} did not start "
                                     f"within {pool.spawn_timeout_s} s")
            pool._ensure_ready()  # reads the READYs (or raises a start-up failure)
        return pool.booting == 0

    def get(self, lane):
        done = self._done[lane]
        while not done:
            try:
                result = self.pool.get(failures=True)
            except WorkerCrashedError as crash:
                self._recover(crash)
                continue
            owner, seq, payload = self._task.pop(result.task_id)
            value = result.value
            if type(value) is UnitFailure:  # an op's SystemExit too: the unit's error
                value.payload = payload
                self._done[owner].append((seq, value, None))
                continue
            timing = result.timing
            if timing is not None:
                self.meter.ran(timing[0], blocked_s=timing[1], nbytes=timing[2],
                               parked=self.parked)
            self._done[owner].append((seq, value, result.busy_s))
        return done.popleft()

    def _recover(self, crash: WorkerCrashedError) -> None:
        lost = [self._task.pop(t) for t in crash.tasks if t in self._task]
        worker = crash.worker
        assert worker is not None  # the pool names the worker of every crash it reports
        self.pool.restart(worker)
        self.meter.event("restart", worker)
        for k, (lane, seq, payload) in enumerate(lost):
            if k == 0:  # the unit the worker was running: the culprit
                self._retries[(lane, seq)] += 1
                if self._retries[(lane, seq)] > self.max_retries:
                    sig = f"signal {crash.signal}" if crash.signal else "an unknown cause"
                    message = (f"stage {self.name}: sequence {seq} of lane {lane} killed its "
                               f"worker {self._retries[(lane, seq)]} times ({sig}); "
                               f"max_worker_retries={self.max_retries} exhausted")
                    if not self.deterministic:
                        warnings.warn(f"zephon: dropping it: {message}", RuntimeWarning,
                                      stacklevel=2)
                        self._done[lane].append((seq, [], None))
                        continue
                    # raised in its place in the stream, after the results before it
                    error = WorkerCrashedError(message, seq=seq, signal=crash.signal,
                                               op=self.name, worker=crash.worker)
                    self._done[lane].append((seq, UnitFailure(error), None))
                    continue
            log.warning("stage %s: re-dispatching sequence %d of lane %s after a worker crash",
                        self.name, seq, lane)
            self.submit(lane, seq, payload)

    def close(self) -> None:
        self.pool.close()
        _stopped(self)

    def adopt(self, meter: StageMeter, workers: int) -> None:
        """Serve a new run of the same stage program with the pool as it is (workers kept
        from the previous run, :mod:`zephon.pipeline.keep`): the run's ``meter`` from
        now on, crash retries counted afresh, grown or shrunk to ``workers``.

        Raises:
            TransportError: the executor is not idle (a kept pool always is).
        """
        if not self.idle:
            raise TransportError(f"stage {self.name!r}: a pool with work in flight cannot "
                                 "serve another run")
        self.meter, self.parked, self._stopped = meter, False, False
        self._retries.clear()
        self._done.clear()
        while self.workers < workers:
            self.grow()
        while self.workers > max(1, workers):
            before = self.workers
            self.shrink()
            if self.workers == before:
                break

    def keepable(self) -> bool:
        """Whether the pool can serve another run: idle, not stopped, no worker dead
        (some may still be booting: they come into service in the next run)."""
        return self.idle and not self._stopped and self.pool.all_running()


class AdaptiveExecutor:
    """An adaptive stage: inline until moved to process workers, and back (see the module
    docstring). ``make_process(workers)`` makes the stage's :class:`ProcessExecutor`
    (called at a move to processes, never before)."""

    adaptive = True
    cpu_pool: int | None = None

    def __init__(self, program: Callable,
                 make_process: Callable[[int, StageMeter], ProcessExecutor],
                 name: str = "stage", *, meter: StageMeter | None = None) -> None:
        self.program, self.name = program, name
        self.meter = meter if meter is not None else StageMeter()
        self._make = make_process
        self._inline = InlineExecutor(program, name=name, meter=self.meter,
                                      measures_demand=True)
        self._proc: ProcessExecutor | None = None  # booting, in service or parked
        self._in_process = False  # units go to _proc (else they run inline)
        self._parked = False  # _proc is kept, nothing new sent to it, after a move back
        self._release = False  # stop _proc once its units are back
        self.max_workers = 1
        #: why the stage cannot move to processes (it stays inline); "" while it can
        self.unable = ""
        #: pools made so far, and units sent to process workers (tests read them)
        self.pools_made = self.process_units = 0
        #: what is still to be seen to pickle: a sample of the stage's input and output
        self._unseen = {"input", "output"}
        #: moves to processes undone by the stage itself, not by the controller: ``(the
        #: workers it had or was booting, why)``, which the controller takes and records
        self.fallen: list[tuple[int, str]] = []

    @property
    def runner(self) -> Runner:
        """The mode now: ``"process"`` once a move's workers are all in service, else
        ``"inline"``."""
        return "process" if self._in_process else "inline"

    @property
    def workers(self) -> int:
        return self._proc.workers if self._in_process and self._proc is not None else 1

    @property
    def booting(self) -> int:
        """Workers of a move to processes not ready yet (the stage runs inline until then),
        or grown and not ready yet."""
        proc = self._proc
        if proc is None or self._release:
            return 0
        if not self._in_process:
            if self._parked:
                return 0
            self._poll()
            if self._proc is None:  # the move failed or was called off
                return 0
            if not self._in_process:
                return max(1, proc.workers)
        return proc.booting

    @property
    def moving_to(self) -> int | None:
        """The workers of a move to processes still booting (None: no such move)."""
        proc = self._proc
        if proc is None or self._in_process or self._parked or self._release:
            return None
        return proc.workers

    # -- moves (the controller's) ------------------------------------------------------------
    def to_process(self, workers: int, wait: bool = False) -> None:
        """Move to ``workers`` process workers: a parked pool is taken back at once (grown
        or shrunk to ``workers``); else a pool is started and the stage submits to it once
        its workers are ready (``wait``: wait for them here, a test's way to know the
        next units go to processes).

        Raises:
            TransportError: the stage cannot run in processes (``unable`` says why).
        """
        if self.unable:
            raise TransportError(f"stage {self.name!r} stays inline: {self.unable}")
        proc = self._proc
        if proc is not None and (self._parked or self._release):
            self._parked = self._release = False
            self._in_process = True
            proc.parked = False
            while proc.workers < workers:
                proc.grow()
            while proc.workers > workers and proc.workers > 1:
                before = proc.workers
                proc.shrink()
                if proc.workers == before:
                    break
            return
        if proc is not None:
            return  # moving or in process mode already
        try:
            proc = self._make(workers, self.meter)
        except Exception as exc:
            self.unable = f"{type(exc).__name__}: {exc}"
            raise TransportError(f"stage {self.name!r} stays inline: {self.unable}") from exc
        self.pools_made += 1
        self._proc = proc
        if wait:
            try:
                proc.pool._ensure_ready()
            except Exception as exc:  # noqa: BLE001 - the move failed: the stage stays inline
                self._boot_failed(proc, exc)
                return
            self._poll()

    def to_inline(self) -> None:
        """Run the units inline from now on; the pool is parked (its units in flight come
        back through ``get()``) until :meth:`release` or a move back. A move still
        booting is called off (its pool stopped)."""
        proc = self._proc
        if proc is None:
            return
        if not self._in_process:
            if not self._parked:  # booting: nothing of it is in flight
                self._proc = None
                self._close(proc)
            return
        self._in_process = False
        self._parked = True
        # its units still in flight are recorded as parked: the stage's busy fraction is
        # its inline units' from now on (they carry the CPU demand a parked pool's lack)
        proc.parked = True

    def release(self) -> None:
        """Stop a parked pool once the units it has in flight are back."""
        if self._proc is not None and not self._in_process:
            self._release = True
            self._reap()

    def grow(self) -> None:
        if self._in_process and self._proc is not None:
            self._proc.grow()

    def shrink(self) -> None:
        if self._in_process and self._proc is not None:
            self._proc.shrink()

    # -- units ---------------------------------------------------------------------------------
    def _poll(self) -> None:
        """A move under way: submit to the pool from now on if every worker is ready; a
        stage found unable meanwhile (its first inline units made what cannot be
        pickled) calls the move off."""
        proc = self._proc
        if proc is None or self._in_process or self._parked or self._release:
            return
        if self.unable:
            self._proc = None
            self._close(proc)
            self.fallen.append((proc.workers, self.unable))
            return
        try:
            ready = proc.ready_now()
        except Exception as exc:  # noqa: BLE001 - a move that failed: stay inline
            self._boot_failed(proc, exc)
            return
        if ready:
            self._in_process = True

    def _boot_failed(self, proc: ProcessExecutor, exc: BaseException) -> None:
        """The workers of a move did not start (``exc`` says why): the stage stays
        inline."""
        log.warning("stage %s: process workers failed to start, staying inline: %s",
                    self.name, exc)
        self.unable = f"its process workers failed to start: {type(exc).__name__}: {exc}"
        self._proc = None
        self._close(proc)
        self.fallen.append((proc.workers, self.unable))

    def _give_up(self, why: str) -> None:
        """The stage's process workers cannot run what it has to run (``why``): it stays
        inline from now on, its pool stopped once the units in flight are back (each
        such unit runs again inline: the caller does)."""
        if self.unable:
            return
        self.unable = why
        log.warning("stage %s goes back inline and stays there: %s", self.name, why)
        workers = self.workers
        self.to_inline()
        self.release()
        self.fallen.append((workers, why))

    def _reap(self) -> None:
        proc = self._proc
        if proc is not None and self._release and not self._in_process and proc.idle:
            self._proc = None
            self._parked = self._release = False
            self._close(proc)

    def _close(self, proc: ProcessExecutor) -> None:
        proc._stopped = True  # a stop of the pool is not the stage's: no stop events
        try:
            proc.close()  # workers still starting up are killed at once (WorkerPool.close)
        except Exception as exc:  # noqa: BLE001 - the stage goes on inline
            log.warning("stage %s: stopping its process workers: %s", self.name, exc)

    def submit(self, lane, seq: int, payload) -> None:
        self._poll()
        if self._in_process and self._proc is not None:
            try:
                self._proc.submit(lane, seq, payload)
            except SerializationError as exc:  # nothing was sent: it runs inline below
                self._give_up(f"its input cannot be pickled for process workers: {exc}")
            else:
                self.process_units += 1
                return
        self._reap()
        if "input" in self._unseen:  # before the program takes the part's records
            self._check_sendable("input", payload[1] if isinstance(payload, tuple) and
                                 len(payload) == 2 else None)
        self._inline.submit(lane, seq, payload)
        if "output" in self._unseen:
            self._check_sendable("output", self._inline._done[lane][-1][1])

    def _check_sendable(self, what: str, items) -> None:
        """Until a sample of the stage's ``what`` ("input" or "output") has been seen (in
        the first inline unit that had one): whether it can cross to or from a process
        worker. One that cannot (a lock, an open file, a generator in it) would fail the
        run once moved, where inline it goes on: the stage stays inline (``unable``,
        logged once). A read unit (indices) always can."""
        if isinstance(items, UnitFailure) or (items is not None and not items):
            return  # nothing to look at in this unit (a failed one, one filtered empty)
        if not isinstance(items, list):
            self._unseen.discard(what)
            return
        self._unseen.discard(what)
        found = find_unpicklable(getattr(items[0], "value", items[0]), what)
        if found is not None:
            self._unseen.clear()
            self.unable = (f"its {what} cannot be pickled for process workers: "
                           f"{found[0]} ({found[1]})")
            log.warning("stage %s stays inline: %s", self.name, self.unable)

    def get(self, lane):
        """The lane's oldest unit first, inline or in the pool: after a move back inline,
        the units the parked pool still holds come before the inline ones made since
        (the dispatch yields in sequence order, so a later unit taken first only waits in
        its buffer), and the pool is stopped as soon as they are back."""
        done = self._inline._done.get(lane)
        proc = self._proc
        if done:
            oldest = proc.oldest(lane) if proc is not None else None
            if oldest is None or oldest > done[0][0]:
                return done.popleft()
        if proc is None or not proc.holds(lane):
            raise TransportError(f"stage {self.name!r}: nothing of lane {lane} in flight")
        out = proc.get(lane)
        failed = out[1]
        if type(failed) is UnitFailure and failed.payload is not None and \
                isinstance(failed.error, Exception):
            out = self._again_inline(lane, out[0], failed)
        self._reap()
        return out

    def _again_inline(self, lane, seq: int, failed: UnitFailure):
        """A unit that failed in a process worker runs again inline, whole (the records
        the worker made before its failure are made again, the same): failing there too,
        the failure is the op's and is handed on as the inline runner hands it on (the
        op's own exception, not its worker's copy); passing, it was the worker's (a
        result it could not send back, an input it could not rebuild: samples the first
        units' check did not see), and the stage stays inline. A unit that failed with
        what is not an ``Exception`` (the op's ``SystemExit`` or ``KeyboardInterrupt``:
        a worker ignores SIGINT, so it is the op's own) is not run again: the op asked
        the program to stop, and runs once, as on every runner."""
        self._inline.submit(lane, seq, failed.payload)
        again = self._inline._done[lane].pop()
        if type(again[1]) is not UnitFailure:
            error = failed.error
            if failed.unsendable:
                self._give_up(f"its output cannot be pickled for process workers: {error}")
            else:
                self._give_up(f"a unit failed in a process worker and passed inline: "
                              f"{type(error).__name__}: {error}")
        return again

    def close(self) -> None:
        self._inline.close()
        proc, self._proc = self._proc, None
        self._in_process = False
        if proc is not None:
            self._close(proc)

    def detach(self) -> ProcessExecutor | None:
        """The stage's pool, taken out for the next run to reuse, when the stage runs on
        it (or is moving to it) and it can serve another run
        (:meth:`ProcessExecutor.keepable`); None otherwise (then :meth:`close` stops it). A move still booting is kept too: the
        next run, which starts where this one left the stage, takes it up."""
        proc = self._proc
        moving = self.moving_to is not None
        if proc is None or not (self._in_process or moving) or not proc.keepable():
            return None
        self._proc, self._in_process = None, False
        return proc

    def pids(self) -> list[int]:
        """The process ids of the pool's workers (booting, in service or parked)."""
        return self._proc.pids() if self._proc is not None else []


def _stopped(executor) -> None:
    """Record the stop of ``executor``'s workers in its meter (once)."""
    if executor._stopped:
        return
    executor._stopped = True
    for k in range(executor.workers):
        executor.meter.event("stop", k)
