"""The Ray runner (``runner="ray"``, :mod:`zephon.runners.ray`): a stage's units on Ray
actors across a real local cluster's nodes, giving the stream every other runner gives,
exactly once through lost actors and nodes, with checkpoints that restore across
runners and actor counts.

The cluster is real: a head and two worker nodes, each its own raylet with its own
resources, on this machine (``ray.cluster_utils.Cluster``, see ``_ray_clusters.py``).
Starting it takes seconds, so everything here is ``slow``; the scenarios the issue
names are ``ci`` too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

ray = pytest.importorskip(
    "ray", reason='the Ray runner tests need Ray: pip install -e ".[test,ray]"')

import _ray_fns as R  # noqa: E402
from _procs import HANG_S, wait_gone  # noqa: E402
from _ray_clusters import TESTS  # noqa: E402
from _resume import assert_resumes  # noqa: E402
from _streams import batch_key  # noqa: E402

from zephon import Pipeline, RuntimeOptions, ZephonConfigError, sources  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(clusters):
    """The session's three-node cluster (2 logical CPUs per node)."""
    return clusters.three_nodes()


def opts(runner: str, workers: int = 2, **kw) -> RuntimeOptions:
    """``workers`` workers (actors) in every stage."""
    return RuntimeOptions(runner=runner, max_workers=workers,
                          **{"worker_allocation": "per_stage_fixed",
                             "execution_tracking": "stages", **kw})


def numbers(runner: str, workers: int = 2, n: int = 600, **kw) -> Pipeline:
    return (Pipeline(sources.from_callable(n, R.item), seed=5, chunk_size=16)
            .map(R.noisy).filter(R.not_div7).shuffle(64).batch(8)
            .options(opts(runner, workers, **kw)))


def digest_of(pipe) -> str:
    return R.digest(pipe)


# -- the same stream -------------------------------------------------------------------

