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
:func:`accumulate` (the op's serial accumulator for this lane). The lane's
records are stamped with their position ``(lane, epoch, k, since, total)``:
the segment they belong to, how many items of the lane were produced since its
boundary, and in total. The tail pulls lanes in strict round robin, computed
as "the live lane with the fewest items so far, lowest id first", which is the
same rule after a restore on any number of ranks. Nothing here depends on
timing: which worker finishes first can only change when a result is ready,
never where it goes.

``deterministic=False``: results of a parallel stage are released in
completion order (throughput over order; checkpoints are then best effort).
"""

from __future__ import annotations

import math
import time
from typing import Iterator

from zephon.kernels import ReorderBuffer
from zephon.options import (
    resolve_canonical_replicas, resolve_dp_degree, resolve_dp_group_id,
    resolve_flush_every_k_chunks, resolve_mapping_strategy, resolve_op_queue_capacity,
    resolve_prefetch_batches,
    resolve_stage_prefetch, resolve_stage_workers,
)
from zephon.pipeline.lanes import lane_units, owned_lanes
from zephon.pipeline.ops import Batch, Boundary
from zephon.pipeline.program import StageProgram
from zephon.pipeline.stats import RunStats
from zephon.runners import InlineExecutor, ProcessExecutor, ThreadExecutor

__all__ = ["Plan", "Engine", "LaneState", "ordered_map", "accumulate"]


class LaneState(tuple):
    """Delivered position of a lane: ``(epoch, k, since, total)``."""

    __slots__ = ()

    def __new__(cls, epoch: int, k: int, since: int, total: int) -> "LaneState":
        return tuple.__new__(cls, (epoch, k, since, total))

    def __getnewargs__(self):
        return tuple(self)

    epoch = property(lambda s: s[0])
    k = property(lambda s: s[1])
    since = property(lambda s: s[2])
    total = property(lambda s: s[3])


class Stage:
    def __init__(self, index: int, ops: list, runner: str, workers: int, depth: int,
                 split: bool, item_cap: int) -> None:
        self.index, self.ops, self.runner = index, ops, runner
        self.workers, self.depth, self.split = workers, depth, split
        self.item_cap = item_cap


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
            self.stages.append(Stage(i, ops, runner, caps[i],
                                     resolve_stage_prefetch(opts, i, runner), split,
                                     resolve_op_queue_capacity(opts)))
        preserves = all(op.preserves_cursor_order for op in pipeline.ops)
        self.flush_every = resolve_flush_every_k_chunks(opts, preserves)
        self.lanes = resolve_canonical_replicas(opts)
        self.dp = resolve_dp_degree(opts)
        self.group = resolve_dp_group_id(opts)
        self.mapping = resolve_mapping_strategy(opts)
        self.owned = owned_lanes(self.lanes, self.dp, self.group, self.mapping)
        self.prefetch = resolve_prefetch_batches(opts)

    @property
    def runners(self) -> set[str]:
        return {s.runner for s in self.stages}

    def explain(self) -> str:
        p, o = self.pipeline, self.opts
        lines = [
            f"pipeline {p.fingerprint()[:12]}: source {p.source.describe()}",
            f"  work: seed={p.seed} shuffle={p.permute} chunk_size={p.chunk_size} "
            f"num_epochs={p.num_epochs}",
            f"  lanes: C={self.lanes} canonical, dp_degree={self.dp}, this rank "
            f"(global_rank {o.global_rank}/{o.world_size}) is dp group {self.group} owning "
            f"{self.owned} ({self.mapping})",
            f"  order: {'deterministic (sequence order in every stage)' if o.deterministic else 'NON-DETERMINISTIC: completion order, checkpoints best effort'}; "
            f"tail: strict lane round robin",
            f"  flush: every {self.flush_every or 'epoch'} "
            f"{'lane chunk(s)' if self.flush_every else ''} (replay boundaries)".rstrip(),
            f"  tail prefetch: {self.prefetch} item(s)"
            + (f"; MTP subprocess, buffer {o.mtp_buffer}" if o.mtp_mode else ""),
        ]
        serial_no = 0
        for kind, what in self.steps:
            if kind == "stage":
                s = self.stages[what]
                ops = ", ".join(f"{op.name}[parallelism={op.parallelism}]" for op in s.ops)
                reads = "read" + (", " if ops else "") if s.index == 0 else ""
                lines.append(
                    f"  stage {s.index}: runner={s.runner} workers={s.workers} "
                    f"depth={s.depth} units/lane op_queue={s.item_cap} items/lane "
                    f"latency_flush={'on' if s.split else 'off'}: "
                    f"{reads}{ops}")
            else:
                serial_no += 1
                lines.append(f"  serial {serial_no}: {what.describe()} "
                             f"(preserves_cursor_order={what.preserves_cursor_order})")
        return "\n".join(lines)


def ordered_map(executor, stage: Stage, upstream: Iterator, lane: int,
                deterministic: bool, stats=None) -> Iterator:
    depth, item_cap = stage.depth, stage.item_cap
    window = 2 * depth * max(1, stage.workers) + 8
    buffer = ReorderBuffer(window)
    # New sequence numbers one pull may take: a marker plus a unit's parts.
    per_pull = 1 + (stage.workers if stage.split else 1)
    seq = inflight = items = 0
    sizes: dict[int, int] = {}
    sent: dict[int, float] = {}
    node = f"stage{stage.index}"
    exhausted = False
    while True:
        # At most `depth` units and `op_queue_capacity` items in flight (always at least
        # one), and never further ahead of the oldest unfinished unit than the reorder
        # window: a slow head-of-line unit must stall the lookahead, not let finished
        # results pile up behind it without bound.
        while not exhausted and inflight < depth and (inflight == 0 or items < item_cap) \
                and seq + per_pull - buffer.cursor <= window:
            try:
                unit = next(upstream)
            except StopIteration:
                exhausted = True
                break
            if unit is None:  # a placeholder of an earlier non-deterministic stage
                continue
            if isinstance(unit, Boundary):
                buffer.push(seq, unit)
                seq += 1
                continue
            parts = [unit]
            if stage.split and len(unit) > stage.workers > 1:
                size = math.ceil(len(unit) / stage.workers)
                parts = [unit[i:i + size] for i in range(0, len(unit), size)]
            for part in parts:
                if stats is not None:
                    stats.submitted(node, len(part))
                    sent[seq] = time.perf_counter()
                executor.submit(lane, seq, (stage.index, part))
                sizes[seq] = len(part)
                items += len(part)
                seq += 1
                inflight += 1
        for out in buffer.pop_ready():
            yield out
        if inflight == 0:
            if exhausted:
                return
            continue
        done_seq, result = executor.get(lane)
        inflight -= 1
        items -= sizes.pop(done_seq)
        if stats is not None:
            stats.completed(node, len(result), time.perf_counter() - sent.pop(done_seq))
        if deterministic:
            buffer.push(done_seq, result)
        else:
            yield result
            buffer.push(done_seq, None)  # keeps markers in place; None is skipped below


def accumulate(op, upstream: Iterator, seed: int, lane: int, stats=None,
               node: str = "") -> Iterator:
    if stats is not None:
        yield from _timed_accumulate(op, upstream, seed, lane, stats, node)
        return
    state = None
    for unit in upstream:
        if unit is None:
            continue
        if isinstance(unit, Boundary):
            if state is not None:
                out = state.drain()
                if out:
                    yield out
            state = op.start(seed, lane, unit)
            yield unit
            continue
        out = state.push(unit)
        if out:
            yield out
    if state is not None:
        out = state.drain()
        if out:
            yield out


def _timed_accumulate(op, upstream: Iterator, seed: int, lane: int, stats, node: str):
    state = None
    for unit in upstream:
        if unit is None:
            continue
        t = time.perf_counter()
        if isinstance(unit, Boundary):
            out = state.drain() if state is not None else []
            state = op.start(seed, lane, unit)
            stats.serial(node, 0, len(out), time.perf_counter() - t)
            if out:
                yield out
            yield unit
            continue
        out = state.push(unit)
        stats.serial(node, len(unit), len(out), time.perf_counter() - t)
        if out:
            yield out
    if state is not None:
        out = state.drain()
        stats.serial(node, 0, len(out), 0.0)
        if out:
            yield out


class Engine:
    """Runs a plan for this rank's lanes from the given delivered lane states."""

    def __init__(self, plan: Plan, states: dict[int, LaneState]) -> None:
        self.plan, self.states = plan, dict(states)
        p, o = plan.pipeline, plan.opts
        mode = str(o.execution_tracking)
        self.stats = None if mode == "off" else RunStats(mode, o.metrics_sink_config)
        program = StageProgram(p.source, [s.ops for s in plan.stages], p.seed)
        self.executors = {}
        try:
            for stage in plan.stages:
                name = f"stage{stage.index}"
                if stage.runner == "process":
                    ex = ProcessExecutor(program, stage.workers, options=o, name=name,
                                         max_retries=o.max_worker_retries,
                                         deterministic=o.deterministic)
                elif stage.runner == "threads":
                    ex = ThreadExecutor(program, stage.workers, name=name)
                else:
                    ex = InlineExecutor(program, name=name)
                self.executors[stage.index] = ex
        except BaseException:
            self.close()
            raise

    def lane_stream(self, lane: int) -> Iterator:
        plan, p = self.plan, self.plan.pipeline
        state = self.states.get(lane)
        start = Boundary(state.epoch, state.k) if state else Boundary(0, 0)
        skip = state.since if state else 0
        total = state.total - skip if state else 0
        it = lane_units(len(p.source), p.seed, p.permute, p.chunk_size, plan.lanes, lane,
                        plan.flush_every, p.num_epochs, start)
        stats = self.stats
        for step_no, (kind, what) in enumerate(plan.steps):
            if kind == "stage":
                stage = plan.stages[what]
                it = ordered_map(self.executors[what], stage, it, lane,
                                 plan.opts.deterministic, stats)
            else:
                node_stats = stats if stats is not None and stats.nodes_enabled else None
                it = accumulate(what, it, p.seed, lane, node_stats,
                                f"serial{step_no}_{what.kind}")
        boundary, since = start, 0
        for unit in it:
            if unit is None:
                continue
            if isinstance(unit, Boundary):
                boundary, since = unit, 0
                continue
            for record in unit:
                since += 1
                total += 1
                if skip:
                    skip -= 1
                    continue
                yield record, (lane, boundary.epoch, boundary.k, since, total)

    def items(self) -> Iterator:
        """``(value, stamp)`` in the rank's round-robin order."""
        streams = {lane: self.lane_stream(lane) for lane in self.plan.owned}
        produced = {lane: (self.states[lane].total if lane in self.states else 0)
                    for lane in self.plan.owned}
        live = set(self.plan.owned)
        while live:
            lane = min(live, key=lambda l: (produced[l], l))
            try:
                record, stamp = next(streams[lane])
            except StopIteration:
                live.discard(lane)
                continue
            produced[lane] += 1
            value = record.value
            if isinstance(value, Batch):
                value.meta["lane"] = lane
                value.meta["lane_index"] = stamp[4] - 1
            yield value, stamp

    def close(self) -> None:
        if self.stats is not None:
            self.stats.close()
        for ex in self.executors.values():
            try:
                ex.close()
            except Exception:  # noqa: BLE001 - closing everything matters more
                pass
        self.executors = {}
