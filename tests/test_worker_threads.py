"""One compute thread per process worker, by default (``worker_compute_threads``).

Process workers of a pipeline stage run torch and the BLAS/OpenMP pools with the
option's threads, whether torch is loaded with the program or by the first task;
a worker whose code never imports torch does not load it; threads-runner stages
leave the consumer's pools and environment alone; ``explain()`` says what is set.
"""

from __future__ import annotations

import os

import _collate_fns as F
import pytest

from zephon import Pipeline, RuntimeOptions, sources


@pytest.mark.parametrize("threads,eager", [(1, True), (3, True), (1, False)])
def test_process_workers_run_torch_and_blas_with_the_option_s_threads(threads, eager):
    """``eager``: the program's module imports torch (loaded when the worker unpickles it);
    else the op imports torch in its first task (the environment sizes its pool)."""
    pytest.importorskip("torch")
    if eager:
        from _collate_torch_fns import eager_thread_report as report
    else:
        report = F.thread_report
    opts = RuntimeOptions(runner="process", max_workers=2, worker_compute_threads=threads)
    pipe = Pipeline(sources.from_callable(16, report), shuffle=False,
                    chunk_size=1).map(F.identity_map, parallelism=2).options(opts)
    got = list(pipe)
    assert len(got) == 16
    for item in got:
        assert item["torch"] == threads, item
        assert item["pools"] and all(n == threads for _, n in item["pools"]), item
    assert f"compute threads: {threads} per process worker" in pipe.explain()


def test_workers_that_never_import_torch_do_not_load_it_and_are_limited():
    opts = RuntimeOptions(runner="process", max_workers=2)
    got = list(Pipeline(sources.from_callable(6, F.numpy_only_report), shuffle=False,
                        chunk_size=1).map(F.identity_map, parallelism=2).options(opts))
    assert [g["torch_loaded"] for g in got] == [False] * 6
    assert all(g["pools"] and all(n == 1 for _, n in g["pools"]) for g in got)


def test_threads_runner_leaves_the_consumer_s_pools_alone():
    from zephon.transport.threads import THREAD_ENV_VARS, compute_threads_report

    before, env = compute_threads_report(), {k: os.environ.get(k) for k in THREAD_ENV_VARS}
    got = list(Pipeline(sources.from_callable(4, F.numpy_only_report), shuffle=False)
               .map(F.identity_map, parallelism=2)
               .options(RuntimeOptions(runner="threads", max_workers=2)))
    assert len(got) == 4
    assert compute_threads_report() == before
    assert {k: os.environ.get(k) for k in THREAD_ENV_VARS} == env


def test_explain_says_when_workers_keep_the_defaults():
    pipe = Pipeline(sources.from_callable(4, F.image_label)).options(
        RuntimeOptions(worker_compute_threads=0))
    assert "keep the libraries' defaults (worker_compute_threads=0)" in pipe.explain()


def test_job_workers_run_with_one_compute_thread():
    pytest.importorskip("torch")
    import zephon.jobs
    from zephon import RunPolicy

    job = zephon.jobs.run(F.job_thread_report, ["a", "b", "c"],
                          RunPolicy(backend="process", workers=2, resume=False),
                          progress=False)
    results = list(job)
    assert [r.ok for r in results] == [True] * 3, [r.error for r in results]
    for r in results:
        assert r.value["torch"] == 1 and r.value["pools"], r.value
        assert all(n == 1 for _, n in r.value["pools"]), r.value
