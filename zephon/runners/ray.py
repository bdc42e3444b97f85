"""The Ray runner: a pipeline stage's units on Ray actors across a cluster's nodes
(``RuntimeOptions(runner="ray")``, or one stage with ``per_stage_runner={i: "ray"}``).

What it owns: :class:`RayExecutor`, a :class:`~zephon.runners.contract.StageExecutor`
whose workers are Ray actors (Ray Core actors, not Ray Data, whose splits and
iterators cannot give zephon's stream). The driver is the trainer's process: the
engine there cuts each lane into units keyed by ``(lane, seq)`` exactly as for every
other runner (:mod:`zephon.pipeline.dispatch`), submits them here, and puts the
results back in sequence order. Where a unit runs never changes what it makes, so the
stream is the one the inline, threads, process and MTP runners give, whatever the
number of actors, the nodes they land on, or the actors lost on the way; and the
checkpoint (lane states, taken on the driver) is the same checkpoint, restorable on
any runner and any number of actors.

**Actors.** Each actor (``num_cpus=1``, placed with Ray's ``SPREAD`` strategy, Ray's
own restarts and retries off: :func:`zephon.transport.ray_cluster.actor_options`) gets
the stage program pickled as Ray ships code (cloudpickle: the driver script's own
functions by value, those of modules by reference, so every node needs zephon and the
ops' modules, or a ``runtime_env`` given to ``ray.init`` that has them), loads it once
in ``start`` and limits its numerical libraries' thread pools as a process worker does
(``worker_compute_threads``, :mod:`zephon.transport.threads`). An actor that cannot
load the program (a module missing on its node) is a
:class:`~zephon.errors.ZephonConfigError` naming the node and the module, raised from
the first ``get``. When no actor has started within the pool's spawn timeout (the
cluster has no free CPU for one) that is an error too, naming the cluster's resources.

**Units and data.** ``submit`` sends ``run(payload)`` to the ready actor with the
fewest units in flight (Ray runs an actor's calls in order, so that actor's oldest
call is the one running), while that actor holds less than its share of the stage's
units (over the actors ready or starting; so the first actor ready does not take
every unit while the others start); the rest wait on the driver, in sequence, and go
as actors start or free up. A unit is never queued on an actor that has not started:
Ray may never place an actor the cluster has no free CPU for. A stage
that reads the source reads it on the actor's node: the payload of a reading stage is
the unit's indices, never its data. Payloads and results travel :func:`pack`-ed
(pickle protocol 5; arrays of 64 KiB and more out of band, as arrays of their own
through Ray's object store); a result that cannot be pickled is found in the actor
and reported as a process worker reports it (an :class:`~zephon.errors.OpError`
naming the op, the sample and the object, the records before it handed on first).
Ray hands the out-of-band arrays over read-only (its store is immutable):
:func:`unpack` copies each once, at memory bandwidth, so every array a stage's ops,
the ops after it and the loop get is one they may write to, as on every other
runner. The driver holds a result from ``get`` until the engine takes it. What is in
flight is bounded by the dispatch, as on the process runner: the lane's depth and
its byte budget (in flight plus parked behind a sequence gap), and the consumer
holds at most the prefetch depth. When no actor has been ready for the spawn
timeout (a cluster without a free CPU, every node holding the actors gone for good)
the stage fails with a :class:`~zephon.errors.TransportError` naming the cluster's
CPUs.

**Exactly once.** Every unit in flight is kept on the driver with its payload until its
result is taken. An actor lost (killed, out of memory, its node gone: Ray reports
the death on each of its calls) takes none of the results it had not returned: its
units go again, in their order, to the other actors, and a replacement actor is
started (Ray places it on a live node). The unit the lost actor was running (its
oldest) is charged a retry (an actor lost before it started ran nothing and charges
none; more than ``max(3, max_worker_retries)`` of those in a row with none ready is a
:class:`~zephon.errors.TransportError`); past ``max_worker_retries`` it fails in its place in the
stream with :class:`~zephon.errors.WorkerCrashedError` (``deterministic=False``:
dropped with a warning), as on the process runner. A result is taken once: the
lost calls' references are dropped, so a call that still finishes somewhere is
never read. An op's own error comes back as the unit's
:class:`~zephon.transport.failure.UnitFailure` (the records before it, then the error
rebuilt link by link, :mod:`zephon.transport.remote_errors`) and is raised in stream
order; a result that cannot be serialized is the unit's
:class:`~zephon.errors.SerializationError`.

**Sizing.** ``workers`` actors from the start; ``grow`` starts one more (it comes into
service when Ray has placed it), ``shrink`` retires the one with the least in flight
once its calls are back. ``max_workers`` (what the autotune controller may grow to)
defaults to the cluster's CPUs when the executor is made, and ``cpu_pool`` says so to
the controller, which gives the stage a budget of its own (the cluster's CPUs,
:mod:`zephon.pipeline.tuning`): it grows while the consumer waits on it and the
cluster has CPUs, shrinks when its actors idle, and its actors never count against
the host's budget. The budget is read when the stage starts and again when a kept
stage serves the next epoch: CPUs an autoscaling cluster adds during a run are used
from the next epoch on.

**Lifecycle.** Made by the engine for one run (connecting through
:func:`zephon.transport.ray_cluster.connect`); ``close`` (any thread, idempotent, never
waits for an op) kills every actor and releases the connection. With persistent workers a
run that ends its pass parks the executor in the pipeline's keep
(:mod:`zephon.pipeline.keep`) instead: its actors and connection serve the next
epoch (``keepable``, ``adopt``, ``runs``). A driver that exits without closing (a
SIGKILL) leaves nothing either: Ray stops the actors of a dead driver.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import pickle
import threading
import time
import traceback
import warnings
from typing import Any, Callable

import numpy as np

from zephon.errors import (
    SerializationError,
    TransportError,
    WorkerCrashedError,
    ZephonConfigError,
)
from zephon.runners.contract import Runner, StageMeter
from zephon.transport.failure import UnitFailure, Unwind
from zephon.transport.optime import OpClock
from zephon.transport.ray_cluster import (
    actor_options,
    alive_nodes,
    connect,
    missing_module,
    where,
)
from zephon.transport.remote_errors import decode_exception, encode_exception

__all__ = ["RayExecutor"]

log = logging.getLogger("zephon.runners")

#: seconds one wait for results lasts before the executor looks at its actors again
#: (a close from another thread is seen within it)
POLL_S = 0.5


class _StageActor:
    """What runs on a Ray worker: loads the stage program once, then runs units."""

    def __init__(self) -> None:
        self.program: Callable | None = None
        self.threads: Any = None

    def start(self, blob: bytes, compute_threads: int) -> tuple:
        """Load the program: ``(pid, node id, node address, error or None, missing
        module or None)``."""
        pid, node, address = where()
        try:
            from zephon.transport.threads import ComputeThreads

            program = pickle.loads(blob)
            self.threads = ComputeThreads(compute_threads)
        except BaseException as exc:  # noqa: BLE001 - reported to the driver
            text = f"{type(exc).__name__}: {exc}"
            return pid, node, address, text, missing_module(traceback.format_exc() + text)
        self.program = program
        return pid, node, address, None, None

    def run(self, data: bytes, *buffers) -> tuple:
        """One unit (its payload :func:`pack`-ed): ``(op seconds, packed result, None)``
        or ``(op seconds, None, (traceback, error blob, packed records before the
        error))``."""
        self.threads.before_task()
        program = self.program
        assert program is not None  # run() comes after a start() that loaded it
        payload = unpack(data, buffers)
        clock = OpClock()
        try:
            result = program(payload)
        except Unwind as unwind:
            result = unwind.failure
        except BaseException as exc:  # noqa: BLE001 - the unit's failure, in stream order
            result = UnitFailure(exc)
        busy = clock.seconds()
        if type(result) is not UnitFailure:
            try:
                return busy, pack(result), None
            except Exception as exc:  # noqa: BLE001 - a record that cannot be pickled
                result = _unsendable(program, result, exc)
        tb, blob = encode_exception(result.error)
        return busy, None, (tb, blob, pack(result.done))


class _Actor:
    __slots__ = ("address", "calls", "handle", "index", "node", "pid", "retiring",
                 "start_ref", "started", "state")

    def __init__(self, index: int, handle, start_ref) -> None:
        self.index, self.handle, self.start_ref = index, handle, start_ref
        self.state = "starting"  # starting -> ready -> gone
        self.started = time.monotonic()
        self.pid = self.node = self.address = None
        self.retiring = False
        self.calls: dict[Any, _Call] = {}  # its calls in flight, in submission order


class _Call:
    __slots__ = ("actor", "lane", "order", "payload", "seq")

    def __init__(self, lane, seq: int, payload, order: int) -> None:
        self.lane, self.seq, self.payload, self.order = lane, seq, payload, order
        self.actor: _Actor | None = None


def _order(call: _Call) -> int:
    return call.order


class RayExecutor:
    """A stage's units on Ray actors (see the module docstring).

    Args:
        program: the stage program (pickled once; every actor loads it).
        workers: actors to start with.
        name: the stage's name (errors, statistics).
        max_retries: deaths a unit may cause before it fails (``max_worker_retries``).
        deterministic: False drops a unit past its retries (with a warning) instead.
        meter: the stage's one meter.
        compute_threads: the actors' numerical thread-pool limit
            (``worker_compute_threads``; 0 leaves them alone).
        spawn_timeout_s: seconds within which some actor must have started.
        most: the most actors it may be grown to (``max_workers``; None: the cluster's
            CPUs).

    Example::

        ex = RayExecutor(program, 2, name="stage0")
        ex.submit(0, 0, unit)
        seq, result, busy_s = ex.get(0)
        ex.close()
    """

    runner: Runner = "ray"
    adaptive = False

    def __init__(self, program: Callable, workers: int, *, name: str = "stage",
                 max_retries: int = 3, deterministic: bool = True,
                 meter: StageMeter | None = None, compute_threads: int = 0,
                 spawn_timeout_s: float = 120.0, most: int | None = None) -> None:
        self.name, self.max_retries, self.deterministic = name, max_retries, deterministic
        self.meter = meter if meter is not None else StageMeter()
        self.compute_threads, self.spawn_timeout_s = compute_threads, spawn_timeout_s
        self.link = connect("runner='ray'")
        ray = self.ray = self.link.ray
        try:
            self.blob = _dumps(program)
        except Exception as exc:
            self.link.release()
            raise SerializationError(
                f"stage {name}: its ops cannot be pickled for Ray actors: "
                f"{type(exc).__name__}: {exc}") from exc
        self._errors = ray.exceptions
        self._lock = threading.Lock()
        self._stopped = False
        self._in_get = False
        try:
            self.blob_ref = ray.put(self.blob)
            self.actor_cls = ray.remote(**actor_options(spread=True))(_StageActor)
            cpus = int(ray.cluster_resources().get("CPU", 0))
        except BaseException:
            self.link.release()
            raise
        self.actors: list[_Actor] = []
        self.calls: dict[Any, _Call] = {}  # ref -> call, every call in flight
        self._order = itertools.count()
        self._index = itertools.count()
        self._retries: collections.Counter = collections.Counter()
        self._done: dict[Any, collections.deque] = collections.defaultdict(collections.deque)
        self.workers = workers
        #: the cluster's CPUs when the stage started: the autotune controller's budget for
        #: this stage, apart from the host's (see the contract)
        self._most = most
        self.cpu_pool: int | None = max(1, min(cpus, most) if most else cpus)
        self.max_workers = max(workers, self.cpu_pool)
        #: units run again after their actor was lost, and actors lost
        self.reruns = self.lost = 0
        #: units waiting for a ready actor (none is ready yet, or every one was lost)
        self._pending: list[_Call] = []
        #: since when no actor has been ready (None: one is); actors lost while starting,
        #: in a row
        self._no_ready_since: float | None = time.monotonic()
        self._start_deaths = 0
        try:
            for _ in range(workers):
                self._spawn()
        except BaseException:
            self.close()
            raise

    # -- the contract --------------------------------------------------------------------
    @property
    def booting(self) -> int:
        """Actors started and not ready yet."""
        return sum(1 for a in self.actors if a.state == "starting" and not a.retiring)

    def pids(self) -> list[int]:
        """None here: the actors' processes are on the cluster's nodes."""
        return []

    def grow(self) -> None:
        """One actor more (in service once Ray has placed it and it has started)."""
        self._spawn()
        self.workers += 1

    def shrink(self) -> None:
        """One actor fewer: the one with the least in flight (a starting one first) takes
        nothing new and is stopped once its calls are back."""
        live = [a for a in self.actors if not a.retiring]
        if self.workers <= 1 or len(live) <= 1:
            return
        actor = min(live, key=lambda a: (a.state == "ready", len(a.calls), -a.index))
        actor.retiring = True
        self.workers -= 1
        if not actor.calls:
            self._retire(actor)

    def submit(self, lane, seq: int, payload) -> None:
        self._dispatch(_Call(lane, seq, payload, next(self._order)))

    def get(self, lane):
        done = self._done[lane]
        self._in_get = True
        try:
            while not done:
                if self._stopped:
                    raise TransportError(f"stage {self.name!r}: the Ray stage was closed")
                self._poll()
        finally:
            with self._lock:
                self._in_get = False
                release = self._stopped
            if release:
                self.link.release()
        return done.popleft()

    def close(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            waiting = self._in_get
        for actor in self.actors:
            self._kill(actor)
        for k in range(self.workers):
            self.meter.event("stop", k)
        self.actors.clear()
        self.calls.clear()
        self._done.clear()
        if not waiting:  # else the get() that waits releases it as it leaves
            self.link.release()

    # -- persistent workers (zephon.pipeline.keep) ---------------------------------------
    @property
    def idle(self) -> bool:
        """Nothing in flight and no result waiting to be taken."""
        return not self.calls and not any(self._done.values())

    def keepable(self) -> bool:
        """Whether the actors can serve another run: idle, open, connected."""
        return self.idle and not self._stopped and self.ray.is_initialized() and \
            any(not a.retiring for a in self.actors)

    def runs(self, program) -> bool:
        """Whether the actors run ``program`` (it pickles to the bytes they loaded)."""
        if not self.ray.is_initialized():  # the connection is gone, and its actors
            return False
        try:
            return _dumps(program) == self.blob
        except Exception:  # noqa: BLE001 - one that cannot be pickled is not what they run
            return False

    def adopt(self, meter: StageMeter, workers: int) -> None:
        """Serve a new run with the actors as they are: its ``meter``, retries counted
        afresh, grown or shrunk to ``workers``."""
        if not self.idle:
            raise TransportError(f"stage {self.name!r}: a Ray stage with work in flight "
                                 "cannot serve another run")
        self.meter = meter
        self._retries.clear()
        # the cluster may have grown (or shrunk) since: the new run's budget is today's
        cpus = int(self.ray.cluster_resources().get("CPU", 0))
        self.cpu_pool = max(1, min(cpus, self._most) if self._most else cpus)
        self.max_workers = max(workers, self.cpu_pool)
        while self.workers < workers:
            self.grow()
        while self.workers > workers and self.workers > 1:
            self.shrink()

    def describe(self) -> str:
        """One line for ``explain()`` and the report: actors, nodes, in flight, re-runs."""
        ready = [a for a in self.actors if a.state == "ready" and not a.retiring]
        nodes = sorted({a.address or "?" for a in ready})
        return (f"{len(ready)} Ray actor(s) ready, {self.booting} starting, on "
                f"{len(nodes)} node(s) {nodes}; {len(self.calls)} unit(s) in flight; "
                f"{self.reruns} unit(s) re-run after {self.lost} actor(s) lost")

    # -- actors ------------------------------------------------------------------------
    def _spawn(self) -> _Actor:
        handle = self.actor_cls.remote()
        actor = _Actor(next(self._index), handle,
                       handle.start.remote(self.blob_ref, self.compute_threads))
        self.actors.append(actor)
        return actor

    def _kill(self, actor: _Actor) -> None:
        actor.state = "gone"
        if not self.ray.is_initialized():  # the user shut Ray down: its actors went with it
            return  # (and ray.kill would start a local Ray to kill nothing)
        try:
            self.ray.kill(actor.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def _retire(self, actor: _Actor) -> None:
        if actor in self.actors:
            self.actors.remove(actor)
        self._kill(actor)
        self.meter.event("stop", actor.index)

    def _ready(self) -> list[_Actor]:
        return [a for a in self.actors if a.state == "ready" and not a.retiring]

    def _dispatch(self, call: _Call) -> None:
        """Queue ``call`` among the units waiting on the driver, in sequence (a unit lost
        with its actor goes before those submitted after it), and send what may go."""
        bisect.insort(self._pending, call, key=_order)
        if not self._drain() and not any(a.state != "gone" and not a.retiring
                                          for a in self.actors):
            self._spawn()  # every actor lost: start one (the count follows as they go)

    def _drain(self) -> bool:
        """Send waiting units, oldest first, each to the ready actor with the fewest in
        flight while that one holds less than its share of the stage's units (those in
        flight and waiting, over the actors ready or starting): a unit is never queued
        on an actor that has not started (Ray may never place it: a cluster without a
        free CPU), and the first actor ready does not take every unit while the others
        start. True when some actor is ready."""
        ready = self._ready()
        if not ready:
            return False
        live = sum(1 for a in self.actors if a.state != "gone" and not a.retiring)
        while self._pending:
            actor = min(ready, key=lambda a: (len(a.calls), a.index))
            share = -(-(len(self.calls) + len(self._pending)) // max(1, live))
            if actor.calls and len(actor.calls) >= share:
                break
            self._send(actor, self._pending.pop(0))
        return True

    def _send(self, actor: _Actor, call: _Call) -> None:
        data, buffers = pack(call.payload)
        ref = actor.handle.run.remote(data, *buffers)
        call.actor = actor
        actor.calls[ref] = call
        self.calls[ref] = call

    def _started(self, actor: _Actor) -> None:
        errors = self._errors
        try:
            pid, node, address, error, module = self.ray.get(actor.start_ref)
        except (errors.RayActorError, errors.ObjectLostError) as exc:
            self._lost(actor, exc, None)
            return
        actor.pid, actor.node, actor.address = pid, node, address
        if error is not None:
            fix = (f": install {module!r} on that node (or connect with ray.init(runtime_env="
                   "...) that provides it)" if module else "")
            self.close()
            raise ZephonConfigError(
                f"stage {self.name}: a Ray actor on node {address} ({node[:12]}) cannot load "
                f"the stage's ops: {error}{fix}")
        if actor.state == "starting":
            actor.state = "ready"
            self._start_deaths = 0
            self.meter.event("start", actor.index)
            if actor.retiring:
                self._retire(actor)
            self._drain()

    def _poll(self) -> None:
        """Wait up to :data:`POLL_S` for results or actor starts and take every one that
        is ready (the dispatch sees all the results that came in at once, and sends the
        next parts to the actors they freed)."""
        starting = {a.start_ref: a for a in self.actors if a.state == "starting"}
        refs = list(starting) + list(self.calls)
        if not refs:
            raise TransportError(f"stage {self.name!r}: get() with nothing in flight")
        self._check_placed()
        ray = self.ray
        ready, _ = ray.wait(refs, num_returns=1, timeout=POLL_S, fetch_local=False)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        for ref in ready:
            if self._stopped:
                return
            actor = starting.get(ref)
            if actor is not None:
                self._started(actor)
            else:
                self._settle(ref)
        self._drain()

    def _check_placed(self) -> None:
        """Raise when the stage has had no ready actor for ``spawn_timeout_s`` (at the
        start, or after every actor was lost): a cluster without a free CPU, or nodes gone
        for good."""
        if self._ready():
            self._no_ready_since = None
            return
        now = time.monotonic()
        if self._no_ready_since is None:
            self._no_ready_since = now
            return
        if now - self._no_ready_since <= self.spawn_timeout_s:
            return
        ray = self.ray
        free, total = (ray.available_resources().get("CPU", 0),
                       ray.cluster_resources().get("CPU", 0))
        self.close()
        raise TransportError(
            f"stage {self.name!r}: no Ray actor ready for {self.spawn_timeout_s:g} s (each "
            f"asks for 1 CPU; the cluster has {free:g} free of {total:g}, on "
            f"{len(alive_nodes(ray))} live node(s))")

    def _settle(self, ref) -> None:
        call = self.calls.pop(ref, None)
        if call is None:  # a call of an actor already lost: its result is never taken
            return
        actor = call.actor
        assert actor is not None
        actor.calls.pop(ref, None)
        errors = self._errors
        try:
            busy, packed, failure = self.ray.get(ref)
        except errors.RayActorError as exc:
            self._lost(actor, exc, call)
            return
        except (errors.ObjectLostError, errors.OwnerDiedError) as exc:
            log.warning("stage %s: the result of sequence %d of lane %s was lost (%s); "
                        "running it again", self.name, call.seq, call.lane,
                        type(exc).__name__)
            self.reruns += 1
            self._dispatch(call)
            return
        except errors.RayTaskError as exc:  # run() returns its failures: this is Ray's
            value = UnitFailure(SerializationError(
                f"stage {self.name}: the result of sequence {call.seq} of lane {call.lane} "
                f"could not travel back from its Ray actor: {_first_line(exc)}"),
                unsendable=True, payload=call.payload)
            self._done[call.lane].append((call.seq, value, None))
            self._after_call(actor)
            return
        if failure is not None:
            tb, blob, records = failure
            error = decode_exception(blob, tb, f"stage {self.name} on Ray actor {actor.pid}")
            self._done[call.lane].append(
                (call.seq, UnitFailure(error, unpack(*records), payload=call.payload), None))
        else:
            self.meter.ran(busy)
            self._done[call.lane].append((call.seq, unpack(*packed), busy))
        self._after_call(actor)

    def _after_call(self, actor: _Actor) -> None:
        if actor.retiring and not actor.calls and actor in self.actors:
            self._retire(actor)

    def _lost(self, actor: _Actor, exc: BaseException, call: _Call | None) -> None:
        """``actor`` died: its calls go again, in order (the oldest, the one it was
        running, charged a retry), and a replacement starts unless it was retiring. One
        that died before it started ran nothing: nothing is charged, but starts that die
        time and again are an error."""
        lost = sorted(([call] if call is not None else []) + list(actor.calls.values()),
                      key=lambda c: c.order)
        for ref in list(actor.calls):
            self.calls.pop(ref, None)
        actor.calls.clear()
        if actor in self.actors:
            self.actors.remove(actor)
        started = actor.state == "ready"
        self._kill(actor)
        self.lost += 1
        self.meter.event("restart", actor.index)
        gone = actor.node is not None and actor.node not in alive_nodes(self.ray)
        log.warning("stage %s: Ray actor %s lost (%s%s); %d unit(s) go to other actors",
                    self.name, actor.index, _first_line(exc),
                    "; its node is gone" if gone else "", len(lost))
        if not started:
            self._start_deaths += 1
            if self._start_deaths > max(3, self.max_retries) and not self._ready():
                self.close()
                raise TransportError(
                    f"stage {self.name!r}: {self._start_deaths} Ray actors in a row died "
                    f"before they started (the last: {_first_line(exc)})")
        if not actor.retiring:
            self._spawn()
        for k, c in enumerate(lost):
            if k == 0 and started and self._charge(c, exc, actor.index):
                continue
            self.reruns += 1
            self._dispatch(c)

    def _charge(self, c: _Call, exc: BaseException, worker: int) -> bool:
        """Charge ``c`` a retry; True when that exhausts them (its failure, or its drop
        with ``deterministic=False``, then takes its place in the stream)."""
        key = (c.lane, c.seq)
        self._retries[key] += 1
        if self._retries[key] <= self.max_retries:
            return False
        message = (f"stage {self.name}: sequence {c.seq} of lane {c.lane} was running on a "
                   f"Ray actor that died {self._retries[key]} times ({_first_line(exc)}); "
                   f"max_worker_retries={self.max_retries} exhausted")
        if not self.deterministic:
            warnings.warn(f"zephon: dropping it: {message}", RuntimeWarning, stacklevel=3)
            self._done[c.lane].append((c.seq, [], None))
            return True
        error = WorkerCrashedError(message, seq=c.seq, op=self.name, worker=worker)
        self._done[c.lane].append((c.seq, UnitFailure(error), None))
        return True


#: arrays (contiguous buffers) of at least this many bytes travel out of band: as arrays
#: of their own through Ray's object store, zero-copy to the other side; smaller ones
#: inside the pickle
OUT_OF_BAND_BYTES = 1 << 16


def pack(value) -> tuple[bytes, list]:
    """``value`` as ``(pickle, out-of-band buffers)`` (pickle protocol 5): what travels
    between the driver and an actor, a payload one way and a result the other.

    Raises:
        Exception: whatever pickling ``value`` raises (a lock in a record).
    """
    buffers: list = []

    def side(buffer: pickle.PickleBuffer) -> bool:
        view = buffer.raw()
        if view.nbytes < OUT_OF_BAND_BYTES:
            return True  # in band
        buffers.append(np.frombuffer(view, dtype=np.uint8))
        return False

    return pickle.dumps(value, protocol=5, buffer_callback=side), buffers


def unpack(data: bytes, buffers) -> Any:
    """The value :func:`pack` made. Ray hands the buffers over read-only (its store's
    memory is immutable); each is copied once, so every array the value holds is one
    its user may write to, as on every other runner (an op after a Ray stage that works
    in place, ``x += 1``, the loop normalising a batch in place)."""
    return pickle.loads(data, buffers=[bytearray(b) for b in buffers])


def _unsendable(program, result, exc: BaseException) -> UnitFailure:
    """The failure of a unit whose ``result`` cannot be pickled: the stage program's
    (an :class:`~zephon.errors.OpError` naming the op, the sample and the object, the
    records before it handed on first), as a process worker reports it."""
    name = getattr(program, "unencodable", None)
    failure = name(result, exc) if callable(name) else None
    if failure is None:
        failure = UnitFailure(SerializationError(
            f"a result cannot travel back from a Ray actor: {type(exc).__name__}: {exc}"),
            unsendable=True)
    return failure


def _dumps(program) -> bytes:
    """The program's bytes for the actors: Ray's cloudpickle, as Ray itself ships code
    (functions of the driver's ``__main__`` by value, those of modules by reference)."""
    from ray import cloudpickle

    return cloudpickle.dumps(program, protocol=5)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
