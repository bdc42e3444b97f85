"""The process backend: job scheduling over supervised worker processes.

Starting, the READY handshake, signalling a worker's process tree, stopping
and reaping belong to :mod:`zephon.transport.supervisor`; this module decides
when: timeouts, OOM back-off, recycling, persistent vs isolated workers.

One outcome per subject, by construction. Each dispatch of a subject is an
*attempt* with a task id unique in the backend; the parent keeps, per round, the
attempts that are running (``task id -> subject index``). An outcome is only
ever produced by :meth:`ProcessBackend._settle`, which removes the attempt from
that map: an attempt is settled at most once, and a message or a death that
belongs to an attempt already settled (a late report from a worker written off,
say) is dropped. A worker's message is accepted only when it names the task the
worker is running. A round ends when no subject is queued or running.

Verdicts come from the worker's own report. A worker sends ``started {id, t}``
(``t`` on ``CLOCK_MONOTONIC``, which parent and worker share) and, once the
callable returned or raised, ``done``/``error`` with ``d``, the time from start
to return measured by the worker. A report with ``d <= subject_timeout_sec`` is
the subject's outcome whenever the parent reads it: a consumer that spends
seconds on each result delays the reading, never the verdict. The parent drains
every pending message before it judges a deadline (``t + subject_timeout_sec``);
when one has passed it SIGTERMs the worker's process group, and the subject's
verdict waits until that worker is gone: a report the worker completed before
dying still wins (the worker blocks SIGTERM while it reports, so a report is
never cut in half), anything else is a :class:`~zephon.errors.SubjectTimeoutError`.
A report with ``d`` over the timeout is a timeout too.

Slots (workers, :class:`SlotState`; each has a slot index, the lowest free
one, reported as ``worker=`` of a crash with the ``pid`` beside it): ``starting`` (spawned, READY not seen; bounded
by ``subject_spawn_timeout_sec``), ``idle``, ``busy`` (an attempt in flight),
``stopping`` (sent STOP after recycling or a failure restart, or because work
ran out: its result was already read), ``dying`` (SIGTERM sent to its process
group; SIGKILL to the group at ``graceful_shutdown_sec`` later). A slot is
dropped once its worker has exited and been reaped, and what it sent before
exiting has been read. The loop never blocks on one worker: it waits on every
channel, and on the wake-up pipe of the run's
:class:`~zephon.transport.deaths.DeathWatch` (the detector the pipeline's pool
uses too), with a timeout that is the nearest deadline. A worker's exit wakes
the loop at once, whoever holds its channel open; a busy worker that died by
itself is reported as a pool worker is (``worker 0 (pid 4321) of job run of f
died by signal SIGKILL while running subject 'S01'``, a
:class:`~zephon.errors.WorkerCrashedError` with ``worker``, ``pid``, ``signal``
and ``tasks``).

The process tree. Each worker leads its own process group and, on Linux, is a
child subreaper, so a descendant that leaves the group (``setsid``, a
double-forked daemon) is re-parented to the worker instead of init. A worker
told to stop, or terminated by SIGTERM, ends every descendant it has (SIGTERM,
then SIGKILL) before it exits. The parent signals whole groups: on a timeout SIGTERM, then SIGKILL
after ``graceful_shutdown_sec`` whether or not the worker itself is already
gone; every group of a worker that exited is swept the same way; at shutdown
every group gets SIGTERM, one shared grace, SIGKILL, and the run returns only
when no member of any of its groups is alive. What escapes: a descendant that
left the group of a worker that was killed outright (SIGKILL, or a subject that
replaced the worker's SIGTERM handler) before it could end it.

Concurrency starts at the run's worker count (capped to the visible GPUs when
asked) and only goes down: each OOM (a ``MemoryError`` in the subject, or the
worker killed by SIGKILL while running it) lowers it by ``oom_reduce_workers_by``
(never below one) when ``oom_backoff`` is on. It lives on the backend, so
retry rounds keep it. Extra workers are stopped as soon as they are idle.

A persistent worker keeps its ``setup()`` for the whole run: an ordinary
exception in a subject is that subject's failure and the worker goes on. It is
replaced only after a crash or a timeout (it is gone), after
``persistent_worker_recycle_after_tasks`` successes, or after
:func:`max_consecutive_failures` failed subjects in a row (a worker whose state
broke fails everything; the default is 10).
``isolated`` mode is ``persistent`` mode with a recycle after every success and
a restart after every failure: a fresh child per subject.

Ctrl-C. A KeyboardInterrupt in the loop leaves the round as it is; the run then
calls :meth:`ProcessBackend.shutdown`, the graceful stop (STOP to idle workers,
SIGTERM to busy ones, SIGKILL after ``graceful_shutdown_sec``). A second Ctrl-C
during that stop kills every worker outright, with its process group and
descendants (:func:`~zephon.transport.supervisor.kill_children`), and is raised
once they are gone; a third one meanwhile is held
(:class:`~zephon.transport.supervisor.InterruptGuard`), so nothing is left
running. The stop's guard takes a Ctrl-C that the run's guard held before the
stop began (a second one right behind the first): the stop then kills at once. Starting a worker and registering it is one step a Ctrl-C cannot
split. Workers are not daemons (a subject may start processes): a backend still
live at interpreter exit (a run whose iterator was kept, not finished) is shut
down from a ``threading`` exit hook, before multiprocessing's own exit handler
would join its workers for ever.

GPU slots: with ``gpu_slots`` each worker gets the lowest slot no live worker
holds (a dying worker still holds its slot until it is gone), exported as
``ZEPHON_GPU_SLOT``; a replacement therefore reuses a freed slot and two live
workers never share one.
"""

