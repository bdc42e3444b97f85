"""Checkpoint aggregation through a directory: rounds belong to one launch, stale files
never count, a merged state is checked, a rank that never calls checkpoint() is named
quickly. Ranks are real processes (tests/_aggregate_rank.py)."""

from __future__ import annotations

import time

import pytest

from _aggregate_rank import launch  # noqa: F401  (fixture)
from test_pipeline_elastic import C, interleave, key, pipeline
from zephon import RuntimeOptions
from zephon.checkpoint import decode_state, encode_state, merge_states
from zephon.checkpoint.aggregate import arrival_grace_s, owned_lanes
from zephon.errors import CheckpointError
from zephon.pipeline import lanes as pipeline_lanes


def expected_after(delivered_per_lane: int):
    """The one-rank stream after ``delivered_per_lane`` batches of every lane."""
    single = [key(b) for b in pipeline().options(RuntimeOptions(canonical_replicas=C))]
    by_lane = {}
    for item in single:
        by_lane.setdefault(item[0], []).append(item)
    return interleave({lane: items[delivered_per_lane:] for lane, items in by_lane.items()},
                      {lane: delivered_per_lane for lane in range(C)})


def resumed(state: bytes, world: int = 1, **extra):
    rest = {}
    for rank in range(world):
        pipe = pipeline().options(RuntimeOptions(world_size=world, global_rank=rank,
                                                 canonical_replicas=C, **extra))
        pipe.restore(state)
        for batch in pipe:
            rest.setdefault(batch.meta["lane"], []).append(key(batch))
    return rest


def test_second_launch_with_a_late_rank_never_merges_the_first_launchs_files(tmp_path, launch):
    agg = str(tmp_path / "agg")  # reused by both launches, default run_id
    first = launch([dict(tag="a", rank=r, world=2, take=6, opts={"aggregate_dir": agg, "run_id": "job"})
                    for r in range(2)])
    assert [code for code, _ in first] == [0, 0], first
    # Second launch: fewer batches, and rank 1 arrives late, after rank 0 has looked at
    # the directory that still holds the first launch's rank-1 file for round 1.
    second = launch([dict(tag="b", rank=0, world=2, take=2, opts={"aggregate_dir": agg, "run_id": "job"}),
                     dict(tag="b", rank=1, world=2, take=2, delay=1.5,
                          opts={"aggregate_dir": agg, "run_id": "job"})])
    assert [code for code, _ in second] == [0, 0], second
    states = [(tmp_path / f"state-b-{r}").read_bytes() for r in range(2)]
    assert states[0] == states[1]
    assert states[0] != (tmp_path / "state-a-0").read_bytes()
    lanes = decode_state(states[0])["lanes"]
    # 2 batches per rank over 2 lanes each: every lane delivered exactly one batch
    assert sorted(int(k) for k in lanes) == list(range(C))
    delivered = {lane: 1 for lane in range(C)}
    assert interleave(resumed(states[0]), delivered) == expected_after(1)


def test_only_rank_0_calling_checkpoint_fails_fast_saying_every_rank_must(tmp_path, launch):
    timeout = 12.0
    (code, err), = launch([dict(tag="a", rank=0, world=2, take=2,
                                opts={"aggregate_dir": str(tmp_path / "agg"), "run_id": "job",
                                      "aggregate_timeout_s": timeout})])
    assert code == 3
    assert "AggregationTimeoutError" in err and "rank(s) [1]" in err
    assert "every rank must call it" in err
    # named after the arrival grace, not after the whole budget
    assert f"within {arrival_grace_s(timeout):.1f} s of rank 0" in err


def test_a_rank_without_rank_0_says_rank_0_must_call_it_too(tmp_path, launch):
    (code, err), = launch([dict(tag="a", rank=1, world=2, take=2,
                                opts={"aggregate_dir": str(tmp_path / "agg"), "run_id": "job",
                                      "aggregate_timeout_s": 2.0})])
    assert code == 3 and "AggregationTimeoutError" in err
    assert "rank 0 included" in err


def test_a_rank_that_comes_after_rank_0_gave_up_on_it_raises_rank_0s_error_at_once(
        tmp_path, launch):
    # rank 0 names rank 1 after its arrival grace (5 s of 30 s) and publishes that; rank 1
    # comes 7 s late, and must take that failure as its own launch's, not wait out its
    # whole budget for a reopening and then blame rank 0
    opts = {"aggregate_dir": str(tmp_path / "agg"), "run_id": "job",
            "aggregate_timeout_s": 30.0}
    start = time.monotonic()
    results = launch([dict(tag="a", rank=0, world=2, take=2, opts=opts),
                      dict(tag="a", rank=1, world=2, take=2, delay=7.0, opts=opts)])
    elapsed = time.monotonic() - start
    assert [code for code, _ in results] == [3, 3], results
    for _, err in results:
        assert "AggregationTimeoutError" in err and "rank(s) [1] did not call checkpoint()" in err
    assert elapsed < 30.0  # rank 1 gave up at once, not at the end of its 30 s budget


