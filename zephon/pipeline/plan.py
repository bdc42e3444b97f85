"""The plan: a pipeline's ops and options resolved once into stages and steps.

The op list is cut into *parallel stages* (maximal runs of stateless ops;
stage 0 also reads the source) and *serial steps* (one per stateful op):

    ops    map, filter    shuffle      map           batch        batch
    steps  StageStep(0)   SerialStep   StageStep(1)  SerialStep   SerialStep

A step is a frozen :class:`StageStep` (run by the stage's executor, results
put back in sequence order) or :class:`SerialStep` (one accumulator per lane
in the engine's process); a lane's chain is its steps in order. Each
:class:`Stage` gets a runner (``per_stage_runner`` > ``runner`` > auto:
``process`` when its ops ask for parallelism > 1, else ``inline``), the runner
whose bounds it is planned with, and a mode, what runs its units: its runner,
except under ``worker_allocation="autotune"``, where a stage with neither runner
option pinned is *adaptive* (``mode="adaptive"``: planned with the process
runner's bounds, run inline until the autotune controller moves it to process
workers). It also gets a worker cap (``worker_allocation``), a lookahead depth in
units per lane (``per_stage_prefetch`` > ``default_stage_prefetch``) and, on the
process runner, its arena bound and the bytes one lane may hold in flight.
``read -> map* -> batch`` is *fused*: the batch step goes, and stage 0
collates each micro-batch itself (:func:`fused_batch`). The flush cadence K
comes from :func:`~zephon.options.resolve_flush_every_k_chunks` and is part
of the pipeline's identity (it decides where a replay can start; batches stay
full across it).

Fields: a packer built without ``aligned=`` packs, beside its tokens, the fields that
the op which made its token field declares aligned with them (a chat op's
``loss_mask``), when every op since hands its fields on (:func:`upstream_aligned`, from
the ops' :meth:`~zephon.pipeline.ops.base.Op.aligned_with`); when an op since does not
say what it makes (a ``map``), the packer is refused at construction, naming the field:
the user says ``aligned=``. No field an op made aligned is dropped unasked.

Invariants: :class:`Plan` is built once from a
:class:`~zephon.pipeline.spec.PipelineSpec` and the options, by pure functions of
the spec's ops and the options (:func:`cut_steps`, :func:`fused_batch`,
:func:`build_stages`, :func:`with_arena`, :func:`carry_layout`), and never changes
after (setting an attribute raises). It holds the spec as the options refine its
source (:meth:`~zephon.pipeline.spec.PipelineSpec.configured`: a copy, the spec it
is given is never changed), ``plan.spec``, and that spec's fingerprint with the
plan's flush cadence (:func:`~zephon.pipeline.fingerprint.pipeline_fingerprint`),
``plan.fingerprint``, computed once, on first use. It knows nothing of the
:class:`~zephon.pipeline.Pipeline` the spec came from. Steps and stages say
what they are by their type, and ops by their contracts
(:mod:`zephon.pipeline.ops.base`): nothing here names an op except ``batch``,
whose fused form is this module's decision.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Union

from zephon.errors import ZephonConfigError
from zephon.options import (
    resolve_autotune_cpu_budget,
    resolve_autotune_memory_bytes,
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
from zephon.options.resolve import OUT_OF_PROCESS_RUNNERS
from zephon.pipeline.fingerprint import fingerprint_parts, pipeline_fingerprint
from zephon.pipeline.lanes import lane_length, owned_lanes
from zephon.pipeline.ops import (
    PASSES_ON,
    BatchOp,
    HoldsBins,
    HoldsPieces,
    HoldsQueue,
    HoldsRecords,
    Op,
    SerialOp,
    StatelessOp,
    check_registered,
)
from zephon.pipeline.spec import PipelineSpec
from zephon.transport.budget import MemoryBudget, pipeline_budget

__all__ = ["INFLIGHT_PER_WORKER", "Plan", "SerialStep", "Stage", "StageStep", "Step",
           "build_stages", "carrier", "carry_layout", "cut_steps", "fused_batch",
           "input_shape", "maker", "upstream_aligned", "with_arena"]

#: tasks a process stage's pool keeps in flight per worker
INFLIGHT_PER_WORKER = 4


@dataclass(frozen=True)
class Stage:
    """One parallel stage of a plan: its ops, runner and mode, worker count (and why),
    depths.

    ``runner`` is the runner whose bounds the stage is planned with (workers, depth,
    arena); ``mode`` is what runs its units (see the field)."""

    index: int
    ops: tuple[StatelessOp, ...]
    runner: str
    workers: int
    depth: int
    #: units may be cut into parts that several workers share (latency flush)
    split: bool
    #: items in flight per lane (None: bounded by bytes only)
    item_cap: int | None
    workers_why: str = ""
    #: a fused batch: each unit is one micro-batch, collated here
    collates: bool = False
    #: process stages: the shared-memory arena bound of each worker, and the output bytes
    #: one lane may have in flight or waiting to be reordered (a share of it)
    arena_bytes: int | None = None
    budget_bytes: int | None = None
    #: what runs the stage's units: ``"inline"``, ``"threads"``, ``"process"``, ``"ray"``
    #: (actors on a Ray cluster, :mod:`zephon.runners.ray`), or
    #: ``"adaptive"`` (autotune with the runner not pinned: the stage starts inline and
    #: the controller moves it to process workers when that pays; ``runner`` is then
    #: ``"process"``, the runner whose bounds it is planned with so that it can).
    #: Empty at construction means the same as ``runner``.
    mode: str = ""

    def __post_init__(self) -> None:
        if not self.mode:
            object.__setattr__(self, "mode", self.runner)
        if self.mode not in ("inline", "threads", "process", "ray", "adaptive"):
            raise ValueError(f"Stage.mode {self.mode!r}")

    @property
    def adaptive(self) -> bool:
        """Whether the stage is adaptive (``mode == "adaptive"``)."""
        return self.mode == "adaptive"


@dataclass(frozen=True)
class StageStep:
    """A step run by a parallel stage (``stage``: the index in ``Plan.stages``)."""

    stage: int


@dataclass(frozen=True)
class SerialStep:
    """A step run by one accumulator of ``op`` per lane, in the engine's process."""

    op: SerialOp


