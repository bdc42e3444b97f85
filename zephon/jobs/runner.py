"""``zephon.jobs.run()``: per-subject jobs under a :class:`~zephon.options.RunPolicy`.

A run, in order:

0. refuse to start inside a spawn worker that is still importing the main
   script (a script without ``if __name__ == "__main__":``): that worker exits
   with one sentence naming the fix, and the parent reports the same sentence;
1. validate: subject ids (unique), the policy, the effective backend
   (:func:`~zephon.options.resolve_backend`; ``explain()`` says why) and the
   worker count (capped to the visible GPUs with ``cap_workers_to_gpu_pool``);
2. open the checkpoint store when ``resume`` is on or a ``checkpoint_dir`` is
   given (lock, fingerprint check);
3. replay: with ``resume``, a stored success is served (``from_cache``); a
   stored failure is served as a :class:`RecordedFailure` unless
   ``retry_failed_subjects``; ids in ``force_rerun_subjects`` are always run.
   An entry the store refuses (corrupt, truncated, bad values, a pickle this
   run does not allow, a symlink, not a regular file, not ours) is reported
   once as a warning and its subject is recomputed; with
   ``on_bad_entry="fail"`` the subject is failed with that
   :class:`~zephon.errors.CheckpointError` instead. Never a reason to abort.
   The store is looked up :data:`RESUME_CHUNK` subjects at a time and the
   results a chunk settles are yielded before the next lookup; a store that
   was empty when opened is not looked up at all;
4. rounds: every remaining subject runs once, then failed ones again for up to
   ``auto_retry_rounds`` extra rounds (the backend, and so a lowered OOM
   concurrency, lives across rounds). Each attempt's outcome is written to the
   store (a success also removes the subject's failure record). With
   ``fail_fast`` the first failure stops every worker at once and raises the
   subject's exception;
5. results are yielded in input order (``ordered=False``: as they become
   final); a failure is final after the last round. The driver keeps only the
   results it cannot release yet, and of those not the successes the store
   holds (see :class:`_Output`); nothing else per subject while the rounds
   run (attempts follow from the round number; a round's items are drawn
   lazily: the serial backend holds only the one running, the process and ray
   backends queue the round);
6. with ``clear_checkpoint_on_success`` the store is removed only when every
   subject's final outcome, replayed ones included, is a success.

Ctrl-C (KeyboardInterrupt) stops the workers within ``graceful_shutdown_sec``
and propagates; the store commits what it holds and is unlocked (a SIGKILL
loses at most the store's durability window: :mod:`zephon.jobs.store`); a
subject interrupted this way is not recorded as a failure. A second Ctrl-C
while the workers stop kills them outright (:mod:`zephon.jobs.process`), and
Ctrl-Cs from then on wait until the store is closed: the KeyboardInterrupt
reaches the caller with nothing left running and the store closed, within a
second. The same holds for a Ctrl-C while a run that ended or was left stops
its workers. The run's iterator (:class:`_Guarded`) keeps an
:class:`~zephon.transport.supervisor.InterruptGuard` in force while the run
works, so a second Ctrl-C right behind the first (landing while the first one's
KeyboardInterrupt unwinds the run, before the stop) is held and cuts the stop
short, never skips it. Two Ctrl-Cs sent at the same instant may reach the
process as one SIGINT (the kernel merges a second one sent before the first is
delivered): that is one Ctrl-C, a graceful stop.

A ``SystemExit`` or ``KeyboardInterrupt`` raised by a subject's own code is that
subject's failure on every backend (recorded as itself, the worker kept, the
run going on); only a real Ctrl-C (or a signal handler's exit) stops the run
(:func:`~zephon.jobs.worker.raised_by_signal`).
"""

from __future__ import annotations

import array
import collections
import logging
import multiprocessing
import os
import traceback
from collections.abc import Sequence
from typing import Any, Iterable, Iterator, NamedTuple

from zephon.errors import (
    CheckpointError,
    RecordedFailure,
    SerializationError,
    ZephonConfigError,
    remote_traceback,
)
from zephon.jobs.gpu import visible_gpu_count
from zephon.jobs.process import TREE_POLICY, ProcessBackend, max_consecutive_failures
from zephon.jobs.progress import Progress
from zephon.jobs.serial import SerialBackend
from zephon.jobs.store import CheckpointStore
from zephon.jobs.subjects import cache_key_of, callable_name, subject_id_of
from zephon.options import RunPolicy, backend_reason, resolve_backend
from zephon.transport.spawn_guard import refuse_in_spawn_bootstrap
from zephon.transport.supervisor import InterruptGuard

