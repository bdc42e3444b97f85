"""The Ray backend of ``jobs.run``: the shared behaviour, parameterized over ``process``
and ``ray``, and what only a cluster has (nodes that come and go).

Real Ray, started by the tests: one local cluster with 2 CPUs for the session (started
on first use), and a simulated two-node cluster (``ray.cluster_utils.Cluster``: a head
and a second node with its own resources, both on this machine). One process holds one
Ray connection, so :class:`RayClusters` switches between the two and shuts down
whichever is up at the end. Ray workers import the job modules by name: this directory
goes on their ``PYTHONPATH``. Starting Ray takes seconds, so everything here is
``slow``; all but recycling, the spawn timeout and the GPU cap (which restarts the
cluster) are ``ci`` too.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ray = pytest.importorskip(
    "ray", reason='the Ray backend tests need Ray: pip install -e ".[test,ray]"')

import _job_fns as J  # noqa: E402
import _job_fns_ray as R  # noqa: E402
from _procs import wait_gone  # noqa: E402
from _ray_clusters import TESTS  # noqa: E402
from zephon import SubjectTimeoutError, WorkerCrashedError, ZephonConfigError  # noqa: E402
from zephon.errors import SerializationError  # noqa: E402
from zephon.jobs import (  # noqa: E402
    CheckpointStore, JobSetupError, RecordedFailure, RunPolicy, run,
)
from zephon.options import backend_reason, resolve_backend  # noqa: E402

pytestmark = pytest.mark.slow

FAST = dict(graceful_shutdown_sec=2.0, subject_spawn_timeout_sec=120.0)  # a loaded machine starts Ray workers slowly


@pytest.fixture(params=["process", "ray"])
def backend(request, clusters):
    if request.param == "ray":
        clusters.local()
    return request.param


@pytest.fixture
def on_ray(clusters):
    clusters.local()
    return "ray"


def subjects(tmp_path, n, action="ok", arg=None, prefix="S"):
    d = tmp_path / "log"
    d.mkdir(parents=True, exist_ok=True)
    return [{"subject_id": f"{prefix}{i:03d}", "dir": str(d), "action": action, "arg": arg}
            for i in range(n)]


def go(fn, subs, backend, **policy):
    kwargs = {k: policy.pop(k) for k in ("fingerprint", "ordered") if k in policy}
    r = run(fn, subs, RunPolicy(backend=backend, **{**FAST, **policy}), progress=False,
            **kwargs)
    return r, list(r)


def stored(store: str) -> tuple[list[str], list[str]]:
    """The store's success keys and failure keys (opened after the run has closed it)."""
    with CheckpointStore(store, None) as st:
        return sorted(st.keys(0)), sorted(st.keys(1))


def started_pids(directory) -> set[int]:
    return {int(f.split(".")[1]) for f in os.listdir(directory) if f.endswith(".start")}


# -- shared behaviour ------------------------------------------------------------------

@pytest.mark.ci
def test_results_in_input_order_or_completion_order(tmp_path, backend):
    subs = subjects(tmp_path, 8, "sleep", 0.01)
    subs[0]["arg"] = 1.5
    r, out = go(J.work, subs, backend, workers=2, resume=False)
    assert r.backend_name == backend
    assert [x.subject_id for x in out] == [s["subject_id"] for s in subs]
    assert all(x.ok for x in out) and out[0].value == 1.5
    r, out = go(J.work, subjects(tmp_path / "u", 8, "sleep", 0.01)[:1] + subs[1:], backend,
                workers=2, resume=False, ordered=False)
    assert sorted(x.subject_id for x in out) == [s["subject_id"] for s in subs]


@pytest.mark.ci
def test_unordered_yields_a_slow_first_subject_last(tmp_path, backend):
    # S000 ends only once the test has the other five results (not after a fixed 2 s: a
    # second worker starting late would leave S000 to end first)
    release = str(tmp_path / "release")
    subs = subjects(tmp_path, 6, "sleep", 0.01)
    subs[0].update(action="wait_for_file", arg=release)
    job = run(J.work, subs, RunPolicy(backend=backend, workers=2, resume=False, **FAST),
              progress=False, ordered=False)
    it = iter(job)
    try:
        out = [next(it) for _ in range(5)]
    finally:
        open(release, "w").close()
    out += list(it)
    assert out[-1].subject_id == "S000"
    assert sorted(x.subject_id for x in out) == [s["subject_id"] for s in subs]


