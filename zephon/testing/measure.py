"""One throughput measurement of a pipeline, optionally against a baseline loop.

What it owns: the run it starts (the iterator of the pipeline, any next-epoch
iterators, the baseline's iterators) and the memory sampler; :func:`measure` closes
all of them before it returns or raises, whatever happened. It imports nothing of
zephon's engine: the pipeline is driven through the iteration protocol alone
(``iter()``, ``next()``, ``close()``), so a ``zephon.torch.loader`` or any iterable
is measured the same way.

How: ``iter(subject)`` is called (``startup_s``: until it returns) and the first
batch pulled (``first_batch_s``: from the ``iter()`` call until that batch); then
``warmup`` batches are pulled and discarded; then ``rounds`` rounds of ``per_round``
batches each are timed, through ``timer(target, setup, rounds)`` (the benchmark
fixture's ``pedantic``: it times each round as its own statistics want). The steady
rate is ``per_round / median(round time)``. When the stream ends, the next
``iter(subject)`` continues it (the next epoch; workers persist) and the restart
counts in the round it falls in (``restarts`` says how many there were).

With a baseline: the baseline is warmed up the same way (``warmup`` items), then
each side is probed once for work done ahead: after a pause (40 of its steady pulls,
20-500 ms), are its next 4 pulls nearly free? A pipeline on process workers or
threads, or a DataLoader, keeps making batches while nobody pulls; an inline pipeline
or a plain loop does not.

- Neither works ahead: the rounds alternate one by one (baseline, pipeline, baseline,
  ...; the baseline round is the fixture's untimed ``setup``, timed here), so the two
  rounds of a pair see the same load, and no item is spent on anything else.
- Either does: the batches it made while the other side ran would come out for free
  at the start of its next round. The rounds then come in blocks of ``rounds // 5``
  of each side, and before its block a side that works ahead is drained (untimed)
  until its last ``max(8, per_round)`` pulls took at least 60 % of their warm-up time
  again (or ``drain_cap`` pulls).

The ratio is the median over pairs (the k-th round of each side) of baseline time /
pipeline time. It is stable from run to run where both sides use the same CPUs (an
inline pipeline against a plain loop, N process workers against a DataLoader with N
workers): a load that slows one slows the other. On a machine shared with other jobs,
a side with more processes than the other loses more to a load than it does.

Invariants: nothing of the run outlives :func:`measure`; no time of the first batch
or of the warm-up is in the rounds; the rounds of the pipeline are back to back when
there is no baseline.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

from zephon.testing.memory import TreeMemory

#: a drain ends when the last pulls took this share of their warm-up time
DRAIN_PACE = 0.6
#: with a baseline, the fewest warm-up pulls (their second half gives each side's pace)
MIN_PACE_PULLS = 8
#: with a baseline, the rounds come in about this many blocks of each side
BLOCKS = 5
#: the probe for work done ahead: the pause's bounds in seconds, the pulls timed after
#: it, and the share of their steady time under which they were made ahead
PROBE_MIN_S, PROBE_MAX_S, PROBE_PULLS, PROBE_PACE = 0.02, 0.5, 4, 0.25


def rows_of(batch: Any) -> int | None:
    """The leading dimension of a batch: its samples (rows), where it can be read.

    An array or tensor gives its ``shape[0]``; a mapping (a zephon ``Batch``) its first
    column's (an array's ``shape[0]``, a list's length); a tuple or list (a
    ``BatchList``, a DataLoader's ``(x, y)``) its first position's.

    Args:
        batch: one batch.

    Returns:
        The number of rows, or None.

    Examples:
        >>> rows_of({"x": [[1, 2], [3, 4], [5, 6]]})
        3
        >>> rows_of(7) is None
        True
    """
    shape = getattr(batch, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    if hasattr(batch, "keys") and hasattr(batch, "values"):
        column = next(iter(batch.values()), None)
        shape = getattr(column, "shape", None)
        if shape is not None and len(shape) > 0:
            return int(shape[0])
        return len(column) if isinstance(column, (list, tuple)) else None
    if isinstance(batch, (list, tuple)) and batch:
        return rows_of(batch[0])
    return None


class Stream:
    """Pulls items from an iterable, starting it again when it ends, and knows its pace.

    Args:
        start: makes the next iterator (``lambda: iter(pipe)``).
        what: the stream's name in errors ("the pipeline", "the baseline").

    Examples:
        >>> s = Stream(lambda: iter([1, 2]), "a list")
        >>> [s.pull() for _ in range(3)], s.restarts
        ([1, 2, 1], 1)
        >>> s.close()
    """

    def __init__(self, start: Callable[[], Iterator], what: str) -> None:
        self._start, self.what = start, what
        self.iterator: Iterator | None = None
        self.restarts = 0
        self.steady_s = 0.0  # mean seconds a pull in the warm-up's second half
        self.ahead = False   # makes items while nobody pulls (prefetches in the background)
        self.drained: list[int] = []  # pulls of each drain

    def open(self) -> None:
        """Start the first iterator."""
        self.iterator = self._start()

    def pull(self) -> Any:
        """The next item (the first pull opens the stream)."""
        if self.iterator is None:
            self.open()
        try:
            return next(self.iterator)  # type: ignore[arg-type]
        except StopIteration:
            pass
        self.close()
        self.iterator, self.restarts = self._start(), self.restarts + 1
        try:
            return next(self.iterator)
        except StopIteration:
            raise RuntimeError(f"{self.what} yielded no item after a restart: it has "
                               f"fewer items than a measurement needs") from None

    def pulls(self, n: int) -> list[float]:
        """Pull ``n`` items; the seconds each pull took."""
        out = []
        for _ in range(n):
            t = time.perf_counter()
            self.pull()
            out.append(time.perf_counter() - t)
        return out

    def warm_up(self, n: int) -> None:
        """Pull ``n`` items; their second half gives the steady pace."""
        late = self.pulls(n)[n // 2:]
        if late:
            self.steady_s = sum(late) / len(late)

    def probe(self) -> None:
        """Whether the stream works ahead while nobody pulls: after a pause of some
        40 pulls' worth of its steady pace, are the next ``PROBE_PULLS`` pulls nearly
        free (under ``PROBE_PACE`` of their steady time)?"""
        if self.steady_s <= 0:
            return
        time.sleep(min(PROBE_MAX_S, max(PROBE_MIN_S, 40 * self.steady_s)))
        self.ahead = sum(self.pulls(PROBE_PULLS)) < PROBE_PACE * PROBE_PULLS * self.steady_s

    def drain(self, window: int, cap: int) -> None:
        """Pull (untimed) until the stream is back to its steady pace: the last
        ``window`` pulls took at least ``DRAIN_PACE`` of their warm-up time (the items it
        made ahead come out much faster), or ``cap`` pulls."""
        need = DRAIN_PACE * window * self.steady_s
        recent: list[float] = []
        for n in range(cap):
            t = time.perf_counter()
            self.pull()
            recent.append(time.perf_counter() - t)
            if len(recent) > window:
                del recent[0]
            if len(recent) == window and sum(recent) >= need:
                self.drained.append(n + 1)
                return
        self.drained.append(cap)

    def close(self) -> None:
        """Close the current iterator (where it can be closed)."""
        it, self.iterator = self.iterator, None
        close = getattr(it, "close", None)
        if callable(close):
            close()


def _starter(subject: Any) -> Callable[[], Iterator]:
    """``iter(subject)``; a callable that is not itself iterable is called first (a
    generator function, a factory of loaders)."""
    if callable(subject) and not hasattr(subject, "__iter__"):
        return lambda: iter(subject())
    return lambda: iter(subject)


@dataclass
class Plan:
    """The sizes of one measurement.

    Attributes:
        rounds: timed rounds.
        per_round: batches per round.
        warmup: batches pulled and discarded after the first.
        block: rounds in a row of each side, with a baseline.
        drain_cap: most pulls of one drain (with a baseline).
    """

    rounds: int
    per_round: int
    warmup: int
    block: int
    drain_cap: int

    @classmethod
    def of(cls, batches: int, rounds: int, warmup: int | None) -> "Plan":
        """The plan for ``batches`` timed batches in ``rounds`` rounds.

        Args:
            batches: batches timed in all (an int >= rounds).
            rounds: rounds (an int >= 1).
            warmup: batches discarded first (None: ``max(2 * per_round, batches // 4)``).

        Returns:
            A Plan.

        Examples:
            >>> Plan.of(200, 20, None)
            Plan(rounds=20, per_round=10, warmup=50, block=4, drain_cap=128)
        """
        for name, value, low in (("rounds", rounds, 1), ("batches", batches, rounds)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"zephon_benchmark: {name} must be an int >= {low}, "
                                 f"got {value!r}")
        per_round = batches // rounds
        if warmup is None:
            warmup = max(2 * per_round, batches // 4)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"zephon_benchmark: warmup must be an int >= 0, got {warmup!r}")
        return cls(rounds, per_round, warmup, max(1, rounds // BLOCKS),
                   max(128, 8 * per_round))


@dataclass
class ThroughputResult:
    """What one ``zephon_benchmark(...)`` call measured.

    Attributes:
        name: the test's node id.
        batches_per_s: the steady rate, ``batches_per_round / median(round_times_s)``.
        samples_per_s: ``batches_per_s * rows_per_batch`` (None when the rows are not
            known).
        rows_per_batch: the leading dimension of the first batch, or ``batch_size=``.
        startup_s: seconds ``iter(pipe)`` took (plan, op checks, worker start).
        first_batch_s: seconds from the ``iter(pipe)`` call to the first batch (start-up
            included); never part of the steady rate.
        warmup_batches: batches pulled and discarded after the first.
        batches_per_round: batches per timed round.
        rounds: timed rounds.
        round_times_s: each round's seconds, in order.
        spread: (p75 - p25) / median of the round times: this run's noise.
        restarts: times the stream ended and the next epoch was started.
        peak_memory_bytes: the largest summed RSS of this process and the processes
            started since the measurement began (the workers) seen while the pipeline
            ran (sampled every 50 ms; baseline rounds and the baseline's processes
            excluded), or None where it cannot be read.
        start_memory_bytes: the same sum just before ``iter(pipe)``.
        peak_processes: processes in the sample of the peak.
        ratio: median over pairs of rounds of baseline time / pipeline time (> 1: the
            pipeline is faster), or None without a baseline.
        baseline_batches_per_s: the baseline's rate over its rounds, or None.
        baseline_round_times_s: the baseline's rounds, in order.
        interleave: with a baseline, the rounds of each side in a row: 1 (they
            alternate) unless a side works ahead while the other runs (process workers,
            a DataLoader's), then blocks of ``rounds // 5``, each side drained first.
        min_ratio: the ratio required, or None.
        disabled: ``--benchmark-disable``: one round only, no gate checked.
    """

    name: str
    batches_per_s: float
    samples_per_s: float | None
    rows_per_batch: int | None
    startup_s: float
    first_batch_s: float
    warmup_batches: int
    batches_per_round: int
    rounds: int
    round_times_s: tuple[float, ...]
    spread: float
    restarts: int
    peak_memory_bytes: int | None
    start_memory_bytes: int | None
    peak_processes: int
    ratio: float | None = None
    baseline_batches_per_s: float | None = None
    baseline_round_times_s: tuple[float, ...] = ()
    interleave: int | None = None
    min_ratio: float | None = None
    disabled: bool = False

    @property
    def memory_growth_bytes(self) -> int | None:
        """The peak over the start: what the pipeline's run added (its workers, its
        buffers), apart from what the test session held before (torch imported by an
        earlier test, say); None where memory cannot be read."""
        if self.peak_memory_bytes is None or self.start_memory_bytes is None:
            return None
        return max(0, self.peak_memory_bytes - self.start_memory_bytes)

    @property
    def round_median_s(self) -> float:
        """The median round time in seconds."""
        return statistics.median(self.round_times_s)

    def extra_info(self) -> dict[str, Any]:
        """The fields saved with the benchmark (``benchmark.extra_info``): JSON values.

        Returns:
            A flat dict.
        """
        return {"startup_s": self.startup_s, "first_batch_s": self.first_batch_s,
                "batches_per_s": self.batches_per_s, "samples_per_s": self.samples_per_s,
                "rows_per_batch": self.rows_per_batch, "warmup_batches": self.warmup_batches,
                "batches_per_round": self.batches_per_round, "rounds": self.rounds,
                "spread": self.spread, "restarts": self.restarts,
                "peak_memory_bytes": self.peak_memory_bytes,
                "start_memory_bytes": self.start_memory_bytes,
                "memory_growth_bytes": self.memory_growth_bytes,
                "round_times_s": list(self.round_times_s),
                "peak_processes": self.peak_processes, "ratio": self.ratio,
                "baseline_batches_per_s": self.baseline_batches_per_s,
                "baseline_round_times_s": list(self.baseline_round_times_s),
                "interleave": self.interleave,
                "min_ratio": self.min_ratio}

    def __str__(self) -> str:
        rate = f"{self.batches_per_s:,.1f} batches/s"
        if self.samples_per_s is not None:
            rate += f" ({self.samples_per_s:,.0f} samples/s)"
        lines = [f"{self.name}: {rate}, median of {self.rounds} rounds of "
                 f"{self.batches_per_round} batches (spread {self.spread:.0%}) after "
                 f"{self.warmup_batches} warm-up batches",
                 f"  first batch {self.first_batch_s:.3f} s (iter() {self.startup_s:.3f} s)"]
        if self.restarts:
            lines[-1] += f"; {self.restarts} epoch restart(s) during the measurement"
        if self.peak_memory_bytes is not None:
            lines.append(f"  peak memory {self.peak_memory_bytes / 2**20:,.1f} MiB RSS over "
                         f"{self.peak_processes} process(es) (at start "
                         f"{(self.start_memory_bytes or 0) / 2**20:,.1f} MiB)")
        if self.ratio is not None:
            need = f", >= {self.min_ratio:.2f} required" if self.min_ratio is not None else ""
            how = ("alternating rounds" if self.interleave == 1 else
                   f"blocks of {self.interleave} rounds")
            lines.append(f"  ratio {self.ratio:.2f} (baseline time / zephon time{need}; "
                         f"baseline {self.baseline_batches_per_s:,.1f} batches/s; {how})")
        if self.disabled:
            lines.append("  (--benchmark-disable: one round, nothing checked)")
        return "\n".join(lines)


def spread_of(times: Iterable[float]) -> float:
    """(p75 - p25) / median of ``times``: 0 for fewer than 4.

    Args:
        times: round times.

    Returns:
        The relative interquartile range.

    Examples:
        >>> spread_of([1.0, 1.0, 1.0, 1.0])
        0.0
    """
    values = sorted(times)
    if len(values) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / statistics.median(values)


@dataclass
class _Run:
    """The state of one measurement while it runs."""

    plan: Plan
    owner: Any  # what was measured (its close() stops what it keeps)
    subject: Stream
    baseline: Stream | None
    memory: TreeMemory
    round_times: list[float] = field(default_factory=list)
    baseline_times: list[float] = field(default_factory=list)
    block: int = 1  # rounds of each side in a row
    rounds: int = 0  # pipeline rounds to run
    index: int = 0  # pipeline rounds started

    @property
    def window(self) -> int:
        return max(8, self.plan.per_round)

    def prepare_baseline(self, disabled: bool) -> None:
        """Warm the baseline up, probe both sides, choose the interleaving: rounds
        alternate one by one unless a side works ahead while the other runs; then they
        come in blocks, each side drained before its block."""
        assert self.baseline is not None
        self.memory.phase("baseline")
        self.baseline.pull()
        if not disabled:
            self.baseline.warm_up(self.plan.warmup)
            self.baseline.probe()
        self.memory.phase("pipeline")
        if not disabled:
            self.subject.probe()
        if self.subject.ahead or self.baseline.ahead:
            self.block = self.plan.block

    def before_round(self) -> None:
        """Before each pipeline round (untimed by the fixture): at the start of a block,
        the baseline's rounds, each side drained first where it works ahead."""
        assert self.baseline is not None
        if self.index % self.block == 0:
            self.memory.phase("baseline")
            if self.baseline.ahead:
                self.baseline.drain(self.window, self.plan.drain_cap)
            for _ in range(min(self.block, self.rounds - self.index)):
                self.baseline_times.append(sum(self.baseline.pulls(self.plan.per_round)))
            self.memory.phase("pipeline")
            if self.subject.ahead:
                self.subject.drain(self.window, self.plan.drain_cap)
        self.index += 1

    def subject_round(self) -> None:
        t = time.perf_counter()
        pull = self.subject.pull
        for _ in range(self.plan.per_round):
            pull()
        self.round_times.append(time.perf_counter() - t)


Timer = Callable[[Callable[[], None], "Callable[[], None] | None", int], None]


def measure(subject: Any, *, plan: Plan, timer: Timer, baseline: Any = None,
            batch_size: int | None = None, name: str = "", disabled: bool = False,
            memory_interval: float = 0.05) -> ThroughputResult:
    """Measure ``subject``'s start-up, first batch, steady rate and peak memory.

    Args:
        subject: a zephon Pipeline (or any iterable; a callable returning one).
        plan: the sizes (:meth:`Plan.of`).
        timer: ``timer(target, setup, rounds)`` runs ``setup()`` then ``target()``
            ``rounds`` times, timing each ``target()`` (pytest-benchmark's ``pedantic``).
        baseline: an iterable, or a callable returning one, measured in interleaved
            rounds; None for none.
        batch_size: rows per batch when the batches do not say (None: read them).
        name: the result's name.
        disabled: the benchmark is disabled: ``timer`` runs one round, no warm-up.
        memory_interval: seconds between memory samples.

    Returns:
        A :class:`ThroughputResult`.

    Examples:
        >>> def timer(target, setup, rounds):
        ...     for _ in range(rounds):
        ...         if setup: setup()
        ...         target()
        >>> r = measure(range(100), plan=Plan.of(40, 4, 5), timer=timer)
        >>> r.rounds, r.batches_per_round, r.ratio
        (4, 10, None)
    """
    if baseline is not None and plan.warmup < MIN_PACE_PULLS:  # the pace needs a few
        plan = replace(plan, warmup=MIN_PACE_PULLS)
    run = _Run(plan, subject, Stream(_starter(subject), "the pipeline"),
               Stream(_starter(baseline), "the baseline") if baseline is not None else None,
               TreeMemory(memory_interval))
    run.memory.start()
    try:
        t0 = time.perf_counter()
        run.subject.open()
        startup = time.perf_counter() - t0
        first = run.subject.pull()
        first_batch = time.perf_counter() - t0
        if not disabled:
            run.subject.warm_up(plan.warmup)
        if run.baseline is not None:
            run.prepare_baseline(disabled)
        run.rounds = 1 if disabled else plan.rounds
        timer(run.subject_round, run.before_round if run.baseline else None, run.rounds)
    finally:
        _close_all(run)
    return _result(run, name, startup, first_batch,
                   batch_size if batch_size is not None else rows_of(first), disabled)


def _close_all(run: _Run) -> None:
    """Close the pipeline's run (and its kept workers), the baseline, the sampler; the
    first error is raised once all of them are closed."""
    errors: list[BaseException] = []
    steps: list[Callable[[], None]] = [run.subject.close]
    close = getattr(run.owner, "close", None)
    if callable(close):  # Pipeline.close(): the workers it kept between passes too
        steps.append(close)
    if run.baseline is not None:
        steps.append(run.baseline.close)
    steps.append(run.memory.stop)
    for step in steps:
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - every step runs; the first is raised
            errors.append(exc)
    if errors:
        raise errors[0]


def _result(run: _Run, name: str, startup: float, first_batch: float,
            rows: int | None, disabled: bool) -> ThroughputResult:
    plan, times = run.plan, tuple(run.round_times)
    rate = plan.per_round / statistics.median(times)
    ratio = baseline_rate = None
    if run.baseline_times:
        ratio = statistics.median(b / z for b, z in zip(run.baseline_times, times, strict=True))
        baseline_rate = plan.per_round / statistics.median(run.baseline_times)
    return ThroughputResult(
        name=name, batches_per_s=rate, samples_per_s=rate * rows if rows else None,
        rows_per_batch=rows, startup_s=startup, first_batch_s=first_batch,
        warmup_batches=0 if disabled else plan.warmup, batches_per_round=plan.per_round,
        rounds=len(times), round_times_s=times, spread=spread_of(times),
        restarts=run.subject.restarts, peak_memory_bytes=run.memory.peak,
        start_memory_bytes=run.memory.start_bytes, peak_processes=run.memory.peak_processes,
        ratio=ratio, baseline_batches_per_s=baseline_rate,
        baseline_round_times_s=tuple(run.baseline_times),
        interleave=run.block if run.baseline is not None else None, disabled=disabled)
