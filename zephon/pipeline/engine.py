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
the pipeline's identity (it decides where partial batches fall).

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
  ``(epoch, k, since, total)``, the segment (boundary) the item belongs to and
  how many items the lane produced since it. A restore replays the lane from
  that boundary (at most ``flush_every_k_chunks`` lane chunks back) and drops
  ``since`` items.

``total`` counts the lane's items since the start of the run; it gives
``meta["lane_index"]`` and the tail's order. The tail is strict lane round
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
from zephon.pipeline.dispatch import PIPELINE_ARENA_BYTES, lane_budget_bytes, ordered_map
from zephon.pipeline.lanes import (
    batched_units,
    grouped_units,
    lane_length,
    lane_units,
    owned_lanes,
)
from zephon.pipeline.ops import Batch, BatchOp, Boundary, MapOp, PackTokensOp
from zephon.pipeline.program import StageProgram, batches_per_message
from zephon.pipeline.stats import RunStats
from zephon.runners import InlineExecutor, ProcessExecutor, ThreadExecutor
from zephon.transport.pool import default_arena_bytes

#: tasks a process stage's pool keeps in flight per worker
INFLIGHT_PER_WORKER = 4

__all__ = ["Engine", "Plan", "accumulate", "cursor_state", "ordered_map", "replay_state"]


def cursor_state(epoch: int, pos: int, total: int) -> tuple[int, int, int]:
    """Lane state under cursor resume: read on from lane position ``pos`` of ``epoch``;
    ``total`` items were delivered from the lane so far."""
    return (epoch, pos, total)


def replay_state(epoch: int, k: int, since: int, total: int) -> tuple[int, int, int, int]:
    """Lane state under replay: replay from boundary ``(epoch, k)`` and drop the ``since``
    items already delivered from it; ``total`` items were delivered from the lane so far."""
    return (epoch, k, since, total)


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
        self.expands = any(isinstance(op, PackTokensOp) for op in pipeline.ops)
        preserves = all(op.preserves_cursor_order for op in pipeline.ops)
        #: cursor resume (restore reads on after the last delivered sample) when every op
        #: preserves cursor order; replay from flush boundaries otherwise
        self.cursor_resume = preserves
        self.flush_every = resolve_flush_every_k_chunks(opts, preserves)
        self.lanes = resolve_canonical_replicas(opts)
        self.dp = resolve_dp_degree(opts)
        self.group = resolve_dp_group_id(opts)
        self.mapping = resolve_mapping_strategy(opts)
        self.owned = owned_lanes(self.lanes, self.dp, self.group, self.mapping)
        self.prefetch = resolve_prefetch_batches(opts)
        for stage in self.stages:
            if stage.runner == "process":
                stage.arena_bytes = max(default_arena_bytes(opts, INFLIGHT_PER_WORKER),
                                        PIPELINE_ARENA_BYTES)
                stage.budget_bytes = lane_budget_bytes(stage.arena_bytes, len(self.owned))
        #: bytes of items the consumer-side prefetch queue may hold (it holds at least one):
        #: a quarter of the smallest arena bound, so that what waits there, what the lanes
        #: hold and what the consumer holds never fill a worker's arena
        arenas = [s.arena_bytes for s in self.stages if s.arena_bytes]
        self.prefetch_bytes = min(arenas) // 4 if arenas else None

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
                      "across samples)")
        if self.flush_every:
            flush = (f"flush: every {self.flush_every} chunks of a lane "
                     "(accumulators drain; replay boundaries)")
        else:
            flush = "flush: at each epoch start (accumulators drain)"
        lines += [f"  {resume}", f"  {flush}",
                  f"  tail prefetch: {self.prefetch} item(s)"
                  + (f"; MTP subprocess, buffer {resolve_mtp_buffer(o)}" if o.mtp_mode else "")]
        lines.append(f"  compute threads: {o.worker_compute_threads} per process worker (torch, "
                     "BLAS/OpenMP; threads stages share the consumer's)" if
                     o.worker_compute_threads else "  compute threads: process workers keep "
                     "the libraries' defaults (worker_compute_threads=0)")
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
               node: str = "") -> Iterator:
    """The serial accumulator of ``op`` over one lane: restarted (seeded from the lane and
    the boundary) at every Boundary, after draining what it held."""
    timer = time.perf_counter if stats is not None else None
    state: Any = None  # the op's accumulator, from the lane's first Boundary on
    out: list
    for unit in upstream:
        if unit is None:
            continue
        t = timer() if timer else 0.0
        if isinstance(unit, Boundary):
            out = state.drain() if state is not None else []
            state = op.start(seed, lane, unit)
            if timer:
                stats.serial(node, 0, len(out), timer() - t)
            if out:
                yield out
            yield unit
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