from __future__ import annotations

import atexit
import collections
import enum
import logging
import os
import pickle
import selectors
import signal
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Final, NamedTuple

from zephon.errors import (
    JobSetupError,
    SerializationError,
    SubjectTimeoutError,
    TransportError,
)
from zephon.jobs.subjects import subject_label
from zephon.jobs.worker import job_worker_main, unpickle_value
from zephon.transport.channel import ChannelClosed
from zephon.transport.deaths import DeathWatch, death_text
from zephon.transport.remote_errors import decode_exception, remote_traceback
from zephon.transport.supervisor import (
    KILL_WAIT_S,
    Child,
    InterruptGuard,
    MsgKind,
    ShutdownPolicy,
    crash_error,
    exit_text,
    handshake,
    kill_children,
    startup_death_error,
    stop_children,
    sweep_groups,
)

__all__ = ["TREE_POLICY", "JobSetupError", "Outcome",
           "ProcessBackend", "max_consecutive_failures"]

log = logging.getLogger("zephon.jobs")

#: How the backend makes sure no process a subject started outlives the run (explain()).
TREE_POLICY = (
    "each worker leads its own process group (SIGTERM, then SIGKILL after the grace, to the "
    "whole group on a timeout, when a worker exits and at shutdown, whether or not the "
    "worker is still alive) and is a child subreaper on Linux (descendants that leave the "
    "group are re-parented to it and ended when it stops or is terminated); what a subject "
    "leaves running outside the group is ended when it returns (what the callable's "
    "setup() started is kept); a descendant that left the group of a worker killed "
    "outright (SIGKILL, or a subject's own SIGTERM handler) while its subject runs is not "
    "covered")



def max_consecutive_failures(policy) -> int:
    """Failed subjects in a row after which a worker of ``policy`` is restarted: 1 in
    ``isolated`` mode, else ``persistent_worker_max_consecutive_failures`` (10 by
    default: one ordinary exception is the subject's, a run of them says the worker's
    own state is broken)."""
    if policy.parallel_mode == "isolated":
        return 1
    return policy.persistent_worker_max_consecutive_failures


_IDLE_WAIT_S: Final = 0.5  # longest wait of the loop when no deadline is nearer
_CLOCK_SKEW_S: Final = 1.0  # a worker's start time this far ahead of ours is not our clock
_CLOCK_PAST_S: Final = 3600.0  # ... nor one this far behind
_CHANNEL_BYTES: Final = 1 << 20  # socket buffer of a job worker's channel


class SlotState(enum.Enum):
    """The state of a worker slot (see the module docstring)."""

    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    STOPPING = "stopping"
    DYING = "dying"


_LIVE_STATES: Final = (SlotState.STARTING, SlotState.IDLE, SlotState.BUSY)


