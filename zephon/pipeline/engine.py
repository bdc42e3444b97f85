"""The engine: runs a plan (:mod:`zephon.pipeline.plan`) for this rank's lanes.

Each owned lane is one generator chain: ``lane_units`` -> for each step either
:func:`ordered_map` (units submitted ``depth`` ahead to the stage's executor,
results put back in sequence order by the ReorderBuffer kernel; Boundary
markers take a sequence number too, so they never overtake data) or
:func:`accumulate` (the op's serial accumulator for this lane).

Every delivered item carries the lane state a restore would continue from
(:func:`cursor_state` / :func:`replay_state`):

- **cursor resume** (every op preserves cursor order: map, filter, batch,
  map_batch): ``(epoch, pos, total)``, the lane position after the last sample
  the item consumed. A restore reads on from there; nothing before it is read
  again, so the cost of a resume does not depend on where in the epoch it was
  taken.
- **replay** (a shuffle buffer or a packer carries history across samples):
  ``(epoch, k, since, total, *carry)``, the segment (boundary) the item belongs
  to, how many items the lane produced since it, and what the accumulators held
  at the boundary (:mod:`zephon.pipeline.carry`). A restore rebuilds those held
  records, replays the lane from that boundary (at most
  ``flush_every_k_chunks`` lane chunks back) and drops ``since`` items.

- **ended** (:func:`ended_state`): ``(total,)``, a lane that has delivered its
  last item of the pass (or that has none in it). A restore delivers nothing more
  of it; a state whose every lane has ended restores to the next pass
  (:func:`zephon.pipeline.state.check_run`), on every rank alike.

``total`` counts the lane's items since the start of the run (its pass, see
:class:`~zephon.pipeline.Pipeline`); it gives ``meta["lane_index"]`` and the
tail's order. A run covers the epochs ``[start_epoch, pass end)``: lanes
without a state start at ``start_epoch``'s beginning. The tail is strict lane round
robin: the lane that has produced the fewest items goes next, lowest id first.
After a restore the lanes behind are first brought level (at most one item
each, since every rank emits in round robin), then the ``LaneRoundRobin``
kernel runs the rotation. Nothing here depends on timing: which worker
finishes first can only change when a result is ready, never where it goes.

**Stamps.** Every item goes out as ``(value, stamp)``; a stamp is a flat tuple of
``lane, lane state`` pairs: the item's own lane and state, then every lane found
ended since the previous item (:func:`ended_state`). In a finite pass the tail
(once every lane has been handed its last unit: no item before can be the
rank's last) looks one item ahead, so the rank's last item already says that
all of the rank's lanes have ended: a checkpoint taken right after it tells
every rank, on any world size, that this rank's part of the pass is done. A rank whose lanes
hold nothing at all ends its stream with one :data:`NOTHING` item carrying their
ended states (the iterator records it and hands nothing over). An error of the
run (any exception, an op's ``SystemExit`` or ``KeyboardInterrupt`` included) is
raised after the item held back has been handed on.

``deterministic=False``: results of a parallel stage are released in
completion order (throughput over order; checkpoints are then best effort).
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from typing import Any, Iterator

from zephon.errors import CheckpointError
from zephon.kernels import LaneRoundRobin
from zephon.options import (
    resolve_autotune_cpu_budget,
    resolve_autotune_memory_bytes,
    resolve_mtp_buffer,
    resolve_prefetch_batches,
)
from zephon.options.metrics import effective_tracking
from zephon.pipeline.autotune import Controller
from zephon.pipeline.carry import Rebuilder, carry_bounds, decode_carry, encode_carry, held_units
from zephon.pipeline.dispatch import ordered_map
from zephon.pipeline.keep import WorkerKeep
from zephon.pipeline.lanes import ReadUnit, batched_units, grouped_units, lane_units
from zephon.pipeline.ops import CarryingAccumulator, SerialOp
from zephon.pipeline.ops.base import made_lineage, pos_lineage
from zephon.pipeline.plan import INFLIGHT_PER_WORKER, Plan, StageStep, carrier, maker
from zephon.pipeline.program import StageProgram, batches_per_message
from zephon.pipeline.records import Batch, BatchList, Boundary
from zephon.pipeline.stats import RunStats
from zephon.runners import AdaptiveExecutor, InlineExecutor, ProcessExecutor, ThreadExecutor
from zephon.runners.contract import StageExecutor, StageMeter
from zephon.runners.ray import RayExecutor
from zephon.transport.codec import ShmPolicy
from zephon.transport.config import PoolConfig

__all__ = ["NOTHING", "Engine", "Plan", "accumulate", "cursor_state", "ended_state",
           "is_ended", "mtp_pool", "ordered_map", "pool_config", "replay_state", "stop_each"]


def pool_config(opts, *, inflight_per_worker: int = INFLIGHT_PER_WORKER,
                arena_bytes: int | None = None,
                buffer_bytes: int | None = None) -> PoolConfig:
    """The transport's configuration (:class:`~zephon.transport.config.PoolConfig`)
    resolved from the run's options ``opts``, once: the channels, the start method, the
    shutdown mode, the shared-memory policy, the prefetch (resolved), and whether workers
    time their tasks (execution tracking, ``$ZEPHON_EXECUTION_TRACKING`` included, or
    the autotune controller, which reads the workers' op time). ``arena_bytes``: the
    workers' arena bound (None: a bare pool's default); ``buffer_bytes``: the channels'
    buffer (None: ``ipc_buffer_bytes``)."""
    return PoolConfig(
        transport=opts.ipc_transport,
        buffer_bytes=opts.ipc_buffer_bytes if buffer_bytes is None else buffer_bytes,
        mp_context=opts.mp_context, shutdown_mode=opts.shutdown_mode,
        policy=ShmPolicy(opts.shm_enabled, opts.shm_coalesce, opts.shm_min_item_bytes,
                         opts.shm_min_new_allocation_bytes, opts.shm_min_forward_bytes,
                         opts.shm_compact_above_ratio, opts.shm_compact_min_savings_bytes,
                         opts.shm_max_coalesced_bytes),
        timing=effective_tracking(opts.execution_tracking) != "off" or
        opts.worker_allocation == "autotune",
        inflight_per_worker=inflight_per_worker, arena_bytes=arena_bytes,
        prefetch_batches=resolve_prefetch_batches(opts))


def mtp_pool(opts) -> tuple[PoolConfig, int]:
    """``(pool configuration, requests in flight)`` of the MTP subprocess's one-worker
    pool (:class:`~zephon.runners.mtp.MtpSource`): ``mtp_buffer`` requests on a channel
    of ``mtp_buffer_bytes``."""
    depth = resolve_mtp_buffer(opts)
    return pool_config(opts, inflight_per_worker=depth,
                       buffer_bytes=opts.mtp_buffer_bytes), depth


class _Nothing:
    """The value of a stamp-only item (see :data:`NOTHING`); one object, also after a
    trip through pickle (the MTP subprocess sends it)."""

    __slots__ = ()

    def __reduce__(self) -> str:
        return "NOTHING"

    def __repr__(self) -> str:
        return "NOTHING"


#: The value of an item that only carries lane states (ended lanes of a rank that
#: delivers nothing): the iterator records its stamp and hands nothing over.
NOTHING = _Nothing()


def _held_records(rebuild, step: int, held: list, holds: str):
    """A callable rebuilding what the accumulator at ``step`` held (``holds``: records, a
    packer's ``(record, a, b)`` pieces, a bin packer's open bins of pieces, or a reorder
    buffer's queued input records), called when the replay reaches it."""
    if holds == "bins":
        return lambda: [[rebuild.piece(step, m) for m in pieces] for pieces in held]
    if holds == "pieces":
        return lambda: [rebuild.piece(step, m) for m in held]
    return lambda: [rebuild.record(step, m) for m in held]


def cursor_state(epoch: int, pos: int, total: int) -> tuple[int, int, int]:
    """Lane state under cursor resume: read on from lane position ``pos`` of ``epoch``;
    ``total`` items were delivered from the lane so far."""
    return (epoch, pos, total)


def replay_state(epoch: int, k: int, since: int, total: int, carry: tuple = ()) -> tuple:
    """Lane state under replay: replay from boundary ``(epoch, k)`` with the accumulators
    holding ``carry`` (encoded, :mod:`zephon.pipeline.carry`) and drop the ``since`` items
    already delivered from it; ``total`` items were delivered from the lane so far."""
    return (epoch, k, since, total, *carry)


def _issuing(units: Iterator, lane: int, issued: set, read: list | None = None) -> Iterator:
    """``units`` (a lane's, cheap to make: indices and markers) with ``lane`` added to
    ``issued`` just before the last one is handed on: no item of the lane can be its last
    before that; ``read`` (a one-element list, or None): the source samples of the units
    handed on are added to ``read[0]``."""
    it = iter(units)
    for unit in it:
        for following in it:
            if read is not None and type(unit) is ReadUnit:
                read[0] += len(unit.indices)
            yield unit
            unit = following
        issued.add(lane)
        if read is not None and type(unit) is ReadUnit:
            read[0] += len(unit.indices)
        yield unit
    issued.add(lane)


def _stamped(item: tuple, ended: list) -> tuple:
    """``item`` with the ``lane, ended state`` pairs of ``ended`` added to its stamp (and
    ``ended`` emptied)."""
    value, stamp = item
    out = (value, stamp + tuple(ended))
    ended.clear()
    return out


def ended_state(total: int) -> tuple[int]:
    """Lane state of a lane that has delivered its last item of the pass: ``total`` items
    in all (0 for a lane with nothing in the pass)."""
    return (total,)


def is_ended(state: tuple | None) -> bool:
    """Whether a lane state is :func:`ended_state`'s (cursor and replay states are longer)."""
    return state is not None and len(state) == 1


def accumulate(op: SerialOp, upstream: Iterator, seed: int, lane: int, stats=None,
               node: str = "", *, capture: bool = False, tracks: bool = False,
               made_input: bool = False, held=None) -> Iterator:
    """The serial accumulator of ``op`` over one lane, started (seeded from the lane and the
    boundary) at the lane's first Boundary. At every later Boundary it hands on what it
    gives up there (a shuffle drains; a batch or a packer keeps what it holds), and with
    ``capture`` adds the lineage of what it holds to the marker's carry.

    ``tracks``: the records it makes record their lineage (a later accumulator may hold
    them); ``made_input``: its input records were made by an accumulator (their lineage
    is ``lin``, else ``pos``); ``held``: a callable giving what a restore puts back into
    it at the first Boundary (rebuilt records or pieces)."""
    timer = time.perf_counter if stats is not None else None
    state: Any = None  # the op's accumulator, from the lane's first Boundary on
    out: list
    for unit in upstream:
        if unit is None:
            continue
        t = timer() if timer else 0.0
        if isinstance(unit, Boundary):
            if state is None:
                state, out = _open(op, seed, lane, unit, tracks, made_input, held), []
                state.count_into(stats, node)
            else:
                out = state.boundary(unit)
            if timer:
                stats.serial(node, 0, len(out), timer() - t)
            if out:
                yield out
            yield unit._replace(carry=(*unit.carry, state.carry())) if capture else unit
            continue
        out = state.push(unit)
        if timer:
            stats.serial(node, len(unit), len(out), timer() - t)
        if out:
            yield out
    if state is not None:
        out = state.drain()
        if timer:
            stats.serial(node, 0, len(out), 0.0)
        if out:
            yield out


def _open(op: SerialOp, seed: int, lane: int, marker: Boundary, tracks: bool,
          made_input: bool, held):
    """The accumulator of ``op`` started at the lane's first boundary ``marker`` (with what
    a restore puts back into it, see :func:`accumulate`)."""
    state = op.start(seed, lane, marker)
    if isinstance(state, CarryingAccumulator) != (op.holds is not None):
        raise TypeError(f"op {op.name}: holds={op.holds!r}, but its start() gave a "
                        f"{type(state).__name__} (an op that holds records or pieces across "
                        "a boundary must start a CarryingAccumulator, and only such an op)")
    if isinstance(state, CarryingAccumulator):
        state.lineage = made_lineage if made_input else pos_lineage
        state.tracks = tracks
        if held is not None:
            state.load(held())
    return state


def stage_rngs(plan: Plan, seeded: tuple) -> list[list[frozenset[str]]]:
    """Per stage, per op, the global generators seeded before each call (``seeded`` is
    per op of the spec)."""
    decided = {id(op): which for op, which in zip(plan.spec.ops, seeded, strict=True)}
    return [[decided.get(id(op), frozenset()) for op in s.ops] for s in plan.stages]


class Engine:
    """Runs a plan for this rank's lanes from the given delivered lane states."""

    def __init__(self, plan: Plan, states: dict[int, tuple], start_epoch: int = 0,
                 tuned: dict[int, tuple[int, float | None]] | None = None,
                 keep: WorkerKeep | None = None,
                 seeded: tuple[frozenset[str], ...] | None = None) -> None:
        """``tuned``: where the pipeline's previous autotune run left its stages (stage ->
        (workers, 0: inline; op seconds per source sample read)), where this run's
        controller starts (:meth:`Controller.resume_point`). ``keep``: the pipeline's
        kept workers (:mod:`zephon.pipeline.keep`): a process stage takes its pool from
        there when the previous run left one, and :meth:`close` with ``park=True`` leaves
        this run's there. ``seeded``: per op of the spec, the global generators seeded
        before each of its calls (validation's decision for the run; None: none)."""
        self.plan, self.states = plan, dict(states)
        self.seeded = seeded or tuple(frozenset() for _ in plan.spec.ops)
        self.keep = keep if plan.opts.persistent_workers else None
        #: the keep's generation when the run began: its pools park into that one only
        self._generation = keep.generation if keep is not None else 0
        #: lanes whose last unit of the run has been handed to their chain
        self._issued: set[int] = set()
        #: source samples of the units handed to the lanes' chains (counted only for the
        #: autotune controller's ``progress``)
        self._read = [0]
        #: the run covers epochs [start_epoch, end_epoch): lanes without a state start at
        #: start_epoch's beginning
        self.start_epoch, self.end_epoch = start_epoch, plan.pass_end(start_epoch)
        p, o = plan.spec, plan.opts
        mode = effective_tracking(o.execution_tracking)  # or $ZEPHON_EXECUTION_TRACKING
        self.stats = None if mode == "off" else RunStats(mode, o.metrics_sink_config)
        self.program = StageProgram(
            p.source, [list(s.ops) for s in plan.stages], p.seed,
            [s.collates for s in plan.stages],
            collate_fn=plan.fused_batch and plan.fused_batch.collate_fn,
            worker_compute_threads=o.worker_compute_threads,
            global_rngs=stage_rngs(plan, self.seeded))
        #: the transport's configuration, resolved from the options once for the run
        self.pool_config = pool_config(o)
        self.executors: dict[int, StageExecutor] = {}
        #: the autotune controller (zephon.pipeline.autotune), None unless
        #: worker_allocation="autotune" and some stage runs on threads or processes or is
        #: adaptive (starts inline, moved to processes when that pays)
        self.tuner: Controller | None = None
        try:
            for stage in plan.stages:
                self.executors[stage.index] = self._executor(stage)
        except BaseException:
            self.close()
            raise
        if o.worker_allocation == "autotune" and plan.runners != {"inline"}:
            todo = self._samples_to_go()
            read = self._read
            self.tuner = Controller(
                self.executors, resolve_autotune_cpu_budget(o), resolve_autotune_memory_bytes(o),
                progress=None if todo is None else lambda: (read[0], max(0, todo - read[0])),
                start=tuned)

    def _samples_to_go(self) -> int | None:
        """The source samples this rank's lanes read in the run, from their states (None:
        the run goes on for ever): what the controller's ``progress`` counts down from (the
        samples of the units handed to the lanes' chains, :attr:`_read`)."""
        if self.end_epoch is None:
            return None
        plan = self.plan
        total = 0
        for lane in plan.owned:
            state = self.states.get(lane)
            if is_ended(state):
                continue
            epoch, at = self.start_epoch, 0
            if state:  # a cursor state's second field is a lane position, a replay's a chunk
                epoch = state[0]
                at = state[1] if plan.cursor_resume else state[1] * plan.spec.chunk_size
            total += max(0, (self.end_epoch - epoch) * plan.lane_length(lane) - at)
        return total

    def _executor(self, stage) -> StageExecutor:
        """The executor of ``stage``, by its mode, with the stage's one meter."""
        name, meter = f"stage{stage.index}", StageMeter()
        if stage.mode == "adaptive":  # inline until the controller moves it (autotune)
            return AdaptiveExecutor(self.program, self._process_maker(stage, name),
                                    name=name, meter=meter)
        if stage.mode == "process":
            return self._process_maker(stage, name)(stage.workers, meter)
        if stage.mode == "ray":
            return self._ray_executor(stage, name, meter)
        if stage.mode == "threads":
            return ThreadExecutor(self.program, stage.workers, name=name, meter=meter)
        return InlineExecutor(self.program, name=name, meter=meter)

    def _process_maker(self, stage, name: str):
        """``(workers, meter) -> ProcessExecutor`` of ``stage`` (its pool starts at once; an
        adaptive stage calls it at its first move to processes)."""
        program, o = self.program, self.plan.opts
        config = replace(self.pool_config, arena_bytes=stage.arena_bytes)

        def make(workers: int, meter: StageMeter) -> ProcessExecutor:
            kept = self.keep.take(("stage", stage.index), self._made_for) \
                if self.keep is not None else None
            if kept is not None and kept.pool.runs(program):
                try:
                    kept.adopt(meter, workers)
                except BaseException:
                    kept.close()  # (taken from the keep: nobody else would stop it)
                    raise
                return kept
            if kept is not None:  # an op or the source changed since its workers started
                kept.close()
            return ProcessExecutor(program, workers, config=config, name=name,
                                   max_retries=o.max_worker_retries,
                                   deterministic=o.deterministic, meter=meter)
        return make

    def _ray_executor(self, stage, name: str, meter: StageMeter) -> StageExecutor:
        """The :class:`~zephon.runners.ray.RayExecutor` of ``stage``: the one the keep holds
        from the pipeline's previous run when its actors run this run's program, else a
        new one."""
        program, o = self.program, self.plan.opts
        kept = self.keep.take(("stage", stage.index), self._made_for) \
            if self.keep is not None else None
        if kept is not None and kept.runs(program):
            try:
                kept.adopt(meter, stage.workers)
            except BaseException:
                kept.close()
                raise
            return kept
        if kept is not None:
            kept.close()
        return RayExecutor(program, stage.workers, name=name,
                           max_retries=o.max_worker_retries, deterministic=o.deterministic,
                           meter=meter, compute_threads=o.worker_compute_threads,
                           spawn_timeout_s=self.pool_config.spawn_timeout_s,
                           most=o.max_workers)

    def lane_stream(self, lane: int) -> Iterator:
        """``(record, lane state after it)`` for every item of ``lane`` from its state."""
        plan, p = self.plan, self.plan.spec
        state = self.states.get(lane)
        if is_ended(state):
            return iter(())
        n, end = len(p.source), self.end_epoch
        if plan.cursor_resume:
            epoch, pos, total = state if state else (self.start_epoch, 0, 0)
            it = lane_units(n, p.seed, p.permute, p.chunk_size, plan.lanes, lane,
                            plan.flush_every, end, Boundary(epoch, 0), pos)
            it = _issuing(it, lane, self._issued, self._read if self.tuner else None)
            return self._cursor_stream(self._chain(it, lane, None), lane, total)
        replay = tuple(state) if state else (self.start_epoch, 0, 0, 0)
        held = None
        if len(replay) > 4:
            held = decode_carry(plan.carry_layout, list(replay[4:]), f"lane {lane}",
                                carry_bounds(plan, lane, replay[0], replay[1],
                                             self.start_epoch))
        it = lane_units(n, p.seed, p.permute, p.chunk_size, plan.lanes, lane,
                        plan.flush_every, end, Boundary(replay[0], replay[1]))
        it = _issuing(it, lane, self._issued, self._read if self.tuner else None)
        return self._replay_stream(self._chain(it, lane, held, Boundary(replay[0], replay[1])),
                                   lane, replay, plan.carry_layout)

    @staticmethod
    def _cursor_stream(it: Iterator, lane: int, total: int) -> Iterator:
        for unit in it:
            if unit is None or isinstance(unit, Boundary):
                continue
            for record in unit:
                total += 1
                epoch, pos = record.pos
                yield record, (lane, (epoch, pos + 1, total))

    @staticmethod
    def _replay_stream(it: Iterator, lane: int, state: tuple, layout: tuple) -> Iterator:
        epoch, k, skip, total = state[:4]
        total -= skip
        boundary, since, opened = (epoch, k, *state[4:]), 0, False
        for unit in it:
            if unit is None:
                continue
            if isinstance(unit, Boundary):
                if skip and opened:
                    break  # the segment ended before what the state says was delivered
                carry = encode_carry(layout, unit.carry) if layout else ()
                boundary, since, opened = (unit.epoch, unit.k, *carry), 0, True
                continue
            for record in unit:
                since += 1
                total += 1
                if skip:
                    skip -= 1
                    continue
                yield record, (lane, (*boundary[:2], since, total, *boundary[2:]))
        if skip:
            raise CheckpointError(
                f"lane {lane}: the restored state says {state[2]} item(s) of the segment at "
                f"(epoch {state[0]}, lane chunk {state[1]}) were delivered, but replaying it "
                f"produced only {state[2] - skip}: the state does not belong to this pipeline "
                "and data")

    def _chain(self, it: Iterator, lane: int, held: list | None,
               start: Boundary | None = None) -> Iterator:
        """The lane's generator chain; ``held``: the decoded carry of the boundary
        ``start`` a replay starts at (what each carrying accumulator held there)."""
        plan = self.plan
        slots = list(held) if held is not None else None
        rebuild = Rebuilder(plan, self.program, lane) if slots else None
        if plan.fused_batch is not None:
            it = self._fused(it, lane, slots, start)
        carriers = [i for i, step in enumerate(plan.steps) if carrier(step) is not None]
        makers = [i for i, step in enumerate(plan.steps) if maker(step) is not None]
        for step_no, step in enumerate(plan.steps):
            if isinstance(step, StageStep):
                it = ordered_map(self.executors[step.stage], plan.stages[step.stage], it, lane,
                                 plan.opts.deterministic, self.stats)
                continue
            restore = None
            if step_no in carriers and slots:
                restore = _held_records(rebuild, step_no, slots.pop(0), step.op.holds or "")
            it = self._serial(it, lane, step.op, step_no, carriers, makers, restore)
        return it

    def _fused(self, it: Iterator, lane: int, slots: list | None,
               start: Boundary | None) -> Iterator:
        """The lane's units cut into the fused batch's micro-batches and grouped into
        messages; a replay's first slot (``slots``, taken off) counts the records the
        batch held at ``start``."""
        plan = self.plan
        fused = plan.fused_batch
        assert fused is not None
        units = None
        if slots:
            count = slots.pop(0)
            assert start is not None
            units = held_units(plan, lane, start.epoch, start.k, count)
        it = batched_units(it, fused.size, fused.drop_last, units, bool(plan.carry_layout))
        return grouped_units(it, batches_per_message(plan.spec.source, fused.size,
                                                     plan.stages[0]))

    def _serial(self, it: Iterator, lane: int, op: SerialOp, step_no: int,
                carriers: list[int], makers: list[int], restore) -> Iterator:
        """The serial accumulator ``op`` of step ``step_no`` over the lane (``carriers``, ``makers``:
        the steps that carry records across a boundary, and that make records;
        ``restore``: what a replay puts back into it)."""
        plan, stats = self.plan, self.stats
        capture = bool(plan.carry_layout)
        node_stats = stats if stats is not None and stats.nodes_enabled else None
        return accumulate(op, it, plan.spec.seed, lane, node_stats,
                          f"serial{step_no}_{op.kind}",
                          capture=capture and step_no in carriers,
                          tracks=capture and any(c > step_no for c in carriers),
                          made_input=any(c < step_no for c in makers), held=restore)

    def items(self) -> Iterator:
        """``(value, stamp)`` in the rank's round-robin order (see "Stamps" in the module
        docstring). In a finite pass, once every lane has been handed its last unit (the
        pass's tail), each item is held until the next one is known, so that the rank's
        last item carries the ended state of all its lanes."""
        ended: list = []
        rotation = self._rotation(ended)
        if self.end_epoch is None:  # an endless pass: no lane ever ends
            yield from rotation
            return
        # the lanes whose last unit is still to come (a lane dealt no sample has none: it
        # never holds back the tail, as it never counts against an ended pass)
        streaming = {lane for lane in self.plan.owned if not is_ended(self.states.get(lane))
                     and self.plan.lane_length(lane) > 0}
        issued = self._issued
        held = None  # in the tail: the item before the one being made
        while True:
            try:
                item = next(rotation)
            except StopIteration:
                break
            except BaseException:  # an op's SystemExit too: it keeps its place
                if held is not None:  # everything before the failure is handed on first
                    yield _stamped(held, ended) if ended else held
                raise
            if held is not None:
                yield _stamped(held, ended) if ended else held
                held = None
            if not streaming <= issued:  # not the tail: no item can be the rank's last
                yield _stamped(item, ended) if ended else item
            else:
                held = item
        if held is not None:
            yield _stamped(held, ended) if ended else held
        elif ended:
            yield NOTHING, tuple(ended)

    def _rotation(self, ended: list) -> Iterator:
        """``(value, (lane, lane state))`` in the rank's round-robin order; appends ``lane,
        ended state`` to ``ended`` for every lane found exhausted."""
        owned = self.plan.owned
        total_at = self._total_at
        tuner = self.tuner
        live = {lane for lane in owned if not is_ended(self.states.get(lane))}
        streams = {lane: self.lane_stream(lane) for lane in owned if lane in live}
        produced = {lane: self._total(lane) for lane in owned}

        def pull(lane: int):
            try:
                record, stamp = next(streams[lane])
            except StopIteration:
                live.discard(lane)
                ended.extend((lane, ended_state(produced[lane])))
                return None
            produced[lane] += 1
            if tuner is not None:
                tuner.tick()
            value = record.value
            if isinstance(value, (Batch, BatchList)):  # raw meta: .meta would make the ids
                meta = value._meta
                meta["lane"] = lane
                meta["lane_index"] = stamp[1][total_at] - 1
            return value, stamp

        # Catch-up: after a restore, lanes that delivered one item less than the others go
        # first (fewest items, lowest id), until every live lane is level.
        while live and len({produced[lane] for lane in live}) > 1:
            lane = min(live, key=lambda x: (produced[x], x))
            item = pull(lane)
            if item is not None:
                yield item
        if not live:
            return
        # Level: the rotation is strict round robin over the owned lanes, lowest id first.
        rotation = LaneRoundRobin([lane for lane in owned if lane in live])
        while not rotation.done:
            lane = rotation.lanes[rotation.cursor]
            item = pull(lane)
            if item is None:
                rotation.mark_exhausted(lane)
            else:
                rotation.push(lane, item)
            for _, ready in rotation.pop_ready():
                yield ready

    @property
    def _total_at(self) -> int:
        """Where a lane state holds the lane's item count (``total``)."""
        return 2 if self.plan.cursor_resume else 3

    def _total(self, lane: int) -> int:
        state = self.states.get(lane)
        if not state:
            return 0
        return state[0] if is_ended(state) else state[self._total_at]

    def close(self, park: bool = False) -> None:
        """Stop the controller, the statistics and every executor (its workers): all of
        them, even when a Ctrl-C cuts one short (see :func:`stop_each`). ``park`` (the
        run completed its pass, with ``persistent_workers``): the process pools that can
        serve another run go to the pipeline's keep instead of stopping."""
        steps = [s.close for s in (self.tuner, self.stats) if s is not None]
        if park and self.keep is not None:  # once the controller has read its stages
            steps.append(self._park)
        stop_each([*steps, self._close_executors])

    def _close_executors(self) -> None:
        # forgotten only once all are closed: a Ctrl-C landing before one was (it is
        # raised at the next call) leaves them to the next close() (each is idempotent)
        stop_each([functools.partial(_close_executor, ex) for ex in self.executors.values()])
        self.executors = {}


    @property
    def _made_for(self) -> tuple:
        """What a kept pool was made for besides its program: the options and the
        generators seeded per op (its program is checked with ``pool.runs``)."""
        return self.plan.opts, self.seeded

    def _park(self) -> None:
        """Hand every pool that can serve another run to the keep (its executor leaves
        this engine; an adaptive stage keeps its inline part, closed as usual)."""
        o, keep = self.plan.opts, self.keep
        assert keep is not None
        for index, ex in list(self.executors.items()):
            pool = None
            if isinstance(ex, (ProcessExecutor, RayExecutor)) and ex.keepable():
                pool = ex
                del self.executors[index]
            elif isinstance(ex, AdaptiveExecutor):
                pool = ex.detach()
            if pool is not None:
                keep.park(("stage", index), pool, self._made_for,
                          o.persistent_workers_idle_s, self._generation)


def _close_executor(ex) -> None:
    try:
        ex.close()
    except Exception:  # noqa: BLE001 - closing everything matters more
        pass


def stop_each(steps: list) -> None:
    """Call every step of a stop, each even when an earlier one raised: a Ctrl-C that
    cut one short (a pool that gets one while it waits for its workers kills them and
    raises it, see :meth:`WorkerPool.close <zephon.transport.pool.WorkerPool.close>`)
    must not leave the next pool running. The first exception is raised once every step
    has run."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - raised below, after the other steps
            first = first or exc
    if first is not None:
        raise first
