"""Execution statistics of a pipeline run (``execution_tracking``) and their sink
(``metrics_sink_config``).

- ``stages``: per parallel stage: units and items submitted, items out, units in
  flight (current and peak), and unit latency (submit to result) p50/p90/p99
  over the last 1024 units; and where the stage's time goes (below);
- ``nodes``: the above, plus every serial op (items in and out, seconds spent;
  ``pack_documents`` also ``rows``, ``tokens``, ``padding_tokens`` and
  ``padding_fraction``) and the tail (items delivered to the consumer, and the
  consumer's wait: ``wait_mean_ms``, ``wait_p50_ms``, ``wait_p99_ms``,
  ``input_bound_fraction``);
- ``off``: nothing is recorded, and nothing on the hot path checks more than one
  ``stats is None``.

``Pipeline.stats()`` returns a snapshot: a dict ``node -> row`` of numbers (what the
sink emits as gauges). A stage row also has ``workers``, ``startup_s`` (run start to its first
result), ``busy_fraction``,
``idle_fraction``, ``blocked_fraction``, ``busy_s`` (op time the workers reported),
``arena_bytes`` (result bytes its workers placed in shared memory), and
``worker_starts``/``worker_stops``/``worker_restarts``.

``stats(report=True)`` returns the report-grade snapshot (schema 1)::

    {"schema": 1, "mode": "stages" | "nodes", "elapsed_s": float,
     "nodes":    {node: row},                      # what stats() returns
     "stages":   {node: {"label": "map(decode)", "runner", "workers", "startup_s", "busy",
                         "idle", "blocked", "busy_s", "worker_blocked_s",
                         "wait_input_s", "wait_result_s", "arena_bytes",
                         "worker_starts", "worker_stops", "worker_restarts"}},
     "consumer": {"batches", "startup_s", "wait_s", "compute_s", "wait_mean_ms",
                  "wait_p50_ms", "wait_p99_ms", "input_bound_steps",
                  "input_bound_fraction"},
     "series":   {"bucket_s": float, "t": [bucket start, s],
                  "batches": [...],                    # delivered to the consumer
                  "steps": [...], "wait_s": [...],     # steps (batches after the
                                                       # first) and their waits
                  "<node>.items": [...],               # items out of the stage
                  "<node>.samples": [...],             # its input samples done
                  "<node>.busy": [fraction], "<node>.depth": [peak parts in flight]},
     "events":   [{"t": s, "node", "kind": "start" | "stop" | "restart", "worker"}]}

Where a stage's time goes (fractions of ``elapsed x workers``, summing to 1):
``busy`` is op time the workers measured (each worker times the ops of a part and
sends the figure with the part's result: no extra messages); ``blocked`` is the
time process workers spent placing a result in the arena (encoding it, and waiting
for space while the arena is full of results not yet taken), plus the stage's share of
the rest spent while the engine was downstream of it (its results waiting to be
taken: a full queue downstream, a slow consumer); ``idle`` is the share spent while
the stage waited for its input (the engine reading upstream). The rest is split
between the two in proportion to the engine's measured time in each. The run
clock starts when the run starts and ``elapsed_s`` ends at the snapshot (or the end
of the run); a stage's clock starts at its first result (what comes before is
start-up: spawning workers, the first read). The consumer's ``startup_s`` is the
time to the first batch; that batch is not a step (its wait is start-up). Time series buckets start at 0.1 s and double (pairs merged) whenever
there would be more than :data:`MAX_BUCKETS`, so a long run costs bounded memory.
A step is **input-bound** when the consumer waited at least
:data:`INPUT_BOUND_SHARE` of it (its wait plus its compute since the previous
batch). MTP mode records in the subprocess: the parent's snapshot is empty.

With a sink configured, gauges named ``<namespace>.<node>.<metric>`` are emitted every
``flush_interval_s`` (checked as the run progresses, no extra thread) and when the
run ends: to the ``zephon.metrics`` logger (``log``; one JSON object per line with
``json_logs``), as statsd gauges over UDP (``statsd``; datagrams of at most
``max_batch_size`` lines, ``default_tags`` as DogStatsD tags), or both.

Recording cost (the hot path). Every counter has exactly one writer and is a plain
attribute or dict entry, updated without a lock: a stage's counters (parts submitted
and completed, latency, input and result waits, and the op time the workers measured)
are written by the engine's thread only -- process workers send their timing in the
header of the result message they send anyway, thread workers return it with the
result, and the executor reports it when ``get()`` takes the result; serial ops'
counters by the engine's thread; the consumer's by the thread calling ``next()`` (one
consumer per iterator). Each writer keeps an open time bucket (:class:`_Bucket`: the
series sums it added since its last roll) and rolls it into the series once per bucket,
the first time it records after the bucket's end: that is the only time it takes the
lock, so a part costs a few attribute updates and one clock read per event, whatever
the part's size. Readers (``stats()``, the sink) take the lock, read the counters as
they are (each exact; rows may be a part apart while the run goes) and add every
writer's open bucket to a copy of the series, so the series always sums to the
counters. Worker start/stop/restart events are rare and take the lock.

:func:`recording` collects every RunStats made while it is active (``python -m
zephon profile`` reports on the runs of the script it runs).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import socket
import time
from threading import Lock
from time import perf_counter
from typing import Iterator

import numpy as np

__all__ = ["INPUT_BOUND_SHARE", "MAX_BUCKETS", "RunStats", "StageProbe", "recording"]

log = logging.getLogger("zephon.metrics")

#: Most time buckets a series keeps (then buckets double in length, pairs merged).
MAX_BUCKETS = 256
#: First bucket length of the time series, seconds.
FIRST_BUCKET_S = 0.1
#: A step is input-bound when the consumer's wait is at least this share of it.
INPUT_BOUND_SHARE = 0.1
#: Most worker start/stop events kept.
MAX_EVENTS = 1000

_recorders: list[list] = []


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """A list that receives every :class:`RunStats` created while the block runs."""
    runs: list = []
    _recorders.append(runs)
    try:
        yield runs
    finally:
        _recorders.remove(runs)


class _Series:
    """Per-bucket sums (and peaks, for keys ending in ``.depth``) over run time."""

    def __init__(self, t0: float) -> None:
        self.t0, self.bucket_s = t0, FIRST_BUCKET_S
        self.data: dict[str, list[float]] = {}
        self._i, self._start, self._end = 0, t0, t0 + FIRST_BUCKET_S  # the last bucket

    def copy(self) -> "_Series":
        out = _Series(self.t0)
        out.bucket_s, out._i, out._start, out._end = \
            self.bucket_s, self._i, self._start, self._end
        out.data = {key: list(values) for key, values in self.data.items()}
        return out

    def _index(self, now: float) -> int:
        if self._start <= now < self._end:  # the bucket of the previous call
            return self._i
        i = int((now - self.t0) / self.bucket_s)
        while i >= MAX_BUCKETS:
            self._halve()
            i = int((now - self.t0) / self.bucket_s)
        i = max(0, i)
        self._i, self._start = i, self.t0 + i * self.bucket_s
        self._end = self._start + self.bucket_s
        return i

    def bounds(self, now: float) -> tuple[float, float]:
        """``(start, end)`` of the bucket of ``now`` (with the current bucket length)."""
        self._index(now)
        return self._start, self._end

    def _halve(self) -> None:
        self.bucket_s *= 2
        for key, values in self.data.items():
            merge = max if key.endswith(".depth") else (lambda a, b: a + b)
            pairs = [values[k:k + 2] for k in range(0, len(values), 2)]
            self.data[key] = [merge(p[0], p[1]) if len(p) == 2 else p[0] for p in pairs]

    def _row(self, key: str, i: int) -> list[float]:
        values = self.data.get(key)
        if values is None:
            values = self.data[key] = []
        if len(values) <= i:
            values.extend([0.0] * (i + 1 - len(values)))
        return values

    def add(self, now: float, *pairs: tuple[str, float]) -> None:
        """Add each ``(key, value)`` to the bucket of ``now``."""
        i = self._index(now)
        data = self.data
        for key, value in pairs:
            values = data.get(key)
            if values is None or len(values) <= i:
                values = self._row(key, i)
            values[i] += value

    def peak(self, now: float, key: str, value: float) -> None:
        """Raise the bucket of ``now`` of ``key`` (a ``.depth`` key) to ``value``."""
        i = self._index(now)
        values = self._row(key, i)
        if value > values[i]:
            values[i] = value

    def take(self, bucket: "_Bucket") -> None:
        """Add what ``bucket`` (one writer's open bucket) holds to the bucket it covers
        (found by its midpoint: ``t0 + i * bucket_s - t0`` may round below ``i``)."""
        at = 0.5 * (bucket.start + bucket.end)
        self.add(at, *[(k, v) for k, v in bucket.sums.copy().items() if v])
        for key, value in bucket.peaks.copy().items():
            if value:
                self.peak(at, key, value)

    def export(self, now: float, workers: dict[str, int]) -> dict:
        n = self._index(now) + 1
        out: dict = {"bucket_s": self.bucket_s,
                     "t": [round(k * self.bucket_s, 6) for k in range(n)]}
        for key, values in sorted(self.data.items()):
            row = values + [0.0] * (n - len(values))
            if key.endswith(".busy"):  # op seconds -> share of the bucket's worker time
                per = self.bucket_s * max(1, workers.get(key[:-5], 1))
                row = [min(1.0, v / per) for v in row]
            out[key] = row
        for key in ("batches", "steps", "wait_s"):
            out.setdefault(key, [0.0] * n)
        return out


class _Bucket:
    """One writer's open time bucket ``[start, end)``: what it recorded there and has not
    yet rolled into the series (``sums``; ``peaks`` of ``.depth`` keys). Its keys are
    made when it is: the hot path only adds to them. ``end`` 0 until the first roll."""

    __slots__ = ("end", "peaks", "start", "sums")

    def __init__(self, sums: tuple[str, ...], peaks: tuple[str, ...] = ()) -> None:
        self.start = self.end = 0.0
        self.sums: dict[str, float] = dict.fromkeys(sums, 0.0)
        self.peaks: dict[str, float] = dict.fromkeys(peaks, 0.0)

    def clear(self) -> None:
        for key in self.sums:
            self.sums[key] = 0.0
        for key in self.peaks:
            self.peaks[key] = 0.0


def _percentiles(values: collections.deque, qs: list[int]) -> list[float]:
    # list() copies the deque in one C call: its writer may append meanwhile
    return [float(v) for v in np.percentile(np.asarray(list(values), dtype=float), qs)]


class _Node:
    """A serial op's counters (or the tail's): items in and out, seconds, a packer's
    rows and tokens."""

    __slots__ = ("counters",)

    def __init__(self) -> None:
        self.counters: dict[str, float] = collections.defaultdict(int)  # "seconds" is a float

    def row(self) -> dict[str, float]:
        row = dict(self.counters)
        row["inflight"] = 0
        if row.get("rows"):  # a packer: the share of its row slots that is padding
            row["padding_fraction"] = row["padding_tokens"] / (
                row["tokens"] + row["padding_tokens"])
        return row


class _Stage:
    """What the engine and the workers measured of one parallel stage (written by the
    engine's thread alone, see the module docstring)."""

    __slots__ = (
        "arena_bytes",
        "bucket",
        "busy_s",
        "events",
        "first",
        "inflight",
        "inflight_peak",
        "items_in",
        "items_out",
        "k_busy",
        "k_depth",
        "k_items",
        "k_samples",
        "label",
        "latency",
        "runner",
        "units",
        "wait_input_s",
        "wait_result_s",
        "worker_blocked_s",
        "workers",
    )

    def __init__(self, node: str, label: str, runner: str, workers: int) -> None:
        self.label, self.runner, self.workers = label, runner, workers
        self.units = self.items_in = self.items_out = self.inflight = self.inflight_peak = 0
        self.latency: collections.deque[float] = collections.deque(maxlen=1024)
        self.busy_s = self.worker_blocked_s = 0.0
        self.wait_input_s = self.wait_result_s = 0.0
        self.arena_bytes = 0
        self.events: collections.Counter = collections.Counter()
        self.first: float | None = None  # when its first result came (its clock starts)
        self.k_items, self.k_samples = node + ".items", node + ".samples"
        self.k_busy, self.k_depth = node + ".busy", node + ".depth"
        self.bucket = _Bucket((self.k_items, self.k_samples, self.k_busy), (self.k_depth,))

    def counters(self) -> dict[str, float]:
        row: dict[str, float] = {"units": self.units, "items_in": self.items_in,
                                 "inflight_peak": self.inflight_peak,
                                 "items_out": self.items_out, "inflight": self.inflight}
        if self.latency:
            p50, p90, p99 = _percentiles(self.latency, [50, 90, 99])
            row.update(latency_p50_ms=p50 * 1e3, latency_p90_ms=p90 * 1e3,
                       latency_p99_ms=p99 * 1e3)
        return row

    def shares(self, end: float) -> dict[str, float]:
        """busy, idle and blocked fractions from the first result to ``end``."""
        elapsed = 0.0 if self.first is None else max(0.0, end - self.first)
        capacity = max(elapsed, 1e-9) * max(1, self.workers)
        busy = min(1.0, self.busy_s / capacity)
        wblocked = min(1.0 - busy, self.worker_blocked_s / capacity)
        rest = 1.0 - busy - wblocked
        inside = self.wait_input_s + self.wait_result_s
        if self.runner == "inline":  # its ops run in the engine's thread, not downstream
            inside += self.busy_s
        downstream = max(0.0, elapsed - inside)
        engine = self.wait_input_s + downstream
        idle = rest * (self.wait_input_s / engine if engine > 0 else 1.0)
        return {"busy": busy, "idle": idle, "blocked": max(0.0, 1.0 - busy - idle)}


class StageProbe:
    """The run statistics' observer of one stage's meter
    (:class:`~zephon.runners.contract.StageMeter`): the meter calls :meth:`ran` with
    each unit's op time as the executor records it (in the engine's thread, as results
    are taken) and :meth:`event` with each worker start, stop and restart."""

    __slots__ = ("node", "stage", "stats")

    def __init__(self, stats: "RunStats", node: str) -> None:
        self.stats, self.node = stats, node
        self.stage = stats.stages[node]

    def ran(self, busy_s: float, blocked_s: float = 0.0, nbytes: int = 0) -> None:
        st = self.stage
        st.busy_s += busy_s
        st.worker_blocked_s += blocked_s
        st.arena_bytes += nbytes
        bucket, now = st.bucket, perf_counter()
        if now >= bucket.end:
            self.stats.roll(bucket, now)
        bucket.sums[st.k_busy] += busy_s

    def event(self, kind: str, worker: int) -> None:
        self.stats.worker_event(self.node, kind, worker)


class _TimedInput:
    """An upstream iterator whose ``next()`` time counts as the stage waiting for input
    (written by the engine's thread alone: no lock)."""

    __slots__ = ("it", "stage")

    def __init__(self, it: Iterator, stage: _Stage) -> None:
        self.it, self.stage = it, stage

    def __iter__(self) -> "_TimedInput":
        return self

    def __next__(self):
        t = perf_counter()
        try:
            return next(self.it)
        finally:
            self.stage.wait_input_s += perf_counter() - t


class _Consumer:
    """The consumer's side (written by the thread calling ``next()`` alone)."""

    __slots__ = ("batches", "bucket", "compute_s", "last", "startup_s", "wait_s",
                 "waited_steps", "waits")

    def __init__(self) -> None:
        self.batches = self.waited_steps = 0
        self.wait_s = self.compute_s = 0.0
        self.last: float | None = None
        self.startup_s: float | None = None  # run start to the first batch
        self.waits: collections.deque[float] = collections.deque(maxlen=4096)
        self.bucket = _Bucket(("batches", "steps", "wait_s"))

    def row(self) -> dict[str, float]:
        steps = self.batches - 1  # the first batch waits for the start-up, not a step
        row = {"batches": self.batches, "wait_s": self.wait_s, "compute_s": self.compute_s,
               "startup_s": self.startup_s or 0.0, "input_bound_steps": self.waited_steps,
               "input_bound_fraction": self.waited_steps / steps if steps > 0 else 0.0}
        if self.waits:
            p50, p99 = _percentiles(self.waits, [50, 99])
            row.update(wait_mean_ms=self.wait_s / steps * 1e3,
                       wait_p50_ms=p50 * 1e3, wait_p99_ms=p99 * 1e3)
        return row


class RunStats:
    def __init__(self, mode: str, sink=None) -> None:
        self.mode, self.sink = mode, sink
        self._nodes_mode = mode == "nodes"
        #: node -> its counters: a parallel stage (from attach) or a serial op, the tail
        self.nodes: dict[str, _Stage | _Node] = {}
        self.lock = Lock()
        self._last_flush = time.monotonic()
        self._socket: socket.socket | None = None
        self.t0 = perf_counter()
        self.t_end: float | None = None
        self.series = _Series(self.t0)
        self.stages: dict[str, _Stage] = {}
        self.consumer = _Consumer()
        self._tail: dict[str, float] | None = None  # the tail's counters (nodes mode)
        self.events: list[dict] = []
        for runs in _recorders:
            runs.append(self)

    @property
    def nodes_enabled(self) -> bool:
        return self._nodes_mode

    # -- recording (engine side) -----------------------------------------------------------
    def attach(self, node: str, executor, stage, upstream: Iterator) -> Iterator:
        """Follow ``executor``'s meter (stage ``node``) from now on, once: its
        :class:`StageProbe` becomes the meter's observer; returns ``upstream`` timed as the
        stage's input wait."""
        info = self.stages.get(node)
        if info is None:  # the engine's thread alone adds stages
            label = " -> ".join(getattr(op, "name", type(op).__name__)
                                for op in getattr(stage, "ops", ()))
            runner = executor.runner
            workers = 1 if runner == "inline" else max(1, stage.workers)
            info = _Stage(node, label or node, runner, workers)
            with self.lock:
                self.stages[node] = self.nodes[node] = info
        meter = executor.meter
        if meter.observer is None:
            meter.observer = StageProbe(self, node)
            for k in range(info.workers):
                self.worker_event(node, "start", k)
        return _TimedInput(upstream, info)

    def roll(self, bucket: _Bucket, now: float) -> None:
        """Move what ``bucket`` holds into the series and open it at the bucket of ``now``
        (its writer calls this once per bucket, the only time it takes the lock)."""
        with self.lock:
            if bucket.end:
                self.series.take(bucket)
                bucket.clear()
            bucket.start, bucket.end = self.series.bounds(now)

    def submitted(self, node: str, items: int) -> None:
        st = self.stages[node]
        st.units += 1
        st.items_in += items
        st.inflight = inflight = st.inflight + 1
        if inflight > st.inflight_peak:
            st.inflight_peak = inflight
        bucket, now = st.bucket, perf_counter()
        if now >= bucket.end:
            self.roll(bucket, now)
        if inflight > bucket.peaks[st.k_depth]:
            bucket.peaks[st.k_depth] = inflight
        if self.sink is not None:
            self._maybe_flush()

    def completed(self, node: str, items: int, seconds: float, waited: float = 0.0,
                  samples: int = 0) -> None:
        """A part of ``samples`` input samples came back with ``items`` items after
        ``seconds``; the engine waited ``waited`` of them for it."""
        now = perf_counter()
        st = self.stages[node]
        st.items_out += items
        st.inflight -= 1
        st.latency.append(seconds)
        if st.first is None:  # start-up ends: its clock starts
            st.first, st.wait_input_s, st.wait_result_s = now, 0.0, 0.0
        else:
            st.wait_result_s += waited
        bucket = st.bucket
        if now >= bucket.end:
            self.roll(bucket, now)
        sums = bucket.sums
        sums[st.k_items] += items
        sums[st.k_samples] += samples

    def worker_ran(self, node: str, busy_s: float, blocked_s: float, nbytes: int) -> None:
        StageProbe(self, node).ran(busy_s, blocked_s, nbytes)

    def worker_event(self, node: str, kind: str, worker: int) -> None:
        with self.lock:
            self.stages[node].events[kind] += 1
            if len(self.events) < MAX_EVENTS:
                self.events.append({"t": perf_counter() - self.t0, "node": node,
                                    "kind": kind, "worker": worker})

    def _counters(self, node: str) -> dict[str, float]:
        n = self.nodes.get(node)
        if not isinstance(n, _Node):  # (stage names never name a serial op or the tail)
            n = self.nodes[node] = _Node()
        return n.counters

    def serial(self, node: str, items_in: int, items_out: int, seconds: float) -> None:
        counters = self._counters(node)
        counters["items_in"] += items_in
        counters["items_out"] += items_out
        counters["seconds"] += seconds

    def add(self, node: str, **counts: int) -> None:
        """Add ``counts`` to ``node``'s counters (a packer's rows, tokens and padding)."""
        counters = self._counters(node)
        for name, value in counts.items():
            counters[name] += value

    def delivered(self, called: float | None = None) -> None:
        """One batch went to the consumer; ``called``: when its ``next()`` was called."""
        now = perf_counter()
        if self._nodes_mode:
            if self._tail is None:
                self._tail = self._counters("tail")
            self._tail["delivered"] += 1
        if called is None:
            return
        c, wait = self.consumer, now - called
        bucket = c.bucket
        if now >= bucket.end:
            self.roll(bucket, now)
        sums = bucket.sums
        c.batches += 1
        sums["batches"] += 1
        if c.last is None:
            c.startup_s = now - self.t0
        else:  # a step: its compute since the previous batch, then its wait
            compute = called - c.last
            if compute < 0.0:
                compute = 0.0
            c.wait_s += wait
            c.compute_s += compute
            c.waited_steps += wait >= INPUT_BOUND_SHARE * (wait + compute)
            c.waits.append(wait)
            sums["steps"] += 1
            sums["wait_s"] += wait
        c.last = now

    def ended(self) -> None:
        """The run ended: its clock stops."""
        with self.lock:
            if self.t_end is None:
                self.t_end = perf_counter()

    # -- reading ---------------------------------------------------------------------------
    def _elapsed(self) -> float:
        return (self.t_end or perf_counter()) - self.t0

    def snapshot(self, report: bool = False) -> dict:
        """``node -> row`` (see the module docstring); ``report``: the schema-1 report.

        Taken from any thread while the run goes: the counters are read as they are (each
        exact, rows a moment apart), the series under the lock with each writer's open
        bucket added to a copy."""
        out = {}
        elapsed = self._elapsed()
        with self.lock:
            for name, n in list(self.nodes.items()):  # one C call: writers may add nodes
                if isinstance(n, _Stage):
                    row = {**n.counters(), **self._stage_row(n, self.t0, elapsed)}
                else:
                    row = n.row()
                if name == "tail":
                    row.update(self.consumer.row())
                out[name] = row
            if not report:
                return out
            stages = dict(self.stages)
            return {"schema": 1, "mode": self.mode, "elapsed_s": elapsed, "nodes": out,
                    "stages": {name: {"label": st.label, "runner": st.runner,
                                      **{k.removesuffix("_fraction"): v for k, v in
                                         self._stage_row(st, self.t0, elapsed).items()},
                                      "worker_blocked_s": st.worker_blocked_s,
                                      "wait_input_s": st.wait_input_s,
                                      "wait_result_s": st.wait_result_s}
                               for name, st in stages.items()},
                    "consumer": self.consumer.row(),
                    "series": self._series_now().export(
                        self.t0 + elapsed, {name: st.workers for name, st in stages.items()}),
                    "events": list(self.events)}

    def _series_now(self) -> _Series:
        """The series with every writer's open bucket in it (a copy; under the lock)."""
        series = self.series.copy()
        for bucket in [self.consumer.bucket, *(st.bucket for st in self.stages.values())]:
            if bucket.end:
                series.take(bucket)
        return series

    @staticmethod
    def _stage_row(stage: _Stage, t0: float, elapsed: float) -> dict[str, float]:
        shares = stage.shares(t0 + elapsed)
        startup = elapsed if stage.first is None else stage.first - t0
        return {"workers": stage.workers, "startup_s": startup, "busy_fraction": shares["busy"],
                "idle_fraction": shares["idle"], "blocked_fraction": shares["blocked"],
                "busy_s": stage.busy_s, "arena_bytes": stage.arena_bytes,
                "worker_starts": stage.events["start"], "worker_stops": stage.events["stop"],
                "worker_restarts": stage.events["restart"]}

    # -- emitting --------------------------------------------------------------------------
    def _maybe_flush(self) -> None:
        if self.sink is not None and \
                time.monotonic() - self._last_flush >= self.sink.flush_interval_s:
            self.flush()

    def gauges(self) -> list[tuple[str, float]]:
        ns = self.sink.namespace
        return [(f"{ns}.{node}.{metric}", float(value))
                for node, row in sorted(self.snapshot().items())
                for metric, value in sorted(row.items())]

    def flush(self) -> None:
        if self.sink is None:
            return
        self._last_flush = time.monotonic()
        gauges = self.gauges()
        if self.sink.mode in ("log", "both"):
            if self.sink.json_logs:
                for name, value in gauges:
                    log.info(json.dumps({"metric": name, "value": value,
                                         "tags": dict(self.sink.default_tags)}))
            else:
                log.info("metrics: %s", " ".join(f"{k}={v:g}" for k, v in gauges))
        if self.sink.mode in ("statsd", "both"):
            tags = ",".join(f"{k}:{v}" for k, v in self.sink.default_tags.items())
            lines = [f"{k}:{v:g}|g" + (f"|#{tags}" if tags else "") for k, v in gauges]
            if self._socket is None:
                self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock = self._socket
            for i in range(0, len(lines), self.sink.max_batch_size):
                packet = "\n".join(lines[i:i + self.sink.max_batch_size]).encode()
                try:
                    sock.sendto(packet, (self.sink.statsd_host, self.sink.statsd_port))
                except OSError as exc:  # metrics must never break the pipeline
                    log.warning("statsd send to %s:%s failed: %s", self.sink.statsd_host,
                                self.sink.statsd_port, exc)
                    break

    def close(self) -> None:
        self.ended()
        self.flush()
        if self._socket is not None:
            self._socket.close()
            self._socket = None
