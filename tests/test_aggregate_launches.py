"""Two launches started at once on one aggregate_dir (issue 40, finding 1).

A checkpoint round belongs to exactly one launch: every rank of a launch returns the
launch's one merged state or raises, and nothing from another launch is ever merged.
Launches that can be told apart (their own run_id, a torchrun launch, an initialized
process group) both succeed with their own states; launches that cannot (the default
run_id and nothing else naming the launch) are refused on every rank before anything
is exchanged. Each launch is 4 real rank processes (tests/_aggregate_rank.py); the two
launches take a different number of batches, so a state that mixes them delivers some
samples twice or never on resume.
"""

from __future__ import annotations

import pytest
from _aggregate_rank import free_port, launch  # noqa: F401  (fixture)
from test_aggregate_dir import expected_after, resumed
from test_pipeline_elastic import C, interleave

from zephon.checkpoint import decode_state

WORLD = 4  # C = 4 lanes: every rank owns one lane, and `take` batches move it `take` on
TAKES = {"a": 1, "b": 3}
CLEAN_ENV = {"MASTER_ADDR": "", "MASTER_PORT": "", "TORCHELASTIC_RUN_ID": "",
             "TORCHELASTIC_USE_AGENT_STORE": ""}


def two_launches(launch, tmp_path, rep, opts_of, env_of=lambda tag: {}, **extra):
    """Start launches "a" and "b" (WORLD ranks each) on one aggregate_dir at once;
    ``{tag: [(returncode, stderr, state or None) per rank]}``."""
    agg = str(tmp_path / "agg")  # shared by both launches and reused by every repetition
    configs = [dict(tag=f"{tag}{rep}", rank=r, world=WORLD, take=TAKES[tag],
                    opts=dict(aggregate_dir=agg, aggregate_timeout_s=60.0, **opts_of(tag)),
                    env=dict(CLEAN_ENV, **env_of(tag)), **extra)
               for r in range(WORLD) for tag in TAKES]  # interleaved: both start at once
    results = launch(configs)
    out: dict = {tag: [] for tag in TAKES}
    for cfg, (code, err) in zip(configs, results, strict=True):
        path = tmp_path / f"state-{cfg['tag']}-{cfg['rank']}"
        out[cfg["tag"][0]].append((code, err, path.read_bytes() if code == 0 else None))
    return out


def check_launch(tag: str, ranks: list) -> bytes | None:
    """The invariant: every rank of the launch returns the same state or raises, and a
    returned state is the launch's own (each of its samples delivered exactly once)."""
    assert all(code in (0, 3) for code, _, _ in ranks), ranks  # a state or an error
    states = {state for _, _, state in ranks if state is not None}
    assert len(states) <= 1, f"launch {tag}: ranks returned different states"
    if not states:
        return None
    assert all(code == 0 for code, _, _ in ranks), \
        f"launch {tag}: some ranks got a state while others raised: {ranks}"
    state = states.pop()
    take = TAKES[tag]
    assert sorted(int(lane) for lane in decode_state(state)["lanes"]) == list(range(C))
    assert interleave(resumed(state), {lane: take for lane in range(C)}) == \
        expected_after(take), f"launch {tag}: the state is not this launch's alone"
    return state


def run_default_run_id(launch, tmp_path, reps):
    for rep in range(reps):
        out = two_launches(launch, tmp_path, rep, lambda tag: {})
        for tag, ranks in out.items():
            assert check_launch(tag, ranks) is None
            # nothing names the launch: every rank refuses before anything is exchanged
            for _, err, _ in ranks:
                assert "ZephonConfigError" in err and "run_id" in err, err
    assert not list((tmp_path / "agg").rglob("round-*"))


def run_distinct_run_ids(launch, tmp_path, reps):
    for rep in range(reps):
        out = two_launches(launch, tmp_path, rep, lambda tag: {"run_id": f"job-{tag}"})
        states = {tag: check_launch(tag, ranks) for tag, ranks in out.items()}
        assert None not in states.values(), out  # both launches succeed
        assert states["a"] != states["b"]


def test_two_launches_with_the_default_run_id_both_refuse_on_every_rank(tmp_path, launch):
    run_default_run_id(launch, tmp_path, reps=2)


def test_two_launches_with_their_own_run_ids_both_get_their_own_state(tmp_path, launch):
    run_distinct_run_ids(launch, tmp_path, reps=2)


def test_two_torchrun_launches_with_the_default_run_id_both_get_their_own_state(
        tmp_path, launch):
    # what torchrun exports to the ranks of a launch (without --standalone every launch's
    # run id is "none"); each launch's store holds its own port while it runs
    ports = {tag: str(free_port()) for tag in TAKES}

    def env_of(tag):
        return {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": ports[tag]}

    out = two_launches(launch, tmp_path, 0, lambda tag: {}, env_of)
    states = {tag: check_launch(tag, ranks) for tag, ranks in out.items()}
    assert None not in states.values(), out


@pytest.mark.slow
@pytest.mark.torch
def test_two_launches_with_process_groups_and_the_default_run_id_both_get_their_own_state(
        tmp_path, launch):
    # no torchrun: each launch's ranks agree on a launch id through their process group
    # (8 processes importing torch: slow; test_aggregate_store covers one such launch)
    pytest.importorskip("torch.distributed")
    ports = {tag: str(free_port()) for tag in TAKES}
    out = two_launches(launch, tmp_path, 0, lambda tag: {},
                       lambda tag: {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": ports[tag]},
                       init_pg=True)
    states = {tag: check_launch(tag, ranks) for tag, ranks in out.items()}
    assert None not in states.values(), out


@pytest.mark.slow
def test_twenty_concurrent_launch_pairs_never_mix(tmp_path, launch):
    run_default_run_id(launch, tmp_path, reps=20)
    run_distinct_run_ids(launch, tmp_path, reps=20)
