"""Checkpoint aggregation through torch's TCPStore (aggregate_store="torch://..."): an
explicit address, MASTER_ADDR/MASTER_PORT, an initialized default process group; missing
ranks named; unreachable or malformed addresses are errors within the budget. Ranks are
real processes (tests/_aggregate_rank.py)."""

from __future__ import annotations

import os

import pytest

from _aggregate_rank import free_port, launch  # noqa: F401  (fixture)
from test_aggregate_dir import expected_after, resumed
from test_pipeline_elastic import C, interleave, pipeline
from zephon import RuntimeOptions
from zephon.errors import ZephonConfigError

pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.torch

CLEAN_ENV = {"MASTER_ADDR": "", "MASTER_PORT": "", "TORCHELASTIC_USE_AGENT_STORE": "",
             "TORCHELASTIC_RUN_ID": ""}


def two_ranks(tag, opts, **extra):
    """Two ranks of a launch; without torchrun or a process group (init_pg) a launch
    names itself with its run_id (tests/test_aggregate_launches.py)."""
    if not extra.get("init_pg"):
        opts = {"run_id": f"job-{tag}", **opts}
    return [dict(tag=tag, rank=r, world=2, take=2, opts=opts, **extra) for r in range(2)]


def check_states(tmp_path, tag):
    states = [(tmp_path / f"state-{tag}-{r}").read_bytes() for r in range(2)]
    assert states[0] == states[1]
    assert interleave(resumed(states[0]), {lane: 1 for lane in range(C)}) == expected_after(1)


def test_explicit_address_rank_0_hosts_the_store(tmp_path, launch):
    store = f"torch://127.0.0.1:{free_port()}"
    results = launch(two_ranks("a", {"aggregate_store": store}), env=CLEAN_ENV)
    assert [code for code, _ in results] == [0, 0], results
    check_states(tmp_path, "a")


def test_torch_url_uses_master_addr_and_port(tmp_path, launch):
    env = dict(CLEAN_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    configs = two_ranks("a", {"aggregate_store": "torch://"})
    configs[1]["delay"] = 1.0  # a late rank still meets the round
    results = launch(configs, env=env)
    assert [code for code, _ in results] == [0, 0], results
    check_states(tmp_path, "a")


def test_torch_url_uses_the_default_process_groups_store(tmp_path, launch):
    # init_process_group binds MASTER_PORT itself: a second server there would fail, so
    # passing means zephon used the group's store
    env = dict(CLEAN_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    results = launch(two_ranks("a", {"aggregate_store": "torch://"}, init_pg=True), env=env)
    assert [code for code, _ in results] == [0, 0], results
    check_states(tmp_path, "a")


def test_aggregate_dir_under_a_process_group_needs_no_run_id(tmp_path, launch):
    # no torchrun and the default run_id: the ranks name their launch with an id rank 0
    # publishes in the group's store (tests/test_aggregate_launches.py: two at once)
    env = dict(CLEAN_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    agg = tmp_path / "agg"
    results = launch(two_ranks("a", {"aggregate_dir": str(agg)}, init_pg=True), env=env)
    assert [code for code, _ in results] == [0, 0], results
    check_states(tmp_path, "a")
    assert [p.name for p in agg.iterdir()] == ["default_run_id"]


def test_a_missing_rank_is_named_quickly(tmp_path, launch):
    store = f"torch://127.0.0.1:{free_port()}"
    (code, err), = launch([dict(tag="a", rank=0, world=2, take=2,
                                opts={"aggregate_store": store, "run_id": "job",
                                      "aggregate_timeout_s": 12.0})],
                          env=CLEAN_ENV)
    assert code == 3 and "AggregationTimeoutError" in err and "rank(s) [1]" in err
    assert "every rank must call it" in err


def test_an_address_nobody_serves_is_a_timeout_naming_it(tmp_path, launch):
    port = free_port()
    (code, err), = launch([dict(tag="a", rank=1, world=2, take=2,
                                opts={"aggregate_store": f"torch://127.0.0.1:{port}",
                                      "run_id": "job", "aggregate_timeout_s": 3.0})], env=CLEAN_ENV)
    assert code == 3 and "AggregationTimeoutError" in err
    assert f"torch://127.0.0.1:{port}" in err


def test_torch_url_without_master_addr_or_group_is_a_config_error(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    pipe = pipeline().options(RuntimeOptions(world_size=2, global_rank=0, canonical_replicas=C,
                                             aggregate_store="torch://"))
    with pytest.raises(ZephonConfigError, match="MASTER_ADDR"):
        pipe.checkpoint()


@pytest.mark.parametrize("opts", [
    dict(aggregate_store="torch://host"), dict(aggregate_store="tcp://h:1"),
    dict(aggregate_store="torch://", aggregate_dir="/tmp/agg"),
])
def test_malformed_or_doubled_exchange_options_are_config_errors(opts):
    with pytest.raises(ZephonConfigError, match="aggregate_store"):
        RuntimeOptions(world_size=2, **opts)


def _listeners(port: int) -> list[str]:
    """The local addresses of every socket listening on TCP ``port`` (from /proc/net)."""
    found = []
    for table, size in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port and len(addr) == size:
                found.append(addr)
    return found


@pytest.fixture
def launcher_store():
    """A TCPStore hosted by this process on 127.0.0.1, as a launcher hosts its own."""
    import datetime

    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    yield store, port
    del store


def test_rank_0_joins_a_store_that_already_listens_at_the_address(tmp_path, launch,
                                                                launcher_store):
    store, port = launcher_store
    before = store.num_keys()
    results = launch(two_ranks("a", {"aggregate_store": f"torch://127.0.0.1:{port}"}),
                     env=CLEAN_ENV)
    assert [code for code, _ in results] == [0, 0], results
    check_states(tmp_path, "a")
    assert store.num_keys() > before  # the round went through the launcher's store


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp")
def test_the_store_rank_0_hosts_listens_on_the_address_given_only():
    import time

    from zephon.checkpoint.store import StoreMedium

    port = free_port()
    assert _listeners(port) == []
    medium = StoreMedium.open(f"torch://127.0.0.1:{port}", run_id="bind-test", rank=0,
                              world=1, deadline=time.monotonic() + 30)
    assert medium.hosted
    assert _listeners(port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or [::]
    medium.put("k", b"v")
    assert medium.get("k") == b"v"
