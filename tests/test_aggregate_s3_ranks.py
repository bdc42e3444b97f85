"""Checkpoint rounds through ``s3://`` with more than two real rank processes.

Each rank is its own process with its own s3fs filesystem, against a moto server on
127.0.0.1, so a listing one process cached cannot see what the others write later:
the exchange must read the store's current state on every poll (with two ranks, or
ranks as threads sharing one filesystem object, a stale listing never shows).
"""

from __future__ import annotations

import pytest
from _aggregate_rank import launch  # noqa: F401  (fixture)
from test_aggregate_dir import expected_after, resumed
from test_aggregate_fsspec import s3_server  # noqa: F401  (fixture)
from test_pipeline_elastic import C, interleave

from zephon.checkpoint import decode_state

pytest.importorskip("fsspec")


def test_s3_round_of_four_processes_sees_records_written_after_rank_0_listed(
        tmp_path, launch, s3_server):  # noqa: F811
    _, env = s3_server
    world = 4
    opts = {"aggregate_dir": "s3://zephon-agg/runs", "run_id": "job"}
    # ranks 2 and 3 come a moment later: rank 0 has listed the round's folder (with
    # rank 1's record in it) before theirs are written
    results = launch([dict(tag="a", rank=r, world=world, take=1,
                           delay=(1.5 if r >= 2 else 0.0), opts=opts)
                      for r in range(world)], env=env)
    assert [code for code, _ in results] == [0] * world, results
    states = [(tmp_path / f"state-a-{r}").read_bytes() for r in range(world)]
    assert all(state == states[0] for state in states)
    assert sorted(int(k) for k in decode_state(states[0])["lanes"]) == list(range(C))
    assert interleave(resumed(states[0]), {lane: 1 for lane in range(C)}) == expected_after(1)
