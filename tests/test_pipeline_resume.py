"""Restore: constant-cost cursor resume, bounded replay, and states that are checked.

A restore must continue the stream exactly (the same items an uninterrupted run
delivers after the cut) and must not pay for the part of the epoch already
delivered: cursor-preserving lanes read nothing before the cut; lanes with a
shuffle buffer replay at most ``flush_every_k_chunks`` chunks.
"""

from __future__ import annotations

import _pipeline_fns as F
import pytest
from _resume import END, assert_resumes, assert_resumes_at, keys_of, passes, take_and_checkpoint
from _streams import id_key

from zephon import CheckpointError, Pipeline, RuntimeOptions, sources
from zephon.checkpoint import decode_state, encode_state

N, CHUNK = 2000, 16


def cursor_chain(src_fn=F.counted_sample, **opts):
    return Pipeline(sources.from_callable(N, src_fn), seed=3, chunk_size=CHUNK) \
        .map(F.double).filter(F.keep_most).batch(8) \
        .options(RuntimeOptions(runner="inline", **opts))


def replay_chain(src_fn=F.counted_sample, **opts):
    return Pipeline(sources.from_callable(N, src_fn), seed=3, chunk_size=CHUNK) \
        .map(F.double).shuffle(32).batch(8).options(RuntimeOptions(runner="inline", **opts))


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("lanes", [1, 3])
def test_cursor_resume_reads_nothing_before_the_cut(fraction, lanes):
    reference = keys_of(cursor_chain(canonical_replicas=lanes), id_key)
    cut = int(len(reference) * fraction)
    head, state = take_and_checkpoint(cursor_chain(canonical_replicas=lanes), cut, key=id_key)
    assert "resume: from the source cursor" in cursor_chain().explain()

    F.reset_reads()
    resumed = cursor_chain(F.counted_sample, canonical_replicas=lanes)
    resumed.restore(state)
    rest = iter(resumed)
    first = next(rest)["id"].tolist()
    # Reading resumes at the cursor, wherever the cut was: the first restored batch reads
    # the rest of the cut chunk and, if it needs more, the next chunk of its lane
    # (+1: validation probes the source's first sample).
    assert F.reads() <= 2 * CHUNK + 1
    assert head + [first] + keys_of(rest, id_key) == reference


@pytest.mark.parametrize("fraction", [0.1, 0.9])
def test_replay_resume_is_bounded_by_the_flush_cadence(fraction):
    k = 8  # the automatic flush_every_k_chunks with a shuffle buffer
    reference = keys_of(replay_chain(), id_key)
    cut = int(len(reference) * fraction)
    head, state = take_and_checkpoint(replay_chain(), cut, key=id_key)
    F.reset_reads()
    resumed = replay_chain(F.counted_sample)
    resumed.restore(state)
    rest = iter(resumed)
    first = next(rest)["id"].tolist()
    assert F.reads() <= CHUNK * (1 + k) + 1  # (+1: the validation probe)
    assert head + [first] + keys_of(rest, id_key) == reference


@pytest.mark.parametrize("runner", ["threads", "process", "mtp"])
def test_cursor_resume_under_every_runner(runner):
    opts = {"mtp_mode": True, "runner": "threads"} if runner == "mtp" else {"runner": runner}
    base = Pipeline(sources.from_callable(300, F.make_sample), seed=9, chunk_size=5) \
        .map(F.double, parallelism=2).filter(F.keep_most).batch(4)
    inline = lambda: base.options(RuntimeOptions(runner="inline", canonical_replicas=2))  # noqa: E731
    reference, following = passes(inline, 2, id_key)
    assert_resumes(lambda: base.options(RuntimeOptions(canonical_replicas=2, max_workers=2,
                                                       **opts)), 17, again=inline, key=id_key,
                   reference=reference, following=following)


