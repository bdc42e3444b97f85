"""The process backend: a pool of spawn-context job workers driven by one loop.

Slots and their states: ``starting`` (spawned, READY not yet seen; bounded by
``subject_spawn_timeout_sec``), ``idle``, ``busy`` (a subject in flight; its
``subject_timeout_sec`` counts from the worker's STARTED message), ``stopping``
(sent STOP after recycling or a failure restart: its result was already read),
``dying`` (terminated after a timeout: SIGTERM to its process group now, SIGKILL
after ``graceful_shutdown_sec``). The loop never blocks on one worker: it waits
on every channel with a timeout that is the nearest deadline.

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

``shutdown(grace)`` stops every worker in parallel: STOP to the idle ones,
SIGTERM to every process group, one shared ``grace`` deadline, SIGKILL to what
is left, then every child is reaped.
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
    SerializationError, SubjectTimeoutError, WorkerCrashedError, ZephonError,
)
from zephon.jobs.worker import job_worker_main, unpickle_value
from zephon.transport.channel import ChannelClosed, channel_pair
from zephon.transport.remote_errors import decode_exception

__all__ = ["ProcessBackend", "Outcome", "JobSetupError"]

log = logging.getLogger("zephon.jobs")


class JobSetupError(ZephonError):
    """A job worker could not start: the callable did not unpickle, ``setup()`` failed, or
    the worker did not become ready within ``subject_spawn_timeout_sec``."""


class Outcome(NamedTuple):
    index: int
    ok: bool
    value: Any
    error: BaseException | None
    duration_s: float
    kind: str  # "ok" | "error" | "oom" | "timeout" | "crash"


class _Slot:
    __slots__ = ("process", "channel", "state", "deadline", "task", "subject_index",
                 "successes", "failures", "gpu_slot", "pid", "kill_at")

    def __init__(self, process, channel, gpu_slot, deadline) -> None:
        self.process, self.channel, self.gpu_slot = process, channel, gpu_slot
        self.state, self.deadline = "starting", deadline
        self.task = self.subject_index = None
        self.successes = self.failures = 0
        self.pid = process.pid
        self.kill_at = None


def _signal_group(slot: _Slot, sig: int) -> None:
    """Signal the worker's process group (its children go too). Only before the worker has
    made itself a group leader (the first instants) is the worker signalled alone, and only
    while it is unreaped: a reaped pid may already belong to someone else."""
    try:
        os.killpg(slot.pid, sig)
        return
    except ProcessLookupError:
        pass
    except PermissionError:
        pass
    if slot.process.exitcode is None:
        try:
            os.kill(slot.pid, sig)
        except ProcessLookupError:
            pass


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
        self.policy = policy
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
        self._task_ids = iter(range(1 << 62))

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
        boot = {"fn": self.fn_bytes, "gpu_slot": gpu, "parent_pid": os.getpid()}
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

    def _forget(self, slot: _Slot) -> None:
        try:
            self.selector.unregister(slot.channel.fileno())
        except (KeyError, ValueError):
            pass
        slot.channel.close()
        if slot in self.slots:
            self.slots.remove(slot)

    def _stop(self, slot: _Slot) -> None:
        slot.state = "stopping"
        slot.deadline = time.monotonic() + self.policy.graceful_shutdown_sec
        try:
            slot.channel.send({"k": "stop"})
        except ChannelClosed:
            pass

    def _terminate(self, slot: _Slot) -> None:
        slot.state = "dying"
        _signal_group(slot, signal.SIGTERM)
        slot.kill_at = time.monotonic() + self.policy.graceful_shutdown_sec

    # -- one round -----------------------------------------------------------------------
    def run_round(self, items: list[tuple[int, Any]]) -> Iterator[Outcome]:
        """Run ``(index, subject)`` items; yields one :class:`Outcome` per item."""
        queue = collections.deque(items)
        busy = 0
        while queue or busy:
            live = [s for s in self.slots if s.state in ("starting", "idle", "busy")]
            want = min(self.concurrency, len(queue) + busy)
            for slot in [s for s in live if s.state == "idle"][: max(0, len(live) - want)]:
                self._stop(slot)  # after an OOM back-off, or when work runs out
                live.remove(slot)
            while len(live) < want:
                slot = self._spawn()
                if slot is None:
                    break
                live.append(slot)
            for slot in live:
                if slot.state == "idle" and queue:
                    index, subject = queue.popleft()
                    try:
                        payload = pickle.dumps(subject, protocol=5)
                    except Exception as exc:  # noqa: BLE001
                        yield Outcome(index, False, None, SerializationError(
                            f"subject {index} cannot be pickled: {exc}"), 0.0, "error")
                        continue
                    slot.task, slot.subject_index = next(self._task_ids), index
                    slot.state, slot.deadline = "busy", None
                    busy += 1
                    try:
                        slot.channel.send({"k": "task", "id": slot.task}, [payload])
                    except ChannelClosed:
                        pass  # its death is handled below, with this subject
            for outcome in self._wait():
                if outcome.index is not None:
                    busy -= 1
                    yield outcome

    def _next_deadline(self) -> float | None:
        times = [t for s in self.slots for t in (s.deadline, s.kill_at) if t is not None]
        return min(times) if times else None

    def _wait(self) -> Iterator[Outcome]:
        deadline = self._next_deadline()
        timeout = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
        for key, _ in self.selector.select(timeout):
            slot = key.data
            try:
                header, frames, _ = slot.channel.recv()
            except ChannelClosed:
                outcome = self._died(slot)
                if outcome is not None:
                    yield outcome
                continue
            outcome = self._message(slot, header, frames)
            if outcome is not None:
                yield outcome
        yield from self._expire()

    def _message(self, slot: _Slot, header, frames) -> Outcome | None:
        kind = header["k"]
        if kind == "ready":
            slot.state, slot.deadline = "idle", None
            return None
        if kind == "fail":
            error = decode_exception(frames[0], header.get("tb", ""),
                                     f"setting up job worker pid {slot.pid}")
            raise JobSetupError(
                f"a job worker could not set up the callable: {type(error).__name__}: "
                f"{error}") from error
        if kind == "started":
            timeout = self.policy.subject_timeout_sec
            slot.deadline = None if timeout is None else time.monotonic() + timeout
            return None
        index = slot.subject_index
        slot.task = slot.subject_index = None
        slot.state, slot.deadline = "idle", None
        if kind == "done":
            slot.successes += 1
            slot.failures = 0
            if self.recycle_after and slot.successes >= self.recycle_after:
                self.stats["recycled"] += 1
                self._stop(slot)
            return Outcome(index, True, unpickle_value(frames), None, header["d"], "ok")
        # kind == "error"
        error = decode_exception(frames[0], header.get("tb", ""),
                                 f"subject {index} on job worker pid {slot.pid}")
        slot.failures += 1
        if slot.failures >= self.max_failures:
            self.stats["restarts"] += 1
            self._stop(slot)
        oom = bool(header.get("oom"))
        if oom:
            self._back_off()
        return Outcome(index, False, None, error, header["d"], "oom" if oom else "error")

    def _died(self, slot: _Slot) -> Outcome | None:
        state, index = slot.state, slot.subject_index
        slot.process.join(2.0)
        code = slot.process.exitcode
        self._forget(slot)
        if state in ("stopping", "dying"):
            return None
        if state == "starting":
            raise JobSetupError(
                f"a job worker (pid {slot.pid}) died before it was ready "
                f"(exit code {code}); is the callable importable in a fresh process?")
        if state != "busy":
            log.warning("idle job worker (pid %s) exited with code %s", slot.pid, code)
            return None
        if code == -signal.SIGKILL:
            self._back_off()
            error = WorkerCrashedError(
                f"the worker running subject {index} was killed by SIGKILL (counted as out of "
                "memory)", signal=signal.SIGKILL, worker=slot.pid)
            return Outcome(index, False, None, error, 0.0, "oom")
        sig = -code if code is not None and code < 0 else None
        error = WorkerCrashedError(
            f"the worker running subject {index} died by "
            f"{'signal ' + signal.Signals(sig).name if sig else f'exit code {code}'}",
            signal=sig, worker=slot.pid)
        return Outcome(index, False, None, error, 0.0, "crash")

    def _expire(self) -> Iterator[Outcome]:
        now = time.monotonic()
        for slot in list(self.slots):
            if slot.state == "dying":
                if not slot.process.is_alive():
                    slot.process.join()
                    self._forget(slot)
                elif slot.kill_at is not None and now >= slot.kill_at:
                    _signal_group(slot, signal.SIGKILL)
                    slot.kill_at = None
                continue
            if slot.deadline is None or now < slot.deadline:
                continue
            if slot.state == "starting":
                _signal_group(slot, signal.SIGKILL)
                raise JobSetupError(
                    f"a job worker did not become ready within "
                    f"{self.policy.subject_spawn_timeout_sec} s (subject_spawn_timeout_sec): "
                    "unpickling the callable or its setup() hangs")
            if slot.state == "stopping":
                self._terminate(slot)
                continue
            if slot.state == "busy":
                index = slot.subject_index
                self.stats["timeouts"] += 1
                self._terminate(slot)
                yield Outcome(index, False, None, SubjectTimeoutError(
                    f"subject {index} ran past subject_timeout_sec="
                    f"{self.policy.subject_timeout_sec} s; its worker's process group was "
                    "terminated", timeout_s=self.policy.subject_timeout_sec),
                    self.policy.subject_timeout_sec, "timeout")

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
        """Stop every worker in parallel within ``grace`` seconds, then kill; reap all."""
        slots = list(self.slots)
        for slot in slots:
            if slot.state == "idle":
                try:
                    slot.channel.send({"k": "stop"})
                except ChannelClosed:
                    pass
            else:
                _signal_group(slot, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for slot in slots:
            slot.process.join(max(0.0, deadline - time.monotonic()))
        for slot in slots:
            if slot.process.is_alive():
                _signal_group(slot, signal.SIGKILL)
                slot.process.join(5.0)
            self._forget(slot)
        self.selector.close()