__all__ = ["ON_BAD_ENTRY", "JobRun", "RecordedFailure", "SubjectResult", "run"]

#: What a resumed run does with a store entry it cannot trust or read.
ON_BAD_ENTRY = ("recompute", "fail")
#: Subjects looked up in the store at once while resuming (results stream per chunk).
RESUME_CHUNK = 512

log = logging.getLogger("zephon.jobs")


class SubjectResult(NamedTuple):
    """The final outcome of one subject, as a job run yields it.

    Attributes:
        subject_id: the subject's id (the subject itself for a string subject, else
            its ``subject_id`` key or attribute).
        value: what ``fn(subject)`` returned (None when it failed).
        error: the exception that failed the subject (a
            :class:`~zephon.errors.SubjectTimeoutError` for a timeout, a
            :class:`RecordedFailure` for a failure replayed from the store), or None.
        from_cache: True when the outcome was served from the checkpoint store without
            running ``fn``.
        attempts: how many times ``fn`` ran on the subject, retry rounds included.
        duration_s: seconds the last attempt took in its worker.

    Examples:
        >>> job = zephon.jobs.run(len, ["ab"], RunPolicy(subject_timeout_sec=None,
        ...                       resume=False), progress=False)
        >>> [(r.subject_id, r.value, r.ok, r.from_cache, r.attempts) for r in job]
        [('ab', 2, True, False, 1)]
    """
    subject_id: str
    value: Any
    error: BaseException | None
    from_cache: bool
    attempts: int
    duration_s: float

    @property
    def ok(self) -> bool:
        """True when the subject succeeded (``error`` is None).

        Examples:
            >>> zephon.jobs.SubjectResult("s", 1, None, False, 1, 0.1).ok
            True
        """
        return self.error is None


def _error_record(error: BaseException) -> dict:
    """What a failure's record keeps: type, message and the traceback of where the
    subject ran: this process's when it ran here (the error has a traceback here; its
    text shows any worker traceback of its chain), else the worker's."""
    tb = remote_traceback(error) if error.__traceback__ is None else None
    if tb is None:
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return {"type": type(error).__name__, "message": str(error), "traceback": tb}


def default_checkpoint_dir(fn) -> str:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in callable_name(fn))
    return os.path.join(os.getcwd(), ".zephon_checkpoints", safe)


