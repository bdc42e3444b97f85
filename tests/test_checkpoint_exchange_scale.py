"""The checkpoint exchange at scale: the operations a rank makes in a round, and rank 0's
round trips, do not grow with the world size (W = 2 to 1024 simulated ranks, threads
running the real protocol over a real TCPStore on 127.0.0.1 and over a directory);
every rank gets the same merged bytes and no key or file is left after a round. Real
processes: a 64-rank round through aggregate_dir, a 16-rank round through a TCPStore,
exact on restore (tests/_aggregate_rank.py)."""

from __future__ import annotations

import itertools
import time

import pytest
from _aggregate_rank import free_port, launch  # noqa: F401, F811  (fixture)
from _exchange_ranks import StoreWorld, dir_media, run_round
from test_pipeline_elastic import key, pipeline

from zephon import RuntimeOptions
from zephon.checkpoint import decode_state
from zephon.checkpoint.media import DirMedium

WORLDS = (2, 64, 1024)
#: store calls of a rank other than 0 in a round: get open, check merged, append, add,
#: (set full), get merged, add ack, (set acked)
FOLLOWER_STORE_CALLS = 8
#: rank 0: check open, set open, get full, check+get subs, check+get open, set merged,
#: get acked, 7 deletes
LEAD_STORE_CALLS = 16


def check_merged_round(out: dict, world: int) -> None:
    assert not out["errors"], list(out["errors"].items())[:3]
    assert sorted(out["results"]) == list(range(world))
    assert len(set(out["results"].values())) == 1  # the same bytes on every rank
    merged = decode_state(out["results"][0])
    assert merged["lanes"] == {str(r): [0, 3 + r, 100] for r in range(world)}


@pytest.fixture(scope="module")
def store_worlds():
    pytest.importorskip("torch.distributed")
    worlds = {}
    yield lambda w: worlds.setdefault(w, StoreWorld(w))
    for world in worlds.values():
        world.close()


@pytest.mark.torch
@pytest.mark.parametrize("world", WORLDS)
def test_store_calls_per_rank_and_round_do_not_grow_with_the_world(store_worlds, world):
    sw = store_worlds(world)
    for round_no in (1, 2):  # a second round on the same connections, too
        out = run_round(sw.media, world, round_no=round_no)
        check_merged_round(out, world)
        calls = sw.calls()
        assert calls[0] <= LEAD_STORE_CALLS, calls[0]
        assert max(calls[1:]) <= FOLLOWER_STORE_CALLS, max(calls[1:])
        assert sw.keys_left() == 0  # the round's keys are gone


def test_the_store_call_bounds_are_reached_not_loose(store_worlds):
    pytest.importorskip("torch.distributed")
    sw = store_worlds(2)
    check_merged_round(run_round(sw.media, 2, round_no=7), 2)
    # one follower, so it sets both full and acked: every call of the list above
    assert sw.calls() == [LEAD_STORE_CALLS, FOLLOWER_STORE_CALLS]


def backoff_steps(seconds: float, medium=DirMedium) -> int:
    """How many reads a backoff wait of ``seconds`` makes at most."""
    delay, slept = medium.first_s, 0.0
    for step in itertools.count(1):
        if slept >= seconds:
            return step
        slept += delay
        delay = min(delay * 1.5, medium.cap_s)
    raise AssertionError  # (unreachable: count() does not end)


@pytest.mark.parametrize("world", WORLDS)
def test_directory_operations_per_rank_and_round_are_bounded_by_the_wait(tmp_path, world):
    from zephon.checkpoint.media import FAN_IN, _Tree

    media = dir_media(str(tmp_path), world)
    out = run_round(media, world)
    check_merged_round(out, world)
    steps = backoff_steps(out["seconds"])
    tree = _Tree(world)
    lead = media[0].calls
    # rank 0: open and merged written; per backoff step one listing of each level's
    # folder (at most FAN_IN names); at most FAN_IN - 1 records read a level, plus the
    # open record three times (before and after opening, once more to check nobody
    # reopened it): nothing per rank, whatever the world size
    assert lead["write"] == 2 and lead["link"] == 1
    assert lead["list"] <= steps * tree.height
    assert lead["read"] <= (FAN_IN - 1) * tree.height + 3
    for r, medium in enumerate(media[1:], start=1):
        calls, top = medium.calls, tree.top_level(r)
        assert calls["link"] == 1
        if top == 0:  # a leaf: its record, then a read of open and of merged per step
            assert calls["write"] == 1 and calls["list"] == 0
            assert calls["read"] <= 2 * steps + 1
        else:  # a subtree's leader also reads its children's records and writes the group
            assert calls["write"] == 2 and calls["list"] <= steps * top
            assert calls["read"] <= 2 * steps + 1 + (FAN_IN - 1) * top
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # the round is gone


