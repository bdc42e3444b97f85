"""zephon.testing (the pytest plugin) as a user's CI runs it: inner pytest sessions.

Every scenario writes a small test project into a temporary directory and runs
``python -m pytest`` there in a subprocess, as a user's CI would: no ``-p`` (the plugin
comes from the ``pytest11`` entry point of the installed zephon), real pipelines, the
options of pytest-benchmark. The inner project's pipeline runs its map inline and its
baseline is a plain loop doing the same work per sample: both use the same one CPU, so
their ratio is what stays put on a loaded machine (on this 2-core machine the time per
round moves by tens of percent from run to run, the ratio by a few). Its map does
``GATE_SLOW`` times the work (an environment variable): 3 is the regression.

- the entry point names the plugin, and an inner session without ``-p`` has the fixture;
- importing the plugin imports neither zephon's engine nor numpy;
- a saved fast run, then the 3x slower pipeline: ``--benchmark-compare-fail``,
  ``--zephon-compare-fail=ratio:20%`` and ``min_ratio`` all fail it;
- noise: the same pipeline measured again never fails ``ratio:20%`` against the first
  saved run: 3 runs in the default suite, 10 (with rounds twice as many) under
  ``-m "slow and ci"``;
- nothing is left behind (no live child, no zephon /dev/shm segment), also when the
  measurement raises, with process workers and a baseline;
- ``--benchmark-disable`` runs it once and checks nothing, ``--benchmark-skip`` skips it,
  and without pytest-benchmark the fixture errors naming ``pip install pytest-benchmark``.

No test asserts a time: only ratios between two runs, pass/fail outcomes, counts.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import statistics
import subprocess
import sys
import textwrap

import pytest

from zephon.transport.arena import SEGMENT_PREFIX

GATEFNS = '''
import os

import numpy as np

SLOW = int(os.environ.get("GATE_SLOW", "1"))
WORK = 400  # loop steps per sample


def work(i, n):
    x = 0
    for k in range(n):
        x += (k ^ i) & 7
    return x


def sample(i):
    return {"x": np.full(8, work(i, WORK * SLOW), dtype=np.int64), "i": i}


def plain_batches(batch=8):
    """The baseline: the same samples, made and stacked by a plain loop."""
    i = 0
    while True:
        rows = [{"x": np.full(8, work(j, WORK), dtype=np.int64), "i": j}
                for j in range(i, i + batch)]
        yield {"x": np.stack([r["x"] for r in rows]), "i": np.array([r["i"] for r in rows])}
        i += batch


def boom_after(i):
    if i >= 400:
        raise ValueError(f"boom at sample {i}")
    return sample(i)
'''

TEST_GATE = '''
import os

from gatefns import plain_batches, sample

from zephon import Pipeline, RuntimeOptions, sources

BATCHES, ROUNDS = int(os.environ["GATE_BATCHES"]), int(os.environ["GATE_ROUNDS"])


def test_gate(zephon_benchmark):
    pipe = (Pipeline(sources.from_callable(10**6, int), num_epochs=None)
            .map(sample).batch(8).options(RuntimeOptions(runner="inline")))
    result = zephon_benchmark(pipe, batches=BATCHES, rounds=ROUNDS, baseline=plain_batches,
                              min_ratio=0.5)
    assert result.ratio is not None and result.rows_per_batch == 8
    print(result)
'''

# Checks after every inner test that nothing of the run is left: no live child process
# (multiprocessing's interpreter-lifetime helpers aside), no new zephon /dev/shm name.
LEFTOVERS_CONFTEST = '''
import importlib.util

import pytest

# the suite's own checks (tests/conftest.py), loaded by path: no copy of them here
_spec = importlib.util.spec_from_file_location("zephon_suite_conftest", OUTER_CONFTEST)
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)


@pytest.fixture(autouse=True)
def nothing_left():
    before = _suite.zephon_shm_entries()
    yield
    left, leaked = _suite.live_children(), sorted(_suite.zephon_shm_entries() - before)
    print(f"LEFTOVERS children={left} shm={leaked}")
    assert not left and not leaked
'''.replace("OUTER_CONFTEST", repr(str(pathlib.Path(__file__).with_name("conftest.py"))))

TEST_LEFTOVERS = '''
import pytest
from gatefns import boom_after, plain_batches, sample

from zephon import Pipeline, RuntimeOptions, sources

PROCESS = RuntimeOptions(runner="process", max_workers=2)


def test_process_workers_and_a_baseline(zephon_benchmark):
    pipe = (Pipeline(sources.from_callable(10**6, int), num_epochs=None)
            .map(sample, parallelism=2).batch(8).options(PROCESS))
    result = zephon_benchmark(pipe, batches=60, rounds=6, warmup=10, baseline=plain_batches)
    assert result.ratio is not None and result.rounds == 6
    assert result.peak_memory_bytes > 0 and result.peak_processes >= 3  # main + 2 workers


def test_a_measurement_that_raises(zephon_benchmark):
    pipe = (Pipeline(sources.from_callable(10**6, int), shuffle=False, num_epochs=None)
            .map(boom_after, parallelism=2).batch(8).options(PROCESS))
    with pytest.raises(Exception, match="boom at sample"):
        zephon_benchmark(pipe, batches=400, rounds=10, warmup=10, baseline=plain_batches)


def test_a_pipeline_that_ends_is_started_again(zephon_benchmark):
    pipe = Pipeline(sources.from_callable(40, sample), num_epochs=1).batch(8) \\
        .options(PROCESS)
    result = zephon_benchmark(pipe, batches=20, rounds=4, warmup=2)
    assert result.restarts >= 4  # 5 batches an epoch, 23 pulled
'''


def clean_env(**extra: str) -> dict:
    """This environment without pytest's variables (the inner session is a user's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.pop("GATE_SLOW", None)
    env.update(extra)
    return env