class JobRun:
    """An iterable job run: what :func:`run` returns (see the module docstring).

    Construction validates everything (the policy, unique subject ids, the effective
    backend, the worker count) and starts nothing; iterating runs the subjects and
    yields a :class:`SubjectResult` per subject. After iteration ``summary`` holds the
    counts (``done``, ``cached``, ``failed``, ``retried``, ``timeouts``,
    ``oom_backoffs``, ``workers_started``, and where non-zero ``replayed_failures``,
    ``recycled``, ``restarts``, ``interrupted``).

    Args:
        fn: ``fn(subject) -> value``, picklable (module level) for the process and ray
            backends. An optional ``fn.setup()`` runs once in each worker before its
            first subject (in this process for ``serial``; per subject with
            ``parallel_mode="isolated"``), and an optional
            ``fn.cache_key(subject) -> str`` names a subject's store entry (default:
            the function's qualified name and the subject id).
        subjects: an iterable of subjects, each a non-empty string (its own id) or an
            object with a ``subject_id`` key or attribute; ids must be unique.
        policy: the :class:`~zephon.RunPolicy` (None: the defaults).
        fingerprint: a string naming what the results depend on (code version,
            parameters); store entries written under another fingerprint are not
            served (with ``strict_checkpoint_hash``, opening such a store raises).
        progress: show a progress bar on a TTY (log lines otherwise) and a summary.
        ordered: yield results in input order (True) or as they become final.
        allow_pickle: let the store keep values msgpack cannot encode, with pickle
            (loading a pickle runs code: only for stores you trust).
        mp_context: the multiprocessing context of the process backend (None: spawn).
        on_bad_entry: what a resumed run does with a store entry it cannot trust or
            read: ``"recompute"`` (a warning, then the subject runs) or ``"fail"``
            (the subject fails with that CheckpointError).

    Raises:
        ZephonConfigError: a bad policy, ``fn`` not callable, a subject without an id,
            duplicate ids, an unknown ``on_bad_entry``, or ``cap_workers_to_gpu_pool``
            without a visible GPU.

    Examples:
        >>> job = zephon.jobs.JobRun(len, ["ab", "abc"], RunPolicy(subject_timeout_sec=None,
        ...                          resume=False), progress=False)
        >>> [r.value for r in job], job.summary["done"]
        ([2, 3], 2)
    """

    def __init__(self, fn, subjects: Iterable[Any], policy: RunPolicy | None = None,
                 fingerprint: str | None = None, progress: bool = True, *,
                 ordered: bool = True, allow_pickle: bool = False, mp_context=None,
                 on_bad_entry: str = "recompute") -> None:
        policy = RunPolicy() if policy is None else policy
        if not isinstance(policy, RunPolicy):
            raise ZephonConfigError(f"policy must be a RunPolicy, got {type(policy).__name__}")
        if not callable(fn):
            raise ZephonConfigError(f"fn must be callable, got {fn!r}")
        if on_bad_entry not in ON_BAD_ENTRY:
            raise ZephonConfigError(f"on_bad_entry must be one of {ON_BAD_ENTRY}, got "
                                    f"{on_bad_entry!r}")
        self.on_bad_entry = on_bad_entry
        self.fn, self.policy, self.fingerprint = fn, policy, fingerprint
        self.subjects = list(subjects)
        self.ids = _subject_ids(self.subjects)
        self.keys = self._cache_keys()
        self.backend_name = resolve_backend(policy)
        self.backend_reason = backend_reason(policy)
        self.workers = policy.workers if self.backend_name in ("process", "ray") else 1
        self.gpu_count = None
        if policy.cap_workers_to_gpu_pool and self.backend_name != "ray":  # ray: cluster GPUs
            self.gpu_count = visible_gpu_count()
            if self.gpu_count == 0:
                raise ZephonConfigError(
                    "RunPolicy.cap_workers_to_gpu_pool is on but no GPU is visible (torch, "
                    "nvidia-smi and CUDA_VISIBLE_DEVICES report none)")
            self.workers = min(self.workers, self.gpu_count)
        self.store_dir = policy.checkpoint_dir
        if self.store_dir is None and policy.resume:
            self.store_dir = default_checkpoint_dir(fn)
        self.progress, self.ordered, self.allow_pickle = progress, ordered, allow_pickle
        self.mp_context = mp_context or multiprocessing.get_context("spawn")
        self.summary: dict[str, int] = {}
        self.backend = None

    def _cache_keys(self) -> Sequence[str]:
        """Every subject's cache key (:func:`~zephon.jobs.subjects.cache_key_of`): computed
        up front when ``fn.cache_key`` decides them, else ``<name>:<id>`` made when
        asked for (no second list of a million strings)."""
        if callable(getattr(self.fn, "cache_key", None)):
            return [cache_key_of(self.fn, s, sid)
                    for s, sid in zip(self.subjects, self.ids, strict=True)]
        return _PrefixedKeys(cache_key_of(self.fn, None, ""), self.ids)

    def explain(self) -> str:
        """What the run will do, as text.

        Returns:
            Lines naming the function and subject count, the effective backend and why,
            the worker count, the worker mode, the timeouts, the failure policy, and the
            store (directory, resume, fingerprint, what a bad entry does).

        Examples:
            >>> job = zephon.jobs.JobRun(len, ["ab"], RunPolicy(subject_timeout_sec=None,
            ...                          resume=False), progress=False)
            >>> print(job.explain().splitlines()[1])
              backend: serial (backend='serial' and no subject timeout)
        """
        p = self.policy
        lines = [
            f"job run of {callable_name(self.fn)} over {len(self.subjects)} subject(s)",
            f"  backend: {self.backend_name} ({self.backend_reason})",
            f"  workers: {self.workers}" + (f" (capped to {self.gpu_count} visible GPU(s))"
                                            if self.gpu_count is not None else ""),
            f"  mode: {p.parallel_mode}; recycle after {p.persistent_worker_recycle_after_tasks} "
            f"task(s); restart after {self._restart_after()} consecutive failure(s)",
            f"  timeouts: subject {p.subject_timeout_sec} s, spawn {p.subject_spawn_timeout_sec} "
            f"s, grace {p.graceful_shutdown_sec} s",
            f"  failures: {p.on_subject_failure}; {p.auto_retry_rounds} retry round(s); OOM "
            f"back-off {'on' if p.oom_backoff else 'off'} (-{p.oom_reduce_workers_by})",
            f"  store: {self.store_dir or 'none'} (resume {p.resume}, fingerprint "
            f"{self.fingerprint!r}, strict {p.strict_checkpoint_hash}; an entry it cannot "
            f"trust or read: {self.on_bad_entry})",
        ]
        if self.backend_name == "ray":
            from zephon.jobs.ray_backend import explain_lines
            lines += explain_lines(self.backend, self.store_dir)
        if self.backend_name == "process":
            lines.append(f"  process tree: {TREE_POLICY}")
        return "\n".join(lines)

    def _restart_after(self) -> int:
        """Failed subjects in a row after which a worker is restarted."""
        return max_consecutive_failures(self.policy)

    def __iter__(self) -> Iterator[SubjectResult]:
        return _Guarded(self._run())

    def _make_backend(self):
        if self.backend_name == "serial":
            return SerialBackend(self.fn)
        if self.backend_name == "ray":
            from zephon.jobs.ray_backend import RayBackend
            return RayBackend(self.fn, self.policy, self.workers, names=self.ids)
        return ProcessBackend(self.fn, self.policy, self.workers,
                              gpu_slots=self.policy.cap_workers_to_gpu_pool,
                              mp_context=self.mp_context, names=self.ids)

    def _judged(self, i: int, entry):
        """Subject ``i``'s stored entry as the run uses it: a bad entry (a
        CheckpointError from the store) is reported once and becomes None (recompute) or
        a :class:`CheckpointError` naming the subject (``on_bad_entry="fail"``)."""
        if not isinstance(entry, CheckpointError):
            return entry
        what = "recomputing it" if self.on_bad_entry == "recompute" else \
            "failing it (on_bad_entry='fail')"
        log.warning("checkpoint entry of subject %s not used, %s: %s", self.ids[i], what,
                    entry)
        if self.on_bad_entry == "fail":
            return CheckpointError(f"subject {self.ids[i]}: {entry}")
        return None

    def _reload(self, store: CheckpointStore | None, i: int, from_cache: bool
                ) -> SubjectResult:
        """Subject ``i``'s success, read back from the store where the output left it
        (see :class:`_Output`)."""
        try:
            entry = store.load(self.keys[i]) if store is not None else None
            if entry is None or not entry.ok:
                raise CheckpointError("its stored success is gone")
        except CheckpointError as exc:
            log.warning("subject %s: its result cannot be read back from the store: %s",
                        self.ids[i], exc)
            return SubjectResult(self.ids[i], None, CheckpointError(
                f"subject {self.ids[i]}: its result cannot be read back from the store: "
                f"{exc}"), from_cache, 0, 0.0)
        return SubjectResult(self.ids[i], entry.value, None, from_cache, entry.attempts,
                             entry.duration_s)

    def _run(self) -> Iterator[SubjectResult]:
        """The run: replay what the store holds, run the rest in rounds (retrying failures),
        then close the backend and the store and publish :attr:`summary`."""
        refuse_in_spawn_bootstrap(f"zephon.jobs.run({callable_name(self.fn)})")
        log.info("starting %s", self.explain().replace("\n", ";"))
        store = self._open_store()
        out = _Output(len(self.subjects), self.ordered,
                      lambda i, from_cache: self._reload(store, i, from_cache))
        counts: collections.Counter[str] = collections.Counter()
        progress = Progress(len(self.subjects), self.progress)
        interrupted = False
        try:
            todo: Sequence[int] = range(len(self.subjects))
            if store is not None and self.policy.resume and not store.empty_at_open:
                todo = array.array("q")  # 8 bytes per subject to run, no int objects
                yield from self._resume(store, out, counts, progress, todo)
            yield from self._rounds(todo, store, out, counts, progress)
            if self.policy.clear_checkpoint_on_success and store is not None and \
                    out.not_ok == 0:
                store.clear()
                log.info("every subject succeeded: removed checkpoint store %s", store.root)
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            self._close(store, counts, progress, interrupted)

    def _open_store(self) -> CheckpointStore | None:
        if self.store_dir is None:
            return None
        return CheckpointStore(self.store_dir, self.fingerprint,
                               strict=self.policy.strict_checkpoint_hash,
                               allow_pickle=self.allow_pickle)

    def _resume(self, store: CheckpointStore, out: _Output,
                counts: collections.Counter[str], progress: Progress,
                todo: array.array) -> Iterator[SubjectResult]:
        """Finish every subject the store already settles (a cached success, a replayed
        failure, an entry that fails under ``on_bad_entry="fail"``), looking the store up
        :data:`RESUME_CHUNK` subjects at a time and yielding what may be released after
        each lookup; appends the indexes still to run to ``todo``, in order. (Not called
        for a store that was empty when opened: it settles nothing.)"""
        n = len(self.subjects)
        force = set(self.policy.force_rerun_subjects)
        for start in range(0, n, RESUME_CHUNK):
            chunk = [i for i in range(start, min(n, start + RESUME_CHUNK))
                     if self.ids[i] not in force]
            entries = dict(zip(chunk, store.load_many([self.keys[i] for i in chunk]),
                               strict=True))
            for i in range(start, min(n, start + RESUME_CHUNK)):
                entry = self._judged(i, entries[i]) if i in entries else None
                result = self._stored_result(i, entry, counts)
                if result is None:
                    todo.append(i)
                    continue
                progress.update(ok=result.ok, cached=True)
                out.finish(i, result, stored=result.ok)
            yield from out.drain()

    def _stored_result(self, i: int, entry, counts: collections.Counter[str]
                       ) -> SubjectResult | None:
        """The result a store entry settles for subject ``i``, or None to run it."""
        if isinstance(entry, CheckpointError):
            counts["failed"] += 1
            return SubjectResult(self.ids[i], None, entry, True, 0, 0.0)
        if entry is None:
            return None
        if entry.ok:
            counts["cached"] += 1
            return SubjectResult(self.ids[i], entry.value, None, True, entry.attempts,
                                 entry.duration_s)
        if self.policy.retry_failed_subjects:
            return None
        err = entry.error
        counts["failed"] += 1
        counts["replayed_failures"] += 1
        return SubjectResult(
            self.ids[i], None,
            RecordedFailure(f"{err['type']}: {err['message']} (recorded by an earlier run)",
                            error_type=err["type"], traceback=err.get("traceback", "")),
            True, entry.attempts, entry.duration_s)

    def _rounds(self, todo: Sequence[int], store: CheckpointStore | None, out: _Output,
                counts: collections.Counter[str], progress: Progress
                ) -> Iterator[SubjectResult]:
        """Run ``todo`` on the backend, then its failures again for each retry round; a
        failure of the last round that ran is final. Every subject of round ``r`` (from
        0) has run ``r`` times before (a backend yields one outcome per item), so its
        attempt is ``r + 1``: no per-subject count is kept."""
        self.backend = backend = self._make_backend() if len(todo) else None
        rounds = 1 + self.policy.auto_retry_rounds
        pending: Sequence[int] = todo
        failures: dict[int, SubjectResult] = {}  # the latest failure of a subject
        for round_no in range(rounds):
            if not pending or backend is None:
                break
            if round_no == 1:
                counts["retried"] = len(pending)  # every subject run more than once
            failed: list[int] = []
            yield from self._round(backend, pending, round_no + 1, round_no == rounds - 1,
                                   store, out, counts, progress, failures, failed)
            pending = failed
        for i, result in failures.items():  # failures of the last round that ran
            self._final(i, result, False, counts, progress, out)
        yield from out.drain()

    def _round(self, backend, pending: Sequence[int], attempt: int, last: bool,
               store: CheckpointStore | None, out: _Output, counts: collections.Counter[str],
               progress: Progress, failures: dict[int, SubjectResult], failed: list[int]
               ) -> Iterator[SubjectResult]:
        """One round over ``pending``: settle each outcome, yield what may be released;
        a failure is final only in the ``last`` round (else kept in ``failures`` and its
        index added to ``failed``)."""
        subjects, settle = self.subjects, self._settle
        for outcome in backend.run_round((i, subjects[i]) for i in pending):
            i = outcome.index
            result, stored = settle(outcome, attempt, store, counts)
            if result.ok:
                if failures:
                    failures.pop(i, None)
            else:
                failed.append(i)
                failures[i] = result
                if not last:
                    continue
                del failures[i]
            counts["done" if result.ok else "failed"] += 1
            progress.update(ok=result.ok, cached=False)
            released = out.release(i, result, stored=stored)
            if released is not None:
                yield released
            else:
                yield from out.drain()

    def _settle(self, outcome, attempt: int, store: CheckpointStore | None,
                counts: collections.Counter[str]) -> tuple[SubjectResult, bool]:
        """Record one outcome in the store; returns its result and whether the store holds
        it as a success, or raises its error under ``on_subject_failure="fail_fast"``."""
        i = outcome.index
        value, error = outcome.value, outcome.error
        stored = False
        if outcome.ok and store is not None:
            try:
                store.save_success(self.keys[i], self.ids[i], value, attempt,
                                   outcome.duration_s)
                stored = True
            except SerializationError as exc:
                value, error = None, exc
        if error is not None:
            counts["timeouts"] += outcome.kind == "timeout"
            if store is not None:
                store.save_failure(self.keys[i], self.ids[i], _error_record(error), attempt,
                                   outcome.duration_s)
            if self.policy.on_subject_failure == "fail_fast":
                raise error
        return SubjectResult(self.ids[i], value, error, False, attempt,
                             outcome.duration_s), stored

    @staticmethod
    def _final(i: int, result: SubjectResult, stored: bool, counts: collections.Counter[str],
               progress: Progress, out: _Output) -> None:
        counts["done" if result.ok else "failed"] += 1
        progress.update(ok=result.ok, cached=False)
        out.finish(i, result, stored=stored)

    def _close(self, store: CheckpointStore | None, counts: collections.Counter[str],
               progress: Progress, interrupted: bool) -> None:
        """Shut the backend down, close the store, publish :attr:`summary`.

        Every Ctrl-C from here on is held (:class:`_Guarded` holds those that land
        between the first one's raise and here) until the backend's stop arms its own
        guard: the first one it sees, held or new, cuts its graceful stop short (the
        process backend kills its workers outright) and propagates; every later one is
        held until the store is closed (and raised then unless a KeyboardInterrupt is on
        its way already). The store is closed whatever happens in the stop."""
        with InterruptGuard(hold=True, raise_held=not interrupted):
            try:
                if self.backend is not None:
                    self.backend.shutdown(self.policy.graceful_shutdown_sec)
            except KeyboardInterrupt:
                interrupted = True
                raise
            finally:
                self._publish(store, counts, progress, interrupted)

    def _publish(self, store: CheckpointStore | None, counts: collections.Counter[str],
                 progress: Progress, interrupted: bool) -> None:
        """Close the store, then publish :attr:`summary` (and show it)."""
        if self.backend is not None:
            for key in ("oom_backoffs", "workers_started", "recycled", "restarts"):
                counts[key] += self.backend.stats[key]
        if store is not None:
            store.close()
        self.summary = {k: counts[k] for k in ("done", "cached", "failed", "retried",
                                               "timeouts", "oom_backoffs")}
        self.summary["workers_started"] = counts["workers_started"]
        self.summary.update({k: counts[k] for k in ("replayed_failures", "recycled",
                                                    "restarts") if counts[k]})
        if interrupted:
            self.summary["interrupted"] = 1
        progress.close(self.summary)


