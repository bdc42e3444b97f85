"""Checkpoint aggregation through an fsspec URL: memory:// (one process), file://, and
s3:// against a real S3-compatible server (moto's server mode) that the tests start on
127.0.0.1, including the server going away in the middle of a round."""

from __future__ import annotations

import os
import threading
import time

import pytest

from _aggregate_rank import free_port, launch  # noqa: F401  (fixture)
from test_aggregate_dir import expected_after, resumed
from test_pipeline_elastic import C, interleave, pipeline
from zephon import RuntimeOptions
from zephon.checkpoint import decode_state

pytest.importorskip("fsspec")


def exchange_in_threads(url, world=2, take=2):
    """Ranks as threads of this process (memory:// is per process)."""
    states, errors = {}, {}

    def rank(r):
        pipe = pipeline().options(RuntimeOptions(world_size=world, global_rank=r,
                                                 canonical_replicas=C, aggregate_dir=url,
                                                 run_id="job"))
        it = iter(pipe)
        for _ in range(take):
            next(it)
        try:
            states[r] = pipe.checkpoint()
        except Exception as exc:  # noqa: BLE001
            errors[r] = exc
        finally:
            pipe.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return [states[r] for r in range(world)]


def test_memory_url_exchanges_within_one_process():
    states = exchange_in_threads(f"memory://zephon-test-{os.getpid()}-{time.time_ns()}")
    assert states[0] == states[1]
    assert interleave(resumed(states[0]), {lane: 1 for lane in range(C)}) == expected_after(1)


def test_file_url_is_a_local_directory(tmp_path, launch):
    url = f"file://{tmp_path / 'agg'}"
    results = launch([dict(tag="a", rank=r, world=2, take=2,
                           opts={"aggregate_dir": url, "run_id": "job"})
                      for r in range(2)])
    assert [code for code, _ in results] == [0, 0], results
    # the round ran in <dir>/<run_id>/<scope of this launch and pipeline>/round-<n>, and
    # the last rank to read the merged state removed it
    scopes = list((tmp_path / "agg" / "job").glob("p-*"))
    assert len(scopes) == 1 and scopes[0].is_dir()
    assert [p for p in scopes[0].rglob("*")] == []


@pytest.fixture
def s3_server():
    """A moto S3 server on 127.0.0.1 with bucket ``zephon-agg``; yields (server, env)."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": endpoint,
           "AWS_ENDPOINT_URL": endpoint}
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.create_bucket(Bucket="zephon-agg")
    state = {"running": True}

    def stop():
        if state["running"]:
            state["running"] = False
            server.stop()

    yield stop, env
    stop()


def test_s3_two_launches_with_a_late_rank_merge_only_their_own_round(tmp_path, launch,
                                                                     s3_server):
    _, env = s3_server
    url = "s3://zephon-agg/runs"
    first = launch([dict(tag="a", rank=r, world=2, take=6,
                         opts={"aggregate_dir": url, "run_id": "job"})
                    for r in range(2)], env=env)
    assert [code for code, _ in first] == [0, 0], first
    second = launch([dict(tag="b", rank=0, world=2, take=2,
                          opts={"aggregate_dir": url, "run_id": "job"}),
                     dict(tag="b", rank=1, world=2, take=2, delay=1.5,
                          opts={"aggregate_dir": url, "run_id": "job"})], env=env)
    assert [code for code, _ in second] == [0, 0], second
    states = [(tmp_path / f"state-b-{r}").read_bytes() for r in range(2)]
    assert states[0] == states[1]
    assert sorted(int(k) for k in decode_state(states[0])["lanes"]) == list(range(C))
    assert interleave(resumed(states[0]), {lane: 1 for lane in range(C)}) == expected_after(1)


def test_s3_server_gone_mid_round_is_a_clear_error_on_every_rank(tmp_path, launch, s3_server):
    stop, env = s3_server
    url = "s3://zephon-agg/runs"
    announce = tmp_path / "rank0-in-checkpoint"
    done = {}

    def run():
        done["results"] = launch(
            [dict(tag="a", rank=0, world=2, take=2, announce=str(announce),
                  opts={"aggregate_dir": url, "run_id": "job"}),
             dict(tag="a", rank=1, world=2, take=2, delay=6.0,
                  opts={"aggregate_dir": url, "run_id": "job"})],
            env=env, timeout=150)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 120
    while not announce.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # rank 0 has opened the round and waits for rank 1
    stop()
    thread.join(160)
    results = done["results"]
    assert [code for code, _ in results] == [3, 3], results
    for _, err in results:
        assert "CheckpointError" in err and "s3://zephon-agg/runs" in err
        assert "nothing was merged" in err
    # nothing half-merged: no rank produced a state
    assert not any((tmp_path / f"state-a-{r}").exists() for r in range(2))


def test_s3_endpoint_nobody_serves_is_a_clear_error(tmp_path, launch):
    pytest.importorskip("s3fs")
    endpoint = f"http://127.0.0.1:{free_port()}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": endpoint,
           "AWS_ENDPOINT_URL": endpoint}
    (code, err), = launch([dict(tag="a", rank=0, world=2, take=2,
                                opts={"aggregate_dir": "s3://zephon-agg/runs",
                                      "run_id": "job"})], env=env)
    assert code == 3 and "CheckpointError" in err
    assert "s3://zephon-agg/runs" in err and "nothing was merged" in err


@pytest.fixture
def silent_server():
    """A TCP server on 127.0.0.1 that accepts connections and never answers."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    accepted = []
    stop = threading.Event()

    def accept():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in accepted:
        conn.close()
    sock.close()


@pytest.mark.slow
def test_s3_server_that_never_answers_ends_at_the_deadline(tmp_path, launch, silent_server):
    pytest.importorskip("s3fs")
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": silent_server,
           "AWS_ENDPOINT_URL": silent_server}
    # a cloud aggregate_dir has a budget of at least 90 s; the rank gives up by then
    (code, err), = launch([dict(tag="a", rank=0, world=2, take=2,
                                opts={"aggregate_dir": "s3://zephon-agg/runs", "run_id": "job",
                                      "aggregate_timeout_s": 90.0})], env=env, timeout=150)
    assert code == 3
    assert "AggregationTimeoutError" in err or "CheckpointError" in err
    assert "s3://zephon-agg/runs" in err


def test_rank_0_removes_the_previous_round_once_every_rank_moved_on():
    url = f"memory://zephon-tidy-{os.getpid()}-{time.time_ns()}"
    import fsspec

    errors = []

    def rank(r):
        try:
            pipe = pipeline().options(RuntimeOptions(world_size=2, global_rank=r,
                                                     canonical_replicas=C, aggregate_dir=url,
                                                     run_id="job"))
            it = iter(pipe)
            for _ in range(3):
                next(it)
                pipe.checkpoint()
            pipe.close()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    fs, root = fsspec.core.url_to_fs(url)
    scopes = fs.ls(f"{root}/job", detail=False)
    assert len(scopes) == 1  # one launch, one pipeline: one scope
    rounds = sorted(p.rsplit("/", 1)[1] for p in fs.ls(scopes[0], detail=False))
    assert rounds == ["round-3"]