@pytest.mark.ci
def test_timeout_of_a_hung_subject(tmp_path, backend):
    subs = subjects(tmp_path, 3, "ok")
    subs[1]["action"] = "hang_with_child"
    r, out = go(J.work, subs, backend, workers=2, subject_timeout_sec=3.0,
                auto_retry_rounds=0, resume=False)
    assert [x.ok for x in out] == [True, False, True]
    assert isinstance(out[1].error, SubjectTimeoutError) and r.summary["timeouts"] == 1
    hung = [int(f.split(".")[1]) for f in os.listdir(subs[1]["dir"])
            if f.startswith("S001.") and f.endswith(".start")]
    assert wait_gone(hung, 20.0) == [], "the hung subject's worker outlived the timeout"
    child = int(open(os.path.join(subs[1]["dir"], "S001.child")).read())
    assert wait_gone([child], 20.0) == [], "the subject's own child outlived the timeout"


@pytest.mark.ci
def test_a_sigkilled_worker_is_retried(tmp_path, backend):
    subs = subjects(tmp_path, 4, "ok")
    r, out = go(R.kill_once, subs, backend, workers=2, auto_retry_rounds=1, resume=False)
    assert all(x.ok for x in out), [x.error for x in out]
    assert [x.attempts for x in out] == [2, 2, 2, 2]
    assert r.summary["retried"] == 4 and r.summary["oom_backoffs"] >= 1
    killed = {int(open(os.path.join(subs[0]["dir"], f"{s['subject_id']}.killed")).read())
              for s in subs}
    assert not killed & {x.value["pid"] for x in out}  # the retries ran in new workers


@pytest.mark.ci
def test_fail_fast_stops_every_worker_and_raises(tmp_path, backend):
    subs = subjects(tmp_path, 2, "sleep", 600)
    subs[1].update(action="raise_once_started", arg=2)  # the sleeper is running by then
    job = run(J.work, subs, RunPolicy(backend=backend, workers=2, resume=False,
                                      on_subject_failure="fail_fast", **FAST),
              progress=False)
    with pytest.raises(ValueError, match="S001 failed on purpose"):
        list(job)
    pids = started_pids(subs[0]["dir"])
    assert len(pids) == 2 and wait_gone(pids, 20.0) == []


@pytest.mark.ci
def test_resume_serves_a_sabotaged_rerun_from_the_store(tmp_path, backend):
    store = str(tmp_path / "ckpt")
    good = subjects(tmp_path, 5, "ok")
    r, out = go(J.work, good, backend, workers=2, checkpoint_dir=store, fingerprint="v1")
    assert all(x.ok and not x.from_cache for x in out)
    sabotaged = [{**s, "action": "raise"} for s in good]
    r, again = go(J.work, sabotaged, backend, workers=2, checkpoint_dir=store,
                  fingerprint="v1")
    assert all(x.ok and x.from_cache for x in again)
    assert [x.value for x in again] == [x.value for x in out]
    assert r.summary["cached"] == 5 and r.summary["done"] == 0


@pytest.mark.ci
@pytest.mark.parametrize("action", ["kill_self", "memory_error"])
def test_oom_backoff_lowers_concurrency_for_the_rest_of_the_run(tmp_path, backend, action):
    first = subjects(tmp_path, 1, action, prefix="A")
    later = subjects(tmp_path, 6, "sleep", 0.3, prefix="B")
    r, out = go(J.work, first + later, backend, workers=2, auto_retry_rounds=1,
                resume=False)
    assert r.summary["oom_backoffs"] == 1
    assert J.interval_overlap(first[0]["dir"], {s["subject_id"] for s in later[2:]}) == 1
    assert out[0].attempts == 2 and all(x.ok for x in out[1:])
    if action == "kill_self":
        assert isinstance(out[0].error, WorkerCrashedError) and "SIGKILL" in str(out[0].error)
    else:
        assert isinstance(out[0].error, MemoryError)


