"""The Ray backend of ``jobs.run``: subjects as Ray actors or tasks on a Ray cluster.

What it owns: the connection to a Ray cluster for the length of a run, the Ray
workers that run subjects, and the translation of Ray's failures into the
:class:`~zephon.jobs.process.Outcome` kinds the run loop understands. The run
loop (store, replay, retry rounds, ordering, fail_fast, progress) is the same
for every backend; this module only runs ``(index, subject)`` items and yields
exactly one outcome per item.

Cluster: when this process is already connected (``ray.init`` was called) the
backend uses that connection and leaves it open. Otherwise it calls
``ray.init(address=RAY_ADDRESS)`` when ``RAY_ADDRESS`` is set, else
``ray.init()`` (which joins a cluster ``ray start`` left on this machine, or
starts a local one), and shuts that connection (and a local cluster it started)
down at the end of the run unless a pipeline's Ray stage still holds it
(:mod:`zephon.transport.ray_cluster` owns connecting, placement and disconnecting
for both).
``describe_cluster`` says which, for ``explain()``.
Ray itself is imported only inside this module's functions (the ``zephon[ray]``
extra); the callable and the subjects travel with Ray's serializer
(cloudpickle), and every node needs zephon and the callable's module installed.

Workers and RunPolicy:

- ``parallel_mode="persistent"``: one actor per worker slot (``num_cpus=1``,
  plus ``num_gpus=1`` with ``cap_workers_to_gpu_pool``). The actor's
  constructor receives the callable; ``setup()`` then runs once in it, and
  ``subject_spawn_timeout_sec`` bounds that start, counted from when Ray has
  placed the actor (waiting for free cluster resources is not the worker's
  fault; but when no actor at all has been placed within the spawn timeout the
  run fails with :class:`~zephon.jobs.process.JobSetupError`). An actor is
  replaced (killed, then a new one started) after
  ``persistent_worker_recycle_after_tasks`` successes and after
  ``persistent_worker_max_consecutive_failures`` consecutive failures; the
  driver already holds the last result, so a recycle never loses one.
- ``parallel_mode="isolated"``: one task per subject on a fresh worker process
  (``max_calls=1``); ``setup()`` runs in that process before the subject.
- ``workers`` is the number of subjects in flight; Ray's own retries are off
  (``max_retries=0``, ``max_restarts=0``): retries are the run's rounds, so
  attempts, the store and ``auto_retry_rounds`` mean what they mean elsewhere.
- ``subject_timeout_sec`` counts from when the subject is handed to an idle
  actor (isolated mode: from submission, which includes starting the fresh
  worker process). On expiry the actor is killed (``ray.kill``) or the task
  force-cancelled (``ray.cancel(force=True)``), which kills its worker
  process, and the subject gets :class:`~zephon.errors.SubjectTimeoutError`.
- Out of memory: a ``MemoryError`` in the subject, Ray's ``OutOfMemoryError``
  (its memory monitor killed the worker), or a worker that died without an
  exception while its node stayed alive (as when killed by SIGKILL, the kernel
  OOM killer's signal: Ray cannot tell which signal it was) counts as OOM:
  the outcome kind is ``oom`` and, with ``oom_backoff``, the concurrency
  drops by ``oom_reduce_workers_by`` (never below one) for the rest of the run.
  A worker lost with its node is a ``crash`` (retried by the next round).
- ``cap_workers_to_gpu_pool``: the worker count is capped to the cluster's GPU
  resource total, each worker requests ``num_gpus=1`` and sees
  ``ZEPHON_GPU_SLOT`` = the id Ray assigned it on its node (``ray.get_gpu_ids()``).

Batching: in persistent mode, when subjects turn out to be short (mean run time
under ``BATCH_TARGET_S`` / 8), several subjects go to an actor in one call
(batch size chosen so a call stays near ``BATCH_TARGET_S``, never more than
``MAX_BATCH``, and never so large that some workers idle). Each subject still
gets its own outcome and duration; a failure of one subject is its own, and a
batch stops where the failures call for a restart (the rest go to the next
actor), as it stops where a recycle is due. Batching
never changes outcomes: when a batch call runs past the subject timeout, or its
actor dies, its subjects are run again one per call (not counted as attempts),
so the timeout, the crash or the OOM is attributed to the one subject that
caused it. With batching the OOM signal of a death is only taken from such a
single-subject call.

``shutdown(grace)`` cancels every outstanding task (force), kills every actor,
waits up to ``grace`` seconds for Ray to confirm, and disconnects when the
backend made the connection (Ctrl-C in the driver goes through it too).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any, Iterable, Iterator

from zephon.errors import (
    SerializationError,
    SubjectTimeoutError,
    WorkerCrashedError,
    ZephonConfigError,
)
from zephon.jobs.process import JobSetupError, Outcome, max_consecutive_failures
from zephon.jobs.subjects import subject_label
from zephon.transport.ray_cluster import (
    actor_options,
    connect,
    describe_cluster,
    import_ray,
    where,
)
from zephon.transport.remote_errors import decode_exception, encode_exception

__all__ = [
    "BATCH_TARGET_S",
    "MAX_BATCH",
    "RayBackend",
    "describe_cluster",
    "explain_lines",
    "import_ray",
]

log = logging.getLogger("zephon.jobs")

BATCH_TARGET_S = 0.05
MAX_BATCH = 64


def explain_lines(backend: "RayBackend | None", store_dir: str | None) -> list[str]:
    """The Ray lines of a job run's ``explain()``: which cluster (and, once the run has
    connected, its nodes and resources) and where the store lives."""
    if backend is None:
        lines = [f"  ray cluster: {describe_cluster()}; nodes and resources are known "
                 "once the run has connected"]
    else:
        lines = backend.describe()
    if store_dir is not None:
        note = ("  ray store: written by this driver process only (results travel back to "
                "it), so a local path is safe on any cluster; a resume must run where that "
                "path is visible")
        if backend is not None and len(backend.nodes) > 1 and "://" not in store_dir:
            note += (f" (this cluster has {len(backend.nodes)} nodes and {store_dir} is a "
                     "local path: it lives on the driver's machine only, so run the next "
                     "driver there too, or use a path every node sees)")
        lines.append(note)
    return lines


# -- what runs on the Ray workers ------------------------------------------------------

def _call(fn, subject) -> tuple:
    """Run one subject: ``(ok, value, duration_s, traceback, exception blob, oom)``."""
    start = time.perf_counter()
    try:
        value = fn(subject)
    except Exception as exc:  # noqa: BLE001 - the subject's failure, reported to the driver
        tb, blob = encode_exception(exc)
        return (False, None, time.perf_counter() - start, tb, blob,
                isinstance(exc, MemoryError))
    return (True, value, time.perf_counter() - start, "", b"", False)


def _export_gpu_slot() -> None:
    import ray

    ids = ray.get_gpu_ids()
    if ids:
        os.environ["ZEPHON_GPU_SLOT"] = str(ids[0])


def _where() -> tuple[int, str]:
    return where()[:2]


class _SubjectActor:
    """A persistent worker: holds the callable, runs ``setup()`` once, then batches."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def ready(self, gpu: bool) -> tuple[int, str]:
        if gpu:
            _export_gpu_slot()
        setup = getattr(self.fn, "setup", None)
        if callable(setup):
            setup()
        return _where()

    def run(self, subjects: list, failures: int, limit: int) -> list[tuple]:
        """Run ``subjects`` in order; stop early once ``limit`` consecutive failures
        (counting the ``failures`` this actor already had) call for a restart."""
        out = []
        for subject in subjects:
            result = _call(self.fn, subject)
            out.append(result)
            failures = 0 if result[0] else failures + 1
            if failures >= limit:
                break
        return out