@pytest.mark.ci
def test_tokenize_pack_batch_over_100k_documents_is_the_threads_stream(cluster, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    del tokenizers
    import _tokenize_fns as T

    tok_dir = T.train_tokenizer(str(tmp_path / "tok"))

    def make(runner):
        return (Pipeline(sources.from_callable(100_000, T.text_sample), seed=2, chunk_size=512)
                .tokenize(tok_dir, add_bos=True, add_eos=True)
                .pack_documents(256).batch(16).options(opts(runner, 3)))

    assert digest_of(make("ray")) == digest_of(make("threads"))


@pytest.mark.ci
def test_an_image_decode_pipeline_is_the_threads_stream(cluster):
    from zephon.vision import RandomResizedCrop

    def make(runner):
        return (Pipeline(sources.from_callable(240, R.jpeg_sample), seed=4, chunk_size=16)
                .map(RandomResizedCrop(32)).batch(16).options(opts(runner, 3)))

    got = list(make("ray"))
    assert got[0]["image"].shape == (16, 32, 32, 3)
    assert R.digest(got) == digest_of(make("threads"))


@pytest.mark.ci
def test_a_mixture_with_a_filter_is_the_threads_stream(cluster):
    def make(runner):
        mix = sources.mixture({"a": sources.from_callable(700, R.value_sample),
                               "b": sources.from_callable(300, R.value_sample)},
                              weights={"a": 0.6, "b": 0.4})
        return (Pipeline(mix, seed=9, chunk_size=32, num_epochs=2).map(R.plus_one)
                .filter(R.drop_every_fifth).batch(10).options(opts(runner, 3)))

    assert digest_of(make("ray")) == digest_of(make("threads"))


def test_one_stage_on_ray_the_rest_on_threads(cluster):
    def make(per_stage):
        return (Pipeline(sources.from_callable(300, R.item), seed=1, chunk_size=16)
                .map(R.noisy).shuffle(32).map(R.plus_id).batch(8)
                .options(RuntimeOptions(runner="threads", per_stage_runner=per_stage,
                                        max_workers=2, worker_allocation="per_stage_fixed")))

    plan = make({0: "ray"}).plan()
    assert [s.mode for s in plan.stages] == ["ray", "threads"]
    assert digest_of(make({0: "ray"})) == digest_of(make({}))


@pytest.mark.parametrize("make", [R.item, R.big_item])
@pytest.mark.parametrize("runners", [("ray", "inline"), ("process", "ray"), ("ray", "ray")])
def test_arrays_in_and_out_of_a_ray_stage_are_writable_as_on_every_runner(cluster, make,
                                                                           runners):
    """Ray's object store hands arrays over read-only; an op of a Ray stage, an op after
    one, and the loop that work in place get arrays they may write to (small and 1 MiB
    ones)."""
    def pipe(first, second):
        return (Pipeline(sources.from_callable(64, make), seed=1, chunk_size=8)
                .map(R.noisy).shuffle(8).map(R.bump_in_place).batch(8)
                .options(RuntimeOptions(per_stage_runner={0: first, 1: second},
                                        max_workers=2, worker_allocation="per_stage_fixed")))

    got = list(pipe(*runners))
    assert all(b["x"].flags.writeable for b in got)
    assert R.digest(got) == digest_of(pipe("process", "inline"))


def test_a_result_that_cannot_be_pickled_fails_as_on_the_process_runner(cluster):
    """The records before it delivered, then the OpError naming the op, the sample and
    the object, as a process worker reports it."""
    def run(runner):
        got, error = [], None
        pipe = (Pipeline(sources.from_callable(80, R.item), seed=2, chunk_size=8)
                .map(R.lock_at_50).options(opts(runner, 2)))
        try:
            got.extend(int(s["id"]) for s in pipe)
        except Exception as exc:  # noqa: BLE001 - compared below
            error = exc
        return got, type(error).__name__, str(error)

    on_ray, on_process = run("ray"), run("process")
    assert on_ray[1] == on_process[1] == "OpError"
    assert on_ray[0] == on_process[0]
    assert "lock_at_50" in on_ray[2] and "50" in on_ray[2] and "cannot be pickled" in on_ray[2]


def test_more_actors_than_the_cluster_has_cpus_for_run_on_those_it_places(cluster):
    """8 actors asked of a 6-CPU cluster: Ray places 6; no unit waits on the other two."""
    def make(runner):
        return (Pipeline(sources.from_callable(400, R.item), seed=2, chunk_size=8)
                .map(R.noisy).batch(8).options(opts(runner, 8)))

    pipe = make("ray")
    assert R.digest(pipe) == digest_of(make("threads"))
    ready = int(re.search(r"(\d+) Ray actor\(s\) ready", pipe.explain()).group(1))
    assert 1 <= ready <= 6
    pipe.close()


# -- exactly once through failures -------------------------------------------------------

def _ids(batches) -> list[int]:
    return [int(i) for b in batches for i in b["id"]]


def _logged(path: str, runner: str, workers: int = 3, n: int = 480) -> Pipeline:
    return (Pipeline(sources.from_callable(n, R.item), seed=7, chunk_size=8)
            .map(R.Logged(path, sleep=0.004)).map(R.noisy).batch(8)
            .options(opts(runner, workers)))


def _check_once(path: str, n: int, lost: set[int]) -> None:
    """Every sample ran; no sample ran twice on an actor that was not lost (a re-run
    follows a call cut short by the loss, on another actor). Calls in this process are
    the validation's probes of the first sample, not the stream's."""
    calls = [(i, pid) for i, pid in R.calls(path) if pid != os.getpid()]
    assert {i for i, _ in calls} == set(range(n))
    survivors: dict[int, int] = {}
    for i, pid in calls:
        if pid not in lost:
            survivors[i] = survivors.get(i, 0) + 1
    assert max(survivors.values()) == 1, "a sample ran twice on actors that lived"


@pytest.mark.ci
def test_an_actor_killed_mid_run_loses_nothing_and_duplicates_nothing(cluster, tmp_path):
    reference = digest_of(_logged(str(tmp_path / "ref.log"), "threads"))
    path = str(tmp_path / "ray.log")
    it = iter(_logged(path, "ray"))
    got = [next(it) for _ in range(12)]
    victim = R.calls(path)[-1][1]
    assert victim != os.getpid()
    os.kill(victim, signal.SIGKILL)
    got += list(it)
    stats = it.stats()
    it.close()
    assert wait_gone([victim], HANG_S) == []
    assert R.digest(got) == reference
    _check_once(path, 480, {victim})
    assert stats["stage0"]["worker_restarts"] >= 1


@pytest.mark.ci
def test_a_worker_node_stopped_mid_run_loses_nothing(clusters, tmp_path):
    cluster, nodes = clusters.three_nodes()
    reference = digest_of(_logged(str(tmp_path / "ref.log"), "threads"))
    path = str(tmp_path / "ray.log")
    it = iter(_logged(path, "ray", workers=4))
    got = [next(it) for _ in range(10)]
    on = {}  # node id -> the actors' pids that ran units there so far
    for _, pid, node in R.placed_calls(path):
        if pid != os.getpid():
            on.setdefault(node, set()).add(pid)
    victim = max(nodes, key=lambda n: len(on.get(n.node_id, ())))  # a worker node
    lost = on.get(victim.node_id, set())
    assert lost, f"no actor ran on either worker node: {on}"
    cluster.remove_node(victim)  # its raylet and every worker process on it stop
    got += list(it)
    it.close()
    assert wait_gone(sorted(lost), HANG_S) == []
    assert R.digest(got) == reference
    _check_once(path, 480, lost)


def test_an_op_error_is_raised_in_stream_order_as_on_threads(cluster):
    def run(runner):
        got, error = [], None
        pipe = (Pipeline(sources.from_callable(400, R.item), seed=3, chunk_size=16)
                .map(R.fail_at).batch(4).options(opts(runner, 3)))
        try:
            for b in pipe:
                got.append(b)
        except Exception as exc:  # noqa: BLE001 - compared below
            error = exc
        return R.digest(got), type(error), str(error)

    ray_run, threads_run = run("ray"), run("threads")
    assert ray_run[1] is threads_run[1] and ray_run[1] is not type(None)
    assert "sample 123 is bad" in ray_run[2]
    assert ray_run[0] == threads_run[0]


# -- checkpoints across runners and actor counts ------------------------------------------

@pytest.mark.ci
@pytest.mark.parametrize("there,back", [("ray", "threads"), ("threads", "ray"),
                                        ("ray", "process"), ("ray", "mtp")])
def test_a_checkpoint_restores_across_ray_and_the_other_runners(cluster, there, back):
    def make(runner):
        if runner == "mtp":  # the engine in a subprocess, its stage on threads
            return numbers("threads", mtp_mode=True)
        return numbers(runner)

    k = int(np.random.default_rng().integers(1, 60))
    assert_resumes(lambda: make(there), k, again=lambda: make(back), key=batch_key)


@pytest.mark.ci
@pytest.mark.parametrize("actors", [1, 3])
def test_a_ray_checkpoint_restores_on_another_number_of_actors(cluster, actors):
    k = int(np.random.default_rng().integers(1, 60))
    assert_resumes(lambda: numbers("ray", 2), k, again=lambda: numbers("ray", actors),
                   key=batch_key, next_pass=False)


RANK = """
import json, sys
sys.path.insert(0, {tests!r})
import ray
ray.init(address={address!r}, logging_level="ERROR")
import _ray_fns as R
print(json.dumps(R.lane_keys(R.ranked("ray", {world}, {rank}))))
"""


@pytest.mark.ci
def test_two_ranks_each_with_their_own_ray_stage_make_the_one_rank_stream(cluster):
    """Two driver processes (as torchrun ranks are), each with its own Ray stage on the
    one shared cluster: their batches, merged lane by lane in the round-robin order, are
    the stream one rank makes on threads."""
    procs = [subprocess.Popen(
        [sys.executable, "-c", RANK.format(tests=TESTS, address=cluster[0].address,
                                           world=2, rank=rank)],
        stdout=subprocess.PIPE, text=True) for rank in range(2)]
    outs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0
        outs.append(json.loads(out.strip().splitlines()[-1]))
    by_lane: dict = {}
    for rank_batches in outs:
        for lane, index, ids, x in rank_batches:
            by_lane.setdefault(lane, []).append((index, ids, x))
    assert sorted(by_lane) == [0, 1, 2, 3] and all(outs)
    single = R.lane_keys(R.ranked("threads"))
    merged, counts = [], dict.fromkeys(by_lane, 0)
    queues = {lane: sorted(items) for lane, items in by_lane.items()}
    while any(queues.values()):
        lane = min((k for k in queues if queues[k]), key=lambda k: (counts[k], k))
        index, ids, x = queues[lane].pop(0)
        merged.append([lane, index, ids, x])
        counts[lane] += 1
    assert merged == single


# -- autotune -----------------------------------------------------------------------------

@pytest.mark.ci
def test_autotune_grows_a_ray_stage_past_the_hosts_cores_within_the_cluster(cluster):
    """An I/O-bound Ray stage under autotune: the controller grows it while the consumer
    waits, past this host's CPU budget (its actors draw on the cluster's 6 CPUs)."""
    pipe = (Pipeline(sources.from_callable(2400, R.item), seed=1, chunk_size=64)
            .map(R.wait_10ms).batch(16)
            .options(RuntimeOptions(runner="ray", worker_allocation="autotune")))
    it = iter(pipe)
    reference = R.digest(numbers_of(2400, "threads"))
    got = R.digest(it)
    snap = it.stats()["autotune"]
    it.close()
    assert got == reference
    most = max(d["after"] for d in snap["decisions"])
    assert most > snap["cpu_budget"], snap["decisions"]
    assert most <= ray.cluster_resources()["CPU"]
    assert "the Ray cluster's CPUs" in pipe.explain()


def numbers_of(n: int, runner: str) -> Pipeline:
    return (Pipeline(sources.from_callable(n, R.item), seed=1, chunk_size=64)
            .map(R.wait_10ms).batch(16).options(opts(runner, 4)))


# -- errors, exits ------------------------------------------------------------------------

def test_without_ray_the_error_names_the_extra():
    code = textwrap.dedent("""
        import sys
        sys.modules["ray"] = None  # as if Ray were not installed
        from zephon import Pipeline, RuntimeOptions, ZephonConfigError, sources
        pipe = Pipeline(sources.from_sequence(list(range(10)))).options(
            RuntimeOptions(runner="ray"))
        try:
            list(pipe)
        except ZephonConfigError as exc:
            print("ERROR", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=HANG_S)
    assert "ERROR runner='ray' needs Ray" in out.stdout, out.stderr
    assert '.[ray]' in out.stdout


@pytest.mark.ci
def test_a_module_missing_on_the_nodes_names_the_node_and_the_module(cluster, tmp_path):
    only_here = tmp_path / "only_here"
    only_here.mkdir()
    (only_here / "driver_only_ops.py").write_text("def twice(s):\n    return s * 2\n")
    sys.path.insert(0, str(only_here))
    try:
        import driver_only_ops

        pipe = Pipeline(sources.from_sequence(list(range(20)))).map(
            driver_only_ops.twice).options(opts("ray"))
        with pytest.raises(ZephonConfigError) as info:
            list(pipe)
    finally:
        sys.path.remove(str(only_here))
        sys.modules.pop("driver_only_ops", None)
    text = str(info.value)
    addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert "driver_only_ops" in text and "install" in text
    assert any(f"on node {a} " in text for a in addresses), text


def _actor_pids(path: str) -> set[int]:
    return {pid for _, pid in R.calls(path)} - {os.getpid()}


@pytest.mark.ci
@pytest.mark.parametrize("how", ["break", "exception"])
def test_leaving_a_run_leaves_no_actor(cluster, tmp_path, how):
    path = str(tmp_path / "calls.log")
    pipe = _logged(path, "ray", workers=3, n=2000)
    try:
        for k, _ in enumerate(pipe):
            if k == 5:
                if how == "break":
                    break
                raise RuntimeError("the training step failed")
    except RuntimeError:
        pass
    pids = _actor_pids(path)
    assert pids
    assert wait_gone(sorted(pids), HANG_S) == []


DRIVER = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
import ray
ray.init(address={address!r}, logging_level="ERROR")
import _ray_fns as R
from zephon import Pipeline, RuntimeOptions, sources
pipe = (Pipeline(sources.from_callable(5000, R.item), seed=7, chunk_size=8)
        .map(R.Logged({path!r}, sleep=0.004)).batch(8)
        .options(RuntimeOptions(runner="ray", max_workers=3,
                                worker_allocation="per_stage_fixed")))
try:
    for k, batch in enumerate(pipe):
        if k == 5:
            os.kill(os.getpid(), signal.SIGINT)
except KeyboardInterrupt:
    print("interrupted", os.getpid(), flush=True)
sys.stdin.readline()  # the driver stays up while the test looks for its actors
"""


@pytest.mark.ci
def test_ctrl_c_in_the_driver_leaves_no_actor(cluster, tmp_path):
    path = str(tmp_path / "calls.log")
    code = DRIVER.format(tests=TESTS, address=cluster[0].address, path=path)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        word, driver = proc.stdout.readline().split()
        assert word == "interrupted"
        pids = _actor_pids(path) - {int(driver)}  # (the driver ran the validation's probes)
        assert pids
        assert wait_gone(sorted(pids), HANG_S) == []  # while the driver still runs
        assert proc.poll() is None
    finally:
        proc.stdin.close()
        try:
            proc.wait(HANG_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


SHUT_DOWN = """
import sys, time
sys.path.insert(0, {tests!r})
import ray
ray.init(address={address!r}, logging_level="ERROR")
import _ray_fns as R
pipe = R.ranked("ray")
list(pipe)                    # an epoch: its actors are kept for the next
ray.shutdown()                # the user ends their connection (its actors go with it)
t = time.monotonic()
pipe.close()                  # must not start a Ray to stop what is gone
print(round(time.monotonic() - t, 2), ray.is_initialized())
"""


def test_closing_kept_actors_after_the_user_shut_ray_down_starts_nothing(cluster):
    code = SHUT_DOWN.format(tests=TESTS, address=cluster[0].address)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=HANG_S * 2)
    assert out.returncode == 0, out.stderr
    seconds, initialized = out.stdout.split()
    assert initialized == "False" and float(seconds) < 2.0, out.stdout


def test_explain_and_the_report_show_the_ray_stage(cluster):
    import zephon

    pipe = numbers("ray", 2)
    assert "runner=ray" in pipe.explain()
    it = iter(pipe)
    next(it)
    report = it.stats(report=True)
    it.close()
    assert report["stages"]["stage0"]["runner"] == "ray"
    assert re.match(r"[12] Ray actor\(s\) ready, [01] starting, on [12] node", report["ray"]["stage0"])
    assert "unit(s) in flight" in report["ray"]["stage0"]
    assert "Ray actor(s) ready" in pipe.explain()
    html = zephon.profile(numbers("ray", 2), steps=10).html()
    assert "Ray stages" in html and "re-run after" in html


def test_persistent_workers_keep_the_actors_between_epochs(cluster, tmp_path):
    path = str(tmp_path / "calls.log")
    pipe = (Pipeline(sources.from_callable(200, R.item), seed=1, chunk_size=8, num_epochs=1)
            .map(R.Logged(path)).batch(8).options(opts("ray", 2)))
    first = R.digest(pipe)
    pids = _actor_pids(path)
    os.remove(path)
    second = R.digest(pipe)
    assert _actor_pids(path) <= pids  # the same actors served the next epoch
    assert first != second  # (another epoch: another order)
    pipe.close()
    assert wait_gone(sorted(pids), HANG_S) == []
    time.sleep(0)
