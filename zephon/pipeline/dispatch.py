"""Dispatch: how a lane's units go to a parallel stage's executor and come back in order.

:func:`ordered_map` owns one lane of one stage. It pulls units (and Boundary
markers) from upstream, cuts each unit into **dispatch parts**, submits parts
to the executor ahead of need, and yields results in sequence order (the
``ReorderBuffer`` kernel), markers in their place.

Dispatch parts are sized for the transport, not for determinism: ``chunk_size``
decides which samples form a lane (and so the stream); how many of them travel
in one message decides only speed and memory. Cutting a unit never changes
what comes out, because every stateless op works sample by sample and the
serial accumulators downstream see the records in the same order either way.
A part aims at :data:`DISPATCH_TARGET_BYTES` of output, or :data:`MIN_PART_SAMPLES`
samples when those are larger (up to :data:`DISPATCH_MAX_BYTES`), and at most
:data:`DISPATCH_TARGET_SECONDS` of a worker's time, both estimated from the
results seen so far (until the first result arrives, parts hold one sample; a
sample counts for at least :data:`MIN_SAMPLE_BYTES`, so samples whose size the
estimate cannot see are bounded by time; and a part is at most twice as large as
the previous result allowed, so a run of slow samples after fast ones is not sent
as one part). The time per sample is the **op time** the executor reports with each
result (what the worker spent on the part, see :mod:`zephon.runners.executors`), never
the time from send to result: that one counts the part's wait behind the parts queued
before it, ``depth / workers`` parts and more on a loaded machine, so it overstated a
tokenizer's ~1 ms per document up to 30-fold and cut its parts to one to three
documents, a message each (a third of the workers' CPU and most of the consumer's went
to messages). Only an executor that reports no op time falls back to send-to-result,
and then only for samples slower than :data:`SLOW_SAMPLE_S`;
with several workers a large unit is cut into at least as many parts as there
are workers, so that all of them get work. Units are not cut where the stage
must see them whole: a batch-shape sensitive op (``map_batch``), a stage that
collates batches itself (a fused ``batch``), or when latency flush is not
allowed (``allow_latency_flush_in_deterministic=False``).

Parts are also not bounded by a unit from below: where a unit is smaller than a
part should be (small samples, a small ``chunk_size``), consecutive units of the
lane are **merged** into one part (never across a Boundary marker), so the
per-message cost is paid once per ~4 MiB whatever ``chunk_size`` is. A merged
part's result goes downstream as one unit: the records and their order are the
same.

Bounds (per lane and stage): at most ``depth`` parts queued beyond one per
worker (``depth + workers`` in flight; ``depth`` on an inline stage). With only
``depth`` in flight, a lane of 16 workers at the default depth of 8 would leave
half of them idle, and 2 workers at depth 4 waited a fifth of the time for
their next part. Parts known to take :data:`LONG_PART_S` of a worker's time or more
(units that are not cut) queue one per worker at most: more only hold large results
in memory sooner. At most ``op_queue_capacity`` items are in flight (always at
least one part; a process stage with the default ``op_queue_capacity=None`` has
no item bound, only the byte bound below), and sequence numbers never further
ahead of the oldest unfinished part than the reorder window, so a slow
head-of-line part stalls the lookahead instead of letting finished results
pile up behind it. **Bytes** bound it too: the estimated output of the parts in
flight plus the finished results waiting in the reorder buffer stays within the
stage's ``budget_bytes`` (the lane's part of a worker's shared-memory arena, see
:mod:`zephon.transport.budget`), so results waiting in zephon's own queues can never
fill the arena whatever the item size; one part is always allowed, so an item
larger than the budget still flows (alone).

Worker counts may change during the run (``worker_allocation="autotune"``, see
:mod:`zephon.pipeline.autotune`): the bounds and the spreading of a unit over workers
read the executor's current ``workers`` at each decision, and the reorder window is
sized once for the most the executor may grow to (``max_workers``). An adaptive stage
(:class:`~zephon.runners.executors.AdaptiveExecutor`) is planned with the process
runner's bounds (depth, byte budget, splitting) and keeps to one part at a time,
handing over what is ready before it reads on, while its executor runs inline; its
stage meter's ``profile`` (op seconds and output bytes per sample, averaged over its
recent units) is kept here, for the controller's moves. The dispatch reads the
executor's contract (:mod:`zephon.runners.contract`) and nothing else. None of this
changes which records come out or their order, only how many parts are in flight.

``deterministic=False``: results are released in completion order (markers
still keep their place).
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any, Iterator

import numpy as np

from zephon.kernels import ReorderBuffer
from zephon.pipeline.lanes import BatchGroup, ReadUnit
from zephon.pipeline.records import Boundary
from zephon.runners.contract import StageExecutor
from zephon.transport.failure import UnitFailure
from zephon.transport.heap import by_reference_bytes

__all__ = [
    "DISPATCH_MAX_BYTES",
    "DISPATCH_TARGET_BYTES",
    "DISPATCH_TARGET_SECONDS",
    "LONG_PART_S",
    "MIN_PART_SAMPLES",
    "approx_nbytes",
    "merge_units",
    "ordered_map",
]

#: Output bytes one dispatch part aims at: large enough that per-message costs vanish,
#: small enough that a part fits the worker's shared-memory arena many times over and the
#: first result arrives early.
DISPATCH_TARGET_BYTES = 4 << 20
#: ... but a part holds at least this many samples while that stays within
#: :data:`DISPATCH_MAX_BYTES`: a message costs the consumer's process about three times
#: what one more sample in it does, so one 4 MiB sample per message spent two thirds of
#: that process on messages (and left the workers less of the two cores).
MIN_PART_SAMPLES = 4
#: The ceiling of a part's output when it grows past DISPATCH_TARGET_BYTES to hold
#: MIN_PART_SAMPLES samples (beyond it the parts' memory costs more than it saves).
DISPATCH_MAX_BYTES = 16 << 20
#: ... and at most this much of a worker's op time: a part of slow samples is small, so
#: that results arrive steadily and closing the run waits for one slow op, not for a
#: whole part of them. (A message costs well under a millisecond at each end: 50 ms of
#: work per part keeps that within a few percent.)
DISPATCH_TARGET_SECONDS = 0.05
#: Op seconds of one part from which a lane queues one part per worker at most (see
#: ``_LaneDispatch.limit``): four times what a cut part aims at, so only units that are
#: not cut (a fused batch, a ``map_batch``) reach it.
LONG_PART_S = 4 * DISPATCH_TARGET_SECONDS
#: Seconds per sample from which the time bound applies when the executor reports no op
#: time and only the time from send to result is known: that counts queueing too, so for
#: fast samples it overstates the work many times over (bounding 4 KiB samples by it cost
#: a third of their throughput).
SLOW_SAMPLE_S = 1e-3
#: The least output bytes a sample is taken to have when sizing parts (a sample whose
#: size the estimate cannot see, e.g. plain Python values, is not taken as free).
MIN_SAMPLE_BYTES = 64

def merge_units(first, second):
    """One unit of two consecutive units of a lane, or None when they cannot be merged
    (read units of another epoch or not contiguous, or units of different kinds)."""
    if isinstance(first, list) and isinstance(second, list):
        return first + second
    if not isinstance(first, ReadUnit) or not isinstance(second, ReadUnit) or \
            second.epoch != first.epoch or second.start != first.start + len(first):
        return None
    return ReadUnit(first.epoch, first.start, np.concatenate([first.indices, second.indices]))


def approx_nbytes(value: Any, depth: int = 0, by_reference: int = 0) -> int:
    """Payload bytes of a sample: arrays, tensors and bytes, a few levels into dicts,
    lists and tuples (a cheap estimate: it never walks large containers element by
    element beyond the first 64 entries). With ``by_reference``, NumPy arrays of at
    least that many bytes count 0: those a process worker makes in its shared heap,
    which reach the consumer without a copy."""
    if isinstance(value, np.ndarray):
        return 0 if by_reference and value.nbytes >= by_reference else value.nbytes
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    nbytes = getattr(value, "nbytes", None)  # torch tensors and other array types
    if isinstance(nbytes, int):
        return nbytes
    if depth >= 6:
        return 0
    if isinstance(value, dict):
        return sum(approx_nbytes(v, depth + 1, by_reference)
                   for v in list(value.values())[:64])
    if isinstance(value, (list, tuple)):
        head = value[:64]
        total = sum(approx_nbytes(v, depth + 1, by_reference) for v in head)
        return total * len(value) // max(1, len(head))
    return 0


def _items_in(part, stage) -> int:
    """Items a part puts in flight: its samples, or its batches for a stage that collates
    (one per micro-batch unit, one per member of a :class:`BatchGroup`)."""
    if stage.collates:
        return len(part.units) if isinstance(part, BatchGroup) else 1
    return len(part)


def ordered_map(executor: StageExecutor, stage, upstream: Iterator, lane: int,
                deterministic: bool, stats=None) -> Iterator:
    """The results of ``stage`` (a :class:`~zephon.pipeline.plan.Stage`) over one lane's
    units, in sequence order (see the module docstring)."""
    feed = _Feeder(executor, stage, upstream, lane, stats)
    state, buffer = feed.state, feed.buffer
    profiled = 1 if executor.adaptive else 0  # 1 + units profiled
    # An inline executor runs a part when it is submitted: hand over what is ready first,
    # so that nothing is read before it is needed. (An adaptive stage's executor says its
    # mode now: inline until the autotune controller moves it to processes.)
    while True:
        if executor.runner == "inline":
            yield from _in_order(buffer)
            state.release(buffer.cursor)
        feed.fill()
        yield from _in_order(buffer)
        state.release(buffer.cursor)
        if feed.inflight == 0:
            if feed.exhausted and not feed.parts:
                return
            continue
        if stats is None:
            done_seq, result, busy_s = executor.get(lane)
        else:
            waited = time.perf_counter()
            done_seq, result, busy_s = executor.get(lane)
            now = time.perf_counter()
            sent, samples = feed.sent.pop(done_seq)
            stats.completed(feed.node, len(result), now - sent, now - waited, samples)
        feed.inflight -= 1
        state.done(done_seq, result, deterministic, busy_s)
        if profiled and busy_s is not None and result and type(result) is not UnitFailure:
            profiled += 1  # every unit of the first 8, then one in 16: sizing a result
            if profiled <= 9 or profiled % 16 == 0:  # costs up to ~50 us
                _profile(executor, result, busy_s)
        if deterministic:
            buffer.push(done_seq, result)
        else:
            if type(result) is UnitFailure:
                yield from _failed(result)
            yield result
            buffer.push(done_seq, None)  # keeps markers in place; None is skipped below


def _profile(executor: StageExecutor, result: list, busy_s: float) -> None:
    """Update an adaptive stage's meter's ``profile`` (op seconds and output bytes per sample, an
    average over its recent units) from one unit's result: what the autotune controller
    weighs before a move to processes (:mod:`zephon.pipeline.autotune`). The bytes are
    those a worker would copy to send the result: arrays its shared heap would hold
    (:func:`~zephon.transport.heap.by_reference_bytes` and larger) go by reference and
    count 0."""
    samples = sum(len(getattr(r, "ids", ())) or 1 for r in result)
    value = getattr(result[0], "value", None)
    nbytes = approx_nbytes(value, 0, by_reference_bytes()) * len(result)
    s, b = busy_s / samples, nbytes / samples
    meter = executor.meter
    old = meter.profile
    meter.profile = (s, b) if old is None or old[0] is None else \
        (0.5 * (old[0] + s), 0.5 * ((old[1] or 0.0) + b))


def _in_order(buffer) -> Iterator:
    """The buffer's ready results; a unit that failed hands on what it made before its
    failing sample and raises its error here, in its place in the stream (after every
    result before it), whatever order the workers finished."""
    for result in buffer.pop_ready():
        if type(result) is UnitFailure:
            yield from _failed(result)
        yield result


def _failed(result: UnitFailure) -> Iterator:
    """What a failed unit made before its failing sample, then its error."""
    if result.done:
        yield result.done
    raise result.error


class _Feeder:
    """The submitting side of one lane of one stage: reads units (and markers) from
    upstream, cuts or merges them into parts and submits them while the bounds allow."""

    def __init__(self, executor, stage, upstream: Iterator, lane: int, stats) -> None:
        self.executor, self.stage, self.upstream, self.lane = executor, stage, upstream, lane
        self.stats, self.node = stats, f"stage{stage.index}"
        if stats is not None:  # times the input wait; workers report their op time
            self.upstream = stats.attach(self.node, executor, stage, upstream)
        self.state = _LaneDispatch(stage, executor)
        self.buffer = ReorderBuffer(self.state.window)
        self.lookahead: collections.deque = collections.deque()  # read ahead by merging
        # units read and not yet sent in full, as [unit, spread] (see _LaneDispatch.split_off):
        # a part is cut from the head when it is sent, with the estimates of that moment
        self.parts: collections.deque = collections.deque()
        self.sent: dict[int, tuple[float, int]] = {}  # seq -> (sent at, samples)
        self.seq = self.inflight = 0
        self.exhausted = False

    def pull(self):
        """The next unit or marker; a failure upstream comes as a
        :class:`~zephon.transport.failure.UnitFailure`
        (raised in its place, after this stage's results before it: an earlier
        stage's error, an op's ``SystemExit`` or ``KeyboardInterrupt`` included, must
        not overtake the samples and errors ahead of it here)."""
        if self.lookahead:
            return self.lookahead.popleft()
        try:
            return next(self.upstream)
        except StopIteration:
            raise
        except BaseException as exc:  # noqa: BLE001 - raised in stream order by _in_order
            return UnitFailure(exc)

    def take(self) -> None:
        """Take one item from upstream: a unit is cut into parts, a marker goes to the
        buffer (it takes a sequence number), the end of upstream is remembered."""
        try:
            unit = self.pull()
        except StopIteration:
            self.exhausted = True
            return
        if unit is None:  # a placeholder of an earlier non-deterministic stage
            return
        if isinstance(unit, (Boundary, UnitFailure)):
            self.buffer.push(self.seq, unit)
            self.seq += 1
            if type(unit) is UnitFailure:
                self.exhausted = True  # nothing upstream follows its error
            return
        unit = self.state.merge(unit, self.pull, self.lookahead)
        self.parts.append(self.state.pending(unit))

    def fill(self) -> None:
        """Submit parts while the window, the depth and the byte budget allow."""
        state, buffer = self.state, self.buffer
        while self.seq + 2 - buffer.cursor <= state.window:
            if not self.parts:
                if self.exhausted:
                    return
                self.take()
                continue
            head = self.parts[0]
            part, rest = state.split_off(head)
            items = _items_in(part, self.stage)
            if not state.room(self.inflight, items):
                return
            if rest is None:
                self.parts.popleft()
            else:
                head[0] = rest
            if self.stats is not None:
                self.stats.submitted(self.node, len(part))
                self.sent[self.seq] = (time.perf_counter(), len(part))
            self.executor.submit(self.lane, self.seq, (self.stage.index, part))
            state.sent(self.seq, items)
            self.seq += 1
            self.inflight += 1


class _LaneDispatch:
    """The sizing and the bounds of one lane of one stage: how units become parts, and
    whether one more part may go out (parts, items and bytes in flight)."""

    def __init__(self, stage, executor: StageExecutor | None = None) -> None:
        self.depth, self.item_cap = stage.depth, stage.item_cap
        self.executor = executor  # its ``workers`` may change during the run (autotune)
        self.fixed = max(1, stage.workers)
        self.planned_runner = stage.runner
        most = self.fixed if executor is None else max(self.fixed, executor.max_workers)
        self.window = 2 * self.depth * most + 8
        self.split = stage.split
        self.merges = stage.split and stage.index == 0  # read units: merging reads nothing
        self.budget: int | None = stage.budget_bytes
        self.per_item: float | None = None  # output bytes per input sample, from results
        self.per_sample_s: float | None = None  # seconds per input sample, from results
        self.op_timed = False  # per_sample_s is op time (else send-to-result time)
        self.part_s: float | None = None  # op seconds of a whole part (its worker's time)
        self.sent_at: dict[int, float] = {}  # seq -> when a part in flight was sent
        self.cap = 1  # samples per part at most: doubles with each result (see target)
        self.items = 0  # input samples in flight
        self.held = 0.0  # estimated output bytes in flight or waiting in the reorder buffer
        self.sizes: dict[int, int] = {}  # seq -> samples of a part in flight
        self.estimate: dict[int, float] = {}  # seq -> bytes counted for a part in flight
        self.buffered: dict[int, float] = {}  # seq -> bytes of a result not yet handed on

    @property
    def workers(self) -> int:
        """The stage's workers now (the executor's count when it has one)."""
        executor = self.executor
        return self.fixed if executor is None else max(1, executor.workers)

    @property
    def inline(self) -> bool:
        """Whether the stage's units run inline now (an adaptive stage's executor says its
        mode; see :class:`~zephon.runners.executors.AdaptiveExecutor`)."""
        executor = self.executor
        runner = self.planned_runner if executor is None else executor.runner
        return runner == "inline"

    @property
    def limit(self) -> int:
        """Parts in flight at most: depth queued beyond one per worker (an inline stage
        runs a part when it is submitted: nothing to keep busy, and reading ahead delays
        the first: one part; an adaptive stage planned with the process runner's depth
        keeps to one part while it runs inline). Parts that take a worker
        :data:`LONG_PART_S` or more (units that are not cut: a fused batch, a
        ``map_batch``) queue one per worker at most: one queued part hides a message's
        round trip hundreds of times over, and each further one only makes its large
        result earlier, to wait in memory while the consumer is the slower side."""
        if self.inline:
            return 1
        workers = self.workers
        queued = self.depth
        if self.part_s is not None and self.part_s >= LONG_PART_S:
            queued = min(queued, workers)
        return queued + workers

    def target(self) -> int:
        """Samples per part: ~DISPATCH_TARGET_BYTES of output (1 until a result says)."""
        if self.per_item is None:
            return 1
        per_item = max(self.per_item, MIN_SAMPLE_BYTES)
        want = min(max(DISPATCH_TARGET_BYTES, MIN_PART_SAMPLES * per_item), DISPATCH_MAX_BYTES)
        size = want // per_item
        per_s = self.per_sample_s
        if per_s is not None and per_s > 0 and (self.op_timed or per_s > SLOW_SAMPLE_S):
            size = min(size, DISPATCH_TARGET_SECONDS / per_s)
        # Parts grow at most twofold per result: the estimates come from the samples seen
        # so far, and a run of slow samples after fast ones must not go out as one part.
        return max(1, int(min(size, self.cap)))

    def merge(self, unit, pull, lookahead: collections.deque):
        """``unit`` grown with the lane's next units while it is smaller than a part (the
        unit that does not fit, or a marker, waits in ``lookahead``)."""
        if not self.merges or self.per_item is None:
            return unit
        want = self.target() * self.workers
        while len(unit) < want:
            try:
                nxt = pull()
            except StopIteration:
                break
            merged = None if nxt is None or isinstance(nxt, (Boundary, UnitFailure)) else \
                merge_units(unit, nxt)
            if merged is None:
                lookahead.appendleft(nxt)
                break
            unit = merged
        return unit

    def pending(self, unit) -> list:
        """``[unit, spread]``: a unit waiting to be sent, in parts of at most ``spread``
        samples (so that several workers share a large unit), or whole (``spread`` None)."""
        n = len(unit)
        return [unit, None if not self.split or n <= 1 else math.ceil(n / self.workers)]

    def split_off(self, entry: list):
        """``(part, rest)``: the next part of a pending unit, sized with the estimates of
        now, and what is left of the unit (None once it is all in ``part``).

        Parts are cut when they are sent, not when their unit is read: a unit read while
        its samples were fast and small must not go out in parts sized for that if the
        samples turned slow or large meanwhile (only the parts already in flight were
        sized before the change)."""
        unit, spread = entry
        n = len(unit)
        if spread is None or n <= 1:
            return unit, None
        size = min(self.target(), spread)
        if size >= n:
            return unit, None
        return unit[:size], unit[size:]

    def room(self, inflight: int, samples: int) -> bool:
        """Whether a part of ``samples`` may go out now (one part always may)."""
        if inflight == 0:
            return True
        if inflight >= self.limit or (
                self.item_cap is not None and self.items >= self.item_cap):
            return False
        if self.per_item is None:  # sizes unknown: one part per worker until a result
            return inflight < self.workers
        return self.budget is None or self.held + samples * self.per_item <= self.budget

    def sent(self, seq: int, samples: int) -> None:
        self.sent_at[seq] = time.perf_counter()
        self.sizes[seq] = samples
        self.items += samples
        guess = samples * (self.per_item or 0.0)
        self.estimate[seq] = guess
        self.held += guess

    def done(self, seq: int, result: list, deterministic: bool,
             busy_s: float | None = None) -> None:
        """A part's result came back; ``busy_s``: the op seconds the executor measured
        for it (None: unknown, then the time since it was sent stands in)."""
        consumed = self.sizes.pop(seq)
        elapsed = time.perf_counter() - self.sent_at.pop(seq)
        self.items -= consumed
        self.held -= self.estimate.pop(seq)
        if result and consumed:
            self.per_item = approx_nbytes(result[0].value) * len(result) / consumed
        self.cap = min(2 * self.cap, 1 << 30)
        if consumed:
            if busy_s is not None:  # what the part cost its worker
                s, timed = busy_s / consumed, True
            else:  # send to result, queueing included: an over-estimate, parts err small
                s, timed = elapsed / consumed, False
            if self.per_sample_s is None or timed != self.op_timed:
                self.per_sample_s = s
            else:
                self.per_sample_s = 0.5 * (self.per_sample_s + s)
            self.op_timed = timed
            if busy_s is not None:
                self.part_s = busy_s if self.part_s is None else 0.5 * (self.part_s + busy_s)
        if deterministic:
            nbytes = (self.per_item or 0.0) * consumed
            self.buffered[seq] = nbytes
            self.held += nbytes

    def release(self, cursor: int) -> None:
        """Results before ``cursor`` were handed on: they leave the lane's budget."""
        if self.buffered:
            for seq in [s for s in self.buffered if s < cursor]:
                self.held -= self.buffered.pop(seq)