@pytest.mark.ci
def test_a_subject_that_cannot_be_serialized_fails_alone(tmp_path, backend):
    import threading

    subs = subjects(tmp_path, 3, "ok")
    subs[1] = {**subs[1], "lock": threading.Lock()}
    r, out = go(J.work, subs, backend, workers=2, auto_retry_rounds=0, resume=False)
    assert [x.ok for x in out] == [True, False, True]
    assert isinstance(out[1].error, SerializationError)


# -- Ray only --------------------------------------------------------------------------

@pytest.mark.ci
def test_backend_ray_stays_ray_with_a_timeout_and_says_why():
    policy = RunPolicy(backend="ray", subject_timeout_sec=5.0)
    assert resolve_backend(policy) == "ray"
    assert "cancelling the Ray task" in backend_reason(policy)
    assert resolve_backend(RunPolicy(backend="ray", subject_timeout_sec=None)) == "ray"


@pytest.mark.ci
def test_isolated_tasks_time_out_by_force_cancel_and_count_a_sigkill_as_oom(tmp_path, on_ray):
    subs = subjects(tmp_path, 4, "ok")
    subs[1]["action"] = "hang_with_child"
    subs[2]["action"] = "kill_self"
    r, out = go(J.work, subs, on_ray, workers=2, parallel_mode="isolated",
                subject_timeout_sec=4.0, auto_retry_rounds=0, resume=False)
    assert [x.ok for x in out] == [True, False, False, True]
    assert isinstance(out[1].error, SubjectTimeoutError) and r.summary["timeouts"] == 1
    assert isinstance(out[2].error, WorkerCrashedError) and r.summary["oom_backoffs"] == 1
    hung = [int(f.split(".")[1]) for f in os.listdir(subs[1]["dir"])
            if f.startswith("S001.") and f.endswith(".start")]
    child = int(open(os.path.join(subs[1]["dir"], "S001.child")).read())
    assert wait_gone(hung + [child], 20.0) == []


@pytest.mark.ci
def test_explain_names_the_cluster_and_ray_runs_elsewhere(tmp_path, on_ray):
    r, out = go(R.where, subjects(tmp_path, 3), on_ray, workers=2, resume=False)
    text = r.explain()
    assert "backend: ray (backend='ray' was requested" in text
    assert "existing Ray connection" in text and "1 node(s), 2 CPU(s)" in text
    assert os.getpid() not in {x.value["pid"] for x in out}
    assert {x.value["node"] for x in out} == {ray.get_runtime_context().get_node_id()}


def test_persistent_actors_set_up_once_and_recycle(tmp_path, on_ray):
    d = tmp_path / "p"
    d.mkdir()
    r, out = go(J.WithSetup(str(d)), subjects(d, 12), on_ray, workers=2, resume=False,
                persistent_worker_recycle_after_tasks=3)
    assert all(x.ok for x in out)
    per_pid = collections.Counter(x.value["pid"] for x in out)
    pids = set(per_pid)
    # how the 12 split between actors depends on which starts first (3+3+3+2+1 is
    # possible): every actor that reached 3 was recycled, none ran more
    assert len(pids) >= 4 and max(per_pid.values()) <= 3
    assert r.summary["recycled"] == sum(n == 3 for n in per_pid.values()) >= 3
    assert sorted(f for f in os.listdir(d) if f.startswith("setup.")) == sorted(
        f"setup.{p}" for p in pids)  # setup() once per actor
    e = tmp_path / "i"
    e.mkdir()
    r, out = go(J.WithSetup(str(e)), subjects(e, 4), on_ray, workers=2,
                parallel_mode="isolated", resume=False)
    assert len({x.value["pid"] for x in out}) == 4  # a fresh worker process per subject
    assert len([f for f in os.listdir(e) if f.startswith("setup.")]) == 4


def test_spawn_timeout_bounds_an_actor_whose_setup_hangs(on_ray):
    # Placing the actor (starting its process) and its setup() are both bounded; on a
    # loaded machine the process start alone may take the whole 5 s.
    with pytest.raises(JobSetupError, match=r"within 5.0 s \(subject_spawn_timeout_sec\)"):
        list(run(J.HangingSetup(), ["S1"], RunPolicy(
            backend="ray", subject_spawn_timeout_sec=5.0, graceful_shutdown_sec=1.0,
            resume=False), progress=False))