Step = Union[StageStep, SerialStep]


def cut_steps(ops: tuple[Op, ...]) -> tuple[list[tuple[StatelessOp, ...]], list[Step]]:
    """``(groups, steps)``: the stateless ops of each parallel stage, and the steps in
    chain order. There is always a stage 0 (it reads), first among the steps."""
    groups: list[list[StatelessOp]] = [[]]
    steps: list[Step] = [StageStep(0)]
    for op in ops:
        if isinstance(op, StatelessOp):
            if isinstance(steps[-1], SerialStep):
                groups.append([])
                steps.append(StageStep(len(groups) - 1))
            groups[-1].append(op)
        elif isinstance(op, SerialOp):
            steps.append(SerialStep(op))
        else:
            raise TypeError(f"op {op!r} is neither a StatelessOp nor a SerialOp")
    return [tuple(g) for g in groups], steps


def fused_batch(groups: list[tuple[StatelessOp, ...]], steps: list[Step],
                deterministic: bool) -> BatchOp | None:
    """``read -> map* -> batch(b)``: the batch is formed where its samples are read.

    When the first stage only reads and maps (1:1: no filter, so which samples make a
    batch is known before they are read) and a ``batch`` follows it, the lane is cut
    into units of exactly one micro-batch and the stage collates each unit itself: the
    batch crosses from a worker as one message, and the consumer's process does not
    copy it again. The stream is the same (see :func:`~zephon.pipeline.lanes.batched_units`).
    Only in deterministic order."""
    if len(steps) < 2 or not deterministic:
        return None
    step = steps[1]
    if not isinstance(step, SerialStep) or not isinstance(step.op, BatchOp) or \
            not all(op.one_to_one for op in groups[0]):
        return None
    return step.op


