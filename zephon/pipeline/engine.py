"""The plan and the engine that runs it.

Plan
----
The op list is cut into *parallel stages* (maximal runs of stateless ops;
stage 0 also reads the source) and *serial steps* (one per stateful op). Each
parallel stage gets a runner (``per_stage_runner`` > ``runner`` > auto:
``process`` when its ops ask for parallelism > 1, else ``inline``), a worker
cap (``worker_allocation``), and a lookahead depth in units per lane
(``per_stage_prefetch`` > ``default_stage_prefetch``). The flush cadence K
comes from :func:`~zephon.options.resolve_flush_every_k_chunks` and is part of
the pipeline's identity (it decides where a replay can start; batches stay full
across it).

Engine
------
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

``total`` counts the lane's items since the start of the run (its pass, see
:class:`~zephon.pipeline.Pipeline`); it gives ``meta["lane_index"]`` and the
tail's order. A run covers the epochs ``[start_epoch, pass end)``: lanes
without a state start at ``start_epoch``'s beginning. The tail is strict lane round
robin: the lane that has produced the fewest items goes next, lowest id first.
After a restore the lanes behind are first brought level (at most one item
each, since every rank emits in round robin), then the ``LaneRoundRobin``
kernel runs the rotation. Nothing here depends on timing: which worker
finishes first can only change when a result is ready, never where it goes.

``deterministic=False``: results of a parallel stage are released in
completion order (throughput over order; checkpoints are then best effort).
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from zephon.errors import CheckpointError
from zephon.kernels import LaneRoundRobin
from zephon.options import (
    resolve_canonical_replicas,
    resolve_dp_degree,
    resolve_dp_group_id,
    resolve_flush_every_k_chunks,
    resolve_mapping_strategy,
    resolve_max_workers,
    resolve_mtp_buffer,
    resolve_op_queue_capacity,
    resolve_prefetch_batches,
    resolve_stage_prefetch,
    resolve_stage_workers,
)
from zephon.options.metrics import effective_tracking
from zephon.pipeline.carry import (
    Rebuilder,
    carry_bounds,
    carry_layout,
    decode_carry,
    encode_carry,
    held_units,
)
from zephon.pipeline.dispatch import ordered_map
from zephon.pipeline.lanes import (
    batched_units,
    grouped_units,
    lane_length,
    lane_units,
    owned_lanes,
)
from zephon.pipeline.ops import (
    Batch,
    BatchList,
    BatchOp,
    Boundary,
    MapOp,
    PackTokensOp,
    _made_lineage,
    _pos_lineage,
)
from zephon.pipeline.packing import PackDocumentsOp  # pack_documents
from zephon.pipeline.program import StageProgram, batches_per_message
from zephon.pipeline.stats import RunStats
from zephon.runners import InlineExecutor, ProcessExecutor, ThreadExecutor
from zephon.transport.budget import pipeline_budget

#: tasks a process stage's pool keeps in flight per worker
INFLIGHT_PER_WORKER = 4


def _held_records(rebuild, step: int, held: list, op):
    """A callable rebuilding what the accumulator ``op`` at ``step`` held (records, a
    packer's ``(record, a, b)`` pieces, or pack_documents' bins of pieces), called when
    the replay reaches it."""
    if isinstance(op, PackDocumentsOp):  # pack_documents
        return lambda: [[rebuild.piece(step, m) for m in pieces] for pieces in held]
    if isinstance(op, PackTokensOp):
        return lambda: [rebuild.piece(step, m) for m in held]
    return lambda: [rebuild.record(step, m) for m in held]

__all__ = ["Engine", "Plan", "accumulate", "cursor_state", "ordered_map",
           "replay_state"]


def cursor_state(epoch: int, pos: int, total: int) -> tuple[int, int, int]:
    """Lane state under cursor resume: read on from lane position ``pos`` of ``epoch``;
    ``total`` items were delivered from the lane so far."""
    return (epoch, pos, total)


def replay_state(epoch: int, k: int, since: int, total: int, carry: tuple = ()) -> tuple:
    """Lane state under replay: replay from boundary ``(epoch, k)`` with the accumulators
    holding ``carry`` (encoded, :mod:`zephon.pipeline.carry`) and drop the ``since`` items
    already delivered from it; ``total`` items were delivered from the lane so far."""
    return (epoch, k, since, total, *carry)


class Stage:
    """One parallel stage of a plan: its ops, runner, worker count (and why), depths."""

    def __init__(self, index: int, ops: list, runner: str, workers: int, depth: int,
                 split: bool, item_cap: int | None, workers_why: str = "") -> None:
        self.index, self.ops, self.runner = index, ops, runner
        self.workers, self.depth, self.split = workers, depth, split
        self.item_cap = item_cap
        self.workers_why = workers_why
        self.collates = False  # a fused batch: each unit is one micro-batch, collated here
        #: process stages: the shared-memory arena bound of each worker, and the output
        #: bytes one lane may have in flight or waiting to be reordered (a share of it)
        self.arena_bytes: int | None = None
        self.budget_bytes: int | None = None


class Plan:
    def __init__(self, pipeline, opts) -> None:
        # Options that refine the source (a mixture's default read policy) apply here.
        pipeline.source = pipeline.source.configured(opts)
        self.pipeline, self.opts = pipeline, opts
        groups: list[list] = [[]]
        steps: list = []  # ("stage", index) | ("serial", op)
        for op in pipeline.ops:
            if op.stateless:
                if steps and steps[-1][0] == "serial":
                    groups.append([])
                groups[-1].append(op)
                if not steps or steps[-1][0] != "stage":
                    steps.append(("stage", len(groups) - 1))
            else:
                if not steps:
                    steps.append(("stage", 0))
                steps.append(("serial", op))
        if not steps:
            steps.append(("stage", 0))
        self.steps = steps
        parallelism = [max(1, sum(op.parallelism for op in g)) for g in groups]
        caps = resolve_stage_workers(opts, parallelism)
        self.stages = []
        for i, ops in enumerate(groups):
            runner = opts.per_stage_runner.get(i) or opts.runner or (
                "process" if parallelism[i] > 1 else "inline")
            sensitive = any(op.batch_shape_sensitive for op in ops)
            split = (not opts.deterministic or opts.allow_latency_flush_in_deterministic) \
                and not sensitive and runner != "inline"
            workers = 1 if runner == "inline" else caps[i]
            # An inline stage runs each unit synchronously when it is submitted: reading
            # ahead would only delay the first item (and a resumed run's first item).
            depth = 1 if runner == "inline" else resolve_stage_prefetch(opts, i, runner)
            # A process stage's samples in flight are bounded by their bytes (the lane's
            # share of the arena) unless op_queue_capacity is set: a count of samples
            # would keep small samples to one part (one busy worker) at a time.
            item_cap = None if runner == "process" and opts.op_queue_capacity is None \
                else resolve_op_queue_capacity(opts)
            self.stages.append(Stage(i, ops, runner, workers, depth, split, item_cap,
                                     _workers_why(opts, runner, parallelism[i], workers)))
        self.fused_batch = self._fuse_batch(opts)
        #: an op may give more items than it reads samples (a packer): no static bound on
        #: the items of a segment
        self.expands = any(isinstance(op, (PackTokensOp, PackDocumentsOp))
                           for op in pipeline.ops)
        preserves = all(op.preserves_cursor_order for op in pipeline.ops)
        #: cursor resume (restore reads on after the last delivered sample) when every op
        #: preserves cursor order; replay from flush boundaries otherwise
        self.cursor_resume = preserves
        self.flush_every = resolve_flush_every_k_chunks(opts, preserves)
        #: replay states record what the accumulators hold at their boundary (cursor
        #: states need nothing: a batch is empty right after it emits)
        self.carry_layout = [] if preserves else carry_layout(self)
        self.lanes = resolve_canonical_replicas(opts)
        self.dp = resolve_dp_degree(opts)
        self.group = resolve_dp_group_id(opts)
        self.mapping = resolve_mapping_strategy(opts)
        self.owned = owned_lanes(self.lanes, self.dp, self.group, self.mapping)
        self.prefetch = resolve_prefetch_batches(opts)
        #: the split of each process worker's arena bound (zephon.transport.budget)
        self.memory = pipeline_budget(opts, len(self.owned), INFLIGHT_PER_WORKER)
        for stage in self.stages:
            if stage.runner == "process":
                stage.arena_bytes = self.memory.arena_bytes
                stage.budget_bytes = self.memory.lane_bytes
        #: bytes of items the consumer-side prefetch queue may hold (it holds at least one):
        #: its part of the arena bound, so that what waits there, what the lanes hold and
        #: what the consumer holds never fill a worker's arena
        self.prefetch_bytes = self.memory.prefetch_bytes if "process" in self.runners else None

    def _fuse_batch(self, opts):
        """``read -> map* -> batch(b)``: the batch is formed where its samples are read.

        When the first stage only reads and maps (1:1: no filter, so which samples make a
        batch is known before they are read) and a ``batch`` follows it, the lane is cut
        into units of exactly one micro-batch and the stage collates each unit itself: the
        batch crosses from a worker as one message, and the consumer's process does not
        copy it again. The stream is the same (see :func:`~zephon.pipeline.lanes.batched_units`)."""
        if len(self.steps) < 2 or self.steps[0] != ("stage", 0) or not opts.deterministic:
            return None
        kind, op = self.steps[1]
        stage = self.stages[0]
        if kind != "serial" or not isinstance(op, BatchOp) or \
                not all(type(o) is MapOp for o in stage.ops):
            return None
        del self.steps[1]
        stage.collates, stage.split = True, False
        return op

    @property
    def runners(self) -> set[str]:
        return {s.runner for s in self.stages}

    def pass_end(self, start_epoch: int) -> int | None:
        """The end (exclusive) of the pass that epoch ``start_epoch`` belongs to: a pass
        is ``num_epochs`` epochs, pass ``q`` covers ``[q * k, (q + 1) * k)``; None for
        ``num_epochs=None`` (for ever)."""
        k = self.pipeline.num_epochs
        return None if k is None else (start_epoch // k + 1) * k

    def lane_length(self, lane: int) -> int:
        """Samples one epoch deals to ``lane``."""
        p = self.pipeline
        return lane_length(len(p.source), p.chunk_size, self.lanes, lane)

    def explain(self) -> str:
        """The resolved plan as text: lanes, order, resume, stages and their workers."""
        p, o = self.pipeline, self.opts
        shuffled = "a seeded permutation per epoch" if p.permute else "source order"
        lines = [
            f"pipeline {p.fingerprint()[:12]}: source {p.source.describe()}",
            f"  work: seed={p.seed}, shuffle={p.permute} ({shuffled}), "
            f"chunk_size={p.chunk_size}, num_epochs={p.num_epochs}",
            f"  lanes: {self.lanes} canonical lane(s) (canonical_replicas: chunk j goes to "
            f"lane j mod {self.lanes}), dp_degree={self.dp}; this rank (global_rank "
            f"{o.global_rank} of {o.world_size}) is dp group {self.group} and owns lane(s) "
            f"{self.owned} ({self.mapping})",
            "  order: " + ("deterministic (sequence order in every stage)" if o.deterministic
                           else "NON-DETERMINISTIC: completion order, checkpoints best effort")
            + "; tail: strict lane round robin",
        ]
        note = p.source.permute_note() if p.permute else None
        if note:
            lines.insert(2, f"  note: {note}")
        if self.cursor_resume:
            resume = ("resume: from the source cursor (every op preserves cursor order: a "
                      "restore reads on after the last delivered sample)")
        else:
            resume = ("resume: replay from the last flush boundary (an op carries history "
                      "across samples; what batch and pack_tokens held there is rebuilt "
                      "from its lineage)")
        if self.flush_every:
            flush = (f"flush: every {self.flush_every} chunks of a lane and at each "
                     "epoch start (resume points: batches stay full across them)")
        else:
            flush = ("flush: at each epoch start (resume points: batches stay full across "
                     "them)")
        lines += [f"  {resume}", f"  {flush}",
                  f"  tail prefetch: {self.prefetch} item(s)"
                  + (f"; MTP subprocess, buffer {resolve_mtp_buffer(o)}" if o.mtp_mode else "")]
        lines.append(f"  compute threads: {o.worker_compute_threads} per process worker (torch, "
                     "BLAS/OpenMP; threads stages share the consumer's)" if
                     o.worker_compute_threads else "  compute threads: process workers keep "
                     "the libraries' defaults (worker_compute_threads=0)")
        if "process" in self.runners:
            lines.append("  " + self.memory.describe())
        serial_no = 0
        for kind, what in self.steps:
            if kind == "stage":
                s = self.stages[what]
                ops = ", ".join(f"{op.name}[parallelism={op.parallelism}]" for op in s.ops)
                if s.collates:
                    ops += (", " if ops else "") + \
                        f"{self.fused_batch.describe()} (collated in the stage)"
                reads = "read" + (", " if ops else "") if s.index == 0 else ""
                lines.append(
                    f"  stage {s.index}: {reads}{ops}: runner={s.runner}, "
                    f"workers={s.workers} ({s.workers_why}), depth={s.depth} units/lane "
                    f"(+1 per worker in flight), "
                    + (f"op_queue={s.item_cap} items/lane, " if s.item_cap is not None
                       else "op_queue=bounded by bytes, ")
                    + (f"in flight <= {s.budget_bytes >> 20} MiB/lane (arena "
                       f"{s.arena_bytes >> 20} MiB/worker), " if s.budget_bytes and
                       s.arena_bytes else "")
                    + f"latency_flush={'on' if s.split else 'off'}")
            else:
                serial_no += 1
                lines.append(f"  serial {serial_no}: {what.describe()} "
                             f"(preserves_cursor_order={what.preserves_cursor_order})")
        return "\n".join(lines)


def _workers_why(opts, runner: str, parallelism: int, workers: int) -> str:
    """How a stage's worker count was derived, for ``explain()``."""
    if runner == "inline":
        return "inline: the consumer's thread"
    mode, cap = opts.worker_allocation, opts.max_workers
    if mode == "fit_to_ops":
        why = f"fit_to_ops: sum of op parallelism {parallelism}"
        if cap is not None and parallelism > cap:
            why += f", capped by max_workers={cap}"
        elif cap is not None and parallelism < cap:
            why += (f"; max_workers={cap} is only a cap here: raise the ops' parallelism or "
                    "use worker_allocation='per_stage_fixed'")
        return why
    total = resolve_max_workers(opts)
    shown = f"max_workers={total}" + (" (auto: cpu_count clamped to [4, 16])"
                                      if cap is None else "")
    if mode == "per_stage_fixed":
        return f"per_stage_fixed: {shown}"
    return (f"global: this stage's share of {shown}, by op parallelism {parallelism}; "
            "every stage gets at least 1, so with more stages than workers the total is "
            "larger")


