"""``Pipeline``: the user-facing builder, iterator, checkpoint and restore.

Builder methods return a new pipeline (the original is unchanged), so one
definition can be run with several option sets. Iterating runs the plan for
this rank's lanes:

- all stages inline and no MTP: the engine runs in the consumer's thread;
- otherwise a pump thread fills a queue of ``prefetch_batches`` items (MTP:
  the engine runs in a subprocess, see :mod:`zephon.runners.mtp`).

Only what ``__next__`` hands to the consumer counts as delivered: each item
carries its lane position and delivery records it, so prefetched items are
replayed after a restore. ``checkpoint()`` encodes the delivered positions of
the owned lanes with the fingerprint and C (with several ranks, exchanged
through ``aggregate_dir`` so every rank returns the same merged bytes).
``restore(state)`` checks the envelope, the fingerprint and C, and makes the
next iteration continue exactly after the last delivered item of every lane.

Shutdown: ``close()`` (also on early ``break`` when the iterator is dropped,
on an exception in the consumer, at garbage collection and interpreter exit)
stops the pump, closes the worker pools and reaps every process.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import queue
import threading
import weakref

from zephon.checkpoint import decode_state, exchange_state
from zephon.errors import CheckpointError, ZephonConfigError
from zephon.options import RuntimeOptions, resolve_canonical_replicas, resolve_mtp_prefetch
from zephon.pipeline import ops as O
from zephon.pipeline.engine import Engine, LaneState, Plan
from zephon.pipeline.sources import Source
from zephon.pipeline.validate import validate

__all__ = ["Pipeline"]

_END = object()
_live: "weakref.WeakSet[_Run]" = weakref.WeakSet()


@atexit.register
def _close_live_runs() -> None:
    for run in list(_live):
        run.close()


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _pump(source, out: queue.Queue, stop: threading.Event, nice: int = 0) -> None:
    if nice:
        # MTP's prefetch thread yields the CPU to the training loop: on Linux a thread has
        # its own nice value, set through its native id (raising it needs no privilege).
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (AttributeError, OSError):
            pass

    def put(item) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in source:
            if not put(item):
                return
        put(_END)
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer
        if not stop.is_set():
            put(_Failure(exc))


class _Run:
    """One iteration of a pipeline (the object ``iter(pipe)`` returns)."""

    def __init__(self, pipe: "Pipeline", plan: Plan) -> None:
        self.pipe, self.plan = pipe, plan
        self.closed = False
        self.engine = None
        self.remote = None
        self.thread = None
        opts = plan.opts
        if opts.mtp_mode:
            from zephon.runners.mtp import MtpSource

            self.remote = MtpSource(_EngineFactory(pipe._spec()), dict(pipe._states), opts)
            self._source = self.remote.items()
            threaded = resolve_mtp_prefetch(opts) > 0
            depth = resolve_mtp_prefetch(opts)
        else:
            self.engine = Engine(plan, pipe._states)
            self._source = self.engine.items()
            threaded = plan.runners != {"inline"}
            depth = plan.prefetch
        if threaded:
            self.queue: queue.Queue = queue.Queue(maxsize=depth)
            self.stop = threading.Event()
            # The pump holds the queue, the stop flag and the item source, never the run:
            # a dropped, half-consumed run must stay collectable so its finalizer can close it.
            self.thread = threading.Thread(target=_pump, args=(self._source, self.queue,
                                                               self.stop,
                                                               10 if opts.mtp_mode else 0),
                                           name="zephon-pump", daemon=True)
            self.thread.start()
        _live.add(self)

    def __iter__(self):
        return self

    def __next__(self):
        if self.closed:
            raise StopIteration
        try:
            if self.thread is None:
                value, stamp = next(self._source)
            else:
                item = self.queue.get()
                if item is _END:
                    raise StopIteration
                if isinstance(item, _Failure):
                    raise item.error
                value, stamp = item
        except StopIteration:
            self.close()
            self.pipe._finished()
            raise
        except BaseException:
            self.close()
            raise
        lane, epoch, k, since, total = stamp
        self.pipe._states[lane] = LaneState(epoch, k, since, total)
        if self.engine is not None and self.engine.stats is not None and \
                self.engine.stats.nodes_enabled:
            self.engine.stats.delivered()
        return value

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        _live.discard(self)
        if self.thread is not None:
            self.stop.set()
        if self.engine is not None:
            self.engine.close()
        if self.remote is not None:
            self.remote.close()
        if self.thread is not None:
            while True:  # unblock a pump waiting on a full queue, then join it
                try:
                    self.queue.get_nowait()
                except queue.Empty:
                    break
            self.thread.join(timeout=30)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


class _EngineFactory:
    """What the MTP subprocess runs: the same pipeline, engine in-process there."""

    def __init__(self, pipe: "Pipeline") -> None:
        self.pipe = pipe

    def __call__(self, states: dict):
        pipe = self.pipe._with(runtime=self.pipe.runtime.replace(mtp_mode=False))
        engine = Engine(pipe.plan(), {int(k): LaneState(*v) for k, v in states.items()})
        return _ClosingItems(engine)


class _ClosingItems:
    def __init__(self, engine: Engine) -> None:
        self.engine, self.items = engine, engine.items()

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.items)

    def close(self) -> None:
        self.engine.close()


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
        self._states: dict[int, LaneState] = {}
        self._run: _Run | None = None
        self._rounds = 0
        self._plan: Plan | None = None
        self._fingerprint: str | None = None
        self.final_state: bytes | None = None

    # -- building ------------------------------------------------------------------------
    def _with(self, op: O.Op | None = None, runtime: RuntimeOptions | None = None) -> "Pipeline":
        new = Pipeline.__new__(Pipeline)
        new.__dict__.update(self.__dict__)
        new.ops = self.ops + ([op] if op is not None else [])
        new.runtime = runtime if runtime is not None else self.runtime
        new._states, new._run, new._rounds, new.final_state = {}, None, 0, None
        new._plan = new._fingerprint = None  # a new definition: resolve it anew
        return new

    def map(self, fn, parallelism: int = 1) -> "Pipeline":
        return self._with(O.MapOp(fn, parallelism))

    def filter(self, pred, parallelism: int = 1) -> "Pipeline":
        return self._with(O.FilterOp(pred, parallelism))

    def map_batch(self, fn, parallelism: int = 1) -> "Pipeline":
        return self._with(O.MapBatchOp(fn, parallelism))

    def shuffle(self, buffer_size: int) -> "Pipeline":
        return self._with(O.ShuffleOp(buffer_size))

    def batch(self, microbatch_size: int, drop_last: bool = False) -> "Pipeline":
        return self._with(O.BatchOp(microbatch_size, drop_last))

    def pack_tokens(self, seq_len: int, field: str = "tokens") -> "Pipeline":
        return self._with(O.PackTokensOp(seq_len, field))

    def options(self, opts: RuntimeOptions) -> "Pipeline":
        if not isinstance(opts, RuntimeOptions):
            raise ZephonConfigError(f"options() takes a RuntimeOptions, got {type(opts).__name__}")
        return self._with(runtime=opts)

    # -- plan ----------------------------------------------------------------------------
    def fingerprint(self) -> str:
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
        return self.plan().explain()

    def _spec(self) -> "Pipeline":
        """A copy without run state (what the MTP subprocess rebuilds)."""
        return self._with()

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> _Run:
        if self._run is not None:
            self._run.close()
        plan = self.plan()
        validate(plan, "pickle")  # before any worker process exists
        run = _Run(self, plan)  # workers start booting here...
        try:
            validate(plan, "behaviour")  # ...while the ops are checked on the first sample
        except BaseException:
            run.close()
            raise
        self._run = run
        return run

    def close(self) -> None:
        if self._run is not None:
            self._run.close()

    def stats(self) -> dict:
        """Execution statistics of the current or last run (``execution_tracking``; empty
        when it is off, and in MTP mode, where they live in the subprocess)."""
        run = self._run
        if run is None or run.engine is None or run.engine.stats is None:
            return {}
        return run.engine.stats.snapshot()

    def _finished(self) -> None:
        if self.runtime.mtp_mode and self.runtime.mtp_auto_checkpoint:
            self.final_state = self.checkpoint()

    # -- checkpoint ------------------------------------------------------------------------
    def _local_state(self) -> dict:
        plan = self.plan()
        lanes = {str(lane): list(self._states[lane]) for lane in plan.owned
                 if lane in self._states}
        return {"fingerprint": self.fingerprint(), "lanes_total": plan.lanes, "lanes": lanes,
                "group": plan.group}

    def checkpoint(self) -> bytes:
        self._rounds += 1  # collective: the n-th call on every rank is round n
        return exchange_state(self._local_state(), self.runtime, self._rounds)

    def restore(self, state: bytes) -> None:
        decoded = decode_state(state)
        for key in ("fingerprint", "lanes_total", "lanes"):
            if key not in decoded:
                raise CheckpointError(f"checkpoint lacks {key!r}: not a pipeline state")
        if decoded["fingerprint"] != self.fingerprint():
            raise CheckpointError(
                "checkpoint is from a different pipeline (its fingerprint "
                f"{str(decoded['fingerprint'])[:12]} is not this pipeline's "
                f"{self.fingerprint()[:12]}: source, ops, seed, chunking or flush differ)")
        lanes = resolve_canonical_replicas(self.runtime)
        if decoded["lanes_total"] != lanes:
            raise CheckpointError(
                f"checkpoint has canonical_replicas={decoded['lanes_total']}, this pipeline "
                f"{lanes}: the number of canonical lanes must not change across a restore")
        states = {}
        for lane, value in decoded["lanes"].items():
            try:
                lane_no = int(lane)
                epoch, k, since, total = (int(v) for v in value)
            except (TypeError, ValueError):
                raise CheckpointError(f"corrupt lane entry {lane!r}: {value!r}") from None
            if not 0 <= lane_no < lanes or min(epoch, k, since, total) < 0:
                raise CheckpointError(f"corrupt lane entry {lane!r}: {value!r}")
            states[lane_no] = LaneState(epoch, k, since, total)
        if self._run is not None:
            self._run.close()
            self._run = None
        self._states = states
