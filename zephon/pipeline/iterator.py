"""``PipelineIterator``: one run of a pipeline, the object ``iter(pipe)`` returns.

It owns everything about its run: the engine (or the MTP subprocess that runs
it), the pump thread that prefetches ahead of the consumer, the run's
:class:`~zephon.pipeline.progress.RunRecord` (the delivered position of every
lane, the epoch it started at, its statistics and final state),
``checkpoint()``/``restore()`` (collective across ranks),
``get_state()``/``set_state()`` (this rank alone) and ``close()``. It is given
the pipeline's plan (its spec resolved under its options, with the fingerprint
its checkpoints carry) and the pipeline's
:class:`~zephon.pipeline.progress.Progress`, never the pipeline itself. Once its
ops pass their checks it registers with the Progress as the latest run, handing
it the callback that restarts it (``pipe.restore``/``pipe.set_epoch`` on a live
run); the Progress refers to the latest run's record and holds the runs weakly,
so that ``pipe.checkpoint()`` still answers after the loop has ended and the next
run continues where this one stopped. The dependency goes one way: this module
uses Progress, which imports nothing of it.

Lifecycle
---------
- start: workers start booting at construction (``validate`` checks the ops
  while they do);
- ``__next__``: where the engine runs inline, in the consumer's thread (also
  while every parallel stage is inline or adaptive and none of them has been moved
  to process workers yet: the pump starts with the first such move, the same item
  source going on in its thread); otherwise from a :class:`Handoff` of
  ``prefetch_batches`` items filled by a pump thread (MTP: a low-priority thread of ``mtp_prefetch`` items). With
  process stages the hand-off is bounded in bytes as well (the plan's
  ``prefetch_bytes``, a share of a worker's shared-memory arena; one item
  always fits), so that large items waiting there can never fill the arena the
  workers write into. The pump refills it half at a time, so the two threads
  switch once per several items, not once per item. Each
  item carries the lane state a restore would continue from; only what ``__next__`` hands over
  is recorded as delivered, so prefetched items are produced again after a
  restore;
- ``close()`` (idempotent): stops the pump, closes the executors' worker pools
  or the MTP subprocess, reaps every process. A Ctrl-C while it runs (a second or
  third one, typically) cuts its waits short (the pools kill their workers at
  once) but never the stop itself, and is raised as one ``KeyboardInterrupt`` once
  it is done (none when one is on its way already). From then on ``next()`` raises
  :class:`~zephon.errors.IteratorClosedError` (a ``__next__`` waiting in another
  thread too, instead of waiting for ever), unless the run had reached the end of
  its stream: an exhausted iterator keeps raising ``StopIteration``, as Python's
  protocol wants. ``restore()``/``set_state()`` start it again. It also runs when the iterator
  is garbage-collected (a ``break`` out of a ``for`` loop drops it at once:
  nothing holds it but the loop), when the consumer's code raises out of the
  loop, at the end of the stream, and at interpreter exit before
  ``multiprocessing`` joins its children (so no zephon process can make the
  interpreter wait).

Where a run starts and ends (its record): a run covers one *pass*
of the pipeline (``num_epochs`` epochs from ``start_epoch``, see
:class:`~zephon.pipeline.Pipeline`), from the lane states it was given. When it
reaches the end of its stream its record says ``finished`` (the pipeline's next
run is then the next pass). Each item's stamp also says which lanes have ended
(:mod:`zephon.pipeline.engine`), so lane states record when a lane has
delivered its last item of the pass: a start whose every lane has ended is the
next pass (:func:`~zephon.pipeline.state.settle`, decided from the state alone,
the same on every rank), and a rank whose own lanes have ended while others
have not runs the (empty) rest of the pass, as the ranks still in it do.

Nothing on the pump side refers to the iterator: the thread holds only the
hand-off and the engine's item generator, so a dropped iterator is
collected by reference counting, without waiting for the cycle collector.
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time
import weakref
from typing import Any, NoReturn

from zephon.checkpoint import decode_state, encode_state
from zephon.errors import IteratorClosedError, ZephonConfigError
from zephon.options import resolve_mtp_prefetch
from zephon.options.resolve import OUT_OF_PROCESS_RUNNERS
from zephon.pipeline import rngs
from zephon.pipeline.dispatch import approx_nbytes
from zephon.pipeline.engine import NOTHING, Engine, mtp_pool, stop_each
from zephon.pipeline.keep import WorkerKeep
from zephon.pipeline.plan import Plan
from zephon.pipeline.progress import Progress, RunRecord
from zephon.pipeline.spec import PipelineSpec
from zephon.pipeline.state import Position, RunStart, check_run, first_unread, position, rank_state
from zephon.pipeline.validate import Seeded, validate
from zephon.transport.supervisor import InterruptGuard

__all__ = ["Handoff", "HandoffClosed", "PipelineIterator"]

_END = object()
_live: "weakref.WeakSet[PipelineIterator]" = weakref.WeakSet()


def _close_live_iterators() -> None:
    for it in list(_live):
        try:
            it._close(raise_held=False)  # a Ctrl-C meanwhile: the interpreter exits anyway
        except Exception:  # noqa: BLE001 - the interpreter is exiting; close the rest
            pass


# Runs before the interpreter joins non-daemon threads and multiprocessing children (an
# atexit callback may run after multiprocessing's own, which would wait on the MTP process).
try:
    threading._register_atexit(_close_live_iterators)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover - not CPython >= 3.9
    pass
atexit.register(_close_live_iterators)


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


#: the longest a side of a :class:`Handoff` waits before it looks again: a wake-up lost to
#: a Ctrl-C that cut the other side short costs at most this
_RECHECK_S = 0.25


def _signal() -> threading.Lock:
    """A wake-up signal: a lock held while not signalled (see :class:`Handoff`)."""
    sig = threading.Lock()
    sig.acquire()
    return sig


def _wake(sig: threading.Lock) -> None:
    """Signal ``sig`` (under the hand-off's lock, so that it is never released twice)."""
    if sig.locked():
        sig.release()


class Handoff:
    """The bounded hand-off from the pump thread to the consumer: at most ``depth`` items
    and, with ``byte_limit``, at most that many bytes of them (an empty hand-off admits
    any item, so nothing is ever refused for its size).

    Each side takes one lock per item and wakes the other only when it is waiting. A
    producer waiting on a full hand-off is woken once half of it is free, so that it
    refills several items per wake-up rather than one (each wake-up is a thread switch,
    and on few cores a context switch). Any number of threads may call ``get`` (each
    item goes to one of them). The producer ends the stream with :meth:`finish` or
    :meth:`fail`, after which ``get`` raises ``StopIteration`` or the error, in order.
    ``close()`` wakes every side for good: ``put`` then answers False and ``get`` raises
    :class:`HandoffClosed`. What every prefetching thread of zephon hands over through
    (the pipeline's pump, the torch loader's pinning thread).

    Ctrl-C: the consumer is typically the main thread, where a ``KeyboardInterrupt``
    (a second or third one too, while the first unwinds) may be raised at any bytecode.
    So no side ever blocks while holding the hand-off's lock: it is a plain
    ``threading.Lock`` taken only by ``with`` (never left held by an exception) around
    short sections that do not wait. A side waits outside it, in one C call, on a
    wake-up signal of its own (a lock the other side releases; an interrupted wait
    leaves nothing half-acquired, unlike ``threading.Condition.wait``), and looks again
    at least every :data:`_RECHECK_S` seconds, so that a wake-up lost to an interrupt
    delays it at most that long. ``close()`` thus never waits on a lock held for long.
    An interrupt inside ``get`` may drop the item it was taking (the caller gets the
    ``KeyboardInterrupt`` instead; the pipeline closes its run then); nothing else.

    Example::

        h = Handoff(depth=8, byte_limit=64 << 20)
        h.put(item, nbytes)   # producer thread; False once closed
        h.finish()            # ... or h.fail(error)
        item = h.get()        # consumer
    """

    __slots__ = ("_getters", "_has_items", "_has_room", "_items", "_lock", "_putters",
                 "closed", "depth", "limit", "used")

    def __init__(self, depth: int, byte_limit: int | None = None) -> None:
        self._items: collections.deque = collections.deque()
        self._lock = threading.Lock()  # short sections only: nobody waits holding it
        self._has_items, self._has_room = _signal(), _signal()
        self._getters = self._putters = 0  # threads waiting on each signal
        self.depth, self.limit, self.used = max(1, int(depth)), byte_limit, 0
        self.closed = False

    def _full(self, nbytes: int) -> bool:
        return len(self._items) >= self.depth or (
            self.limit is not None and self.used > 0 and self.used + nbytes > self.limit)

    def put(self, item, nbytes: int = 0) -> bool:
        """Add ``item`` (of ``nbytes``), waiting while the hand-off is full; False if it
        was closed (the consumer is gone)."""
        lock = self._lock
        while True:
            with lock:
                if self.closed:
                    if self._putters:  # the next waiting producer sees it too
                        _wake(self._has_room)
                    return False
                if not self._full(nbytes):
                    self._items.append((item, nbytes))
                    self.used += nbytes
                    if self._getters:
                        _wake(self._has_items)
                    return True
                self._putters += 1
            try:
                self._has_room.acquire(timeout=_RECHECK_S)
            finally:
                with lock:
                    self._putters -= 1

    def finish(self) -> bool:
        """End the stream: ``get`` raises ``StopIteration`` after the items before."""
        return self.put(_END)

    def fail(self, error: BaseException) -> bool:
        """End the stream with ``error``: ``get`` raises it after the items before."""
        return self.put(_Failure(error))

    def get(self):
        """The oldest item, waiting while there is none (see :meth:`finish`, :meth:`fail`
        and :meth:`close` for the ends)."""
        lock = self._lock
        while True:
            with lock:
                items = self._items
                if items:
                    item, nbytes = items.popleft()
                    self.used = self.used - nbytes if items else 0
                    if self._putters and (not items or (
                            len(items) <= self.depth // 2
                            and (self.limit is None or self.used <= self.limit // 2))):
                        _wake(self._has_room)
                    if items and self._getters:  # another consumer waits: its turn
                        _wake(self._has_items)
                    break
                if self.closed:
                    if self._getters:  # the next waiting consumer sees it too
                        _wake(self._has_items)
                    raise HandoffClosed
                self._getters += 1
            try:
                self._has_items.acquire(timeout=_RECHECK_S)
            finally:
                with lock:
                    self._getters -= 1
        if item is _END:
            raise StopIteration
        if type(item) is _Failure:
            raise item.error
        return item

    def close(self) -> None:
        """Drop what waits and wake every side for good."""
        self.closed = True  # a waiting side sees it at its next look, woken or not
        with self._lock:  # short sections only (see the class docstring)
            dropped, self._items = self._items, collections.deque()
            self.used = 0
            _wake(self._has_items)
            _wake(self._has_room)
        dropped.clear()  # outside the lock: an item's finalizers may run arbitrary code


class HandoffClosed(Exception):
    """:meth:`Handoff.get` on a closed, empty hand-off."""


def _pump(source, out: Handoff, nice: int = 0, sized: bool = False) -> None:
    if nice:
        # MTP's prefetch thread yields the CPU to the training loop: on Linux a thread has
        # its own nice value, set through its native id (raising it needs no privilege).
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (AttributeError, OSError):
            pass

    try:
        for value, stamp in source:
            if not out.put((value, stamp), approx_nbytes(value) if sized else 0):
                return
        out.finish()
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer
        out.fail(exc)


class _EngineFactory:
    """What the MTP subprocess runs: the same spec planned there (once) under the same
    options (MTP off), a run's engine in-process there, from ``(states, start_epoch)``.
    The subprocess lives as long as the consumer keeps it (persistent workers): its
    engines' process pools are kept between its runs in a keep of its own, stopped
    with the factory (:meth:`close`, when the subprocess stops)."""

    def __init__(self, spec: PipelineSpec, opts,
                 global_rngs: tuple[frozenset[str], ...]) -> None:
        self.spec, self.opts, self.global_rngs = spec, opts, global_rngs
        self._plan: Plan | None = None
        self._keep: WorkerKeep | None = None

    def __getstate__(self):
        return {"spec": self.spec, "opts": self.opts, "global_rngs": self.global_rngs}

    def __setstate__(self, state) -> None:
        self.__init__(state["spec"], state["opts"], state["global_rngs"])  # type: ignore[misc]

    def __call__(self, start: tuple[dict, int]):
        states, start_epoch = start
        if self._plan is None:
            rngs.own_process()  # its seeded calls only seed: it runs nothing else
            self._plan = Plan(self.spec, self.opts.replace(mtp_mode=False))
            self._keep = WorkerKeep()
        engine = Engine(self._plan, {int(k): tuple(v) for k, v in states.items()},
                        start_epoch, keep=self._keep, seeded=self.global_rngs)
        return _ClosingItems(engine)

    def close(self) -> None:
        if self._keep is not None:
            self._keep.close()


class _ClosingItems:
    def __init__(self, engine: Engine) -> None:
        self.engine, self.items = engine, engine.items()

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.items)

    def close(self, park: bool = False) -> None:
        self.engine.close(park)


class PipelineIterator:
    """One run of a pipeline: what ``iter(pipe)`` returns (see the module docstring).

    It yields the pipeline's items in stream order and owns the run: worker processes,
    the prefetching thread, and the delivered position of every lane. It closes itself
    at the end of the stream, when its run raises, when it is garbage-collected (a
    ``break`` out of a ``for`` loop), and at interpreter exit. It is also a context
    manager (``with iter(pipe) as it:``).

    Args:
        plan: the pipeline's :class:`~zephon.pipeline.plan.Plan` (its spec resolved under
            its options); build the iterator with ``iter(pipeline)`` rather than
            directly.
        start: the lane states and the first epoch of the run.
        progress: the pipeline's :class:`~zephon.pipeline.progress.Progress`: once the
            ops pass their checks on the first sample, the run is its latest (its
            checkpoint rounds are counted there too).
        seeded: per op of the spec, the global generators seeded before each of its
            calls (what ``validate(plan, "pickle")`` decided for the run; None: none).
        checked: the ops already passed the behaviour checks (``validate(plan, "all")``,
            for a run that starts no process); False: the iterator runs them while the
            workers boot.

    Raises:
        ValidationError: with ``auto_validation="strict"``, an op fails the checks run on
            the first sample (the run is closed then, and is not the pipeline's latest).

    Attributes:
        closed: True once the run is stopped.
        record: the run's :class:`~zephon.pipeline.progress.RunRecord` (delivered lane
            states, first epoch, statistics, final state).

    Examples:
        >>> pipe = Pipeline(sources.from_sequence(list(range(5))), shuffle=False)
        >>> with iter(pipe) as it:
        ...     first = next(it)
        ...     state = it.checkpoint()   # continue after ``first``, anywhere
        >>> first, it.closed
        (0, True)
        >>> pipe.restore(state)
        >>> list(pipe)
        [1, 2, 3, 4]
    """

    def __init__(self, plan: Plan, start: RunStart, progress: Progress,
                 seeded: Seeded | None = None, *, checked: bool = False) -> None:
        #: the plan as the pipeline made it; ``plan``: with the mixture weights a trainer
        #: set (the same plan when there are none)
        self.base_plan = plan
        self.plan, self.progress = plan.with_mixture(start.mixture), progress
        #: per op of the spec, the global generators seeded before each call (validation's
        #: decision for the run, :func:`~zephon.pipeline.validate.decide_global_rngs`)
        self.seeded: Seeded = seeded or tuple(frozenset() for _ in plan.spec.ops)
        self.record = RunRecord(start)
        self.closed = False
        self.engine: Engine | None = None
        self.remote: Any = None  # the MTP subprocess's end (MtpSource), in MTP mode
        self.thread: threading.Thread | None = None
        self.handoff: Handoff | None = None
        #: the pump thread starts once an adaptive stage is moved to processes
        self._lazy_pump = False
        self._closed_by = "close()"  # what stopped the run, for next()'s error
        self._pid = os.getpid()  # the process that may stop the run (not a forked copy)
        self._start()
        if not checked:
            try:  # workers are booting while the ops are checked on the first sample
                validate(plan, "behaviour", self.seeded)
            except BaseException:
                self.close()
                raise
        progress.begin(self, self._restart)

    # -- running ---------------------------------------------------------------------------
    def _start(self) -> None:
        plan, opts = self.plan, self.plan.opts
        states = dict(self.record.states)
        self._lazy_pump = False
        self._park = False
        if opts.mtp_mode:
            from zephon.runners.mtp import MtpSource

            start = (states, self.record.start_epoch)
            keep = self.progress.keep if opts.persistent_workers else None
            self._generation = keep.generation if keep else 0
            factory = _EngineFactory(plan.spec, opts, self.seeded)
            self.remote = keep.take(("mtp",), (opts, self.seeded)) if keep else None
            if self.remote is not None and not self.remote.runs(factory):
                self.remote.close()  # an op or the source changed since it started
                self.remote = None
            if self.remote is not None:
                self.remote.start(start)
            else:
                config, requests = mtp_pool(opts)
                self.remote = MtpSource(factory, start, config, requests)
            self._source = self.remote.items()
            depth = resolve_mtp_prefetch(opts)
            threaded = depth > 0
        else:
            self.engine = Engine(plan, states, self.record.start_epoch, self.progress.tuned,
                                 self.progress.keep, self.seeded)
            self.record.stats = self.engine.stats
            self.record.autotune = self.engine.tuner
            self.record.ray = [ex for ex in self.engine.executors.values()
                               if ex.runner == "ray"]
            self._source = self.engine.items()
            # adaptive stages (autotune) run inline until moved: the engine stays in the
            # consumer's thread until one is on process workers (see __next__)
            modes = {s.mode for s in plan.stages}
            threaded = bool(modes & {"threads", *OUT_OF_PROCESS_RUNNERS})
            self._lazy_pump = not threaded and "adaptive" in modes
            depth = plan.prefetch
        if threaded:
            self._start_pump(depth)
        self.closed = False
        self._closed_by = "close()"
        _live.add(self)

    def _start_pump(self, depth: int) -> None:
        """Hand the item source to a pump thread filling a :class:`Handoff` of ``depth``
        items (the source is the same generator: it goes on where ``next()`` left it)."""
        opts = self.plan.opts
        limit = None if opts.mtp_mode else self.plan.prefetch_bytes
        self._lazy_pump = False
        self.handoff = Handoff(depth, limit or None)
        self.thread = threading.Thread(
            target=_pump, args=(self._source, self.handoff,
                                10 if opts.mtp_mode else 0, bool(limit)),
            name="zephon-pump", daemon=True)
        self.thread.start()

    def _moved(self) -> bool:
        """Whether an adaptive stage runs on process workers now (the pump starts then)."""
        engine = self.engine
        return engine is not None and any(
            ex.runner == "process" for ex in engine.executors.values())

    def __iter__(self) -> "PipelineIterator":
        return self

    def __next__(self) -> Any:
        if self.closed:
            self._refuse()
        stats = self.engine.stats if self.engine is not None else None
        tuner = self.engine.tuner if self.engine is not None else None
        called = time.perf_counter() if stats is not None or tuner is not None else 0.0
        if self._lazy_pump and self.thread is None and self._moved():
            self._start_pump(self.plan.prefetch)
        try:
            if self.thread is None:
                value, stamp = next(self._source)
            else:
                value, stamp = self.handoff.get()  # type: ignore[union-attr]
        except HandoffClosed:  # closed (or restarted) from another thread while waiting
            if self.closed:
                self._refuse()
            return self.__next__()
        except StopIteration:
            self._park = True  # a complete pass: its idle workers serve the next run
            self.close()
            self.record.finished = True
            self._finished()
            raise
        except BaseException as exc:
            try:
                self._closed_by = f"the {type(exc).__name__} its run raised"
                self.close()
            finally:  # also when a second Ctrl-C lands before the stop holds them
                self._close_after_interrupt()
            raise
        states = self.record.states
        states[stamp[0]] = stamp[1]
        for i in range(2, len(stamp), 2):  # lanes found ended since the previous item
            states[stamp[i]] = stamp[i + 1]
        if value is NOTHING:  # lane states only: nothing to hand over
            return self.__next__()
        if stats is not None:  # the consumer's wait: from next() called to the batch
            stats.delivered(called)
        if tuner is not None:  # the autotune controller's signal of the same wait
            tuner.waited(time.perf_counter() - called)
        return value

    def _close_after_interrupt(self) -> None:
        """Close the run if a Ctrl-C (typically a second one, landing before the stop
        holds them: it then replaces the first on its way out) kept :meth:`close` from
        starting the stop, so that no worker is left running behind the caller's
        ``except KeyboardInterrupt``. Called where that one was caught: nothing runs
        between."""
        while not self.closed and os.getpid() == self._pid:
            try:
                self._close(raise_held=False)
            except KeyboardInterrupt:  # one more, before the stop held them
                pass

    def _refuse(self) -> NoReturn:
        """``next()`` on a closed run: the end of the stream again if it was reached (an
        exhausted iterator stays exhausted), else an error naming what closed it."""
        if self.record.finished:
            raise StopIteration
        raise IteratorClosedError(
            f"next() on a closed PipelineIterator (stopped by {self._closed_by}): "
            "restore() or set_state() starts it again; iter(pipe) starts the pipeline's "
            "next run")

    def _restart(self, start: RunStart) -> None:
        """Stop the current run and start one from ``start``."""
        self.close()
        record = self.record
        record.states, record.start_epoch = dict(start.states), start.start_epoch
        if start.mixture != record.mixture:
            self.plan = self.base_plan.with_mixture(start.mixture)
        record.mixture = start.mixture
        record.finished = False
        self._start()

    def rewind(self, delivered: dict[int, tuple]) -> None:
        """Record ``delivered`` (from :meth:`delivered`) as what this run delivered: a
        wrapper that took items ahead of its consumer (a prefetching thread) and is
        closing says where its consumer really is, so that the pipeline's next run
        continues there (and not after the items the wrapper dropped).

        Args:
            delivered: positions from :meth:`delivered`.

        Examples:
            >>> pipe = Pipeline(sources.from_sequence(list(range(5))), shuffle=False)
            >>> it = iter(pipe)
            >>> seen = it.delivered(); _ = next(it), next(it)   # taken ahead, not used
            >>> it.rewind(seen); it.close()
            >>> list(pipe)
            [0, 1, 2, 3, 4]
        """
        self.record.states = dict(delivered)
        self.record.finished = False

    def _finished(self) -> None:
        opts = self.plan.opts
        if opts.mtp_mode and opts.mtp_auto_checkpoint:
            self.record.final_state = self.checkpoint()

    # -- state -----------------------------------------------------------------------------
    def delivered(self) -> dict[int, tuple]:
        """A copy of the delivered position of every lane that delivered something.

        This is what :meth:`checkpoint` saves now. A wrapper that hands items on later
        than it takes them (a prefetching thread) keeps the copy taken with each item and
        passes the one of the last item it handed on to :meth:`checkpoint`.

        Returns:
            A dict: lane id -> lane state (a tuple of ints, the format of the checkpoint's
            ``lanes`` entries).

        Examples:
            >>> it = iter(Pipeline(sources.from_sequence(list(range(5))), shuffle=False))
            >>> it.delivered()
            {}
            >>> _ = next(it)
            >>> it.delivered()
            {0: (0, 1, 1)}
            >>> it.close()
        """
        return dict(self.record.states)

    def position(self, delivered: dict[int, tuple] | None = None) -> Position:
        """Where this run stands: batches (items) and samples delivered, on this rank and
        over every lane (:class:`~zephon.pipeline.state.Position`).

        After a restore on another number of ranks, ``batches`` is the whole stream's
        count as the checkpoint had it, so the optimizer step to continue from is
        ``position().batches // global_batch_in_batches``.

        Args:
            delivered: positions from :meth:`delivered` to read instead of the current ones.

        Examples:
            >>> it = iter(Pipeline(sources.from_sequence(list(range(6))), shuffle=False).batch(2))
            >>> _ = next(it), next(it)
            >>> it.position().batches, it.position().samples
            (2, 4)
            >>> it.close()
        """
        return position(self.plan, self.record.states if delivered is None else delivered,
                        self.record.start_epoch)

    def checkpoint(self, delivered: dict[int, tuple] | None = None) -> bytes:
        """The delivered position of every lane as checkpoint bytes.

        Only items handed over by ``next()`` count: items prefetched but not yet delivered
        are produced again after a restore. With several ranks every rank must call it at
        the same step: the ranks exchange their states (through ``aggregate_dir`` or
        ``aggregate_store``) and all return the same merged bytes.

        Args:
            delivered: positions from :meth:`delivered` to save instead of the current ones
                (None: the current ones).

        Returns:
            The checkpoint as bytes.

        Raises:
            CheckpointError: the multi-rank exchange failed.
            AggregationTimeoutError: the exchange exceeded ``aggregate_timeout_s``.

        Examples:
            >>> it = iter(Pipeline(sources.from_sequence(list(range(5))), shuffle=False))
            >>> _ = next(it)
            >>> earlier = it.delivered()
            >>> _ = next(it)
            >>> it.checkpoint(earlier) == it.checkpoint()
            False
            >>> it.close()
        """
        return self.progress.exchange(self.plan, self.record, delivered)

    def restore(self, state: bytes) -> None:
        """Continue exactly after the last item delivered when ``state`` was taken.

        The current run stops (its workers are reaped) and the next ``next()`` starts the
        restored one, also after :meth:`close`. The state may come from another runner,
        worker count or number of ranks, with the same pipeline definition and number of
        canonical lanes. Nothing is exchanged between ranks: every rank restores the same
        merged bytes.

        Args:
            state: checkpoint bytes from :meth:`checkpoint` or ``Pipeline.checkpoint()``,
                or this rank's own from :meth:`get_state`.

        Raises:
            CheckpointError: the bytes are corrupt or do not fit this pipeline (checked
                before anything is applied: the current run then goes on).

        Examples:
            >>> it = iter(Pipeline(sources.from_sequence(list(range(5))), shuffle=False))
            >>> state = it.checkpoint()      # nothing delivered yet: the start
            >>> next(it), next(it)
            (0, 1)
            >>> it.restore(state)
            >>> list(it)
            [0, 1, 2, 3, 4]
        """
        self._restart(check_run(decode_state(state), self.base_plan))

    def set_mixture_weights(self, weights: dict) -> int:
        """Set new weights of the pipeline's mixture from the next sample no lane has
        delivered on (a mixture with ``schedule_unit="samples"`` or ``"tokens"``): they
        replace the schedule there and hold until the next call. Call it between steps;
        with several ranks every rank calls it at the same step with the same weights
        (the ranks exchange their positions, as :meth:`checkpoint` does).

        The change is exact and replays: it takes effect at the first stream position
        past every lane's delivered one (rounded up to a block of 256 positions; with a
        packer, past the lane's current flush segment), which depends only on the
        stream so far; what was read ahead is read again under the new weights; and
        every change is part of the checkpoint, so a restore on any world size goes on
        with the same weights at the same positions.

        Args:
            weights: component name -> weight, every component named (0 switches one off;
                one must be positive).

        Returns:
            The stream position (in samples) from which the weights hold: the start of
            the first block of 256 positions past everything delivered (a second change
            in that block replaces the first).

        Raises:
            ZephonConfigError: the source is no mixture with a position-keyed schedule,
                or the weights do not name exactly its components.
            CheckpointError: with several ranks, their positions could not be exchanged.
            IteratorClosedError: the iterator is closed (or its pass has ended).

        Examples:
            >>> mix = sources.mixture(
            ...     {"a": sources.from_sequence(list(range(1000)), name="a"),
            ...      "b": sources.from_sequence(list(range(1000, 2000)), name="b")},
            ...     {"a": 1, "b": 1}, schedule_unit="samples")
            >>> it = iter(Pipeline(mix, num_epochs=None).batch(64))
            >>> _ = [next(it) for _ in range(4)]
            >>> it.set_mixture_weights({"a": 0, "b": 1})  # 4 batches of 64 delivered
            256
            >>> all(x >= 1000 for x in next(it))
            True
            >>> it.close()
        """
        from zephon.pipeline.sources.stream_schedule import BLOCK, override_vector

        if self.closed:
            raise IteratorClosedError(
                f"set_mixture_weights on a closed PipelineIterator (stopped by "
                f"{self._closed_by}): restore() or iter(pipe) starts a run to set them in")
        source = self.base_plan.spec.source
        names = getattr(source, "names", None)
        if getattr(source, "stream", None) is None or names is None:
            source.with_weight_overrides(())  # raises, naming what the source is
            raise ZephonConfigError("set_mixture_weights: no position-keyed mixture")
        vector = override_vector(list(names), weights)
        merged = self.checkpoint() if self.plan.opts.world_size > 1 else None
        start = check_run(decode_state(merged), self.base_plan) if merged is not None else \
            RunStart(dict(self.record.states), self.record.start_epoch, self.record.mixture)
        mixture: Any = self.plan.spec.source  # a MixtureSource, with the changes so far
        stream = mixture.stream
        block = stream.first_block_from(first_unread(self.plan, start))
        if start.mixture:  # a change in the block of the last one replaces it
            block = max(block, start.mixture[-1][0] // BLOCK)
        changes = tuple(c for c in start.mixture if c[0] < block * BLOCK)
        self._restart(start._replace(
            mixture=(*changes, (block * BLOCK, tuple(vector.tolist())))))
        return stream.block_start(block)

    def get_state(self) -> bytes:
        """This rank's delivered position as checkpoint bytes, without any exchange.

        Grain's ``get_state``: local, so a rank may call it alone, at any step (nothing
        waits for the other ranks and no exchange round is used). The state holds the
        lanes this rank owns and its layout (dp group, ``dp_degree``, mapping):
        :meth:`set_state` (or :meth:`restore`) takes it back on a rank of the same
        layout and group, and refuses it elsewhere by name. For a state that restores
        under any number of ranks, use the collective :meth:`checkpoint`.

        Returns:
            The state as checkpoint bytes (a versioned, checksummed envelope).

        Examples:
            >>> it = iter(Pipeline(sources.from_sequence(list(range(5))), shuffle=False))
            >>> _ = next(it), next(it)
            >>> state = it.get_state()
            >>> next(it)
            2
            >>> it.set_state(state)
            >>> list(it)
            [2, 3, 4]
        """
        opts = self.plan.opts
        local = rank_state(self.plan, self.record.states, self.record.start_epoch,
                           self.record.mixture)
        return encode_state(local, opts.aggregate_serializer, opts.aggregate_compressor)

    def set_state(self, state: bytes) -> None:
        """Grain's ``set_state``: :meth:`restore` from :meth:`get_state` bytes (or from
        :meth:`checkpoint` bytes); nothing is exchanged between ranks either way.

        Args:
            state: checkpoint bytes.

        Raises:
            CheckpointError: as :meth:`restore`; also a rank's own state taken under
                another rank layout or dp group.

        Examples:
            >>> pipe = Pipeline(sources.from_sequence(list(range(4))), shuffle=False)
            >>> it = iter(pipe)
            >>> state = it.get_state()       # nothing delivered yet: the start
            >>> list(it)
            [0, 1, 2, 3]
            >>> it.set_state(state)          # an exhausted iterator starts again
            >>> next(it)
            0
            >>> it.close()
        """
        self.restore(state)

    def stats(self, report: bool = False) -> dict:
        """Execution statistics of this run.

        Args:
            report: the report-grade snapshot instead of the counters (see
                :meth:`Pipeline.stats <zephon.pipeline.pipeline.Pipeline.stats>`).

        Returns:
            A dict snapshot of the run's counters (``RuntimeOptions.execution_tracking``);
            empty when tracking is off, and in MTP mode, where they live in the subprocess.
            Under ``worker_allocation="autotune"`` it has an ``"autotune"`` entry, tracking
            or not.

        Examples:
            >>> it = iter(Pipeline(sources.from_sequence([1, 2])))
            >>> it.stats()
            {}
            >>> it.close()
        """
        return self.record.stats_snapshot(report)

    # -- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the run and reap every process it started (idempotent).

        Items prefetched but not delivered are dropped; the delivered position stays
        available to :meth:`checkpoint`, :meth:`get_state` and ``Pipeline.checkpoint()``.
        After ``close()``, ``next()`` raises :class:`~zephon.errors.IteratorClosedError`
        (a run that had reached the end of its stream keeps raising ``StopIteration``)
        until :meth:`restore` or :meth:`set_state` starts it again.

        Examples:
            >>> it = iter(Pipeline(sources.from_sequence([1, 2]), shuffle=False))
            >>> next(it)
            1
            >>> it.close()
            >>> it.close()
            >>> next(it)
            Traceback (most recent call last):
            ...
            zephon.errors.IteratorClosedError: next() on a closed PipelineIterator (stopped by close()): ...
        """
        # a Ctrl-C while it runs is held until every process is stopped and reaped, then
        # raised, unless it is the same request as a KeyboardInterrupt on its way already
        self._close(raise_held=not isinstance(sys.exc_info()[1], KeyboardInterrupt))

    def _close(self, raise_held: bool) -> None:
        """:meth:`close`, never left half done by a Ctrl-C (a second or third one,
        typically: the first one is what is closing the run). The first one inside
        (:class:`~zephon.transport.supervisor.InterruptGuard`) cuts the wait it lands in
        short (a pool then kills its workers at once) and the rest of the stop still runs
        (:func:`~zephon.pipeline.engine.stop_each`); later ones are held until it is
        done. Cut short, the stop would leave worker processes running (joined for ever at
        interpreter exit) and shared-memory names behind. Then one ``KeyboardInterrupt``
        is raised if ``raise_held``, else none."""
        if self.closed or os.getpid() != self._pid:
            return  # (a copy in a forked process: the run is its parent's to stop)
        with InterruptGuard(raise_held=raise_held):
            try:
                self._stop()
            except KeyboardInterrupt:
                if raise_held:
                    raise

    def _stop(self) -> None:
        self.closed = True
        steps = [self._forget, self._stop_engine, self._stop_remote, self._join_pump,
                 self._stop_kept]
        try:
            stop_each(steps)
        except KeyboardInterrupt:
            # the one Ctrl-C the guard lets through may have landed before a step began
            # (it is raised at the next call or loop): the steps are idempotent, and the
            # guard holds every later Ctrl-C, so this pass runs the whole stop
            stop_each(steps)
            raise

    def _forget(self) -> None:
        _live.discard(self)
        if self.handoff is not None:  # the pump's next put() answers False: it ends
            self.handoff.close()

    def _stop_engine(self) -> None:
        if self.engine is not None:
            try:
                self.engine.close(park=self._park)
            finally:
                if self.engine.tuner is not None:  # where the pipeline's next run starts
                    self.progress.tuned = self.engine.tuner.resume_point()

    def _stop_remote(self) -> None:
        remote, opts = self.remote, self.plan.opts
        if remote is None:
            return
        if self._park and opts.persistent_workers:
            self.progress.keep.park(("mtp",), remote, (opts, self.seeded),
                                    opts.persistent_workers_idle_s, self._generation)
        else:
            remote.close()

    def _stop_kept(self) -> None:
        """A run that ends early (a break, an error, a Ctrl-C, a restart) stops the
        workers kept for the pipeline too: only a completed pass leaves workers behind."""
        if not self._park:
            self.progress.keep.close()

    def _join_pump(self) -> None:
        thread, self.thread = self.thread, None
        if thread is not None:  # a daemon: a Ctrl-C stops this wait, not the run's stop
            thread.join(timeout=30)

    def __enter__(self) -> "PipelineIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            # a KeyboardInterrupt raised here would only be printed and ignored (Python
            # does so in a finalizer, typically one run while the first is unwinding)
            self._close(raise_held=False)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass
