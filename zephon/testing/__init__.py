"""zephon's pytest plugin: throughput gates for your own pipelines, on pytest-benchmark.

Installing zephon registers this module as a pytest plugin (the ``pytest11`` entry
point ``zephon``), so every pytest session has the ``zephon_benchmark`` fixture and the
``--zephon-compare-fail`` option; ``-p no:zephon`` turns it off. Importing it costs
pytest alone: the measurement (:mod:`zephon.testing.measure`) is imported by the
fixture when a test calls it, and it drives a pipeline through ``iter()``/``next()``/
``close()`` only, importing nothing of zephon's engine.

What it owns: the ``zephon_benchmark`` fixture, the option, the results of the session
(listed in a "zephon throughput" section of the terminal summary), and the ratios of the
saved runs ``--benchmark-compare`` loads. pytest-benchmark owns everything else: the
``benchmark`` fixture that times the rounds, its statistics, saving (``--benchmark-save``,
``--benchmark-autosave``, ``--benchmark-json``), comparing (``--benchmark-compare``,
``--benchmark-compare-fail``), ``--benchmark-disable``, ``--benchmark-skip`` and
``--benchmark-only``, all of which work unchanged on a test that uses the fixture.

What it measures (one call, :func:`zephon.testing.measure.measure`)::

    result = zephon_benchmark(pipe, batches=200, rounds=20, warmup=None,
                              baseline=None, min_ratio=None, batch_size=None)

- ``startup_s``: how long ``iter(pipe)`` took; ``first_batch_s``: from that call to the
  first batch (worker start-up, the first sample's checks, the first batch's work);
- ``warmup`` batches pulled and thrown away (default ``max(2 * per_round, batches // 4)``);
- ``rounds`` rounds of ``batches // rounds`` batches each, each timed by
  ``benchmark.pedantic``: the benchmark's statistics (min, median, mean...) are the
  seconds per round, what ``--benchmark-compare-fail=median:20%`` compares; the steady
  rate is ``per_round / median`` (batches/s; samples/s where the batch's leading
  dimension, or ``batch_size=``, gives the rows);
- the peak memory: the summed RSS of the test process and the processes started since
  the measurement began (the workers), sampled every 50 ms while the pipeline runs
  (:mod:`zephon.testing.memory`);
- with ``baseline=`` (an iterable, or a callable returning one: a plain loop over the
  same data, a torch DataLoader): a baseline round before each pipeline round, so both
  see the same load; ``ratio`` is the median over the pairs of baseline time / pipeline
  time (> 1: zephon is faster), and ``min_ratio=`` fails the test below it.

Start-up, first batch, rate, peak memory and ratio go into ``benchmark.extra_info``
(saved with the run), and the fixture returns a
:class:`~zephon.testing.measure.ThroughputResult` with the same fields.

Why a ratio: on a shared CI machine the time per round moves by tens of percent from one
job to the next (another job on the host, a different CPU model), while two loops
measured in alternating rounds slow down together: their ratio stays put. So a saved run
can be compared on the ratio too: ``--benchmark-compare --zephon-compare-fail=ratio:20%``
fails a test whose ratio fell by more than 20 % against the saved run (its pipeline time
relative to the baseline grew by more than 20 %: ``saved / now - 1 > 0.20``), read from
the ``extra_info`` the saved file holds. ``rate``, ``first_batch`` and ``peak_memory``
can be gated the same way (``rate`` is compared as a time: higher is better). The ratio
is kept in ``extra_info`` rather than recorded as the benchmark's statistic so that the
statistics stay what pytest-benchmark users know: seconds.

Invariants:

- a measurement never leaves anything running: the pipeline's iterator is closed (its
  workers reaped, its shared memory unlinked), then the pipeline itself (the workers it
  keeps between passes), then the baseline's iterator, whether the measurement
  returned or raised;
- the first batch and the warm-up are never in the timed rounds;
- a gate (``min_ratio``, ``--zephon-compare-fail``) fails the test itself, with the
  numbers, after the benchmark's statistics were recorded (so the run is still saved);
  under ``--benchmark-disable`` one round is run and no gate is checked.

Without pytest-benchmark (not installed, or ``-p no:benchmark``) the plugin still loads;
a test that asks for ``zephon_benchmark`` then errors with "pip install
pytest-benchmark" (a throughput gate that skipped itself would pass CI without
measuring anything; ``pytest.importorskip("pytest_benchmark")`` in the test file makes
it a skip where that is what you want).

Lifecycle: ``pytest_addoption`` adds the option; ``pytest_configure`` checks it and
registers the fixture (one of two: with and without pytest-benchmark);
pytest-benchmark's ``handle_loading`` (in its own ``pytest_configure``) calls
``pytest_benchmark_compare_machine_info`` once per saved file it compares with, where
the saved ``extra_info`` is kept; each fixture call measures, records and checks;
``pytest_terminal_summary`` lists the session's results.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from zephon.testing.measure import ThroughputResult

__all__ = ["Gate", "ZephonBenchmark", "gate_failures", "parse_gate"]

_RESULTS = pytest.StashKey[list]()
_SAVED = pytest.StashKey[list]()
_INSTALL = ("zephon_benchmark needs pytest-benchmark, which this session does not have "
            "(not installed, or disabled with -p no:benchmark): pip install pytest-benchmark")

#: gate field -> (extra_info key, whether higher is better)
FIELDS = {"ratio": ("ratio", True), "rate": ("batches_per_s", True),
          "first_batch": ("first_batch_s", False), "startup": ("startup_s", False),
          "peak_memory": ("peak_memory_bytes", False),
          "memory_growth": ("memory_growth_bytes", False)}
_GATE = re.compile(r"^(?P<field>[a-z_]+):(?P<pct>[0-9]+(\.[0-9]+)?)%$")


@dataclass(frozen=True)
class Gate:
    """A ``--zephon-compare-fail`` check: ``field`` may regress by ``percent`` at most.

    Attributes:
        field: one of ``FIELDS`` (ratio, rate, first_batch, startup, peak_memory,
            memory_growth).
        percent: the largest regression allowed, in percent.

    Examples:
        >>> Gate("ratio", 20.0).regression(now=1.0, saved=1.5)
        50.0
    """

    field: str
    percent: float

    def regression(self, now: float, saved: float) -> float:
        """How much worse ``now`` is than ``saved``, in percent (< 0: better).

        A higher-is-better field is compared as a time: ``saved / now - 1``.

        Args:
            now: this run's value.
            saved: the saved run's value.

        Returns:
            The regression in percent.
        """
        higher_better = FIELDS[self.field][1]
        if higher_better:
            return (saved / now - 1.0) * 100.0 if now > 0 else float("inf")
        return (now / saved - 1.0) * 100.0 if saved > 0 else 0.0


def parse_gate(text: str) -> Gate:
    """Parse ``FIELD:PERCENT%`` (``ratio:20%``).

    Args:
        text: the option's value.

    Returns:
        A :class:`Gate`.

    Examples:
        >>> parse_gate("ratio:20%")
        Gate(field='ratio', percent=20.0)
    """
    m = _GATE.match(text.strip())
    if m is None or m.group("field") not in FIELDS:
        raise pytest.UsageError(
            f"--zephon-compare-fail: expected FIELD:PERCENT% with FIELD one of "
            f"{', '.join(FIELDS)} (ratio:20%), got {text!r}")
    return Gate(m.group("field"), float(m.group("pct")))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("zephon", "zephon throughput gates (zephon_benchmark)")
    group.addoption(
        "--zephon-compare-fail", action="append", default=[], metavar="FIELD:PCT%",
        help="with --benchmark-compare: fail a zephon_benchmark test whose FIELD regressed "
             "by more than PCT%% against the saved run; FIELD: ratio (baseline time / "
             "zephon time, stable on noisy machines), rate, first_batch, startup, "
             "peak_memory (the process tree's summed RSS), memory_growth (peak minus "
             "the start: what the run added). May be given several times.")


def _has_benchmark(config: pytest.Config) -> bool:
    """Whether pytest-benchmark's plugin is active in this session."""
    return any(getattr(plugin, "__name__", "") == "pytest_benchmark.plugin"
               for plugin in config.pluginmanager.get_plugins())


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RESULTS] = []
    config.stash.setdefault(_SAVED, [])
    gates = [parse_gate(text) for text in config.getoption("zephon_compare_fail", []) or []]
    if gates and not config.getoption("benchmark_compare", None):
        raise pytest.UsageError("--zephon-compare-fail needs --benchmark-compare (the saved "
                                "run to compare with)")
    fixture = _FixtureWithBenchmark() if _has_benchmark(config) else _FixtureWithout()
    config.pluginmanager.register(fixture, "zephon-benchmark-fixture")


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_compare_machine_info(config: pytest.Config, benchmarksession: Any,
                                          machine_info: dict,
                                          compared_benchmark: dict) -> None:
    """Keep the ``extra_info`` of each benchmark of a saved run being compared with."""
    saved = {b.get("fullname"): b.get("extra_info") or {}
             for b in compared_benchmark.get("benchmarks", [])}
    label = str(compared_benchmark.get("datetime", "a saved run"))
    config.stash.setdefault(_SAVED, []).append((label, saved))


