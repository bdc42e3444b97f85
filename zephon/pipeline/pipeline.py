"""``Pipeline``: the user-facing definition of a pipeline and its builder methods.

A ``Pipeline`` is an immutable definition: every builder method (``map``,
``filter``, ``shuffle``, ``batch``, ``map_batch``, ``pack_tokens``,
``options``) returns a new pipeline and leaves the original unchanged, so one
definition can run with several option sets. ``iter(pipe)`` starts a run and
returns a :class:`~zephon.pipeline.iterator.PipelineIterator`, which owns it:
its checkpoint, restore and close.

Every ``iter(pipe)`` starts an independent run from the beginning of the
stream, unless ``pipe.restore(state)`` was called since the last one: then it
starts from ``state``. ``pipe.checkpoint()`` and ``pipe.restore(state)`` are
shortcuts: ``checkpoint()`` gives a pending restored state, else the delivered
position of the latest run still going, else of the latest run;
``restore(state)`` restores the latest run still going, or, when none is, the
next one. The pipeline holds its iterators weakly: dropping one (leaving a
``for`` loop with ``break``) closes its run at once.
"""

from __future__ import annotations

import hashlib
import weakref

from zephon.checkpoint import decode_state
from zephon.errors import ZephonConfigError
from zephon.options import RuntimeOptions
from zephon.pipeline import ops as O
from zephon.pipeline.engine import Plan
from zephon.pipeline.iterator import PipelineIterator, RunRecord
from zephon.pipeline.sources import Source
from zephon.pipeline.state import check_state, local_state
from zephon.pipeline.validate import validate
from zephon.transport.spawn_guard import refuse_in_spawn_bootstrap

__all__ = ["Pipeline"]