def _isolated_task(fn, subject, gpu: bool) -> list[tuple]:
    if gpu:
        _export_gpu_slot()
    setup = getattr(fn, "setup", None)
    if callable(setup):
        setup()
    return [_call(fn, subject)]


# -- the driver side ------------------------------------------------------------------

class _Actor:
    __slots__ = (
        "created",
        "failures",
        "handle",
        "node",
        "pid",
        "placed_at",
        "ready_ref",
        "state",
        "successes",
    )

    def __init__(self, handle, ready_ref) -> None:
        self.handle, self.ready_ref = handle, ready_ref
        self.state = "placing"  # placing -> starting -> idle <-> busy -> gone
        self.created = time.monotonic()
        self.placed_at: float | None = None  # when Ray placed it (state "starting")
        self.pid = self.node = None
        self.successes = self.failures = 0


class _Call:
    """One in-flight call: its items, its deadline, the actor (persistent mode)."""

    __slots__ = ("actor", "deadline", "items", "ref", "submitted")

    def __init__(self, ref, items, actor, deadline) -> None:
        self.ref, self.items, self.actor, self.deadline = ref, items, actor, deadline
        self.submitted = time.monotonic()


class RayBackend:
    """Runs subjects on a Ray cluster (see the module docstring).

    Args:
        fn: the job callable (serialized with cloudpickle, once per run).
        policy: the run's :class:`~zephon.options.RunPolicy`.
        workers: concurrent subjects (capped to the cluster's GPUs with
            ``cap_workers_to_gpu_pool``).
        batching: allow several short subjects per actor call (persistent mode).

    Example::

        backend = RayBackend(fn, RunPolicy(backend="ray", workers=4), 4)
        for outcome in backend.run_round([(0, "S0"), (1, "S1")]):
            ...
        backend.shutdown(5.0)
    """

    name = "ray"

    def __init__(self, fn, policy, workers: int, *, batching: bool = True,
                 names=None) -> None:
        self.names = names  # subject ids by position, to name subjects in errors
        self.cluster = describe_cluster()
        self.policy = policy
        self.stats: collections.Counter[str] = collections.Counter()
        self.link = connect("RunPolicy(backend='ray')")  # see zephon.transport.ray_cluster
        self.ray = ray = self.link.ray
        self.owns_connection = self.link.made
        self.gpu = bool(policy.cap_workers_to_gpu_pool)
        self.gpu_count = None
        resources = ray.cluster_resources()
        self.cluster_cpus = resources.get("CPU", 0.0)
        if self.gpu:
            self.gpu_count = int(resources.get("GPU", 0))
            if self.gpu_count == 0:
                self._disconnect()
                raise ZephonConfigError(
                    "RunPolicy.cap_workers_to_gpu_pool is on but the Ray cluster has no GPU "
                    f"resource (cluster resources: {sorted(resources)})")
            workers = min(workers, self.gpu_count)
        self.workers = self.concurrency = workers
        self.nodes = self._alive_nodes()
        try:
            self.fn_ref = ray.put(fn)
        except Exception as exc:
            self._disconnect()
            raise SerializationError(
                f"the job callable {fn!r} cannot be serialized for Ray workers: "
                f"{type(exc).__name__}: {exc}") from exc
        self.persistent = policy.parallel_mode == "persistent"
        self.batching = batching and self.persistent
        opts = actor_options(num_gpus=1 if self.gpu else 0)
        if self.persistent:
            self.actor_cls = ray.remote(**opts)(_SubjectActor)
        else:
            del opts["max_restarts"], opts["max_task_retries"]
            self.task = ray.remote(max_retries=0, max_calls=1, **opts)(_isolated_task)
        self.actors: list[_Actor] = []
        self.calls: dict[Any, _Call] = {}
        self.durations: collections.deque[float] = collections.deque(maxlen=256)

    # -- cluster ---------------------------------------------------------------------
    def _alive_nodes(self) -> set[str]:
        return {n["NodeID"] for n in self.ray.nodes() if n.get("Alive")}

    def describe(self) -> list[str]:
        """Lines for ``explain()`` once connected: cluster, nodes, resources."""
        lines = [f"  ray cluster: {self.cluster}; {len(self.nodes)} node(s), "
                 f"{self.cluster_cpus:g} CPU(s)"
                 + (f", {self.gpu_count} GPU(s)" if self.gpu_count is not None else "")]
        if self.gpu_count is not None:
            lines.append(f"  ray workers: {self.workers} (capped to the cluster's "
                         f"{self.gpu_count} GPU(s); each requests num_gpus=1)")
        return lines

    def _disconnect(self) -> None:
        self.link.release()

    # -- actors ----------------------------------------------------------------------
    def _spawn(self) -> _Actor:
        handle = self.actor_cls.remote(self.fn_ref)
        actor = _Actor(handle, handle.__ray_ready__.remote())
        self.actors.append(actor)
        self.stats["workers_started"] += 1
        return actor

    def _retire(self, actor: _Actor) -> None:
        actor.state = "gone"
        if actor in self.actors:
            self.actors.remove(actor)
        try:
            self.ray.kill(actor.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass

    def _check_starting(self) -> None:
        """Advance starting actors: ``placing`` (Ray has not run the constructor yet: waiting
        for resources) -> ``starting`` (``setup()`` runs, bounded by the spawn timeout) ->
        ``idle``. A failed setup raises; so does a run where no actor at all became ready
        within the spawn timeout."""
        timeout = self.policy.subject_spawn_timeout_sec
        starting = [a for a in self.actors if a.state in ("placing", "starting")]
        if not starting:
            return
        refs = [a.ready_ref for a in starting]
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        done = set(done)
        now = time.monotonic()
        for actor in starting:
            if actor.ready_ref in done:
                self._ready(actor, now)
            else:
                self._check_setup_time(actor, now, timeout)
        self._check_placing(now, timeout)

    def _check_setup_time(self, actor: _Actor, now: float, timeout: float | None) -> None:
        """Raise when ``actor``'s ``setup()`` has run past the spawn timeout since Ray
        placed it (an actor still waiting for resources is :meth:`_check_placing`'s)."""
        if actor.state == "starting" and timeout is not None and \
                actor.placed_at is not None and now - actor.placed_at > timeout:
            self._retire(actor)
            raise JobSetupError(
                f"a Ray job worker did not become ready within {timeout} s "
                "(subject_spawn_timeout_sec) after Ray placed it: its setup() hangs")

    def _ready(self, actor: _Actor, now: float) -> None:
        """One step of an actor whose ready call returned: a placed actor starts its
        ``setup()``, a set-up one becomes idle; a failed step raises, or retires the
        actor when its node went away (a replacement is started)."""
        ray = self.ray
        try:
            answer = ray.get(actor.ready_ref)
        except ray.exceptions.RayActorError as exc:
            self._start_failed(actor, exc)
            self._retire(actor)  # its node went away: a replacement is started
            return
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            raise JobSetupError(
                f"a Ray job worker could not set up the callable: "
                f"{type(cause).__name__}: {cause}") from cause
        if actor.state == "placing":
            actor.state, actor.placed_at = "starting", now
            actor.ready_ref = actor.handle.ready.remote(self.gpu)
        else:
            actor.pid, actor.node = answer
            actor.state = "idle"

    def _start_failed(self, actor: _Actor, exc) -> None:
        """Raise for an actor that died starting, unless its node went away (then the
        caller retires it)."""
        cause = getattr(exc, "cause", None)
        if actor.state == "placing" and isinstance(cause, BaseException) and \
                not isinstance(cause, self.ray.exceptions.RayError):
            raise JobSetupError(
                f"a Ray job worker could not load the callable: {exc.cause}") from exc
        if self._node_alive(exc, actor):
            raise JobSetupError(f"a Ray job worker could not start: {exc}") from exc

    def _check_placing(self, now: float, timeout: float | None) -> None:
        """Raise when every actor has waited for resources past the spawn timeout."""
        placing = [a for a in self.actors if a.state == "placing"]
        if timeout is not None and placing and len(placing) == len(self.actors) and \
                now - min(a.created for a in placing) > timeout:
            raise JobSetupError(
                f"no Ray job worker could be placed within {timeout} s "
                "(subject_spawn_timeout_sec): the cluster has no free "
                f"{'GPU' if self.gpu else 'CPU'} for a worker, or its worker processes "
                f"fail to start (cluster resources now: {self.ray.available_resources()})")

    def _node_alive(self, exc, actor: _Actor | None) -> bool:
        if actor is not None and actor.node is not None:
            self.nodes = self._alive_nodes()
            return actor.node in self.nodes
        text = str(exc).lower()
        return not ("node" in text and ("died" in text or "dead" in text
                                        or "removed" in text))

    # -- one round -------------------------------------------------------------------
    def _batch_size(self, queued: int) -> int:
        if not self.batching or not self.durations:
            return 1
        mean = sum(self.durations) / len(self.durations)
        if mean >= BATCH_TARGET_S / 8:
            return 1
        by_time = int(BATCH_TARGET_S / max(mean, 1e-6))
        by_spread = queued // (2 * max(1, self.concurrency))
        return max(1, min(MAX_BATCH, by_time, by_spread))

    def _deadline(self) -> float | None:
        timeout = self.policy.subject_timeout_sec
        return None if timeout is None else time.monotonic() + timeout

    def _label(self, index: int) -> str:
        return subject_label(self.names, index)

    def _submit(self, items: list, actor: _Actor | None, singles) -> Outcome | None:
        """Hand ``items`` to ``actor`` (or to a new task). A subject Ray cannot serialize
        is that subject's failure; a batch holding one is split into single calls."""
        try:
            if actor is not None:
                ref = actor.handle.run.remote(
                    [s for _, s in items], actor.failures,
                    max_consecutive_failures(self.policy))
            else:
                (_, subject), = items
                ref = self.task.remote(self.fn_ref, subject, self.gpu)
        except Exception as exc:  # noqa: BLE001 - Ray's serializer refused an argument
            if len(items) > 1:
                singles.extend(items)
                return None
            return Outcome(items[0][0], False, None, SerializationError(
                f"{self._label(items[0][0])} cannot be serialized for Ray: "
                f"{type(exc).__name__}: {exc}"), 0.0, "error")
        if actor is not None:
            actor.state = "busy"
        self.calls[ref] = _Call(ref, items, actor, self._deadline())
        self.stats["batched_calls"] += len(items) > 1
        return None

    def run_round(self, items: Iterable[tuple[int, Any]]) -> Iterator[Outcome]:
        """Run ``(index, subject)`` items; yields one :class:`Outcome` per item, in
        completion order."""
        queue = collections.deque(items)
        singles: collections.deque = collections.deque()  # split batches, one per call
        while queue or singles or self.calls:
            if self.persistent:
                self._size_actors(len(queue) + len(singles) + sum(
                    len(c.items) for c in self.calls.values()))
                self._check_starting()
                yield from self._feed_actors(queue, singles)
            else:
                while (queue or singles) and len(self.calls) < self.concurrency:
                    refused = self._submit([(singles or queue).popleft()], None, singles)
                    if refused is not None:
                        yield refused
            yield from self._wait(singles)

    def _size_actors(self, outstanding: int) -> None:
        """Keep as many live actors as the concurrency and the ``outstanding`` items
        need: retire the spare ones (those still starting first, so warm actors stay),
        spawn the missing ones."""
        live = [a for a in self.actors if a.state != "gone"]
        want = min(self.concurrency, outstanding)
        spare = [a for a in live if a.state in ("placing", "starting")] + \
            [a for a in live if a.state == "idle"]  # keep warm actors first
        for actor in spare[: max(0, len(live) - want)]:
            self._retire(actor)  # after an OOM back-off, or when work runs out
            live.remove(actor)
        while len(live) < want:
            live.append(self._spawn())

    def _feed_actors(self, queue: collections.deque,
                     singles: collections.deque) -> Iterator[Outcome]:
        """Hand every idle actor its next batch (a split batch's item first); yields the
        outcome of a subject Ray refused to serialize."""
        for actor in [a for a in self.actors if a.state == "idle"]:
            if singles:
                batch = [singles.popleft()]
            elif queue:
                batch = [queue.popleft() for _ in range(self._take(actor, len(queue)))]
            else:
                break
            refused = self._submit(batch, actor, singles)
            if refused is not None:
                yield refused

    def _take(self, actor: _Actor, queued: int) -> int:
        """How many of the ``queued`` items ``actor``'s next batch takes."""
        size = min(self._batch_size(queued), queued)
        recycle = self.policy.persistent_worker_recycle_after_tasks
        if recycle:  # a batch never carries an actor past its recycle
            size = max(1, min(size, recycle - actor.successes))
        return size

    def _wait(self, singles) -> Iterator[Outcome]:
        ray = self.ray
        deadlines = [c.deadline for c in self.calls.values() if c.deadline is not None]
        wait_s = 0.2
        if deadlines:
            wait_s = max(0.0, min(wait_s, min(deadlines) - time.monotonic()))
        refs = list(self.calls)
        if refs:
            done, _ = ray.wait(refs, num_returns=1, timeout=wait_s)
            # collect whatever else is ready too, without waiting
            if done:
                more, _ = ray.wait([r for r in refs if r not in done],
                                   num_returns=len(refs) - len(done), timeout=0)
                done = done + more
        else:
            done = []
            time.sleep(min(wait_s, 0.05))
        for ref in done:
            call = self.calls.pop(ref)
            yield from self._finished(call, singles)
        yield from self._expire(singles)

    def _finished(self, call: _Call, singles) -> Iterator[Outcome]:
        ray, actor = self.ray, call.actor
        try:
            results = ray.get(call.ref)
        except ray.exceptions.OutOfMemoryError as exc:
            yield from self._lost(call, singles, "oom", exc)
            return
        except (ray.exceptions.ActorDiedError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.ActorUnavailableError) as exc:
            kind = "oom" if self._node_alive(exc, actor) else "crash"
            yield from self._lost(call, singles, kind, exc)
            return
        except ray.exceptions.RayError as exc:  # e.g. the node's objects were lost
            yield from self._lost(call, singles, "crash", exc)
            return
        if actor is not None and actor.state == "busy":
            actor.state = "idle"
        for item in reversed(call.items[len(results):]):  # not run: the actor restarts
            singles.appendleft(item)
        yield from self._outcomes(call, results)
        if actor is not None and actor.state == "idle":
            self._maybe_retire(actor)

    def _outcomes(self, call: _Call, results: list) -> Iterator[Outcome]:
        """One Outcome per result of a finished call (a persistent actor's batch may
        return fewer results than items: the rest went back to ``singles``)."""
        actor = call.actor
        where = f"Ray worker pid {actor.pid}" if actor is not None else "a Ray task"
        for (index, _), (ok, value, duration, tb, blob, oom) in zip(
                call.items, results, strict=False):
            self.durations.append(duration)
            if ok:
                if actor is not None:
                    actor.successes += 1
                    actor.failures = 0
                yield Outcome(index, True, value, None, duration, "ok")
                continue
            error = decode_exception(blob, tb, f"{self._label(index)} on {where}")
            if actor is not None:
                actor.failures += 1
            if oom:
                self._back_off()
            yield Outcome(index, False, None, error, duration, "oom" if oom else "error")

    def _maybe_retire(self, actor: _Actor) -> None:
        """Retire an idle actor that reached its recycle count or its failure limit."""
        recycle = self.policy.persistent_worker_recycle_after_tasks
        if recycle and actor.successes >= recycle:
            self.stats["recycled"] += 1
            self._retire(actor)
        elif actor.failures >= max_consecutive_failures(self.policy):
            self.stats["restarts"] += 1
            self._retire(actor)

    def _lost(self, call: _Call, singles, kind: str, exc) -> Iterator[Outcome]:
        """The worker running ``call`` died: a batch is split into single calls; a single
        subject gets its outcome."""
        if call.actor is not None:
            self._retire(call.actor)
        if len(call.items) > 1:
            singles.extend(call.items)
            return
        (index, _), = call.items
        if kind == "oom":
            self._back_off()
            error = WorkerCrashedError(
                f"the Ray worker running {self._label(index)} died without an exception while its "
                "node stayed up (as when killed by SIGKILL, e.g. by the OOM killer, or by "
                f"Ray's memory monitor; counted as out of memory): {_first_line(exc)}",
                pid=None if call.actor is None else call.actor.pid)
        else:
            error = WorkerCrashedError(
                f"the Ray worker running {self._label(index)} was lost with its node: "
                f"{_first_line(exc)}", pid=None if call.actor is None else call.actor.pid)
        yield Outcome(index, False, None, error, time.monotonic() - call.submitted, kind)

    def _expire(self, singles) -> Iterator[Outcome]:
        now = time.monotonic()
        timeout = self.policy.subject_timeout_sec
        for ref, call in list(self.calls.items()):
            if call.deadline is None or now < call.deadline:
                continue
            del self.calls[ref]
            if call.actor is not None:
                self._retire(call.actor)
            else:
                try:
                    self.ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001 - it finished meanwhile
                    pass
            if len(call.items) > 1:
                singles.extend(call.items)
                continue
            (index, _), = call.items
            self.stats["timeouts"] += 1
            yield Outcome(index, False, None, SubjectTimeoutError(
                f"{self._label(index)} ran past subject_timeout_sec={timeout} s; its Ray worker "
                "was killed", timeout_s=timeout,
                subject_id=None if self.names is None else self.names[index]), timeout,
                "timeout")

    def _back_off(self) -> None:
        if not self.policy.oom_backoff:
            return
        lowered = max(1, self.concurrency - self.policy.oom_reduce_workers_by)
        if lowered < self.concurrency:
            log.warning("out of memory: lowering Ray job concurrency from %d to %d for the "
                        "rest of the run", self.concurrency, lowered)
            self.concurrency = lowered
            self.stats["oom_backoffs"] += 1

    # -- shutdown --------------------------------------------------------------------
    def shutdown(self, grace: float) -> None:
        """Cancel every outstanding task (force), kill every actor, wait up to ``grace``
        seconds for Ray to confirm, then disconnect if this backend connected."""
        ray = self.ray
        if not ray.is_initialized():
            return
        refs = list(self.calls)
        for ref, call in self.calls.items():
            if call.actor is None:
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001
                    pass
        refs += [a.ready_ref for a in self.actors if a.state in ("placing", "starting")]
        for actor in list(self.actors):
            self._retire(actor)
        self.calls.clear()
        if refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=grace)
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
        self._disconnect()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