@pytest.mark.parametrize("world", [2, 31, 32, 33, 1024, 1025, 40_000])
def test_the_gathering_tree_brings_every_rank_to_rank_0_once(world):
    from zephon.checkpoint.media import FAN_IN, _Tree

    # follow every rank's record up the tree by the keys the medium writes and reads:
    # it reaches rank 0 exactly once, and rank 0 reads at most FAN_IN - 1 keys a level
    tree = _Tree(world)
    assert FAN_IN ** (tree.height - 1) < world <= FAN_IN ** tree.height
    read_by: dict = {}  # key -> the leader that reads it
    for leader in range(world):
        for level in range(1, tree.top_level(leader) + 1):
            for child in tree.children(leader, level):
                key = (tree.record_key(child) if level == 1
                       else tree.group_key(child, level - 1))
                assert key.startswith(tree.folder(leader, level) + "/")
                assert key not in read_by
                read_by[key] = leader
    for rank in range(1, world):
        top = tree.top_level(rank)  # a leader's own record goes up inside its group
        key = tree.record_key(rank) if top == 0 else tree.group_key(rank, top)
        for _ in range(tree.height + 1):
            holder = read_by[key]
            if holder == 0:
                break
            key = tree.group_key(holder, tree.top_level(holder))
        assert holder == 0, rank
    assert sum(1 for who in read_by.values() if who == 0) <= (FAN_IN - 1) * tree.height


def test_a_rank_its_leader_gave_up_on_is_still_gathered_by_rank_0(tmp_path):
    world = 40
    import threading

    # rank 33 (a child of leader 32) arrives after leader 32 gave up its share of the
    # wait; rank 0 reads the late rank's own record, and the round is exact
    media = dir_media(str(tmp_path), world)
    late = 33
    on_time = [r for r in range(world) if r != late]
    out: dict = {}
    others = threading.Thread(target=lambda: out.update(
        run_round(media, world, ranks=on_time, timeout_s=12.0)))
    others.start()
    gone = time.monotonic() + 60
    while not list(tmp_path.rglob("group-32")) and time.monotonic() < gone:
        time.sleep(0.01)  # leader 32 published its group without rank 33
    assert list(tmp_path.rglob("group-32")), "leader 32 never published its group"
    late_out = run_round(media, world, ranks=[late], timeout_s=12.0)
    others.join(60)
    assert not out["errors"] and not late_out["errors"], (out["errors"], late_out["errors"])
    out["results"].update(late_out["results"])
    check_merged_round(out, world)


def test_directory_waits_back_off_instead_of_polling(tmp_path):
    import threading

    # rank 0 arrives 2 s late: the follower reads the directory at most backoff_steps
    # times in that while, not the 100 times a 20 ms poll would
    media = dir_media(str(tmp_path), 2)
    out: dict = {}
    follower = threading.Thread(target=lambda: out.update(run_round(media, 2, ranks=[1])))
    follower.start()
    time.sleep(2.0)  # a late rank 0 (the scenario, not a synchronisation)
    lead = run_round(media, 2, ranks=[0])
    follower.join(60)
    assert not lead["errors"] and not out["errors"]
    assert out["results"][1] == lead["results"][0]
    assert media[1].calls["read"] <= 2 * backoff_steps(out["seconds"]) + 1 < 60


def one_rank_stream(lanes: int) -> dict:
    """lane -> the keys of its batches in the one-rank stream with ``lanes`` lanes."""
    by_lane: dict = {}
    for batch in pipeline().options(RuntimeOptions(canonical_replicas=lanes)):
        by_lane.setdefault(batch.meta["lane"], []).append(key(batch))
    return by_lane


def resumed_stream(state: bytes, lanes: int) -> dict:
    pipe = pipeline().options(RuntimeOptions(canonical_replicas=lanes))
    pipe.restore(state)
    by_lane: dict = {}
    for batch in pipe:
        by_lane.setdefault(batch.meta["lane"], []).append(key(batch))
    return by_lane