def test_cursor_resume_across_epochs_and_at_an_epoch_end():
    base = Pipeline(sources.from_callable(40, F.make_sample), seed=2, chunk_size=4,
                    num_epochs=3).map(F.double).batch(5)
    reference = keys_of(base.options(base.runtime), id_key)  # from the start of the stream
    following = base.options(base.runtime)
    following.set_epoch(3)
    following = keys_of(following, id_key)  # the next pass: epochs 3, 4, 5
    assert following != reference and len(following) == len(reference)
    # restored at the end of the pass (END), a run goes on with the next pass
    assert_resumes_at(lambda: base.options(base.runtime),
                      (1, 7, 8, 9, 16, len(reference) - 1, END), key=id_key,
                      reference=reference, following=following)


def test_mixture_cursor_resume():
    a = sources.from_sequence([{"id": i} for i in range(50)], name="a")
    b = sources.from_sequence([{"id": 1000 + i} for i in range(30)], name="b")
    base = Pipeline(sources.mixture({"a": a, "b": b}, weights={"a": 2, "b": 1}), seed=4,
                    chunk_size=4).batch(3)
    assert_resumes(lambda: base.options(base.runtime), 11, key=id_key)


# -- states that are not what they claim ---------------------------------------------------

def _state_of(pipe, k=5):
    head, state = take_and_checkpoint(pipe, k, key=id_key)
    state = decode_state(state)
    return state


def _crafted(state, **changes):
    return encode_state(dict(state, **changes))


@pytest.mark.parametrize("chain", [cursor_chain, replay_chain])
@pytest.mark.parametrize("bad_lanes", [
    ["not", "a", "mapping"],
    {"0": "x"},
    {"0": [0.0, 1, 2]},
    {"0": [True, 1, 2]},
    {"0": ["0", 1, 2]},
    {"0": [0, 10 ** 18, 5]},
    {"0": [0, 8, 10 ** 18]},
    {"0": [0, 1]},
    {"0": [-1, 1, 1]},
    {"7": [0, 1, 1]},
    {"-0": [0, 1, 1]},
    {"zero": [0, 1, 1]},
    {"0": [5, 1, 1]},
])
def test_crafted_lane_entries_are_checkpoint_errors(chain, bad_lanes):
    state = _state_of(chain())
    if chain is replay_chain and isinstance(bad_lanes, dict):
        # the replay form has four numbers: keep the crafted ones, add the fourth
        bad_lanes = {k: (v + [1] if isinstance(v, list) and len(v) == 3 else v)
                     for k, v in bad_lanes.items()}
    pipe = chain()
    with pytest.raises(CheckpointError):
        pipe.restore(_crafted(state, lanes=bad_lanes))
    # nothing was applied: the pipeline still starts from the beginning
    assert keys_of(pipe, id_key)[:2] == keys_of(chain(), id_key)[:2]


@pytest.mark.parametrize("field,value", [
    ("fingerprint", 7), ("fingerprint", "0" * 64), ("lanes_total", 2), ("lanes_total", True),
    ("lanes_total", "1"), ("resume", "replay"),
])
def test_crafted_header_fields_are_checkpoint_errors(field, value):
    state = _state_of(cursor_chain())
    with pytest.raises(CheckpointError):
        cursor_chain().restore(_crafted(state, **{field: value}))


def test_a_replay_count_beyond_the_segment_is_refused_at_restore():
    pipe = replay_chain()
    state = _state_of(pipe)
    (lane, entry), = state["lanes"].items()
    entry = list(entry)
    entry[2] = entry[3] = 10 ** 6  # claims a million items delivered from one segment
    with pytest.raises(CheckpointError, match="items"):
        replay_chain().restore(_crafted(state, lanes={lane: entry}))


def test_a_packer_replay_count_beyond_the_segment_is_an_error_not_an_empty_stream():
    # a packer may cut many rows from one sample: no static bound, the replay finds out
    def packed():
        return Pipeline(sources.from_callable(N, F.counted_sample), seed=3, chunk_size=CHUNK) \
            .pack_tokens(4).batch(2).options(RuntimeOptions(runner="inline"))

    it = iter(packed())
    for _ in range(5):
        next(it)
    state = decode_state(it.checkpoint())
    it.close()
    (lane, entry), = state["lanes"].items()
    entry = [entry[0], entry[1], 10 ** 6, 10 ** 6, *entry[4:]]  # the carry kept
    again = packed()
    again.restore(_crafted(state, lanes={lane: entry}))
    with pytest.raises(CheckpointError, match="replaying it produced only"):
        list(again)


