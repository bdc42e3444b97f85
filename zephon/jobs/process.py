"""The process backend: spawn-context job workers driven by one loop.

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

Slots (workers) and their states: ``starting`` (spawned, READY not seen; bounded
by ``subject_spawn_timeout_sec``), ``idle``, ``busy`` (an attempt in flight),
``stopping`` (sent STOP after recycling or a failure restart, or because work
ran out: its result was already read), ``dying`` (SIGTERM sent to its process
group; SIGKILL to the group at ``graceful_shutdown_sec`` later). A slot is
dropped once its worker has exited and been reaped, and what it sent before
exiting has been read. The loop never blocks on one worker: it waits on every
channel with a timeout that is the nearest deadline.

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

``isolated`` mode is ``persistent`` mode with a recycle after every success and
a restart after every failure: a fresh child per subject.

GPU slots: with ``gpu_slots`` each worker gets the lowest slot no live worker
holds (a dying worker still holds its slot until it is gone), exported as
``ZEPHON_GPU_SLOT``; a replacement therefore reuses a freed slot and two live
workers never share one.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import selectors
import signal
import time
from typing import Any, Iterator, NamedTuple

from zephon.errors import (
    JobSetupError, SerializationError, SubjectTimeoutError, TransportError, WorkerCrashedError,
)
from zephon.jobs.tree import group_alive, signal_group
from zephon.jobs.worker import job_worker_main, unpickle_value
from zephon.transport.channel import ChannelClosed, channel_pair
from zephon.transport.remote_errors import decode_exception
from zephon.transport.spawn_guard import EXIT_UNGUARDED_MAIN, unguarded_main_error

__all__ = ["ProcessBackend", "Outcome", "JobSetupError", "TREE_POLICY"]

log = logging.getLogger("zephon.jobs")

#: How the backend makes sure no process a subject started outlives the run (explain()).
TREE_POLICY = (
    "each worker leads its own process group (SIGTERM, then SIGKILL after the grace, to the "
    "whole group on a timeout, when a worker exits and at shutdown, whether or not the "
    "worker is still alive) and is a child subreaper on Linux (descendants that leave the "
    "group are re-parented to it and ended when it stops or is terminated); a descendant "
    "that left the group of a worker killed outright (SIGKILL, or a subject's own SIGTERM "
    "handler) is not covered")

_EXIT_POLL_S = 0.02  # how often a worker known to be going is checked for exit
_KILL_WAIT_S = 5.0  # after SIGKILL: how long a worker may take to disappear
_CENSUS_S = 0.25  # how often every worker is checked for exit, EOF or not


class Outcome(NamedTuple):
    index: int
    ok: bool
    value: Any
    error: BaseException | None
    duration_s: float
    kind: str  # "ok" | "error" | "oom" | "timeout" | "crash"


class _Slot:
    __slots__ = ("process", "channel", "state", "deadline", "task", "successes", "failures",
                 "gpu_slot", "pid", "kill_at", "killed_at", "eof", "registered")

    def __init__(self, process, channel, gpu_slot, deadline) -> None:
        self.process, self.channel, self.gpu_slot = process, channel, gpu_slot
        self.state, self.deadline = "starting", deadline
        self.task = None
        self.successes = self.failures = 0
        self.pid = process.pid
        self.kill_at = self.killed_at = None
        self.eof = False
        self.registered = True


class ProcessBackend:
    name = "process"

    def __init__(self, fn, policy, workers: int, *, gpu_slots: bool, mp_context) -> None:
        try:
            self.fn_bytes = pickle.dumps(fn, protocol=5)
        except Exception as exc:  # noqa: BLE001
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
        self.max_failures = 1 if isolated else policy.persistent_worker_max_consecutive_failures
        self.slots: list[_Slot] = []
        self.selector = selectors.DefaultSelector()
        self.stats = collections.Counter()
        self._task_ids = iter(range(1, 1 << 62))
        self._running: dict[int, int] = {}  # task id -> subject index (attempts in flight)
        self._sweeps: dict[int, float] = {}  # process group -> when it gets SIGKILL
        self._census_at = 0.0

    # -- workers ---------------------------------------------------------------------
    def _spawn(self) -> _Slot | None:
        gpu = None
        if self.gpu_slots:
            held = {s.gpu_slot for s in self.slots}
            free = [g for g in range(self.gpu_count) if g not in held]
            if not free:
                return None  # a dying worker still holds the slot: wait for it
            gpu = free[0]
        parent_end, child_end = channel_pair("socketpair", 1 << 20)
        boot = {"fn": self.fn_bytes, "gpu_slot": gpu, "parent_pid": os.getpid(),
                "grace": self.grace}
        process = self.ctx.Process(target=job_worker_main, args=(child_end, boot),
                                   name="zephon-job-worker")
        process.start()
        child_end.close()
        spawn_timeout = self.policy.subject_spawn_timeout_sec
        deadline = None if spawn_timeout is None else time.monotonic() + spawn_timeout
        slot = _Slot(process, parent_end, gpu, deadline)
        self.slots.append(slot)
        self.selector.register(parent_end.fileno(), selectors.EVENT_READ, slot)
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
            if signal_group(slot.pid, signal.SIGTERM):
                kill_at = time.monotonic() + self.grace
        if kill_at is not None:
            self._sweeps[slot.pid] = kill_at

    def _stop(self, slot: _Slot) -> None:
        slot.state = "stopping"
        slot.deadline = time.monotonic() + self.grace
        try:
            slot.channel.send({"k": "stop"})
        except ChannelClosed:
            pass

    def _terminate(self, slot: _Slot) -> None:
        slot.state = "dying"
        slot.deadline = None
        _signal_slot(slot, signal.SIGTERM)
        slot.kill_at = time.monotonic() + self.grace

    # -- attempts ----------------------------------------------------------------------
    def _settle(self, task: int | None, ok: bool, value, error, duration_s: float,
                kind: str) -> Outcome | None:
        """The one place an outcome is made: only for an attempt still running."""
        index = self._running.pop(task, None) if task is not None else None
        if index is None:
            return None
        return Outcome(index, ok, value, error, duration_s, kind)

    def _timeout_error(self, index: int) -> SubjectTimeoutError:
        return SubjectTimeoutError(
            f"subject {index} ran past subject_timeout_sec={self.timeout} s; its worker's "
            "process group was terminated", timeout_s=self.timeout)

    # -- one round -----------------------------------------------------------------------
    def run_round(self, items: list[tuple[int, Any]]) -> Iterator[Outcome]:
        """Run ``(index, subject)`` items; yields exactly one :class:`Outcome` per item."""
        queue = collections.deque(items)
        self._running = {}
        while queue or self._running:
            out: list[Outcome] = []
            self._staff(len(queue))
            for slot in self.slots:
                if slot.state == "idle" and queue:
                    index, subject = queue.popleft()
                    self._dispatch(slot, index, subject, out)
            self._poll(out)
            yield from out

    def _staff(self, queued: int) -> None:
        live = [s for s in self.slots if s.state in ("starting", "idle", "busy")]
        busy = sum(1 for s in live if s.state == "busy")
        want = min(self.concurrency, queued + busy)
        for slot in [s for s in live if s.state == "idle"][: max(0, len(live) - want)]:
            self._stop(slot)  # after an OOM back-off, or when work runs out
            live.remove(slot)
        while len(live) < want:
            slot = self._spawn()
            if slot is None:
                break
            live.append(slot)

    def _dispatch(self, slot: _Slot, index: int, subject, out: list) -> None:
        task = next(self._task_ids)
        self._running[task] = index
        try:
            payload = pickle.dumps(subject, protocol=5)
        except Exception as exc:  # noqa: BLE001
            out.append(self._settle(task, False, None, SerializationError(
                f"subject {index} cannot be pickled: {exc}"), 0.0, "error"))
            return
        slot.task, slot.state = task, "busy"
        # Until the worker says when it started, the deadline counts from the dispatch.
        slot.deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            slot.channel.send({"k": "task", "id": task}, [payload])
        except ChannelClosed:
            pass  # its death is handled with this attempt, when the worker is reaped

    def _poll(self, out: list) -> None:
        """Wait for the nearest event, read every pending message, reap the workers that
        exited, then (and only then) judge deadlines."""
        ready = self.selector.select(self._wait_time())
        while ready:
            for key, _ in ready:
                self._read(key.data, out)
            ready = self.selector.select(0)
        self._reap(out)
        self._judge(out)

    def _wait_time(self) -> float:
        if any(s.eof or s.state in ("dying", "stopping") for s in self.slots):
            return _EXIT_POLL_S
        times = [t for s in self.slots for t in (s.deadline, s.kill_at) if t is not None]
        times.extend(self._sweeps.values())
        if not times:
            return 0.5
        return max(0.0, min(0.5, min(times) - time.monotonic()))

    def _read(self, slot: _Slot, out: list) -> None:
        try:
            header, frames, _ = slot.channel.recv()
        except (ChannelClosed, TransportError, OSError):
            self._unregister(slot)
            slot.eof = True
            return
        self._message(slot, header, frames, out)

    def _message(self, slot: _Slot, header, frames, out: list) -> None:
        kind = header.get("k")
        if kind == "ready":
            if slot.state == "starting":
                slot.state, slot.deadline = "idle", None
            return
        if kind == "fail":
            error = decode_exception(frames[0], header.get("tb", ""),
                                     f"setting up job worker pid {slot.pid}")
            raise JobSetupError(
                f"a job worker could not set up the callable: {type(error).__name__}: "
                f"{error}") from error
        task = header.get("id")
        if task is None or task != slot.task or task not in self._running:
            log.debug("dropped a %s message for task %s from worker pid %s (running %s)",
                      kind, task, slot.pid, slot.task)
            return
        if kind == "started":
            if slot.state == "busy" and self.timeout is not None:
                started = float(header.get("t", 0.0))
                now = time.monotonic()
                if not now - 3600.0 < started <= now + 1.0:  # not our clock: count from now
                    started = now
                slot.deadline = started + self.timeout
            return
        if kind not in ("done", "error"):
            return
        duration = float(header["d"])
        index = self._running[task]
        late = self.timeout is not None and duration > self.timeout
        if kind == "done" and not late:
            try:
                value = unpickle_value(frames)
            except Exception as exc:  # noqa: BLE001 - the value's class is not importable here
                kind, error = "error", SerializationError(
                    f"the value of subject {index} cannot be unpickled in the parent: "
                    f"{type(exc).__name__}: {exc}")
                frames = None
        else:
            value = None
        if kind == "error" and not late and frames is not None:
            error = decode_exception(frames[0], header.get("tb", ""),
                                     f"subject {index} on job worker pid {slot.pid}")
        oom = kind == "error" and not late and bool(header.get("oom"))
        if slot.state == "busy":
            slot.task = None
            slot.state, slot.deadline = "idle", None
            if late:
                self.stats["timeouts"] += 1
                self._terminate(slot)
            elif kind == "done":
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
        else:  # dying: the report came in before the worker was gone
            slot.task = None
        if late:
            outcome = self._settle(task, False, None, self._timeout_error(index), self.timeout,
                                   "timeout")
        elif kind == "done":
            outcome = self._settle(task, True, value, None, duration, "ok")
        else:
            if oom:
                self._back_off()
            outcome = self._settle(task, False, None, error, duration, "oom" if oom else "error")
        if outcome is not None:
            out.append(outcome)

    def _drain_dead(self, slot: _Slot, out: list) -> None:
        """Read what a worker that has exited sent before it did (never blocks for long: a
        grandchild may still hold the worker's end of the channel open)."""
        if not slot.registered:
            return
        sock = getattr(slot.channel, "sock", None)
        if sock is not None:
            sock.settimeout(1.0)
        waiter = selectors.DefaultSelector()
        try:
            waiter.register(slot.channel.fileno(), selectors.EVENT_READ)
            while slot.registered and waiter.select(0):
                self._read(slot, out)
        finally:
            waiter.close()

    def _reap(self, out: list) -> None:
        now = time.monotonic()
        census = now >= self._census_at  # every worker, now and then: a dead worker whose
        if census:                       # channel a grandchild holds open sends no EOF
            self._census_at = now + _CENSUS_S
        for slot in list(self.slots):
            if not (census or slot.eof or slot.state in ("dying", "stopping")):
                continue
            code = slot.process.exitcode
            if code is None:
                continue
            self._drain_dead(slot, out)
            state, task = slot.state, slot.task
            self._forget(slot)
            if state == "starting":
                if code == EXIT_UNGUARDED_MAIN:
                    raise JobSetupError(str(unguarded_main_error(
                        f"job run of {self.fn_label}"))) from None
                raise JobSetupError(
                    f"a job worker (pid {slot.pid}) died before it was ready ({_exit_text(code)})"
                    "; is the callable importable in a fresh process?")
            if state == "dying":
                outcome = self._settle(task, False, None, self._timeout_error(
                    self._running.get(task, -1)), self.timeout or 0.0, "timeout")
            elif state == "busy":
                outcome = self._crashed(slot, task, code)
            else:
                if state == "idle":
                    log.warning("idle job worker (pid %s) exited (%s)", slot.pid,
                                _exit_text(code))
                outcome = None
            if outcome is not None:
                out.append(outcome)

    def _crashed(self, slot: _Slot, task, code: int) -> Outcome | None:
        index = self._running.get(task, -1)
        if code == -signal.SIGKILL:
            self._back_off()
            error = WorkerCrashedError(
                f"the worker running subject {index} was killed by SIGKILL (counted as out of "
                "memory)", signal=signal.SIGKILL, worker=slot.pid)
            return self._settle(task, False, None, error, 0.0, "oom")
        sig = -code if code < 0 else None
        error = WorkerCrashedError(
            f"the worker running subject {index} died by {_exit_text(code)}",
            signal=sig, worker=slot.pid)
        return self._settle(task, False, None, error, 0.0, "crash")

    def _judge(self, out: list) -> None:
        now = time.monotonic()
        for slot in list(self.slots):
            if slot.state == "dying":
                if slot.kill_at is not None and now >= slot.kill_at:
                    _signal_slot(slot, signal.SIGKILL)
                    slot.kill_at, slot.killed_at = None, now
                elif slot.killed_at is not None and now >= slot.killed_at + _KILL_WAIT_S:
                    log.warning("job worker pid %s survived SIGKILL for %s s; giving up on it",
                                slot.pid, _KILL_WAIT_S)
                    task = slot.task
                    self._forget(slot)
                    outcome = self._settle(task, False, None, self._timeout_error(
                        self._running.get(task, -1)), self.timeout or 0.0, "timeout")
                    if outcome is not None:
                        out.append(outcome)
                continue
            if slot.deadline is None or now < slot.deadline:
                continue
            if slot.state == "starting":
                _signal_slot(slot, signal.SIGKILL)
                raise JobSetupError(
                    f"a job worker did not become ready within "
                    f"{self.policy.subject_spawn_timeout_sec} s (subject_spawn_timeout_sec): "
                    "unpickling the callable or its setup() hangs")
            if slot.state == "stopping":
                self._terminate(slot)
            elif slot.state == "busy":
                self.stats["timeouts"] += 1
                self._terminate(slot)  # the verdict waits for the worker to be gone
        for pgid, kill_at in list(self._sweeps.items()):
            if now >= kill_at:
                signal_group(pgid, signal.SIGKILL)
                del self._sweeps[pgid]

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
    def shutdown(self, grace: float) -> None:
        """Stop every worker in parallel within ``grace`` seconds, then kill; reap all; then
        sweep every process group the run created until none of its members is alive:
        SIGTERM, the rest of the same ``grace``, SIGKILL."""
        deadline = time.monotonic() + grace
        slots = list(self.slots)
        for slot in slots:
            if slot.state == "idle":
                try:
                    slot.channel.send({"k": "stop"})  # it ends its own descendants first
                    continue
                except ChannelClosed:
                    pass
            if slot.state not in ("dying", "stopping"):
                _signal_slot(slot, signal.SIGTERM)
        while any(s.process.exitcode is None for s in slots) and time.monotonic() < deadline:
            time.sleep(0.01)
        for slot in slots:
            if slot.process.exitcode is None:
                _signal_slot(slot, signal.SIGKILL)
        groups = dict(self._sweeps)
        for slot in slots:
            slot.process.join(_KILL_WAIT_S)
            self._unregister(slot)
            slot.channel.close()
            groups[slot.pid] = deadline
        self.slots.clear()
        self._sweeps.clear()
        self._running = {}
        for pgid in groups:
            signal_group(pgid, signal.SIGTERM)
        groups = _live_groups(groups, deadline)
        for pgid in groups:
            signal_group(pgid, signal.SIGKILL)
        groups = _live_groups(groups, time.monotonic() + _KILL_WAIT_S)
        if groups:
            log.warning("process groups %s still have live members after SIGKILL",
                        sorted(groups))
        self.selector.close()


def _live_groups(groups, until: float) -> list[int]:
    """Wait until no group in ``groups`` has a live member, or ``until``; the live ones."""
    live = list(groups)
    while live:
        live = [g for g in live if group_alive(g)]
        if not live or time.monotonic() >= until:
            break
        time.sleep(0.01)
    return live


def _signal_slot(slot: _Slot, sig: int) -> bool:
    """Signal the worker's process group (its children go too). Only before the worker has
    made itself a group leader (its first instants) is the worker signalled alone, and only
    while it is unreaped: a reaped pid may already belong to someone else."""
    if signal_group(slot.pid, sig):
        return True
    if slot.process.exitcode is None:
        try:
            os.kill(slot.pid, sig)
            return True
        except ProcessLookupError:
            pass
    return False


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