class _Guarded(Iterator[SubjectResult]):
    """A run's iterator: its generator, each step of it (and its close) under an
    :class:`~zephon.transport.supervisor.InterruptGuard`, so the guard is in force
    before a KeyboardInterrupt starts propagating through the run: the first Ctrl-C
    while the run works raises as usual, and every later one is held until the run's
    ``finally`` has stopped the workers and closed the store (a second one, held or
    not, makes that stop kill the workers outright), then dropped for the one on its
    way. Without it a second Ctrl-C right behind the first could land between the
    run's ``except`` and its stop: the stop would be skipped, and the interpreter would
    hang at exit joining workers that shrug off SIGTERM. Between steps (the caller's
    own code) the caller's handler is in force (Python's, unless it set one); a kept,
    unfinished iterator leaves Ctrl-C as the caller set it. Main thread only (the guard does nothing elsewhere)."""

    def __init__(self, steps: Iterator[SubjectResult]) -> None:
        self._steps: Any = steps
        self._guard: InterruptGuard | None = None

    def __iter__(self) -> "_Guarded":
        return self

    def __next__(self) -> SubjectResult:
        guard = self._guard
        if guard is None or not guard.renew():
            guard = self._step_guard()
        try:
            result = next(self._steps)
        except BaseException as exc:  # the run ended (StopIteration) or failed: let go
            self._release(exc)
            raise
        guard.pause()  # the caller's code: Ctrl-C as Python's own handler
        return result

    def close(self) -> None:
        """Leave the run: stop its workers and close its store now."""
        self._step_guard()
        try:
            self._steps.close()
        except BaseException as exc:
            self._release(exc)
            raise
        self._release(None)

    def _step_guard(self) -> InterruptGuard:
        """The run's guard, installed on its first step (one handler install for the
        whole run: a guard per step costs several times the serial loop's own step),
        fresh for this step. Installed again if the caller's code replaced the handler
        meanwhile."""
        guard = self._guard
        if guard is None or not guard.in_force:
            if guard is not None:
                guard.__exit__(None, None, None)
            guard = self._guard = InterruptGuard()
            guard.__enter__()
        guard.resume()
        return guard

    def _release(self, exc: BaseException | None) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.__exit__(type(exc) if exc is not None else None, exc, None)

    def __del__(self) -> None:
        if getattr(self._steps, "gi_frame", None) is None:
            return  # finished (its finally has run): nothing to stop
        try:
            self.close()
        except KeyboardInterrupt:  # a Ctrl-C cut the stop short: the workers were killed
            pass