class Pipeline:
    """``Pipeline(source, seed=..., shuffle=..., chunk_size=..., num_epochs=...)`` then ops."""

    def __init__(self, source: Source, *, seed: int = 0, shuffle: bool = True,
                 chunk_size: int = 64, num_epochs: int | None = 1) -> None:
        if not isinstance(source, Source):
            raise ZephonConfigError(f"Pipeline: source must be a zephon source "
                                    f"(zephon.sources.*), got {type(source).__name__}")
        for name, value, low in (("seed", seed, 0), ("chunk_size", chunk_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ZephonConfigError(f"Pipeline: {name} must be an int >= {low}, "
                                        f"got {value!r}")
        if num_epochs is not None and (isinstance(num_epochs, bool) or
                                       not isinstance(num_epochs, int) or num_epochs < 1):
            raise ZephonConfigError(f"Pipeline: num_epochs must be None or an int >= 1, "
                                    f"got {num_epochs!r}")
        if not isinstance(shuffle, bool):
            raise ZephonConfigError(f"Pipeline: shuffle must be True or False, got {shuffle!r}")
        # ``shuffle`` (the flag) permutes each epoch; ``shuffle(n)`` (the method) is the op.
        self.source, self.seed, self.permute = source, seed, shuffle
        self.chunk_size, self.num_epochs = chunk_size, num_epochs
        self.ops: list[O.Op] = []
        self.runtime = RuntimeOptions()
        self._record = RunRecord()  # the latest run's delivered positions
        self._pending: dict[int, tuple] | None = None  # restore() before the next iter()
        self._runs: list[weakref.ref] = []  # this pipeline's iterators, oldest first
        self._rounds = 0  # multi-rank checkpoint exchanges, across runs
        self._plan: Plan | None = None
        self._fingerprint: str | None = None

    # -- building ------------------------------------------------------------------------
    def _with(self, op: O.Op | None = None, runtime: RuntimeOptions | None = None) -> "Pipeline":
        new = Pipeline.__new__(Pipeline)
        new.__dict__.update(self.__dict__)
        new.ops = self.ops + ([op] if op is not None else [])
        new.runtime = runtime if runtime is not None else self.runtime
        new._record, new._runs, new._pending, new._rounds = RunRecord(), [], None, 0
        new._plan = new._fingerprint = None  # a new definition: resolve it anew
        return new

    def map(self, fn, parallelism: int = 1) -> "Pipeline":
        """Apply ``fn(sample) -> sample`` (or ``fn(sample, ctx)``: ``ctx.rng`` is seeded from
        the sample's identity) to every sample; ``parallelism`` is the number of workers
        this op asks for (see ``RuntimeOptions.worker_allocation``).

        Example: ``pipe.map(decode, parallelism=4)``."""
        return self._with(O.MapOp(fn, parallelism))

    def filter(self, pred, parallelism: int = 1) -> "Pipeline":
        """Keep the samples for which ``pred(sample)`` (or ``pred(sample, ctx)``) is true."""
        return self._with(O.FilterOp(pred, parallelism))

    def map_batch(self, fn, parallelism: int = 1) -> "Pipeline":
        """Apply ``fn(batch) -> batch`` to every batch (after ``batch()``); a dict result
        becomes a :class:`~zephon.Batch` with the input's ``meta``."""
        return self._with(O.MapBatchOp(fn, parallelism))

    def shuffle(self, buffer_size: int) -> "Pipeline":
        """A seeded shuffle buffer of ``buffer_size`` samples per lane (deterministic: its
        seed comes from the pipeline seed, the lane and the flush boundary). It carries
        history across samples, so a restore replays from the last flush boundary."""
        return self._with(O.ShuffleOp(buffer_size))

    def batch(self, microbatch_size: int, drop_last: bool = False) -> "Pipeline":
        """Collate dict samples into a :class:`~zephon.Batch` of ``microbatch_size``
        (stacked arrays where shapes agree, lists otherwise). Batches never mix lanes; a
        lane's partial batch is emitted at a flush boundary and at the end, or dropped
        with ``drop_last=True``."""
        return self._with(O.BatchOp(microbatch_size, drop_last))

    def pack_tokens(self, seq_len: int, field: str = "tokens") -> "Pipeline":
        """Concatenate the ``field`` token arrays of consecutive samples and cut rows of
        exactly ``seq_len`` tokens (the remainder at a flush boundary is dropped)."""
        return self._with(O.PackTokensOp(seq_len, field))

    def options(self, opts: RuntimeOptions) -> "Pipeline":
        """The same pipeline run with ``opts`` (runners, workers, queues, ranks): options
        never change the stream, only how it is produced."""
        if not isinstance(opts, RuntimeOptions):
            raise ZephonConfigError(f"options() takes a RuntimeOptions, got {type(opts).__name__}")
        return self._with(runtime=opts)

    # -- plan ----------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """A hash of what defines the stream: source, ops, seed, chunking, epochs and the
        flush cadence (a checkpoint restores only into a pipeline with the same one)."""
        if self._fingerprint is None:
            plan = self.plan()
            parts = [plan.pipeline.source.describe(), f"seed={self.seed}",
                     f"shuffle={self.permute}",
                     f"chunk={self.chunk_size}", f"epochs={self.num_epochs}"]
            parts += [op.describe() for op in self.ops]
            parts.append(f"flush={plan.flush_every}")
            self._fingerprint = hashlib.sha256("\n".join(parts).encode()).hexdigest()
        return self._fingerprint

    def plan(self) -> Plan:
        """The resolved plan, computed once: a pipeline's definition never changes (every
        builder method returns a new pipeline), while a plan can be costly (a mixture
        under ``mixture_config`` recomputes its schedule)."""
        if self._plan is None:
            # A snapshot without run state: the engine (held by a live pump thread) must
            # not keep this object, and through it the run, from being collected.
            self._plan = Plan(self._spec(), self.runtime)
        return self._plan

    def explain(self) -> str:
        """The resolved plan as text: lanes, order, resume, stages, runners and workers."""
        return self.plan().explain()

    def _spec(self) -> "Pipeline":
        """A copy without run state (what the MTP subprocess rebuilds)."""
        return self._with()

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> PipelineIterator:
        """Start a run and return its iterator: from the start of the stream, or from the
        state given to :meth:`restore` since the last ``iter()``. Runs are independent: an
        earlier iterator goes on (and is closed when it is dropped or exhausted)."""
        refuse_in_spawn_bootstrap("iterating a zephon Pipeline")
        plan = self.plan()
        validate(plan, "pickle")  # before any worker process exists
        record = RunRecord(self._pending)
        it = PipelineIterator(self, record)  # workers start booting here...
        try:
            validate(plan, "behaviour")  # ...while the ops are checked on the first sample
        except BaseException:
            it.close()
            raise
        self._pending = None
        self._record = record
        self._runs = [ref for ref in self._runs if ref() is not None] + [weakref.ref(it)]
        return it

    def _live(self) -> PipelineIterator | None:
        """The most recently started run that is still going, if any."""
        for ref in reversed(self._runs):
            it = ref()
            if it is not None and not it.closed:
                return it
        return None

    def close(self) -> None:
        """Close every run of this pipeline that is still going."""
        for ref in self._runs:
            it = ref()
            if it is not None:
                it.close()
        self._runs = []

    def stats(self) -> dict:
        """Execution statistics of the latest run (``execution_tracking``; empty when it is
        off, and in MTP mode, where they live in the subprocess)."""
        stats = self._record.stats
        return {} if stats is None else stats.snapshot()

    @property
    def final_state(self) -> bytes | None:
        """With ``mtp_mode`` and ``mtp_auto_checkpoint``: the checkpoint taken when the last
        run reached the end of its stream."""
        return self._record.final_state

    def _next_round(self) -> int:
        """A new multi-rank exchange round: counted per pipeline, across its runs."""
        self._rounds += 1
        return self._rounds

    # -- checkpoint ------------------------------------------------------------------------
    def checkpoint(self) -> bytes:
        """The delivered position as checkpoint bytes: of the state given to :meth:`restore`
        if no run started since, else of the latest run still going, else of the latest run
        (with several ranks every rank must call it). When a pipeline runs several
        iterators at once, call ``it.checkpoint()`` on the one you mean."""
        if self._pending is not None:
            return self._checkpoint_of(self._pending)
        current = self._live()
        if current is not None:
            return current.checkpoint()
        return self._checkpoint_of(self._record.states)

    def _checkpoint_of(self, states: dict[int, tuple]) -> bytes:
        """Checkpoint bytes of lane ``states`` without a live run (a pending restore, or a
        run that has ended), as :meth:`PipelineIterator.checkpoint` makes them."""
        from zephon.checkpoint import exchange_state

        plan = self.plan()
        local = local_state(plan, self.fingerprint(), states)
        return exchange_state(local, plan.opts, self._next_round())

    def restore(self, state: bytes) -> None:
        """Continue exactly after the last item delivered when ``state`` was taken: the
        latest run still going restarts from it; if none is going, the next ``iter(pipe)``
        starts there."""
        current = self._live()
        if current is not None:
            current.restore(state)
            return
        self._pending = check_state(decode_state(state), self.plan(), self.fingerprint())