def real_round(tmp_path, launch, world: int, opts: dict, take: int, env=None) -> bytes:
    configs = [dict(tag="x", rank=r, world=world, take=take, lanes=world,
                    opts=dict(opts, run_id="scale", aggregate_timeout_s=240.0))
               for r in range(world)]
    results = launch(configs, env=env, timeout=300)
    assert [code for code, _ in results] == [0] * world, [e for _, e in results if e][:2]
    states = {(tmp_path / f"state-x-{r}").read_bytes() for r in range(world)}
    assert len(states) == 1  # every rank returned the same bytes
    return states.pop()


def check_exact(state: bytes, world: int, take: int) -> None:
    """Each rank (one lane each) delivered ``take`` batches: the restore goes on exactly
    after them, lane by lane."""
    full = one_rank_stream(world)
    assert resumed_stream(state, world) == {lane: items[take:] for lane, items in full.items()
                                            if items[take:]}


@pytest.mark.slow
@pytest.mark.parametrize("world", [pytest.param(8, marks=pytest.mark.ci), 64])
def test_real_processes_through_a_directory(tmp_path, launch, world):
    agg = tmp_path / "agg"
    state = real_round(tmp_path, launch, world, {"aggregate_dir": str(agg)}, take=0)
    assert sorted(decode_state(state)["lanes"]) == []  # nothing delivered yet
    assert decode_state(state)["world"] == world
    assert [p for p in agg.rglob("*") if p.is_file()] == []  # the round is gone


@pytest.fixture
def launcher_store():
    """A TCPStore this process hosts on 127.0.0.1, as a launcher hosts its own."""
    import datetime

    dist = pytest.importorskip("torch.distributed")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    yield store, port
    del store


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("world", [pytest.param(4, marks=pytest.mark.ci), 16])
def test_real_processes_through_a_tcpstore_restore_exactly(tmp_path, launch, launcher_store,
                                                          world):
    store, port = launcher_store
    env = {"MASTER_ADDR": "", "MASTER_PORT": "", "TORCHELASTIC_USE_AGENT_STORE": ""}
    state = real_round(tmp_path, launch, world,
                       {"aggregate_store": f"torch://127.0.0.1:{port}"}, take=1, env=env)
    check_exact(state, world, take=1)
    # the ranks' connections may count in num_keys; none of the round's keys is left
    assert [k for k in store.list_keys() if k.startswith("zephon/")] == []


@pytest.mark.parametrize("medium", ["dir", "store"])
@pytest.mark.parametrize("leftover", ["crashed", "finished"])
def test_leftovers_of_an_earlier_launch_are_never_merged(tmp_path, store_worlds, medium,
                                                         leftover):
    import threading

    from zephon.checkpoint.codec import encode_state

    world = 3
    if medium == "store":
        pytest.importorskip("torch.distributed")
        media = store_worlds(world).media
    else:
        media = dir_media(str(tmp_path), world)
    # an earlier launch opened round 1 and died (crashed) or finished it (its merged
    # record is there), before the followers of this launch arrive
    stale = "0123456789abcdef"
    media[0].put("s/round-1/open", encode_state({"token": stale, "world": world}, "msgpack",
                                                "none"))
    if leftover == "finished":
        old = encode_state({"fingerprint": "old", "lanes_total": 1, "lanes": {}}, "msgpack")
        media[0].put(f"s/round-1/{stale}/merged",
                     encode_state({"state": old}, "msgpack", "none"))
    out: dict = {}
    followers = threading.Thread(target=lambda: out.update(
        run_round(media, world, ranks=[1, 2], timeout_s=60)))
    followers.start()
    time.sleep(1.0)  # the followers have met the leftovers (the scenario)
    lead = run_round(media, world, ranks=[0], timeout_s=60)
    followers.join(90)
    assert not lead["errors"] and not out["errors"], (lead["errors"], out["errors"])
    out["results"].update(lead["results"])
    check_merged_round(out, world)


def test_a_group_holding_a_rank_outside_its_subtree_is_refused():
    from zephon.checkpoint.media import _Tree
    from zephon.errors import CheckpointError

    tree = _Tree(2048)  # leader 1024 leads ranks 1024 .. 2047 at level 2
    tree.check_group(1024, 2, {1025: b"x", 2047: b"y"}, "here")
    with pytest.raises(CheckpointError, match="outside its subtree"):
        tree.check_group(1024, 2, {1025: b"x", 5: b"forged"}, "here")