@pytest.mark.ci
def test_short_subjects_are_batched_without_changing_results(tmp_path, on_ray):
    ids = [f"N{i:04d}" for i in range(600)]
    r, out = go(R.noop, ids, on_ray, workers=2, resume=False)
    assert [x.value for x in out] == ids and all(x.attempts == 1 for x in out)
    assert r.backend.stats["batched_calls"] > 0  # the later calls carried several subjects
    subs = subjects(tmp_path, 300, "ok")
    subs[250]["action"] = "raise"
    r, out = go(J.work, subs, on_ray, workers=2, resume=False, auto_retry_rounds=0,
                persistent_worker_max_consecutive_failures=1)  # one failure restarts it
    assert [x.ok for x in out] == [i != 250 for i in range(300)]
    assert isinstance(out[250].error, ValueError)
    assert r.summary["restarts"] == 1 and r.summary["workers_started"] == 3
    r, out = go(J.work, subs, on_ray, workers=2, resume=False, auto_retry_rounds=0)
    assert [x.ok for x in out] == [i != 250 for i in range(300)]
    assert "restarts" not in r.summary and r.summary["workers_started"] == 2  # default 10


@pytest.mark.ci
@pytest.mark.parametrize("action", ["sleep", "kill_self"])
def test_a_batch_that_hangs_or_dies_is_split_and_blames_one_subject(tmp_path, on_ray, action):
    subs = subjects(tmp_path, 400, "ok")
    subs[300] = {**subs[300], "action": action, "arg": 600}
    r, out = go(J.work, subs, on_ray, workers=2, subject_timeout_sec=4.0,
                auto_retry_rounds=0, resume=False)
    assert r.backend.stats["batched_calls"] > 0
    assert [x.ok for x in out] == [i != 300 for i in range(400)]
    assert all(x.attempts == 1 for x in out)
    if action == "sleep":
        assert isinstance(out[300].error, SubjectTimeoutError)
        assert r.summary["timeouts"] == 1 and r.summary["oom_backoffs"] == 0
    else:
        assert isinstance(out[300].error, WorkerCrashedError)
        assert r.summary["timeouts"] == 0 and r.summary["oom_backoffs"] == 1


@pytest.mark.ci
def test_the_store_is_shared_with_the_process_backend(tmp_path, on_ray):
    store = str(tmp_path / "ckpt")
    subs = subjects(tmp_path, 4, "ok")
    subs[3] = {**subs[3], "action": "raise"}
    r, first = go(J.work, subs, "process", workers=2, checkpoint_dir=store,
                  auto_retry_rounds=0)
    assert [x.ok for x in first] == [True, True, True, False]
    r, again = go(J.work, subs, on_ray, workers=2, checkpoint_dir=store)
    assert [x.from_cache for x in again] == [True] * 4
    assert isinstance(again[3].error, RecordedFailure)
    fixed = subs[:3] + [{**subs[3], "action": "ok"}]
    r, third = go(J.work, fixed, on_ray, workers=2, checkpoint_dir=store,
                  retry_failed_subjects=True, force_rerun_subjects=("S000",))
    assert [x.from_cache for x in third] == [False, True, True, False]
    assert all(x.ok for x in third) and third[0].value["pid"] != first[0].value["pid"]
    assert stored(store) == (sorted(r.keys), [])


INTERRUPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    os.environ["PYTHONPATH"] = {tests!r}
    import _job_fns as J
    from zephon.jobs import RunPolicy, run

    if __name__ == "__main__":
        subs = [{{"subject_id": f"S{{i}}", "dir": {log!r}, "action": "sleep", "arg": 600}}
                for i in range(3)]
        subs[0]["arg"] = 0.01
        print("ready", flush=True)
        try:
            for result in run(J.work, subs, RunPolicy(backend="ray", workers=2,
                                                      graceful_shutdown_sec=2.0,
                                                      checkpoint_dir={store!r}),
                              progress=False):
                print("result", result.subject_id, result.ok, flush=True)
        except KeyboardInterrupt:
            import ray
            print("interrupted", ray.is_initialized(), flush=True)
