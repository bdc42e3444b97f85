"""ensure_mixture: after a filter that drops half of one component, the delivered shares
(by samples and by tokens) hold the target within 1 %; nothing of an epoch is lost
(``leftover="emit"``) or only the surplus is (``"drop"``); the stream is the same on every
runner and resumes exactly from a checkpoint at any cut; bad arguments are refused."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from _resume import assert_resumes, passes, take_and_checkpoint
from _streams import keys_of
from zephon import MixtureReadConfig, Pipeline, RuntimeOptions, sources
from zephon.checkpoint import decode_state, encode_state
from zephon.errors import CheckpointError, OpError, ZephonConfigError

import _mixture_fns as F  # noqa: E402

N = 6000  # samples per component


def mixture(weights=None, by="samples", n=N, mode="weighted_random"):
    comps = {"a": sources.from_callable(n, F.doc_a, name="a"),
             "b": sources.from_callable(n, F.doc_b, name="b")}
    return sources.mixture(comps, weights or {"a": 0.7, "b": 0.3}, by=by,
                           config=MixtureReadConfig(mode=mode, seed=5))


def filtered(mix, seed=3, chunk_size=64, **opts):
    pipe = Pipeline(mix, seed=seed, chunk_size=chunk_size).filter(F.drop_half_of_a)
    return pipe.options(RuntimeOptions(**opts)) if opts else pipe


def comp(sid) -> str:
    return sid[0].split("#")[0]


def items(pipe, size=50):
    """``(component, sample id, tokens)`` of every sample of a run, in order."""
    out = []
    for b in pipe.batch(size):
        lengths = [int(np.asarray(t).size) for t in b["tokens"]]
        out += [(comp(s), tuple(s), n) for s, n in zip(b.meta["sample_ids"], lengths,
                                                              strict=True)]
    return out


def share(stream, by="samples") -> float:
    """The share of component ``a``."""
    weigh = (lambda x: 1) if by == "samples" else (lambda x: x[2])
    total = sum(weigh(x) for x in stream)
    return sum(weigh(x) for x in stream if x[0] == "a") / total


# -- shares ----------------------------------------------------------------------------------

def test_the_filter_alone_drifts_from_the_target():
    """The premise: half of ``a`` dropped, its share falls far below 0.7."""
    assert share(items(filtered(mixture()))) < 0.6


@pytest.mark.parametrize("mode", ["weighted_random", "weighted_round_robin"])
def test_drop_holds_the_sample_shares_within_one_percent(mode):
    base = items(filtered(mixture(mode=mode)))
    got = items(filtered(mixture(mode=mode)).ensure_mixture(leftover="drop"))
    assert abs(share(got) - 0.7) < 0.01
    kept = collections.Counter(x[1] for x in got)
    assert max(kept.values()) == 1 and set(kept) <= {x[1] for x in base}
    assert {x[1] for x in base if x[0] == "a"} <= set(kept)  # only the surplus goes


def test_the_running_share_tracks_the_target():
    got = items(filtered(mixture()).ensure_mixture(leftover="drop"))
    a = np.cumsum([x[0] == "a" for x in got])
    n = np.arange(1, len(got) + 1)
    assert np.all(np.abs(a[99:] / n[99:] - 0.7) < 0.01)  # every prefix of 100 or more


def test_drop_holds_the_token_shares_within_one_percent():
    """A mixture by tokens, half of ``a`` filtered out: by tokens, restored."""
    weights = {"a": 0.5, "b": 0.5}
    base = items(filtered(mixture(weights, by="tokens")))
    assert share(base, "tokens") < 0.4
    got = items(filtered(mixture(weights, by="tokens")).ensure_mixture(by="tokens",
                                                                        leftover="drop"))
    assert abs(share(got, "tokens") - 0.5) < 0.01


def test_under_a_schedule_each_epoch_holds_its_own_weights():
    steps = [(0, {"a": 0.7, "b": 0.3}), (1, {"a": 0.4, "b": 0.6})]
    pipe = Pipeline(mixture(steps, n=3000), seed=3, num_epochs=2).filter(F.drop_half_of_a)
    got = items(pipe.ensure_mixture(leftover="drop"))
    for epoch, weights in steps:
        assert abs(share([x for x in got if x[1][2] == epoch]) - weights["a"]) < 0.01


def test_tokens_of_a_mixture_by_samples_are_put_back_to_the_target():
    """Shares by samples are not shares by tokens (``b``'s documents are longer): given
    token weights, the op holds them."""
    got = items(Pipeline(mixture({"a": 0.5, "b": 0.5}), seed=3)
                .ensure_mixture({"a": 0.5, "b": 0.5}, by="tokens", leftover="drop"))
    assert abs(share(got, "tokens") - 0.5) < 0.01


def test_emit_keeps_the_epoch_and_delivers_the_surplus_last():
    """``leftover="emit"``: the epoch's multiset is its input's; the stream is the
    ``drop`` stream followed by the surplus, which the target could not place."""
    base = items(filtered(mixture()))
    got = items(filtered(mixture()).ensure_mixture())
    dropped = items(filtered(mixture()).ensure_mixture(leftover="drop"))
    assert collections.Counter(got) == collections.Counter(base)
    assert got[:len(dropped)] == dropped
    assert abs(share(got[:len(dropped)]) - 0.7) < 0.01
    assert {x[0] for x in got[len(dropped):]} == {"b"}


def test_every_epoch_is_kept_whole_and_the_buffer_never_spans_two():
    pipe = Pipeline(mixture(n=500), seed=3, chunk_size=32, num_epochs=3).filter(
        F.drop_half_of_a)

    def ids(p):
        return [tuple(s) for b in p.batch(10) for s in b.meta["sample_ids"]]

    base, got = ids(pipe), ids(pipe.ensure_mixture(max_buffer=64))
    assert collections.Counter(got) == collections.Counter(base)
    epochs = [s[2] for s in got]
    assert epochs == sorted(epochs) and set(epochs) == {0, 1, 2}


def held_at_most(base, got, bound):
    """Whether, after each record read (``base``: the op's input, one lane), the op had
    emitted all but at most ``bound`` of them."""
    pending, ahead = set(), set()  # read, not yet emitted; emitted, not yet read
    for x, y in zip(base, got, strict=True):
        if x in ahead:
            ahead.remove(x)
        else:
            pending.add(x)
        if y in pending:
            pending.remove(y)
        else:
            ahead.add(y)
        if len(pending) > bound:
            return False
    return True


def test_a_bounded_buffer_holds_at_most_max_buffer_and_then_follows_the_input():
    """With a buffer too small for the surplus, the op still reorders only: the epoch
    is its input, and it never holds more than ``max_buffer`` samples."""
    base = items(filtered(mixture()))
    got = items(filtered(mixture()).ensure_mixture(max_buffer=16))
    assert collections.Counter(got) == collections.Counter(base)
    assert held_at_most(base, got, 16) and not held_at_most(base, got, 15)


@pytest.mark.parametrize("leftover", ["emit", "drop"])
def test_stats_count_the_forced_the_flushed_and_the_dropped(leftover):
    base = items(filtered(mixture(n=1000)))
    pipe = filtered(mixture(n=1000)).ensure_mixture(max_buffer=16, leftover=leftover)
    it = iter(pipe.options(RuntimeOptions(execution_tracking="nodes")).batch(50))
    got = sum(len(b.meta["sample_ids"]) for b in it)
    node = it.stats()["serial1_ensure_mixture"]
    assert node["forced"] > 0 and node[{"emit": "flushed", "drop": "dropped"}[leftover]] == 16
    assert got == len(base) - (16 if leftover == "drop" else 0)


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_ties_go_to_the_first_component_of_the_weights(order):
    """At a lane's start every deficit is 0: the first component named goes first, and
    then they alternate (equal weights)."""
    got = items(Pipeline(mixture({"a": 0.5, "b": 0.5}, n=50), seed=3)
                .ensure_mixture({k: 0.5 for k in order}))
    assert [x[0] for x in got[:6]] == list(order) * 3


def test_a_component_that_runs_dry_does_not_stall_the_stream():
    """Every ``a`` filtered out: the op waits for it while its buffer has room, then lets
    ``b`` through; nothing is lost."""
    pipe = Pipeline(mixture(n=400), seed=3).filter(F.only_b)
    base, got = items(pipe), items(pipe.ensure_mixture(max_buffer=8))
    assert collections.Counter(got) == collections.Counter(base) and len(base) == 400
    assert held_at_most(base, got, 8)


# -- determinism, runners, resume -------------------------------------------------------------

def small(flush=1, lanes=2, runner=None, leftover="emit", max_buffer=256):
    opts = dict(canonical_replicas=lanes, flush_every_k_chunks=flush)
    if runner:
        opts.update(runner=runner, max_workers=2)
    return filtered(mixture(n=600), chunk_size=16, **opts).ensure_mixture(
        max_buffer=max_buffer, leftover=leftover).batch(4)


def key(batch):
    return (batch.meta["lane"], tuple(map(tuple, batch.meta["sample_ids"])))


@pytest.mark.parametrize("runner", ["threads", "process"])
def test_every_runner_gives_the_same_stream(runner):
    assert keys_of(small(runner=runner), key) == keys_of(small(), key)


@pytest.mark.parametrize("leftover", ["emit", "drop"])
@pytest.mark.parametrize("take", [1, 7, 30, 61, 95])
def test_restore_at_any_cut_equals_the_uninterrupted_stream(take, leftover):
    resumed = assert_resumes(lambda: small(leftover=leftover), take, key=key)
    lanes = decode_state(resumed.state)["lanes"]
    if take in (30, 61):  # mid-epoch: a lane's buffer is in its carry
        assert any(len(v) > 4 and v[4] > 0 for v in lanes.values())


def packed(runner=None):
    opts = dict(canonical_replicas=2, flush_every_k_chunks=1)
    if runner:
        opts.update(runner=runner, max_workers=2)
    return filtered(mixture(n=300), chunk_size=16, **opts).ensure_mixture(
        by="tokens", max_buffer=64).pack_tokens(32).batch(2)


def packed_key(batch):
    return (batch.meta["lane"], tuple(map(tuple, batch.meta["sample_ids"])),
            tuple(batch["tokens"].reshape(-1).tolist()))


@pytest.mark.parametrize("take", [3, 20, 47])
def test_a_packer_after_it_resumes_exactly(take):
    """The packer's pieces are records the queue handed on: their lineage is the samples'."""
    ref, following = passes(packed, 2, packed_key)
    assert keys_of(packed("threads"), packed_key) == ref
    assert_resumes(packed, take, key=packed_key, reference=ref, following=following)


def test_restore_on_another_runner():
    assert_resumes(small, 40, again=lambda: small(runner="threads"), key=key)


def test_a_carry_holding_more_than_max_buffer_is_refused():
    _, state = _take(small(max_buffer=256), 30)
    decoded = decode_state(state)
    entry = next(v for _, v in decoded["lanes"].items() if len(v) > 4)
    entry[4] = 10_000
    with pytest.raises(CheckpointError):
        small(max_buffer=256).restore(encode_state(decoded))


def _take(pipe, k):
    return take_and_checkpoint(pipe, k, key)


# -- arguments ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, says", [
    ({"by": "bytes"}, "by must be"),
    ({"field": ""}, "field must be"),
    ({"max_buffer": 0}, "max_buffer"),
    ({"max_buffer": 1.5}, "max_buffer"),
    ({"max_buffer": (1 << 20) + 1}, "at most"),
    ({"leftover": "keep"}, "leftover must be"),
    ({"weights": {"a": 0.0, "b": 1.0}}, "positive"),
    ({"weights": {"a": "x"}}, "positive"),
    ({"weights": {}}, "non-empty mapping"),
    ({"weights": [0.5, 0.5]}, "non-empty mapping"),
    ({"weights": {"a": 0.5, "zz": 0.5}}, r"unknown component\(s\) \['zz'\] and leave out "
                                         r"the component\(s\) \['b'\]"),
])
def test_bad_arguments_are_refused_by_name(kwargs, says):
    with pytest.raises(ZephonConfigError, match=says):
        filtered(mixture()).ensure_mixture(**kwargs)


def test_weights_are_needed_when_the_source_is_no_mixture():
    pipe = Pipeline(sources.from_callable(10, F.doc_a))
    with pytest.raises(ZephonConfigError, match="not a mixture"):
        pipe.ensure_mixture()
    pipe.ensure_mixture({"a": 1.0})  # given weights: fine


def test_after_batch_or_a_packer_it_is_refused():
    for pipe in (filtered(mixture()).batch(4), filtered(mixture()).pack_tokens(16)):
        with pytest.raises(ZephonConfigError, match="place it before"):
            pipe.ensure_mixture()


def test_a_sample_of_an_unnamed_component_is_an_op_error():
    pipe = Pipeline(sources.from_callable(10, F.doc_a, name="c")).ensure_mixture({"a": 1.0})
    with pytest.raises(OpError, match="not one of the target"):
        list(pipe)


def test_a_missing_token_field_is_an_op_error():
    pipe = Pipeline(mixture()).ensure_mixture(by="tokens", field="nope")
    with pytest.raises(OpError, match="no token field"):
        list(pipe)


def test_the_fingerprint_names_every_argument():
    prints = {filtered(mixture()).ensure_mixture(**kw).fingerprint() for kw in (
        {}, {"by": "tokens"}, {"max_buffer": 7}, {"leftover": "drop"},
        {"weights": {"a": 0.6, "b": 0.4}})}
    assert len(prints) == 5