class Engine:
    """Runs a plan for this rank's lanes from the given delivered lane states."""

    def __init__(self, plan: Plan, states: dict[int, tuple]) -> None:
        self.plan, self.states = plan, dict(states)
        p, o = plan.pipeline, plan.opts
        mode = str(o.execution_tracking)
        self.stats = None if mode == "off" else RunStats(mode, o.metrics_sink_config)
        program = StageProgram(p.source, [s.ops for s in plan.stages], p.seed,
                               [s.collates for s in plan.stages],
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
        n = len(p.source)
        if plan.cursor_resume:
            epoch, pos, total = state if state else (0, 0, 0)
            it = lane_units(n, p.seed, p.permute, p.chunk_size, plan.lanes, lane,
                            plan.flush_every, p.num_epochs, Boundary(epoch, 0), pos)
            return self._cursor_stream(self._chain(it, lane), lane, total)
        replay = state if state else (0, 0, 0, 0)
        it = lane_units(n, p.seed, p.permute, p.chunk_size, plan.lanes, lane,
                        plan.flush_every, p.num_epochs, Boundary(replay[0], replay[1]))
        return self._replay_stream(self._chain(it, lane), lane, replay)

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
    def _replay_stream(it: Iterator, lane: int, state: tuple) -> Iterator:
        epoch, k, skip, total = state
        total -= skip
        boundary, since, opened = Boundary(epoch, k), 0, False
        for unit in it:
            if unit is None:
                continue
            if isinstance(unit, Boundary):
                if skip and opened:
                    break  # the segment ended before what the state says was delivered
                boundary, since, opened = unit, 0, True
                continue
            for record in unit:
                since += 1
                total += 1
                if skip:
                    skip -= 1
                    continue
                yield record, (lane, (boundary.epoch, boundary.k, since, total))
        if skip:
            raise CheckpointError(
                f"lane {lane}: the restored state says {state[2]} item(s) of the segment at "
                f"(epoch {state[0]}, lane chunk {state[1]}) were delivered, but replaying it "
                f"produced only {state[2] - skip}: the state does not belong to this pipeline "
                "and data")

    def _chain(self, it: Iterator, lane: int) -> Iterator:
        plan, stats = self.plan, self.stats
        if plan.fused_batch is not None:
            it = batched_units(it, plan.fused_batch.size, plan.fused_batch.drop_last)
            it = grouped_units(it, batches_per_message(
                plan.pipeline.source, plan.fused_batch.size, plan.stages[0]))
        for step_no, (kind, what) in enumerate(plan.steps):
            if kind == "stage":
                it = ordered_map(self.executors[what], plan.stages[what], it, lane,
                                 plan.opts.deterministic, stats)
            else:
                node_stats = stats if stats is not None and stats.nodes_enabled else None
                it = accumulate(what, it, plan.pipeline.seed, lane, node_stats,
                                f"serial{step_no}_{what.kind}")
        return it

    def items(self) -> Iterator:
        """``(value, (lane, lane state))`` in the rank's round-robin order."""
        owned = self.plan.owned
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
            if isinstance(value, Batch):  # its raw meta: reading .meta would make the ids
                meta = value._meta
                meta["lane"] = lane
                meta["lane_index"] = stamp[1][-1] - 1
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

    def _total(self, lane: int) -> int:
        state = self.states.get(lane)
        return state[-1] if state else 0

    def close(self) -> None:
        if self.stats is not None:
            self.stats.close()
        for ex in self.executors.values():
            try:
                ex.close()
            except Exception:  # noqa: BLE001 - closing everything matters more
                pass
        self.executors = {}