def _subject_ids(subjects: list) -> list[str]:
    """Every subject's id, checked unique before the run yields anything. Subjects that
    are all non-empty strings are their own ids: the list itself, not a copy. The check
    is :func:`~zephon.kernels.distinct_str_ids` (one pass hashing the strings, no Python
    set: 10^6 ids in a small part of the resume's first-result budget); only when it
    cannot tell (a possible duplicate) are the ids counted exactly, and an actual
    duplicate is a ZephonConfigError naming up to 10 of them."""
    from zephon.kernels import distinct_str_ids

    verdict = distinct_str_ids(subjects)
    if verdict == 1:
        return subjects
    ids = subjects if verdict == 0 else [
        s if type(s) is str and s else subject_id_of(s, i) for i, s in enumerate(subjects)]
    if verdict == 0 or distinct_str_ids(ids) != 1:
        dupes = [sid for sid, n in collections.Counter(ids).items() if n > 1]
        if dupes:
            raise ZephonConfigError(f"duplicate subject ids: {sorted(dupes)[:10]}")
    return ids


class _PrefixedKeys(Sequence):
    """The default cache keys, ``prefix + id``, made when indexed."""

    def __init__(self, prefix: str, ids: list[str]) -> None:
        self._prefix, self._ids = prefix, ids

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._prefix + sid for sid in self._ids[i]]
        return self._prefix + self._ids[i]


