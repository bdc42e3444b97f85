"""Ray backend benchmark (pytest-benchmark): 2,000 no-op subjects, Ray vs the process backend.

    pip install -e ".[test,ray]"
    python -m pytest bench/test_bench_jobs_ray.py -p no:cacheprovider

One local Ray cluster with 2 CPUs is started for the module (its start-up is not
timed: a study connects once); each round starts its own workers (2 actors, or 2
spawn processes) and runs the same 2,000 no-op subjects, subject timeouts on
(60 s), store off:

- ``jobs_ray_vs_process``: the Ray backend as shipped (short subjects batched into
  one actor call) vs the process backend;
- ``jobs_ray_unbatched_vs_process``: the Ray backend with batching off (one actor
  call per subject: Ray's per-task overhead as it is) vs the process backend.

A ratio > 1 means Ray is faster. No target: Ray pays a per-call cost the process
backend's socketpairs do not, and this reports how much.
"""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray", reason='needs Ray: pip install -e ".[test,ray]"')

from zephon.jobs import RunPolicy, run  # noqa: E402

N = 2000
SUBJECTS = [f"S{i:05d}" for i in range(N)]
GROUP = f"{N} no-op subjects, 2 workers, from cold (Ray cluster already up)"


def noop(subject):
    return subject


@pytest.fixture(scope="module")
def local_ray():
    here = os.path.dirname(os.path.abspath(__file__))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, old) if p)
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


def jobs(backend):
    policy = RunPolicy(backend=backend, workers=2, subject_timeout_sec=60.0, resume=False)
    out = list(run(noop, SUBJECTS, policy, progress=False))
    assert len(out) == N and all(r.ok for r in out) and out[-1].value == SUBJECTS[-1]


def test_process_backend(benchmark, record_ratio):
    benchmark.group = GROUP
    benchmark.pedantic(jobs, args=("process",), rounds=3, warmup_rounds=1)
    record_ratio("jobs_ray_vs_process", "baseline")
    record_ratio("jobs_ray_unbatched_vs_process", "baseline")


def test_ray_backend(benchmark, record_ratio, local_ray):
    benchmark.group = GROUP
    benchmark.pedantic(jobs, args=("ray",), rounds=3, warmup_rounds=1)
    record_ratio("jobs_ray_vs_process", "subject")


def test_ray_backend_unbatched(benchmark, record_ratio, local_ray, monkeypatch):
    import zephon.jobs.ray_backend as rb

    monkeypatch.setattr(rb, "MAX_BATCH", 1)
    benchmark.group = GROUP
    benchmark.pedantic(jobs, args=("ray",), rounds=3, warmup_rounds=1)
    record_ratio("jobs_ray_unbatched_vs_process", "subject")