def upstream_aligned(ops: tuple[Op, ...], packer: str, field: str) -> tuple[str, ...]:
    """The fields a packer (kind ``packer``) placed after ``ops`` packs with its token field
    ``field`` when ``aligned=`` is not given: those the op that made ``field`` declares
    aligned with it when every op since hands its fields on; ``()`` when the op that made
    it declares none, or no op says it made it (a source's fields: as given).

    Raises:
        ZephonConfigError: an op declares fields aligned with ``field`` and an op since
            does not say what it makes (a ``map``): naming the fields and the fix.
    """
    unsaid: Op | None = None  # the latest op that does not say what it makes
    for op in reversed(ops):
        said = op.aligned_with(field)
        if said == PASSES_ON:
            continue
        if said is None:
            unsaid = unsaid or op
            continue
        if not said or unsaid is None:
            return tuple(said)
        names = ", ".join(map(repr, said))
        raise ZephonConfigError(
            f"{packer}: {op.name} makes {names} aligned with the tokens {field!r}, and "
            f"{unsaid.name} after it may have changed or dropped it: say what to pack with "
            f"the tokens: {packer}(..., aligned={tuple(said)!r}) packs it (one value per "
            f"token in every sample), {packer}(..., aligned=()) drops it")
    return ()


def carrier(step: Step) -> HoldsRecords | HoldsPieces | HoldsBins | HoldsQueue | None:
    """The op of ``step`` when it holds records, pieces, bins or queued records across a
    boundary, else None."""
    if isinstance(step, SerialStep) and isinstance(
            step.op, (HoldsRecords, HoldsPieces, HoldsBins, HoldsQueue)):
        return step.op
    return None


def maker(step: Step) -> HoldsRecords | HoldsPieces | HoldsBins | None:
    """The op of ``step`` when it holds data across a boundary and makes new records of it
    (a :class:`HoldsQueue` op hands on its input records: it makes none), else None."""
    op = carrier(step)
    return None if isinstance(op, HoldsQueue) else op


def _shape(op: HoldsRecords | HoldsPieces | HoldsBins, inner: tuple) -> tuple:
    """The carry shape of the records ``op`` makes from records of shape ``inner``."""
    if isinstance(op, HoldsBins):
        return ("bins", op.made_size(), op.carried_bins, inner)
    return (op.holds, op.made_size(), inner)


def input_shape(steps: tuple[Step, ...], fused: BatchOp | None, i: int) -> tuple:
    """The shape of the records entering ``steps[i]`` (``fused``: the plan's fused batch;
    see :mod:`zephon.pipeline.carry`). A queue (:class:`HoldsQueue`) is transparent: its
    records are those it read."""
    for j in range(i - 1, -1, -1):
        op = maker(steps[j])
        if op is not None:
            return _shape(op, input_shape(steps, fused, j))
    if fused is not None:
        return ("run", fused.size)
    return ("sample",)


def carry_layout(steps: tuple[Step, ...], fused: BatchOp | None) -> tuple:
    """The carry slots of a plan's ``steps``, in chain order: ``("count", size)`` for the
    fused batch ``fused``, ``(step, shape)`` for a serial op holding records (shape
    ``("records", size, input)``), pieces (``("pieces", size, input)``), bins (``("bins",
    size, bins, input)``) or queued input records (``("queue", most held, input)``)."""
    slots: list = []
    if fused is not None:
        slots.append(("count", fused.size))
    for i, step in enumerate(steps):
        op = carrier(step)
        if isinstance(op, HoldsQueue):
            slots.append((i, ("queue", op.carried_records, input_shape(steps, fused, i))))
        elif op is not None:
            slots.append((i, _shape(op, input_shape(steps, fused, i))))
    return tuple(slots)