class _Output:
    """The one output cursor of a run: results become final in any order; ``drain()``
    releases them in completion order (unordered) or in subject order (ordered, each as
    soon as every earlier subject is final).

    Memory is bounded by what cannot be released yet, and a success the store holds is
    not even kept: ordered, a final success that must wait for an earlier subject is
    only marked (one byte per subject), and read back from the store
    (``reload(i, from_cache)``) when its turn comes. Results kept in memory: those that
    may be released at the next ``drain()``, and failures or successes without a store
    that wait for an earlier subject."""

    _HELD, _STORED_CACHED, _STORED_RUN = 1, 2, 3

    def __init__(self, n: int, ordered: bool, reload) -> None:
        self.ordered = ordered
        self.not_ok = 0  # final results that are failures
        self._state = bytearray(n)  # 0: not final, else how the final result is kept
        self._held: dict[int, SubjectResult] = {}
        self._reload = reload
        self._ready: list[int] = []  # unordered: final, not yet released
        self._cursor = 0  # ordered: every subject before it has been released
        self._frontier = 0  # ordered: every subject before it is final

    def finish(self, i: int, result: SubjectResult, *, stored: bool) -> None:
        """Subject ``i``'s result is final; ``stored``: the store holds it (a success)."""
        self.not_ok += not result.ok
        state = self._state
        if not self.ordered:
            self._ready.append(i)
        if self.ordered and stored and i != self._frontier:
            state[i] = self._STORED_CACHED if result.from_cache else self._STORED_RUN
        else:
            state[i] = self._HELD
            self._held[i] = result
        while self._frontier < len(state) and state[self._frontier]:
            self._frontier += 1

    def release(self, i: int, result: SubjectResult, *, stored: bool
                ) -> SubjectResult | None:
        """:meth:`finish`, then: ``result`` itself when it is the one result that may be
        released now (the caller yields it, nothing is kept), else None (the caller
        drains). The common case of a run in order, without a dict entry or a generator
        per subject."""
        if self.ordered:
            if i != self._cursor or i != self._frontier:
                self.finish(i, result, stored=stored)
                return None
            self.not_ok += not result.ok
            state = self._state
            state[i] = self._HELD
            frontier = i + 1
            if frontier < len(state) and state[frontier]:
                self._held[i] = result  # later subjects are final too: drain them all
                while frontier < len(state) and state[frontier]:
                    frontier += 1
                self._frontier = frontier
                return None
            self._frontier = self._cursor = frontier
            return result
        if self._ready:
            self.finish(i, result, stored=stored)
            return None
        self.not_ok += not result.ok
        self._state[i] = self._HELD
        return result

    def drain(self) -> Iterator[SubjectResult]:
        """The results that may be released now."""
        if not self.ordered:
            ready, self._ready = self._ready, []
            for i in ready:
                yield self._held.pop(i)
            return
        while self._cursor < self._frontier:
            i = self._cursor
            self._cursor += 1
            if self._state[i] == self._HELD:
                yield self._held.pop(i)
            else:
                result = self._reload(i, self._state[i] == self._STORED_CACHED)
                self.not_ok += not result.ok
                yield result


