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
    media = dir_media(str(tmp_path), world)
    out = run_round(media, world)
    check_merged_round(out, world)
    steps = backoff_steps(out["seconds"])
    lead = media[0].calls
    # rank 0: open and merged written; one listing per backoff step; each rank's file
    # read once, plus the open record three times (before and after opening, once more
    # to check nobody reopened it)
    assert lead["write"] == 2 and lead["link"] == 1
    assert lead["list"] <= steps
    assert lead["read"] <= (world - 1) + 3
    for medium in media[1:]:
        calls = medium.calls
        assert calls["write"] == 1 and calls["link"] == 1 and calls["list"] == 0
        # a read of open and of merged per backoff step of its two waits
        assert calls["read"] <= 2 * steps + 1
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # the round is gone


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
                    opts=dict(opts, aggregate_timeout_s=240.0)) for r in range(world)]
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