""")


@pytest.mark.ci
def test_ctrl_c_cancels_the_tasks_and_keeps_the_store(tmp_path):
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    store = str(tmp_path / "ckpt")
    code = INTERRUPT.format(tests=TESTS, log=str(log_dir), store=store)
    env = {**os.environ, "RAY_ADDRESS": "local"}  # a cluster of its own, started by zephon
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        # S0 (10 ms) has been handed to the script, so the driver has saved it (waited
        # for, not assumed after a fixed sleep); then S1 and S2 sleep in their workers
        assert proc.stdout.readline().strip() == "result S0 True"
        deadline = time.monotonic() + 120
        while len([f for f in os.listdir(log_dir) if f.endswith(".start")]) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert "interrupted False" in out, err  # zephon's own cluster was shut down
    assert wait_gone(started_pids(log_dir), 20.0) == []
    ok, failed = stored(store)  # S0 kept; the cancelled S1 and S2 are not failures
    assert len(ok) == 1 and failed == []
    assert not [f for f in os.listdir(store) if f.startswith(".tmp")]


def test_cap_workers_to_gpu_pool_uses_the_cluster_gpus(tmp_path, clusters):
    clusters.local()
    with pytest.raises(ZephonConfigError, match="Ray cluster has no GPU"):
        list(run(J.work, subjects(tmp_path, 1), RunPolicy(
            backend="ray", cap_workers_to_gpu_pool=True, resume=False), progress=False))
    clusters.local(num_gpus=2)  # CUDA_VISIBLE_DEVICES of this process plays no part
    subs = subjects(tmp_path / "g", 8, "ok", 0.3)
    r, out = go(R.gpu_slot, subs, "ray", workers=4, cap_workers_to_gpu_pool=True,
                resume=False)
    assert all(x.ok for x in out)
    assert "ray workers: 2 (capped to the cluster's 2 GPU(s)" in r.explain()
    assert r.summary["workers_started"] == 2
    slots = {x.value["pid"]: x.value["slot"] for x in out}  # one GPU id per actor...
    assert set(slots.values()) <= {"0", "1"} and len(set(slots.values())) == len(slots)
    assert all(x.value["cuda"] == x.value["slot"] for x in out)  # ...the one Ray gave it


# -- two nodes (last: it replaces the local cluster) -----------------------------------

@pytest.mark.ci
def test_subjects_land_on_both_nodes_and_survive_losing_one(tmp_path, clusters):
    cluster, second = clusters.two_nodes()
    head = ray.get_runtime_context().get_node_id()
    store = str(tmp_path / "ckpt")
    subs = subjects(tmp_path, 16, "sleep", 0.5)
    job = run(R.where, subs, RunPolicy(backend="ray", workers=4, checkpoint_dir=store,
                                       auto_retry_rounds=2, **FAST), progress=False,
              ordered=False)
    out, removed = [], False
    for result in job:
        out.append(result)
        if not removed and result.ok and result.value["node"] != head:
            # the second node has finished a subject and is busy with the next ones
            assert "2 node(s), 4 CPU(s)" in job.explain()
            assert "local path" in job.explain()
            cluster.remove_node(second)
            removed = True
    assert removed
    out.sort(key=lambda x: x.subject_id)
    assert [x.subject_id for x in out] == [s["subject_id"] for s in subs]
    assert all(x.ok for x in out), [x.error for x in out if not x.ok]
    nodes = {x.value["node"] for x in out}
    assert head in nodes and len(nodes) == 2  # some finished on the second node first
    assert any(x.attempts > 1 for x in out)  # lost with the node, retried on the head
    assert all(x.value["node"] == head for x in out if x.attempts > 1)
    st = CheckpointStore(store, None)
    try:
        entries = [st.load(job.keys[i]) for i in range(len(subs))]
    finally:
        st.close()
    assert all(e is not None and e.ok for e in entries)
    assert stored(store) == (sorted(job.keys), [])  # one entry per subject