def project(where: pathlib.Path, **files: str) -> pathlib.Path:
    """A test project: ``gatefns.py`` and ``files`` (name without .py -> source)."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "gatefns.py").write_text(textwrap.dedent(GATEFNS), encoding="utf-8")
    for name, source in files.items():
        (where / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    return where


# batches and rounds of test_gate: rounds of 50 batches (some 15-30 ms here), longer than
# the few-ms time slices another process takes from a round on a loaded machine
SIZES = {"GATE_BATCHES": "1500", "GATE_ROUNDS": "30"}
LONG_SIZES = {"GATE_BATCHES": "3000", "GATE_ROUNDS": "60"}  # the 10-run test's


def inner(where: pathlib.Path, *args: str, slow: int = 1, sizes: dict | None = None,
          timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m pytest -q ARGS`` in ``where``, as a user's CI runs it."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=where,
                          capture_output=True, text=True, timeout=timeout,
                          env=clean_env(GATE_SLOW=str(slow), **(sizes or SIZES)))


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout[-6000:] + proc.stderr[-4000:]


def ratio_of(path: pathlib.Path) -> tuple[float, float]:
    """(ratio, median round seconds) of the one benchmark in a --benchmark-json file."""
    (bench,) = json.loads(path.read_text(encoding="utf-8"))["benchmarks"]
    return bench["extra_info"]["ratio"], bench["stats"]["median"]


def compare(where: pathlib.Path, n: int, *gates: str, slow: int = 1,
            sizes: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``n`` compared with the first saved run (0001) under ``gates``."""
    return inner(where, "--benchmark-compare=0001", *gates, f"--benchmark-json=run{n}.json",
                 "test_gate.py", slow=slow, sizes=sizes)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[pathlib.Path, subprocess.CompletedProcess]:
    """A project whose fast run was saved (``--benchmark-autosave``: 0001), by a session
    given no ``-p``: the fixture comes from the entry point."""
    where = project(tmp_path_factory.mktemp("gate"), test_gate=TEST_GATE)
    proc = inner(where, "--benchmark-autosave", "--benchmark-json=run0.json", "test_gate.py")
    assert proc.returncode == 0, output(proc)
    assert list((where / ".benchmarks").rglob("0001_*.json")), output(proc)
    return where, proc