def test_an_earlier_launchs_failed_round_is_not_taken_for_this_launchs(tmp_path, launch):
    agg = str(tmp_path / "agg")
    # an earlier launch with the same run_id: rank 0 alone, it gives up on rank 1
    (code, err), = launch([dict(tag="a", rank=0, world=2, take=2,
                                opts={"aggregate_dir": agg, "run_id": "job",
                                      "aggregate_timeout_s": 6.0})])
    assert code == 3 and "rank(s) [1]" in err
    # this launch's rank 1 meets that failure before its own rank 0 reopens the round
    opts = {"aggregate_dir": agg, "run_id": "job", "aggregate_timeout_s": 60.0}
    second = launch([dict(tag="b", rank=0, world=2, take=2, delay=3.0, opts=opts),
                     dict(tag="b", rank=1, world=2, take=2, opts=opts)])
    assert [code for code, _ in second] == [0, 0], second
    states = [(tmp_path / f"state-b-{r}").read_bytes() for r in range(2)]
    assert states[0] == states[1]
    assert interleave(resumed(states[0]), {lane: 1 for lane in range(C)}) == expected_after(1)


def test_a_late_rank_knows_its_launchs_failed_round_by_the_round_before(tmp_path):
    from _exchange_ranks import dir_media, run_round

    from zephon.errors import AggregationTimeoutError

    media = dir_media(str(tmp_path), 2)
    first = run_round(media, 2, round_no=1, timeout_s=30.0)
    assert not first["errors"], first["errors"]
    # round 2: rank 0 gives up on rank 1 after 0.3 s, too soon after round 1 for any
    # clock to tell; its open record names round 1's token, which rank 1 took part in
    lead = run_round(media, 2, round_no=2, ranks=[0], timeout_s=30.0, grace_s=0.3)
    assert isinstance(lead["errors"].get(0), AggregationTimeoutError), lead
    start = time.monotonic()
    late = run_round(media, 2, round_no=2, ranks=[1], timeout_s=30.0)
    assert "rank(s) [1] did not call checkpoint()" in str(late["errors"].get(1)), late
    assert time.monotonic() - start < 20.0  # at once, not at the end of its 30 s budget


def test_a_refused_merge_reaches_every_rank(tmp_path, launch):
    # one dp group of two replicas that did not stop at the same step
    opts = {"aggregate_dir": str(tmp_path / "agg"), "run_id": "job", "dp_degree": 1,
            "aggregate_timeout_s": 60.0}
    results = launch([dict(tag="a", rank=0, world=2, take=2, opts=opts),
                      dict(tag="a", rank=1, world=2, take=3, opts=opts)])
    assert [code for code, _ in results] == [3, 3]
    for _, err in results:
        assert "disagree on lane" in err and "barrier" in err
    assert "refused" in results[1][1]


def submission(group, lanes, **over):
    sub = {"fingerprint": "f", "lanes_total": 4, "lanes": lanes, "group": group, "world": 2,
           "dp_degree": 2, "mapping": "contiguous", "nonce": "n", "rank": group}
    sub.update(over)
    return sub


def test_merge_accepts_consistent_states():
    merged = merge_states({0: submission(0, {"0": [0, 1, 0, 2], "1": [0, 1, 0, 2]}),
                           1: submission(1, {"3": [0, 1, 0, 2]})})
    assert merged["lanes"] == {"0": [0, 1, 0, 2], "1": [0, 1, 0, 2], "3": [0, 1, 0, 2]}
    assert "nonce" not in merged and "group" not in merged and merged["world"] == 2


@pytest.mark.parametrize("states, match", [
    ({0: submission(0, {"2": [0, 1, 0, 2]}), 1: submission(1, {})}, "does not own"),
    ({0: submission(0, {"0": [0, 1, 0, 2]}), 1: submission(1, {"0": [0, 1, 0, 2]})},
     "does not own"),
    ({0: submission(0, {"7": [0, 1, 0, 2]}), 1: submission(1, {})}, "out of range|does not own"),
    ({0: submission(0, {"0": []}), 1: submission(1, {})}, "corrupt lane"),
    ({0: submission(0, {"0": [0, "x", 0, 1]}), 1: submission(1, {})}, "corrupt lane"),
    ({0: submission(0, {"0": [0, -1, 0, 2]}), 1: submission(1, {})}, "corrupt lane"),
    ({0: submission(0, {}), 1: submission(1, {}, fingerprint="g")}, "fingerprint"),
    ({0: submission(0, {}), 1: submission(0, {})}, "dp group"),
    ({0: submission(0, {}), 1: submission(5, {})}, "dp group"),
    ({0: submission(0, {}, world=3), 1: submission(1, {}, world=3)}, "world_size=3"),
])
def test_merge_refuses_an_inconsistent_state(states, match):
    with pytest.raises(CheckpointError, match=match):
        merge_states(states)


@pytest.mark.parametrize("strategy", ["contiguous", "interleaved"])
def test_ownership_rule_is_the_pipelines(strategy):
    for lanes in range(1, 13):
        for groups in range(1, lanes + 1):
            for group in range(groups):
                assert owned_lanes(lanes, groups, group, strategy) == \
                    pipeline_lanes.owned_lanes(lanes, groups, group, strategy)