def _runner(opts, index: int, parallelism: int) -> str:
    return opts.per_stage_runner.get(index) or opts.runner or (
        "process" if parallelism > 1 or _adaptive(opts, index) else "inline")


def _adaptive(opts, index: int) -> bool:
    """Whether stage ``index`` is adaptive: autotune, and no runner pinned for it (neither
    ``runner`` nor a ``per_stage_runner`` entry). A pinned runner is kept: a stage pinned
    to threads or processes is tuned within it and never runs inline."""
    return opts.worker_allocation == "autotune" and not opts.runner and \
        not opts.per_stage_runner.get(index)


def build_stages(opts, groups: list[tuple[StatelessOp, ...]], fused: bool) -> list[Stage]:
    """The parallel stages of ``groups`` under ``opts`` (``fused``: stage 0 collates a
    fused batch), before their arena bounds (:func:`with_arena`)."""
    parallelism = [max(1, sum(op.parallelism for op in g)) for g in groups]
    caps = resolve_stage_workers(opts, parallelism)
    stages = []
    for i, ops in enumerate(groups):
        runner = _runner(opts, i, parallelism[i])
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
        item_cap = None if runner in OUT_OF_PROCESS_RUNNERS and opts.op_queue_capacity is None \
            else resolve_op_queue_capacity(opts)
        adaptive = _adaptive(opts, i)
        stage = Stage(i, ops, runner, workers, depth, split, item_cap,
                      _workers_why(opts, runner, parallelism[i], workers, adaptive),
                      mode="adaptive" if adaptive else runner)
        if fused and i == 0:
            stage = replace(stage, collates=True, split=False)
        stages.append(stage)
    return stages


def with_arena(stage: Stage, memory: MemoryBudget) -> Stage:
    """``stage`` with, on the process runner, its workers' arena bound and the byte budget
    of each lane the rank owns (both from the budget ``memory``); on the Ray runner the
    lane's byte budget alone (results wait in Ray's object store, not in an arena)."""
    if stage.runner == "ray":
        return replace(stage, budget_bytes=memory.lane_bytes)
    if stage.runner != "process":
        return stage
    return replace(stage, arena_bytes=memory.arena_bytes, budget_bytes=memory.lane_bytes)


