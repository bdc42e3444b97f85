"""Jobs benchmarks (pytest-benchmark): per-subject overhead of the process backend.

    python -m pytest bench/test_bench_jobs.py [--enforce-ratios]

Each round runs a no-op callable over the same 3,000 subjects from cold (workers
started inside the round, for both sides):

- zephon ``run()``, 2 persistent process workers, subject timeouts on
  (60 s), store off  vs  ``concurrent.futures.ProcessPoolExecutor(2, spawn).map``:
  target ratio >= 0.8;
- the store's added cost: the same run with a checkpoint store (entries
  group-committed to one SQLite database) vs without; reported as a ratio and per
  subject. ``bench/jobs_store.py`` measures the store alone at 10^6 subjects.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import shutil
import tempfile

from zephon.jobs import RunPolicy, run

N = 3000
SUBJECTS = [f"S{i:05d}" for i in range(N)]


def noop(subject):
    return subject


def zephon_run(checkpoint_dir=None):
    policy = RunPolicy(workers=2, subject_timeout_sec=60.0, resume=checkpoint_dir is not None,
                       checkpoint_dir=checkpoint_dir)
    out = list(run(noop, SUBJECTS, policy, progress=False))
    assert len(out) == N and all(r.ok for r in out)


def executor_run():
    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as ex:
        assert len(list(ex.map(noop, SUBJECTS))) == N


def test_jobs_process_backend(benchmark, record_ratio):
    benchmark.group = f"{N} no-op subjects, 2 spawn workers, from cold"
    benchmark.pedantic(zephon_run, rounds=3, warmup_rounds=1)
    record_ratio("jobs_noop_vs_process_pool_executor", "subject", target=0.8)
    record_ratio("jobs_store_off_vs_on", "baseline")


def test_process_pool_executor(benchmark, record_ratio):
    benchmark.group = f"{N} no-op subjects, 2 spawn workers, from cold"
    benchmark.pedantic(executor_run, rounds=3, warmup_rounds=1)
    record_ratio("jobs_noop_vs_process_pool_executor", "baseline")


def test_jobs_with_store(benchmark, record_ratio):
    benchmark.group = f"{N} no-op subjects, 2 spawn workers, from cold"

    def with_store():
        directory = tempfile.mkdtemp(prefix="zephon-bench-store-")
        try:
            zephon_run(directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    benchmark.pedantic(with_store, rounds=3, warmup_rounds=0)
    record_ratio("jobs_store_off_vs_on", "subject")
    stats = benchmark.stats.stats
    benchmark.extra_info["store_ms_per_subject"] = stats.median * 1e3 / N