@pytest.mark.parametrize("mapping", ["contiguous", "interleaved"])
def test_state_of_2_ranks_restores_on_3_when_3_does_not_divide_the_lanes(tmp_path, mapping):
    # the merge of two real ranks is simulated in-process: the per-lane positions after
    # one delivered batch per lane, as the 2-rank run of the test above produces them
    from zephon.pipeline.state import local_state

    ranks = []
    for rank in range(2):
        pipe = pipeline().options(RuntimeOptions(world_size=2, global_rank=rank,
                                                 canonical_replicas=C, mapping_strategy=mapping))
        it = iter(pipe)
        next(it), next(it)
        ranks.append((pipe, it))
    state = merge_states({r: dict(decode_state(encode_state(local_state(
        p.plan(), it.delivered()))), world=2, dp_degree=2, mapping=mapping,
        nonce="x", rank=r) for r, (p, it) in enumerate(ranks)})
    for _, it in ranks:
        it.close()
    blob = encode_state(state)
    by_lane = resumed(blob, world=3, mapping_strategy=mapping)
    assert sorted(by_lane) == list(range(C))
    assert interleave(by_lane, {lane: 1 for lane in range(C)}) == expected_after(1)


def _ranks_in_threads(world, body):
    import threading

    errors, out = [], {}

    def run(rank):
        try:
            out[rank] = body(rank)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def test_two_pipelines_of_one_job_share_an_aggregate_dir(tmp_path):
    from zephon import sources

    agg = str(tmp_path / "agg")

    def body(rank):
        opts = RuntimeOptions(world_size=2, global_rank=rank, canonical_replicas=C,
                              aggregate_dir=agg, run_id="job", aggregate_timeout_s=60)
        train = pipeline().options(opts)
        val = pipeline("cursor").options(opts)  # another pipeline, same dir
        states = []
        t_it, v_it = iter(train), iter(val)
        for _ in range(2):
            next(t_it), next(v_it)
            states.append((t_it.checkpoint(), v_it.checkpoint()))
        t_it.close(), v_it.close()
        return states

    out = _ranks_in_threads(2, body)
    assert out[0] == out[1]  # every rank got the same bytes, round after round
    for train_state, val_state in out[0]:
        assert decode_state(train_state)["fingerprint"] != decode_state(val_state)["fingerprint"]


def test_garbage_left_in_a_reused_directory_is_ignored(tmp_path):
    import time

    agg = tmp_path / "agg"

    def body(rank, delay=0.0):
        pipe = pipeline().options(RuntimeOptions(world_size=2, global_rank=rank,
                                                 canonical_replicas=C, aggregate_dir=str(agg),
                                                 run_id="job", aggregate_timeout_s=60))
        it = iter(pipe)
        next(it)
        time.sleep(delay if rank == 0 else 0.0)
        state = it.checkpoint()
        it.close()
        return state

    first = _ranks_in_threads(2, body)
    for path in agg.rglob("*"):  # every record of the finished launch becomes garbage
        if path.is_file():
            path.write_bytes(b"\x00garbage\xff" * 3)
    second = _ranks_in_threads(2, lambda rank: body(rank, delay=1.0))
    assert second[0] == second[1] == first[0]


TORCH_ENV = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


def test_exchange_scopes_keep_launches_and_pipelines_apart(monkeypatch):
    from zephon.checkpoint.aggregate import exchange_scope, launch_identity

    local = {"fingerprint": "a" * 64}
    opts = RuntimeOptions(world_size=2, aggregate_dir="agg")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --standalone
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    first = exchange_scope(local, launch_identity(opts, 1.0))
    assert exchange_scope(local, launch_identity(opts, 1.0)) == first  # every rank agrees
    assert exchange_scope({"fingerprint": "b" * 64}, launch_identity(opts, 1.0)) != first
    monkeypatch.setenv("MASTER_PORT", "29501")
    assert exchange_scope(local, launch_identity(opts, 1.0)) != first  # another launch
    # a loopback master is one machine's: another machine's launch uses the same address
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    import socket

    assert socket.gethostname() in launch_identity(opts, 1.0)


def test_without_torchrun_the_default_run_id_names_no_launch(monkeypatch):
    from zephon.checkpoint.aggregate import launch_identity
    from zephon.errors import ZephonConfigError

    for name in TORCH_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ZephonConfigError, match="give every launch its own run_id") as info:
        launch_identity(RuntimeOptions(world_size=2, aggregate_dir="agg"), 1.0)
    assert info.value.field == "RuntimeOptions.run_id"
    assert launch_identity(RuntimeOptions(world_size=2, aggregate_dir="agg", run_id="job-7"),
                           1.0) == ""  # the run_id, in the medium's path, names the launch


@pytest.mark.parametrize("url", ["s3:/bucket/x", "file://", "gs://"])
def test_url_typos_in_aggregate_dir_are_refused(url):
    from zephon.errors import ZephonConfigError

    with pytest.raises(ZephonConfigError, match="aggregate_dir"):
        RuntimeOptions(world_size=2, aggregate_dir=url)