def accumulate(op, upstream: Iterator, seed: int, lane: int, stats=None,
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
                state = _open(op, seed, lane, unit, tracks, made_input, held, (stats, node))
                out = []
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


def _open(op, seed: int, lane: int, marker: Boundary, tracks: bool, made_input: bool, held,
          counts: tuple = (None, "")):
    """The accumulator of ``op`` started at the lane's first boundary ``marker`` (with what
    a restore puts back into it, see :func:`accumulate`; ``counts``: the node statistics
    and node name a packer counts its rows and padding in)."""
    state = op.start(seed, lane, marker)
    if counts[0] is not None and hasattr(state, "count_into"):  # pack_documents
        state.count_into(*counts)
    if state.carries:
        state.lineage = _made_lineage if made_input else _pos_lineage
        state.tracks = tracks
        if held is not None:
            state.load(held())
    return state


class Engine:
    """Runs a plan for this rank's lanes from the given delivered lane states."""

    def __init__(self, plan: Plan, states: dict[int, tuple], start_epoch: int = 0) -> None:
        self.plan, self.states = plan, dict(states)
        #: the run covers epochs [start_epoch, end_epoch): lanes without a state start at
        #: start_epoch's beginning
        self.start_epoch, self.end_epoch = start_epoch, plan.pass_end(start_epoch)
        p, o = plan.pipeline, plan.opts
        mode = effective_tracking(o.execution_tracking)  # or $ZEPHON_EXECUTION_TRACKING
        self.stats = None if mode == "off" else RunStats(mode, o.metrics_sink_config)
        self.program = program = StageProgram(
            p.source, [s.ops for s in plan.stages], p.seed, [s.collates for s in plan.stages],
            collate_fn=plan.fused_batch and plan.fused_batch.collate_fn,
            worker_compute_threads=o.worker_compute_threads)
        self.executors = {}
        try:
            for stage in plan.stages:
                name = f"stage{stage.index}"
                ex: ProcessExecutor | ThreadExecutor | InlineExecutor
                if stage.runner == "process":
                    ex = ProcessExecutor(program, stage.workers, options=o, name=name,
                                         max_retries=o.max_worker_retries,
                                         deterministic=o.deterministic,
                                         inflight_per_worker=INFLIGHT_PER_WORKER,
                                         arena_max_bytes=stage.arena_bytes)
                elif stage.runner == "threads":
                    ex = ThreadExecutor(program, stage.workers, name=name)
                else:
                    ex = InlineExecutor(program, name=name)
                self.executors[stage.index] = ex
        except BaseException:
            self.close()
            raise

    def lane_stream(self, lane: int) -> Iterator:
        """``(record, lane state after it)`` for every item of ``lane`` from its state."""
        plan, p = self.plan, self.plan.pipeline
        state = self.states.get(lane)
        n, end = len(p.source), self.end_epoch
        if plan.cursor_resume:
            epoch, pos, total = state if state else (self.start_epoch, 0, 0)
            it = lane_units(n, p.seed, p.permute, p.chunk_size, plan.lanes, lane,
                            plan.flush_every, end, Boundary(epoch, 0), pos)
            return self._cursor_stream(self._chain(it, lane, None), lane, total)
        replay = tuple(state) if state else (self.start_epoch, 0, 0, 0)
        held = None
        if len(replay) > 4:
            held = decode_carry(plan.carry_layout, list(replay[4:]), f"lane {lane}",
                                carry_bounds(plan, lane, replay[0], replay[1],
                                             self.start_epoch))
        it = lane_units(n, p.seed, p.permute, p.chunk_size, plan.lanes, lane,
                        plan.flush_every, end, Boundary(replay[0], replay[1]))
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
    def _replay_stream(it: Iterator, lane: int, state: tuple, layout: list) -> Iterator:
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
        plan, stats = self.plan, self.stats
        capture = bool(plan.carry_layout)
        slots = list(held) if held is not None else None
        rebuild = Rebuilder(plan, self.program, lane) if slots else None
        if plan.fused_batch is not None:
            units = None
            if slots:
                count = slots.pop(0)
                assert start is not None
                units = held_units(plan, lane, start.epoch, start.k, count)
            it = batched_units(it, plan.fused_batch.size, plan.fused_batch.drop_last,
                               units, capture)
            it = grouped_units(it, batches_per_message(
                plan.pipeline.source, plan.fused_batch.size, plan.stages[0]))
        carriers = [i for i, (kind, what) in enumerate(plan.steps)
                    if kind == "serial" and
                    isinstance(what, (BatchOp, PackTokensOp, PackDocumentsOp))]
        for step_no, (kind, what) in enumerate(plan.steps):
            if kind == "stage":
                it = ordered_map(self.executors[what], plan.stages[what], it, lane,
                                 plan.opts.deterministic, stats)
                continue
            node_stats = stats if stats is not None and stats.nodes_enabled else None
            carries = step_no in carriers
            restore = None
            if carries and slots:
                restore = _held_records(rebuild, step_no, slots.pop(0), what)
            it = accumulate(what, it, plan.pipeline.seed, lane, node_stats,
                            f"serial{step_no}_{what.kind}", capture=capture and carries,
                            tracks=capture and any(c > step_no for c in carriers),
                            made_input=any(c < step_no for c in carriers), held=restore)
        return it

    def items(self) -> Iterator:
        """``(value, (lane, lane state))`` in the rank's round-robin order."""
        owned = self.plan.owned
        total_at = self._total_at
        streams = {lane: self.lane_stream(lane) for lane in owned}
        produced = {lane: self._total(lane) for lane in owned}
        live = set(owned)

        def pull(lane: int):
            try:
                record, stamp = next(streams[lane])
            except StopIteration:
                live.discard(lane)
                return None
            produced[lane] += 1
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
        return state[self._total_at] if state else 0

    def close(self) -> None:
        if self.stats is not None:
            self.stats.close()
        for ex in self.executors.values():
            try:
                ex.close()
            except Exception:  # noqa: BLE001 - closing everything matters more
                pass
        self.executors = {}