class Plan:
    """A pipeline spec resolved under its options (see the module docstring); immutable.

    Args:
        spec: the pipeline's :class:`~zephon.pipeline.spec.PipelineSpec`.
        opts: its runtime options.
    """

    def __init__(self, spec: PipelineSpec, opts) -> None:
        for op in spec.ops:
            check_registered(op)
        #: the spec as the options refine its source (a mixture's default read policy)
        self.spec: PipelineSpec = spec.configured(opts)
        self.opts = opts
        groups, steps = cut_steps(spec.ops)
        fused = fused_batch(groups, steps, opts.deterministic)
        stages = build_stages(opts, groups, fused is not None)
        #: the steps of a lane's chain, in order (a fused batch is stage 0's, not a step)
        self.steps: tuple[Step, ...] = tuple(steps if fused is None else steps[:1] + steps[2:])
        self.fused_batch = fused
        #: an op may give more items than it reads samples (a packer): no static bound on
        #: the items of a segment
        self.expands = any(isinstance(op, SerialOp) and op.expands for op in spec.ops)
        preserves = spec.preserves_cursor_order
        #: cursor resume (restore reads on after the last delivered sample) when every op
        #: preserves cursor order; replay from flush boundaries otherwise
        self.cursor_resume = preserves
        self.flush_every = resolve_flush_every_k_chunks(opts, preserves)
        #: replay states record what the accumulators hold at their boundary (cursor
        #: states need nothing: a batch is empty right after it emits)
        self.carry_layout = () if preserves else carry_layout(self.steps, fused)
        self.lanes = resolve_canonical_replicas(opts)
        self.dp = resolve_dp_degree(opts)
        self.group = resolve_dp_group_id(opts)
        self.mapping = resolve_mapping_strategy(opts)
        self.owned = tuple(owned_lanes(self.lanes, self.dp, self.group, self.mapping))
        self.prefetch = resolve_prefetch_batches(opts)
        #: the split of each process worker's arena bound (zephon.transport.budget)
        self.memory = pipeline_budget(len(self.owned), INFLIGHT_PER_WORKER, self.prefetch,
                                      opts.shm_max_coalesced_bytes)
        self.stages = tuple(with_arena(s, self.memory) for s in stages)
        #: bytes of items the consumer-side prefetch queue may hold (it holds at least one):
        #: its part of the arena bound, so that what waits there, what the lanes hold and
        #: what the consumer holds never fill a worker's arena
        self.prefetch_bytes = self.memory.prefetch_bytes if self._arenas else None
        #: the mixture weights a trainer set that this plan's source holds
        #: (:meth:`with_mixture`; the pipeline's own plan: none)
        self.mixture: tuple = ()
        self._sealed = True

    def __setattr__(self, name: str, value) -> None:
        if getattr(self, "_sealed", False):
            raise AttributeError(f"a Plan does not change once built: cannot set {name!r}")
        object.__setattr__(self, name, value)

    def with_mixture(self, overrides: tuple) -> "Plan":
        """This plan with the mixture weights a trainer set (``RunStart.mixture``) in its
        source (the plan itself when there are none and its source has none); its
        fingerprint is this plan's (the overrides are run state)."""
        if tuple(overrides) == self.mixture:
            return self
        plan = Plan(replace(self.spec, source=self.spec.source.with_weight_overrides(
            overrides)), self.opts)
        object.__setattr__(plan, "mixture", tuple(overrides))
        return plan

    @functools.cached_property
    def fingerprint(self) -> str:
        """The fingerprint of :attr:`spec` with this plan's flush cadence (what a
        checkpoint must match to restore), computed once."""
        return pipeline_fingerprint(self.spec, self.flush_every)

    @functools.cached_property
    def fingerprint_parts(self) -> tuple[str, ...]:
        """The lines the fingerprint hashes (a checkpoint's proof records them)."""
        return tuple(fingerprint_parts(self.spec, self.flush_every))

    @property
    def runners(self) -> set[str]:
        """The runners the stages are planned with (``"inline"``, ``"threads"``,
        ``"process"``; an adaptive stage is planned with ``"process"``)."""
        return {s.runner for s in self.stages}

    @property
    def _arenas(self) -> bool:
        """Whether a stage is planned with the process runner's bounds (a worker arena:
        a process stage, or an adaptive one, which may move to process workers)."""
        return any(s.arena_bytes is not None for s in self.stages)

    def pass_end(self, start_epoch: int) -> int | None:
        """The end (exclusive) of the pass that epoch ``start_epoch`` belongs to: a pass
        is ``num_epochs`` epochs, pass ``q`` covers ``[q * k, (q + 1) * k)``; None for
        ``num_epochs=None`` (for ever)."""
        k = self.spec.num_epochs
        return None if k is None else (start_epoch // k + 1) * k

    def lane_length(self, lane: int) -> int:
        """Samples one epoch deals to ``lane``."""
        p = self.spec
        return lane_length(len(p.source), p.chunk_size, self.lanes, lane)

    def explain(self) -> str:
        """The resolved plan as text: lanes, order, resume, stages and their workers."""
        lines = self._explain_header()
        serial_no = 0
        for step in self.steps:
            if isinstance(step, StageStep):
                lines.append(self._explain_stage(self.stages[step.stage]))
            else:
                serial_no += 1
                lines.append(f"  serial {serial_no}: {step.op.describe()} "
                             f"(preserves_cursor_order={step.op.preserves_cursor_order})")
        return "\n".join(lines)

    def _explain_header(self) -> list[str]:
        p, o = self.spec, self.opts
        shuffled = ("a seeded permutation per epoch" if p.permute is True else "source order"
                    if p.permute is False else "shards in a seeded order, windows shuffled")
        lines = [
            f"pipeline {self.fingerprint[:12]}: source {p.source.describe()}",
            f"  work: seed={p.seed}, shuffle={p.permute} ({shuffled}), "
            f"chunk_size={p.chunk_size}, num_epochs={p.num_epochs}",
            f"  lanes: {self.lanes} canonical lane(s) (canonical_replicas: chunk j goes to "
            f"lane j mod {self.lanes}), dp_degree={self.dp}; this rank (global_rank "
            f"{o.global_rank} of {o.world_size}) is dp group {self.group} and owns lane(s) "
            f"{list(self.owned)} ({self.mapping})",
            "  order: " + ("deterministic (sequence order in every stage)" if o.deterministic
                           else "NON-DETERMINISTIC: completion order, checkpoints best effort")
            + "; tail: strict lane round robin",
        ]
        note = p.source.permute_note() if p.permute is True else None
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
        if self._arenas:
            lines.append("  " + self.memory.describe())
        if "ray" in self.runners:
            from zephon.transport.ray_cluster import describe_cluster

            lines.append("  ray: a ray stage's workers are Ray actors (1 CPU each, spread "
                         f"over the nodes) on {describe_cluster()}; results travel through "
                         "Ray's object store, a lost actor's units run again on another")
        return lines

    def _explain_stage(self, s: Stage) -> str:
        ops = ", ".join(f"{op.name}[parallelism={op.parallelism}]" for op in s.ops)
        if s.collates:
            assert self.fused_batch is not None
            ops += (", " if ops else "") + \
                f"{self.fused_batch.describe()} (collated in the stage)"
        reads = "read" + (", " if ops else "") if s.index == 0 else ""
        runner = "adaptive (inline <-> process)" if s.mode == "adaptive" else s.mode
        return (
            f"  stage {s.index}: {reads}{ops}: runner={runner}, "
            f"workers={s.workers} ({s.workers_why}), depth={s.depth} units/lane "
            f"(+1 per worker in flight), "
            + (f"op_queue={s.item_cap} items/lane, " if s.item_cap is not None
               else "op_queue=bounded by bytes, ")
            + (f"in flight <= {s.budget_bytes >> 20} MiB/lane (arena "
               f"{s.arena_bytes >> 20} MiB/worker), " if s.budget_bytes and
               s.arena_bytes else "")
            + f"latency_flush={'on' if s.split else 'off'}")


def _workers_why(opts, runner: str, parallelism: int, workers: int,
                 adaptive: bool = False) -> str:
    """How a stage's worker count was derived, for ``explain()``."""
    if runner == "inline":
        return "inline: the consumer's thread"
    mode, cap = opts.worker_allocation, opts.max_workers
    if mode == "autotune":
        budget = resolve_autotune_cpu_budget(opts)
        memory = resolve_autotune_memory_bytes(opts)
        within = (f"within {budget} worker(s) in all "
                  f"({'max_workers' if cap is not None else 'cores available'}) and "
                  f"{memory >> 20} MiB of worker memory")
        if runner == "ray":
            top = "the Ray cluster's CPUs" + (f" (at most max_workers={cap})"
                                              if cap is not None else "")
            return (f"autotune: starts at 1 actor; grown while the consumer waits on it and "
                    f"shrunk when its actors idle, within {top}, a budget apart from "
                    "this host's")
        if adaptive:
            return ("autotune, runner not pinned: starts inline (the engine's thread, "
                    "nothing spawned); moved to process workers when a trial shows it pays, "
                    f"then grown and shrunk, and moved back inline when they stop paying; {within}")
        return f"autotune: starts at 1; grown and shrunk at run time {within}"
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