class Outcome(NamedTuple):
    """One subject's outcome: its index, whether it succeeded, its value or error, how long
    it ran and its ``kind`` (``"ok"``, ``"error"``, ``"oom"``, ``"timeout"``, ``"crash"``)."""

    index: int  # type: ignore[assignment]  # the public field name shadows tuple.index
    ok: bool
    value: Any
    error: BaseException | None
    duration_s: float
    kind: str  # "ok" | "error" | "oom" | "timeout" | "crash"


class _Slot:
    __slots__ = ("channel", "child", "deadline", "failures", "gpu_slot", "index",
                 "kill_at", "killed_at", "pid", "registered", "state", "successes", "task")

    def __init__(self, child: Child, index: int, gpu_slot, deadline) -> None:
        self.child, self.index, self.gpu_slot = child, index, gpu_slot
        self.channel, self.pid = child.channel, child.pid
        self.state, self.deadline = SlotState.STARTING, deadline
        self.task: int | None = None
        self.successes = self.failures = 0
        self.kill_at = self.killed_at = None
        self.registered = True


class ProcessBackend:
    name = "process"

    def __init__(self, fn, policy, workers: int, *, gpu_slots: bool, mp_context,
                 names=None) -> None:
        self.names = names  # subject ids by position, to name subjects in errors
        try:
            self.fn_bytes = pickle.dumps(fn, protocol=5)
        except Exception as exc:
            raise SerializationError(
                f"the job callable {fn!r} cannot be pickled for worker processes: "
                f"{type(exc).__name__}: {exc}; use a module-level function or an object "
                "whose class is importable") from exc
        self.fn_label = getattr(fn, "__qualname__", type(fn).__qualname__)
        self.policy = policy
        self.timeout = policy.subject_timeout_sec
        self.grace = policy.graceful_shutdown_sec
        self.concurrency = workers
        self.gpu_slots = gpu_slots
        self.gpu_count = workers  # slots 0..workers-1 (the run capped workers to the GPUs)
        self.ctx = mp_context
        isolated = policy.parallel_mode == "isolated"
        self.recycle_after = 1 if isolated else policy.persistent_worker_recycle_after_tasks
        self.max_failures = max_consecutive_failures(policy)
        self.slots: list[_Slot] = []
        self.selector = selectors.DefaultSelector()
        self.stats: collections.Counter[str] = collections.Counter()
        self._task_ids = iter(range(1, 1 << 62))
        self._running: dict[int, int] = {}  # task id -> subject index (attempts in flight)
        self._sweeps: dict[Child, float] = {}  # a gone worker's group -> when it gets SIGKILL
        # every worker's exit, as it happens (see zephon.transport.deaths); its wake-up
        # pipe is the selector's key without data
        self.deaths = DeathWatch(f"job run of {self.fn_label}")
        self.selector.register(self.deaths.fileno(), selectors.EVENT_READ, None)
        self._closed = False
        _live_backends.add(self)

    # -- workers ---------------------------------------------------------------------
    def _spawn(self) -> _Slot | None:
        gpu = None
        if self.gpu_slots:
            held = {s.gpu_slot for s in self.slots}
            free = [g for g in range(self.gpu_count) if g not in held]
            if not free:
                return None  # a dying worker still holds the slot: wait for it
            gpu = free[0]
        boot = {"fn": self.fn_bytes, "gpu_slot": gpu, "parent_pid": os.getpid(),
                "grace": self.grace}
        spawn_timeout = self.policy.subject_spawn_timeout_sec
        held = {s.index for s in self.slots}
        index = next(k for k in range(len(self.slots) + 1) if k not in held)
        # a Ctrl-C waits until the worker is a slot: one it split off would be a non-daemon
        # child nobody stops, which multiprocessing joins for ever at exit
        with InterruptGuard(hold=True):
            child = Child.spawn(self.ctx, job_worker_main, (boot,), transport="socketpair",
                                buffer_bytes=_CHANNEL_BYTES, name="zephon-job-worker",
                                daemon=False, group=True)
            deadline = None if spawn_timeout is None else time.monotonic() + spawn_timeout
            slot = _Slot(child, index, gpu, deadline)
            self.slots.append(slot)
            self.selector.register(child.channel.fileno(), selectors.EVENT_READ, slot)
            self.deaths.watch(index, child)
            self.stats["workers_started"] += 1
        return slot

    def _unregister(self, slot: _Slot) -> None:
        if slot.registered:
            slot.registered = False
            try:
                self.selector.unregister(slot.channel.fileno())
            except (KeyError, ValueError):
                pass

    def _forget(self, slot: _Slot) -> None:
        """Drop a slot whose worker is gone; its process group is swept (see the module
        docstring): SIGKILL at its kill time if it was terminated, else SIGTERM now."""
        self._unregister(slot)
        slot.channel.close()
        if slot in self.slots:
            self.slots.remove(slot)
        kill_at = slot.kill_at
        if kill_at is None and slot.killed_at is None:
            if slot.child.signal(signal.SIGTERM):  # exited: its group only
                kill_at = time.monotonic() + self.grace
        if kill_at is not None:
            self._sweeps[slot.child] = kill_at

    def _stop(self, slot: _Slot) -> None:
        slot.state = SlotState.STOPPING
        slot.deadline = time.monotonic() + self.grace
        slot.child.send_stop()

    def _terminate(self, slot: _Slot) -> None:
        slot.state = SlotState.DYING
        slot.deadline = None
        slot.child.stopped = True
        slot.child.signal(signal.SIGTERM)
        slot.kill_at = time.monotonic() + self.grace

    # -- attempts ----------------------------------------------------------------------
    def _settle(self, task: int | None, ok: bool, value, error, duration_s: float,
                kind: str) -> Outcome | None:
        """The one place an outcome is made: only for an attempt still running."""
        index = self._running.pop(task, None) if task is not None else None
        if index is None:
            return None
        return Outcome(index, ok, value, error, duration_s, kind)

    def _index_of(self, task: int | None) -> int:
        """The subject index of a running attempt (-1 when it is not running)."""
        return -1 if task is None else self._running.get(task, -1)

    def _label(self, index: int) -> str:
        return subject_label(self.names, index)

    def _timeout_error(self, index: int) -> SubjectTimeoutError:
        return SubjectTimeoutError(
            f"{self._label(index)} ran past subject_timeout_sec={self.timeout} s; its worker's "
            "process group was terminated", timeout_s=self.timeout,
            subject_id=None if self.names is None else self.names[index])

    # -- one round -----------------------------------------------------------------------
    def run_round(self, items: Iterable[tuple[int, Any]]) -> Iterator[Outcome]:
        """Run ``(index, subject)`` items; yields exactly one :class:`Outcome` per item."""
        queue = collections.deque(items)
        self._running = {}
        while queue or self._running:
            out: list[Outcome] = []
            self._staff(len(queue))
            for slot in self.slots:
                if slot.state is SlotState.IDLE and queue:
                    index, subject = queue.popleft()
                    self._dispatch(slot, index, subject, out)
            self._poll(out)
            yield from out

    def _staff(self, queued: int) -> None:
        live = [s for s in self.slots if s.state in _LIVE_STATES]
        busy = sum(1 for s in live if s.state is SlotState.BUSY)
        want = min(self.concurrency, queued + busy)
        for slot in [s for s in live if s.state is SlotState.IDLE][: max(0, len(live) - want)]:
            self._stop(slot)  # after an OOM back-off, or when work runs out
            live.remove(slot)
        while len(live) < want:
            started = self._spawn()
            if started is None:
                break
            live.append(started)

    def _dispatch(self, slot: _Slot, index: int, subject, out: list) -> None:
        task = next(self._task_ids)
        self._running[task] = index
        try:
            payload = pickle.dumps(subject, protocol=5)
        except Exception as exc:  # noqa: BLE001
            out.append(self._settle(task, False, None, SerializationError(
                f"{self._label(index)} cannot be pickled: {exc}"), 0.0, "error"))
            return
        slot.task, slot.state = task, SlotState.BUSY
        # Until the worker says when it started, the deadline counts from the dispatch.
        slot.deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            slot.channel.send({"k": MsgKind.TASK, "id": task}, [payload])
        except ChannelClosed:
            pass  # its death is handled with this attempt, when the worker is reaped

    def _poll(self, out: list) -> None:
        """Wait for the nearest event, read every pending message, reap the workers that
        exited, then (and only then) judge deadlines."""
        ready = self.selector.select(self._wait_time())
        while ready:
            for key, _ in ready:
                if key.data is None:
                    self.deaths.clear_wake()  # the exits are taken by _reap
                else:
                    self._read(key.data, out)
            ready = self.selector.select(0)
        self._reap(out)
        self._judge(out)

    def _wait_time(self) -> float:
        times = [t for s in self.slots for t in (s.deadline, s.kill_at) if t is not None]
        times.extend(self._sweeps.values())
        if not times:
            return _IDLE_WAIT_S
        return max(0.0, min(_IDLE_WAIT_S, min(times) - time.monotonic()))

    def _read(self, slot: _Slot, out: list) -> None:
        try:
            header, frames, _ = slot.channel.recv()
        except (ChannelClosed, TransportError, OSError):
            self._unregister(slot)  # its exit comes from the death watch
            return
        self._message(slot, header, frames, out)

    def _message(self, slot: _Slot, header, frames, out: list) -> None:
        kind = header.get("k")
        if kind in (MsgKind.READY, MsgKind.FAIL):
            self._handshake(slot, header, frames)
            return
        task = header.get("id")
        if task is None or task != slot.task or task not in self._running:
            log.debug("dropped a %s message for task %s from worker pid %s (running %s)",
                      kind, task, slot.pid, slot.task)
            return
        if kind == MsgKind.STARTED:
            self._started(slot, header)
        elif kind in (MsgKind.DONE, MsgKind.ERROR):
            self._report(slot, task, header, frames, out)

    def _started(self, slot: _Slot, header) -> None:
        """The worker says when the subject started: its deadline counts from then."""
        if slot.state is SlotState.BUSY and self.timeout is not None:
            started = float(header.get("t", 0.0))
            now = time.monotonic()
            if not now - _CLOCK_PAST_S < started <= now + _CLOCK_SKEW_S:  # not our clock
                started = now
            slot.deadline = started + self.timeout

    def _decode_report(self, slot: _Slot, index: int, header, frames):
        """``(ok, value, error)`` of a DONE/ERROR report judged in time."""
        if header.get("k") == MsgKind.DONE:
            try:
                return True, unpickle_value(frames), None
            except Exception as exc:  # noqa: BLE001 - the value's class is not importable here
                return False, None, SerializationError(
                    f"the value of {self._label(index)} cannot be unpickled in the parent: "
                    f"{type(exc).__name__}: {exc}")
        return False, None, decode_exception(frames[0], header.get("tb", ""),
                                             f"{self._label(index)} on job worker pid {slot.pid}")

    def _after_report(self, slot: _Slot, late: bool, ok: bool) -> None:
        """The slot's next state once its subject reported: idle, recycled, restarted after
        failures, or terminated (a report over the timeout)."""
        slot.task = None
        if slot.state is not SlotState.BUSY:
            return  # dying: the report came in before the worker was gone
        slot.state, slot.deadline = SlotState.IDLE, None
        if late:
            self.stats["timeouts"] += 1
            self._terminate(slot)
        elif ok:
            slot.successes += 1
            slot.failures = 0
            if self.recycle_after and slot.successes >= self.recycle_after:
                self.stats["recycled"] += 1
                self._stop(slot)
        else:
            slot.failures += 1
            if slot.failures >= self.max_failures:
                self.stats["restarts"] += 1
                self._stop(slot)

    def _report(self, slot: _Slot, task: int, header, frames, out: list) -> None:
        """A DONE or ERROR report: the subject's outcome (see the module docstring)."""
        duration = float(header["d"])
        index = self._running[task]
        late = self.timeout is not None and duration > self.timeout
        ok, value, error = (False, None, None) if late else \
            self._decode_report(slot, index, header, frames)
        oom = not (late or ok) and header.get("k") == MsgKind.ERROR and bool(header.get("oom"))
        self._after_report(slot, late, ok)
        if late:
            outcome = self._settle(task, False, None, self._timeout_error(index),
                                   self.timeout or 0.0, "timeout")
        elif ok:
            outcome = self._settle(task, True, value, None, duration, "ok")
        else:
            if oom:
                self._back_off()
            outcome = self._settle(task, False, None, error, duration, "oom" if oom else "error")
        if outcome is not None:
            out.append(outcome)

    def _drain_dead(self, slot: _Slot, out: list) -> None:
        """Read what a worker that has exited sent before it did, without blocking: it is
        all in the channel already, and a grandchild may hold the worker's end open for
        ever (a message cut short by the death reads as the end)."""
        if not slot.registered:
            return
        try:
            os.set_blocking(slot.channel.fileno(), False)
        except OSError:
            pass  # closed already: the read says so
        waiter = selectors.DefaultSelector()
        try:
            waiter.register(slot.channel.fileno(), selectors.EVENT_READ)
            while slot.registered and waiter.select(0):
                self._read(slot, out)
        finally:
            waiter.close()

    def _reap(self, out: list) -> None:
        """Judge every worker exit the death watch saw: what it sent first, then its
        slot's state says what the exit means."""
        for death in self.deaths.take():
            slot = next((s for s in self.slots if s.child is death.child), None)
            if slot is None:
                continue  # written off already (it outlived SIGKILL by KILL_WAIT_S)
            code = death.exitcode
            self._drain_dead(slot, out)
            state, task = slot.state, slot.task
            self._forget(slot)
            if state is SlotState.STARTING:
                unguarded = startup_death_error(code, f"job run of {self.fn_label}")
                if unguarded is not None:
                    raise JobSetupError(str(unguarded)) from None
                raise JobSetupError(
                    f"a job worker (pid {slot.pid}) died before it was ready ({exit_text(code)})"
                    "; is the callable importable in a fresh process?")
            if state is SlotState.DYING:
                outcome = self._settle(task, False, None, self._timeout_error(
                    self._index_of(task)), self.timeout or 0.0, "timeout")
            elif state is SlotState.BUSY:
                outcome = self._crashed(slot, task, code)
            else:
                if state is SlotState.IDLE:
                    log.warning("idle job worker %d (pid %s) exited (%s)", slot.index, slot.pid,
                                exit_text(code))
                outcome = None
            if outcome is not None:
                out.append(outcome)

    def _crashed(self, slot: _Slot, task, code: int | None) -> Outcome | None:
        """A busy worker died by itself: the subject's crash (the same report as a pool
        worker's: :func:`~zephon.transport.deaths.death_text`), or its OOM when SIGKILL."""
        index = self._index_of(task)
        tasks = () if task is None else (task,)
        oom = code == -signal.SIGKILL
        if oom:
            self._back_off()
        text = death_text(slot.index, slot.pid, f"job run of {self.fn_label}", code)
        error = crash_error(
            f"{text} while running {self._label(index)}" + (" (counted as out of memory: the kernel's OOM killer sends SIGKILL)" if oom
               else ""), worker=slot.index, pid=slot.pid, exitcode=code, tasks=tasks)
        return self._settle(task, False, None, error, 0.0, "oom" if oom else "crash")

    def _judge(self, out: list) -> None:
        now = time.monotonic()
        for slot in list(self.slots):
            if slot.state is SlotState.DYING:
                if slot.kill_at is not None and now >= slot.kill_at:
                    slot.child.signal(signal.SIGKILL)
                    slot.kill_at, slot.killed_at = None, now
                elif slot.killed_at is not None and now >= slot.killed_at + KILL_WAIT_S:
                    log.warning("job worker pid %s survived SIGKILL for %s s; giving up on it",
                                slot.pid, KILL_WAIT_S)
                    task = slot.task
                    self._forget(slot)
                    outcome = self._settle(task, False, None, self._timeout_error(
                        self._index_of(task)), self.timeout or 0.0, "timeout")
                    if outcome is not None:
                        out.append(outcome)
                continue
            if slot.deadline is None or now < slot.deadline:
                continue
            if slot.state is SlotState.STARTING:
                slot.child.signal(signal.SIGKILL)
                raise JobSetupError(
                    f"a job worker did not become ready within "
                    f"{self.policy.subject_spawn_timeout_sec} s (subject_spawn_timeout_sec): "
                    "unpickling the callable or its setup() hangs")
            if slot.state is SlotState.STOPPING:
                self._terminate(slot)
            elif slot.state is SlotState.BUSY:
                self.stats["timeouts"] += 1
                self._terminate(slot)  # the verdict waits for the worker to be gone
        for child, kill_at in list(self._sweeps.items()):
            if now >= kill_at:
                child.signal(signal.SIGKILL)
                del self._sweeps[child]

    def _back_off(self) -> None:
        if not self.policy.oom_backoff:
            return
        lowered = max(1, self.concurrency - self.policy.oom_reduce_workers_by)
        if lowered < self.concurrency:
            log.warning("out of memory: lowering job concurrency from %d to %d for the rest "
                        "of the run", self.concurrency, lowered)
            self.concurrency = lowered
            self.stats["oom_backoffs"] += 1

    # -- shutdown ---------------------------------------------------------------------
    def _handshake(self, slot: _Slot, header, frames) -> None:
        """READY makes a starting slot idle; FAIL (the callable did not unpickle, or its
        ``setup()`` raised) fails the run with :class:`JobSetupError`."""
        try:
            ready = handshake(header, frames, f"setting up job worker pid {slot.pid}")
        except BaseException as error:  # the worker's own set-up exception, whatever its type
            if not isinstance(error, Exception) and remote_traceback(error) is None:
                raise  # this process's own interrupt, not the worker's SystemExit
            raise JobSetupError(
                f"a job worker could not set up the callable: {type(error).__name__}: "
                f"{error}") from error
        if ready and slot.state is SlotState.STARTING:
            slot.state, slot.deadline = SlotState.IDLE, None

    def shutdown(self, grace: float) -> None:
        """Stop every worker in parallel within ``grace`` seconds, then kill; reap all; then
        sweep every process group the run created until none of its members is alive:
        SIGTERM, the rest of the same ``grace``, SIGKILL (see
        :func:`~zephon.transport.supervisor.stop_children` and
        :func:`~zephon.transport.supervisor.sweep_groups`). A Ctrl-C meanwhile kills them
        all outright and is raised once they are gone (later ones are held). Idempotent."""
        # held from the start: a Ctrl-C before the stop is under way (a second one right
        # behind the first, typically) is raised by arm(), inside it: it kills at once
        with InterruptGuard(hold=True, take_held=True) as guard:
            if self._closed:
                return
            self._closed = True
            _live_backends.discard(self)
            self.deaths.close()  # the exits from here on are the shutdown's own
            slots = list(self.slots)
            groups = {child.pid for child in self._sweeps} | {slot.pid for slot in slots}
            try:
                try:
                    guard.arm()
                    left = self._stop_gracefully(slots, groups, grace)
                except KeyboardInterrupt:
                    log.warning("Ctrl-C while job workers stop: killing them now")
                    kill_children([s.child for s in slots], groups)
                    raise
            finally:
                guard.hold()
                for slot in slots:
                    self._unregister(slot)
                    slot.channel.close()
                self.slots.clear()
                self._sweeps.clear()
                self._running = {}
                self.selector.close()
        if left:
            log.warning("process groups %s still have live members after SIGKILL", sorted(left))

    @staticmethod
    def _stop_gracefully(slots: list[_Slot], groups: set[int], grace: float) -> list[int]:
        """STOP to idle workers, SIGTERM to the others, SIGKILL after ``grace``, then sweep
        ``groups``; returns the groups still alive after that."""
        policy = ShutdownPolicy.for_grace(grace)
        deadline = stop_children(
            [s.child for s in slots], policy,
            graceful=lambda child: any(s.child is child and s.state is SlotState.IDLE
                                       for s in slots))
        return sweep_groups(groups, deadline, policy)


#: Every process backend not shut down yet (see "Ctrl-C" in the module docstring).
_live_backends: "weakref.WeakSet[ProcessBackend]" = weakref.WeakSet()


def _shutdown_live_backends() -> None:
    """At interpreter exit: shut down every backend still live, as its run would have."""
    for backend in list(_live_backends):
        try:
            backend.shutdown(backend.grace)
        except KeyboardInterrupt:
            pass  # its workers were killed outright: the exit goes on
        except Exception:  # the exit goes on; say why
            log.warning("shutting down a job run's workers at exit failed", exc_info=True)


# threading's exit hooks run before non-daemon threads are joined and before any atexit
# handler, so before multiprocessing's own, which joins non-daemon workers for ever (the
# same net as zephon.transport.pool's).
try:
    threading._register_atexit(_shutdown_live_backends)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # not CPython, or imported during shutdown
    pass
atexit.register(_shutdown_live_backends)  # the fallback; shutdown() is idempotent