@pytest.mark.parametrize("key", ["01", "\u00b2", "\uff11", " 1", "1 "])
def test_lane_ids_must_be_canonical_ascii_numbers(key):
    state = _state_of(cursor_chain(canonical_replicas=2))
    entry = next(iter(state["lanes"].values()))
    with pytest.raises(CheckpointError, match="lane id"):
        cursor_chain(canonical_replicas=2).restore(_crafted(state, lanes={key: entry}))


def test_replay_entries_off_a_flush_boundary_or_with_nothing_delivered_are_refused():
    state = _state_of(replay_chain(), k=40)
    (lane, entry), = state["lanes"].items()
    for bad in ([entry[0], 3, entry[2], entry[3]], [entry[0], entry[1], 0, entry[3]]):
        with pytest.raises(CheckpointError):
            replay_chain().restore(_crafted(state, lanes={lane: bad}))


def test_restore_before_iter_is_what_checkpoint_returns_and_survives_an_ended_run():
    reference = keys_of(cursor_chain(), id_key)
    head, state = take_and_checkpoint(cursor_chain(), 3, key=id_key)
    pipe = cursor_chain()
    pipe.restore(state)
    assert decode_state(pipe.checkpoint())["lanes"] == decode_state(state)["lanes"]
    done = iter(pipe)
    rest = keys_of(done, id_key)  # this run ends; `done` is still referenced
    assert head + rest == reference
    pipe.restore(state)  # no run is going: the next iter() starts there
    assert keys_of(pipe, id_key) == rest


def test_a_second_iterator_does_not_end_the_first():
    pipe = cursor_chain()
    reference = keys_of(cursor_chain(), id_key)
    got = []
    for step, batch in enumerate(pipe):
        got.append(batch["id"].tolist())
        if step == 3:
            # a peek: its own run, continuing after the items delivered so far
            assert next(iter(pipe))["id"].tolist() == reference[4]
    assert got == reference


def _keep_mod(s, m):
    return s["id"] % m != 0


def test_fingerprints_tell_partials_and_lambdas_apart_and_are_stable_across_processes():
    import functools
    import subprocess
    import sys

    def build(fn):
        return Pipeline(sources.from_callable(10, F.make_sample)).filter(fn).batch(2)

    two, three = build(functools.partial(_keep_mod, m=2)), build(functools.partial(_keep_mod, m=3))
    assert two.fingerprint() != three.fingerprint()
    assert build(lambda s: True).fingerprint() != build(lambda s: False).fingerprint()
    it = iter(two)
    next(it)
    state = it.checkpoint()
    it.close()
    with pytest.raises(CheckpointError, match="different pipeline"):
        three.restore(state)
    code = ("import sys, functools; sys.path.insert(0, {tests!r}); import test_pipeline_resume as T;"
            "import _pipeline_fns as F; from zephon import Pipeline, sources;"
            "print(Pipeline(sources.from_callable(10, F.make_sample))"
            ".filter(functools.partial(T._keep_mod, m=2)).batch(2).fingerprint())")
    import os

    out = subprocess.run([sys.executable, "-c", code.format(tests=os.path.dirname(__file__))],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == two.fingerprint(), out.stderr


@pytest.mark.parametrize("runner", ["inline", "threads"])
def test_pack_tokens_with_empty_samples_resumes_at_every_item(runner):
    # A sample without tokens is no piece of a row: the row held at a flush boundary
    # never carries an empty piece, which its own restore would refuse as corrupt.
    def pipe():
        opts = RuntimeOptions(runner=runner, flush_every_k_chunks=1)
        return Pipeline(sources.from_callable(12, F.some_empty_tokens), shuffle=False,
                        chunk_size=1).pack_tokens(5).options(opts)

    def key(row):
        return tuple(row["tokens"].tolist())

    reference = keys_of(pipe(), key)
    assert sum(len(r) for r in reference) == sum(i % 3 for i in range(12))
    assert_resumes_at(pipe, key=key)  # every item, and the end of the pass