class ZephonBenchmark:
    """The callable a test gets from the ``zephon_benchmark`` fixture.

    Call it once per test (it runs ``benchmark.pedantic``, which pytest-benchmark
    allows once). ``.benchmark`` is the test's pytest-benchmark fixture (set its
    ``group`` or ``extra_info`` there).

    Args:
        benchmark: the test's ``benchmark`` fixture.
        request: the test's ``request`` fixture.

    Examples:
        >>> def test_throughput(zephon_benchmark):  # doctest: +SKIP
        ...     result = zephon_benchmark(pipe, batches=200)
    """

    def __init__(self, benchmark: Any, request: pytest.FixtureRequest) -> None:
        self.benchmark = benchmark
        self._request = request
        self._used = False

    def __call__(self, pipe: Any, batches: int = 200, *, rounds: int = 20,
                 warmup: int | None = None, baseline: Any = None,
                 min_ratio: float | None = None,
                 batch_size: int | None = None) -> ThroughputResult:
        """Measure ``pipe`` (and ``baseline``), record, check the gates.

        Args:
            pipe: a zephon Pipeline (fresh: no run of it going); any iterable (a
                ``zephon.torch.loader``), or a callable returning one, is measured the
                same way. A stream that ends is started again (the next epoch).
            batches: batches timed in all, split into ``rounds`` rounds.
            rounds: timed rounds (the statistics' samples).
            warmup: batches discarded after the first (None: ``max(2 * batches //
                rounds, batches // 4)``; with a baseline at least 8, whose second half
                gives each side's steady pace).
            baseline: an iterable, or a callable returning one, of the same batches
                made another way (a plain loop, a torch DataLoader): its rounds of
                ``batches // rounds`` items alternate with the pipeline's.
            min_ratio: fail when baseline time / pipeline time is below it (needs
                ``baseline``).
            batch_size: rows per batch, where the batch's leading dimension does not
                say (for samples/s).

        Returns:
            A :class:`~zephon.testing.measure.ThroughputResult`.

        Raises:
            ValueError: a size out of range, or ``min_ratio`` without ``baseline``.
            RuntimeError: a second call in the same test.
        """
        from zephon.testing.measure import Plan, measure

        plan = Plan.of(batches, rounds, warmup)
        if min_ratio is not None and baseline is None:
            raise ValueError("zephon_benchmark: min_ratio needs a baseline")
        if self._used:
            raise RuntimeError("zephon_benchmark can be called once per test (it runs "
                               "pytest-benchmark's pedantic, which a test uses once)")
        self._used = True
        bench = self.benchmark

        def timer(target, setup, count):
            bench.pedantic(target, setup=setup, rounds=count, iterations=1)

        result = measure(pipe, plan=plan, timer=timer, baseline=baseline,
                         batch_size=batch_size, name=self._request.node.nodeid,
                         disabled=bool(getattr(bench, "disabled", False)))
        result.min_ratio = min_ratio
        bench.extra_info.update(result.extra_info())
        self._request.config.stash[_RESULTS].append(result)
        failures = [] if result.disabled else self._failures(result)
        if failures:
            pytest.fail("\n".join([*failures, str(result)]), pytrace=False)
        return result

    def _failures(self, result: ThroughputResult) -> list[str]:
        out = []
        if result.min_ratio is not None and result.ratio is not None and \
                result.ratio < result.min_ratio:
            out.append(f"zephon_benchmark: ratio {result.ratio:.2f} is below min_ratio "
                       f"{result.min_ratio:.2f} (baseline time / zephon time)")
        config = self._request.config
        gates = [parse_gate(text) for text in config.getoption("zephon_compare_fail", [])]
        if gates:
            fullname = getattr(self.benchmark, "fullname", self._request.node.nodeid)
            out += gate_failures(gates, result.extra_info(), fullname,
                                 config.stash.get(_SAVED, []))
        return out