def run(fn, subjects: Iterable[Any], policy: RunPolicy | None = None,
        fingerprint: str | None = None, progress: bool = True, **kwargs) -> JobRun:
    """Run ``fn`` on every subject under ``policy``; iterate the result for outcomes.

    Nothing runs until the returned :class:`JobRun` is iterated; each iteration yields
    a :class:`SubjectResult`. Failures are results (``r.error``), not exceptions,
    unless ``on_subject_failure="fail_fast"``. With ``resume`` (the default) every
    outcome is written to a checkpoint store, and a later run with the same
    fingerprint serves stored successes instead of recomputing them. Call it under
    ``if __name__ == "__main__":`` in a script: the process backend spawns workers
    that re-import the main script.

    Args:
        fn: ``fn(subject) -> value``, picklable (module level) for the process and ray
            backends; optional ``fn.setup()`` (once per worker) and
            ``fn.cache_key(subject)``.
        subjects: an iterable of subjects, each a non-empty string (its own id) or an
            object with a ``subject_id`` key or attribute; ids must be unique.
        policy: the :class:`~zephon.RunPolicy` (None: the defaults).
        fingerprint: a string naming what the results depend on; stored entries of
            another fingerprint are not served.
        progress: show a progress bar on a TTY (log lines otherwise) and a summary.
        **kwargs: ``ordered`` (default True), ``allow_pickle`` (default False),
            ``mp_context`` and ``on_bad_entry`` (``"recompute"``, the default, or
            ``"fail"``), as in :class:`JobRun`.

    Returns:
        A :class:`JobRun`; iterate it, then read ``summary``.

    Raises:
        ZephonConfigError: an invalid policy, subject or option (when called).

    Examples:
        >>> policy = RunPolicy(subject_timeout_sec=None, checkpoint_dir="ckpt")
        >>> [r.value for r in zephon.jobs.run(len, ["ab", "abc"], policy, progress=False)]
        [2, 3]
        >>> again = zephon.jobs.run(len, ["ab", "abc"], policy, progress=False)
        >>> [r.from_cache for r in again]
        [True, True]

        In a script, on worker processes::

            def tokenize(shard):          # module level: workers import it
                return len(shard)

            if __name__ == "__main__":
                job = run(tokenize, ["shard-000", "shard-001"],
                          RunPolicy(workers=2, subject_timeout_sec=600, checkpoint_dir="ckpt"),
                          fingerprint="tokenizer-v3")
                for r in job:
                    print(r.subject_id, "ok" if r.ok else r.error)
                print(job.summary)
    """
    return JobRun(fn, subjects, policy, fingerprint, progress, **kwargs)