def test_the_entry_point_registers_the_plugin_and_a_session_has_the_fixture(saved):
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="pytest11")}
    assert names.get("zephon") == "zephon.testing", (
        "the pytest11 entry point is missing: refresh the install's metadata "
        "(pip install -e . --no-deps --no-build-isolation)")
    _, proc = saved
    assert "1 passed" in proc.stdout
    assert "zephon throughput (zephon_benchmark)" in proc.stdout  # its terminal summary
    info = json.loads((saved[0] / "run0.json").read_text(encoding="utf-8"))
    extra = info["benchmarks"][0]["extra_info"]
    for key in ("startup_s", "first_batch_s", "batches_per_s", "peak_memory_bytes", "ratio"):
        assert extra[key] is not None, key
    assert info["benchmarks"][0]["stats"]["rounds"] == int(SIZES["GATE_ROUNDS"])


def test_importing_the_plugin_imports_neither_the_engine_nor_numpy():
    code = ("import sys, zephon.testing\n"
            "heavy = [m for m in ('zephon.pipeline', 'zephon.transport', 'zephon.runners', "
            "'zephon.testing.measure', 'numpy', 'torch') if m in sys.modules]\n"
            "print(heavy)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_three_times_slower_pipeline_fails_every_gate(saved):
    where, _ = saved
    proc = compare(where, 99, "--benchmark-compare-fail=median:20%",
                   "--zephon-compare-fail=ratio:20%", slow=3)
    text = output(proc)
    assert proc.returncode != 0, text
    assert "Performance has regressed" in text  # --benchmark-compare-fail=median:20%
    assert "ratio regressed by" in text  # --zephon-compare-fail=ratio:20%
    assert "is below min_ratio 0.50" in text
    then, _ = ratio_of(where / "run0.json")
    now, _ = ratio_of(where / "run99.json")
    assert now < then / 2  # the map does 3x the work: the ratio falls well past 20 %


def _measure_noise(where: pathlib.Path, runs: int,
                   sizes: dict | None = None) -> list[tuple[float, float]]:
    """Compare ``runs`` runs of the unchanged pipeline with the saved one on the ratio
    (``--zephon-compare-fail=ratio:20%``); every run must pass. Returns (ratio, median
    round seconds) of the saved run, then of each run."""
    seen = [ratio_of(where / "run0.json")]
    for n in range(1, runs + 1):
        proc = compare(where, n, "--zephon-compare-fail=ratio:20%", sizes=sizes)
        assert proc.returncode == 0, f"run {n} of the same pipeline failed:\n{output(proc)}"
        seen.append(ratio_of(where / f"run{n}.json"))
    ratios = [r for r, _ in seen]
    medians = [m for _, m in seen]
    print(f"ratios {[round(r, 3) for r in ratios]} (max/min {max(ratios) / min(ratios):.3f}); "
          f"medians max/min {max(medians) / min(medians):.3f}")
    return seen


def test_the_same_pipeline_measured_again_passes_a_20_percent_gate(saved):
    """The saved run and 2 more: none fails ratio:20%. (The median round time is not
    gated here: on this loaded 2-core machine it moves by up to a third between runs.)"""
    seen = _measure_noise(saved[0], 2)
    ratios = [r for r, _ in seen]
    assert statistics.median(ratios) > 0.5


@pytest.mark.slow
@pytest.mark.ci
def test_the_same_pipeline_measured_ten_times_passes_a_20_percent_gate(tmp_path):
    """The issue's "done when": a first saved run, then 10 runs of the same pipeline
    against it, on this machine, none failing a 20 % gate."""
    where = project(tmp_path, test_gate=TEST_GATE)
    proc = inner(where, "--benchmark-autosave", "--benchmark-json=run0.json", "test_gate.py",
                 sizes=LONG_SIZES)
    assert proc.returncode == 0, output(proc)
    _measure_noise(where, 10, sizes=LONG_SIZES)


def _zephon_shm() -> set[str]:
    try:
        return {e for e in os.listdir("/dev/shm") if e.startswith(SEGMENT_PREFIX)}
    except FileNotFoundError:
        return set()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for child processes")
def test_nothing_is_left_behind_even_when_the_measurement_raises(tmp_path):
    where = project(tmp_path, conftest=LEFTOVERS_CONFTEST, test_leftovers=TEST_LEFTOVERS)
    before = _zephon_shm()
    proc = inner(where, "-s", "test_leftovers.py")
    text = output(proc)
    assert proc.returncode == 0 and "3 passed" in proc.stdout, text
    assert text.count("LEFTOVERS children=[] shm=[]") == 3, text
    assert not _zephon_shm() - before


def test_benchmark_disable_runs_once_and_benchmark_skip_skips(tmp_path):
    where = project(tmp_path, test_gate=TEST_GATE)
    proc = inner(where, "--benchmark-disable", "test_gate.py", slow=3)  # no gate checked
    assert proc.returncode == 0 and "1 passed" in proc.stdout, output(proc)
    assert "one round, nothing checked" in proc.stdout
    proc = inner(where, "--benchmark-skip", "test_gate.py")
    assert proc.returncode == 0 and "1 skipped" in proc.stdout, output(proc)


def test_without_pytest_benchmark_the_fixture_says_what_to_install(tmp_path):
    where = project(tmp_path, test_gate=TEST_GATE)
    proc = inner(where, "-p", "no:benchmark", "test_gate.py")
    assert proc.returncode != 0 and "1 error" in proc.stdout, output(proc)
    assert "pip install pytest-benchmark" in proc.stdout
    proc = inner(where, "-p", "no:benchmark", "--zephon-compare-fail=ratio:20%",
                 "test_gate.py")
    assert proc.returncode != 0 and "needs --benchmark-compare" in output(proc)


def test_a_bad_gate_is_a_usage_error(tmp_path):
    where = project(tmp_path, test_gate=TEST_GATE)
    proc = inner(where, "--benchmark-compare", "--zephon-compare-fail=speed:20",
                 "test_gate.py")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, output(proc)
    assert "expected FIELD:PERCENT%" in output(proc)


def test_a_gate_asked_for_never_passes_without_comparing():
    from zephon.testing import Gate, gate_failures

    ratio = [Gate("ratio", 20.0)]
    assert gate_failures(ratio, {"ratio": 0.9}, "t", [("0001", {"t": {"ratio": 1.0}})]) == []
    assert "regressed by" in gate_failures(ratio, {"ratio": 0.7}, "t",
                                           [("0001", {"t": {"ratio": 1.0}})])[0]
    assert "no saved run" in gate_failures(ratio, {"ratio": 0.9}, "t", [])[0]
    missing = gate_failures(ratio, {"ratio": 0.9}, "t", [("0001", {"other": {"ratio": 1.0}})])
    assert "has no entry for t" in missing[0] and "other" in missing[0]
    no_baseline = gate_failures(ratio, {"ratio": None}, "t", [("0001", {"t": {"ratio": 1.0}})])
    assert "baseline=" in no_baseline[0]
    grown = gate_failures([Gate("memory_growth", 25.0)], {"memory_growth_bytes": 300 << 20},
                          "t", [("0001", {"t": {"memory_growth_bytes": 200 << 20}})])
    assert "300.0 MiB now" in grown[0]