def _shown(field: str, value: float) -> str:
    return f"{value / 2**20:,.1f} MiB" if field in ("peak_memory", "memory_growth") \
        else f"{value:.4g}"


def gate_failures(gates: list[Gate], info: dict, fullname: str,
                  saved_runs: list[tuple[str, dict]]) -> list[str]:
    """What ``--zephon-compare-fail`` finds wrong with one test's ``info`` against the
    saved runs: a regression past a gate, and every gate that cannot be checked (no
    saved run, no entry of this test in it, no value of the field): a gate asked for
    never passes without comparing.

    Args:
        gates: the parsed gates.
        info: this run's ``extra_info``.
        fullname: the test's name as pytest-benchmark saves it.
        saved_runs: ``(label, {fullname: extra_info})`` of each run compared with.

    Returns:
        One message per failure; empty when every gate held.

    Examples:
        >>> gate_failures([Gate("ratio", 20.0)], {"ratio": 0.5}, "t",
        ...               [("0001", {"t": {"ratio": 1.0}})])[0][:45]
        'zephon_benchmark: ratio regressed by 100.0% ('
    """
    if not saved_runs:
        return ["zephon_benchmark: --zephon-compare-fail has no saved run to compare with "
                "(--benchmark-compare names none that could be read)"]
    out = []
    for label, runs in saved_runs:
        saved = runs.get(fullname)
        if saved is None:
            known = ", ".join(sorted(runs)[:5]) or "none"
            out.append(f"zephon_benchmark: the run saved {label} has no entry for {fullname} "
                       f"(it has: {known}); run from the same directory with the same paths")
            continue
        for gate in gates:
            key = FIELDS[gate.field][0]
            now, then = info.get(key), saved.get(key)
            if now is None or then is None:
                which = "this run" if now is None else f"the run saved {label}"
                out.append(f"zephon_benchmark: {gate.field} cannot be compared: {which} "
                           f"has no {key}" + (" (give the test a baseline=)"
                                              if gate.field == "ratio" else ""))
                continue
            worse = gate.regression(float(now), float(then))
            if worse > gate.percent:
                out.append(f"zephon_benchmark: {gate.field} regressed by {worse:.1f}% "
                           f"(> {gate.percent:g}%) against the run saved {label}: "
                           f"{_shown(gate.field, then)} then, {_shown(gate.field, now)} now")
    return out


class _FixtureWithBenchmark:
    @pytest.fixture
    def zephon_benchmark(self, benchmark: Any,
                         request: pytest.FixtureRequest) -> ZephonBenchmark:
        """Measure a pipeline's throughput through pytest-benchmark (zephon.testing)."""
        return ZephonBenchmark(benchmark, request)


class _FixtureWithout:
    @pytest.fixture
    def zephon_benchmark(self) -> ZephonBenchmark:
        """Errors: pytest-benchmark is missing (zephon.testing)."""
        pytest.fail(_INSTALL, pytrace=False)


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark's, which raises on a regression
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    results = config.stash.get(_RESULTS, [])
    if not results:
        return
    terminalreporter.section("zephon throughput (zephon_benchmark)")
    for result in results:
        for line in str(result).splitlines():
            terminalreporter.write_line(line)
