"""Mixture weights are sampling rates: the realized share of every component matches its
weight (within 1 % over 10^5 samples) under every shuffle setting, runner and world size,
and after a restore; the exhaustion policies end or extend an epoch exactly as they say;
a repeat is read in a new order; nothing of the epoch's size is built."""

from __future__ import annotations

import collections
import pickle
import threading

import _mixture_fns as F
import numpy as np
import pytest
from _resume import assert_resumes
from _streams import sample_ids, take

from zephon import MixtureReadConfig, Pipeline, RuntimeOptions, sources
from zephon.errors import ZephonConfigError

C = 4  # canonical lanes


def component(name: str, n: int):
    return sources.from_callable(n, F.row, name=name)


def shares(batches) -> dict:
    """Realized share of each component (by sample ids; a repeat counts for its
    component) over the batches."""
    return shares_of(sample_ids(batches))


def shares_of(ids) -> dict:
    """Realized share of each component over these sample ids."""
    counts = collections.Counter(sid[0].split("#")[0] for sid in ids)
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()}


WEIGHTS = [({"a": 0.7, "b": 0.3}), ({"a": 0.5, "b": 0.5}), ({"a": 0.9, "b": 0.1}),
           ({"a": 0.2, "b": 0.3, "c": 0.5})]
SIZES = {"a": 200_000, "b": 2_000, "c": 20_000}  # b is 100x smaller than a


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("mode", ["weighted_random", "weighted_round_robin"])
def test_realized_share_is_the_weight_within_one_percent(weights, shuffle, mode):
    mix = sources.mixture({k: component(k, SIZES[k]) for k in weights}, weights,
                          config=MixtureReadConfig(mode=mode, seed=3))
    pipe = Pipeline(mix, seed=1, shuffle=shuffle, chunk_size=256).batch(1000)
    got = shares(take(pipe.options(RuntimeOptions(canonical_replicas=C)), 100))
    for k, w in weights.items():
        assert abs(got[k] - w) <= 0.01, (k, got, weights)


@pytest.mark.parametrize("runner", ["threads", "process"])
def test_share_and_stream_are_the_same_on_every_runner(runner):
    weights = {"a": 0.6, "b": 0.4}
    mix = sources.mixture({k: component(k, SIZES[k]) for k in weights}, weights)

    def run(opts):
        pipe = Pipeline(mix, seed=2, chunk_size=128).batch(500).options(opts)
        return [b.meta["sample_ids"] for b in take(pipe, 200)]

    ref = run(RuntimeOptions(runner="inline", canonical_replicas=C))
    got = run(RuntimeOptions(runner=runner, max_workers=2, canonical_replicas=C))
    assert got == ref
    flat = [s[0].split("#")[0] for b in got for s in b]
    assert abs(flat.count("b") / len(flat) - 0.4) <= 0.01


@pytest.mark.parametrize("world", [2, 4])
def test_share_holds_on_every_rank_and_the_ranks_make_the_one_rank_stream(world):
    weights = {"a": 0.75, "b": 0.25}
    mix = sources.mixture({k: component(k, SIZES[k]) for k in weights}, weights)

    def pipe(rank, size):
        return Pipeline(mix, seed=4, chunk_size=128).batch(250).options(RuntimeOptions(
            world_size=size, global_rank=rank, canonical_replicas=C))

    per_rank = [take(pipe(r, world), 400 // world) for r in range(world)]
    for batches in per_rank:
        assert abs(shares(batches)["b"] - 0.25) <= 0.01
    one = {(b.meta["lane"], b.meta["lane_index"]): b.meta["sample_ids"]
           for b in take(pipe(0, 1), 400)}
    for batches in per_rank:
        for b in batches:
            assert one[(b.meta["lane"], b.meta["lane_index"])] == b.meta["sample_ids"]


def test_share_holds_after_a_restore_mid_stream():
    weights = {"a": 0.8, "b": 0.2}
    mix = sources.mixture({k: component(k, SIZES[k]) for k in weights}, weights)

    def pipe():
        return Pipeline(mix, seed=5, chunk_size=64).shuffle(512).batch(200).options(
            RuntimeOptions(canonical_replicas=C))

    # an endless stream: its first 500 batches, 137 of them before the state
    rest = assert_resumes(pipe, 137, key=lambda b: sample_ids([b]), limit=500).rest
    assert abs(shares_of([s for b in rest for s in b])["b"] - 0.2) <= 0.01


def epoch(mix, **kw) -> list:
    """One epoch's sample ids, in order."""
    pipe = Pipeline(mix, seed=0, num_epochs=1, **kw).batch(1)
    return [b.meta["sample_ids"][0] for b in pipe]


def test_repeat_holds_the_share_by_reading_a_small_component_again():
    mix = sources.mixture({"big": component("big", 900), "small": component("small", 100)},
                          {"big": 0.5, "small": 0.5})
    ids = epoch(mix)
    assert len(ids) == 1800
    big = [i for i in ids if i[0] == "big"]
    small = [i for i in ids if i[0].split("#")[0] == "small"]
    assert sorted(i[1] for i in big) == list(range(900))  # the big one once
    assert len(small) == 900 and collections.Counter(i[1] for i in small) == \
        {j: 9 for j in range(100)}  # the small one 9 times, every sample 9 times
    assert len(set(ids)) == len(ids)  # a repeat has an identity of its own


def test_each_repeat_pass_is_read_in_a_new_order():
    mix = sources.mixture({"big": component("big", 400), "small": component("small", 50)},
                          {"big": 0.5, "small": 0.5})
    ids = epoch(mix, shuffle=False)
    passes = collections.defaultdict(list)
    for name, index, _ in ids:
        if name.startswith("small"):
            passes[name].append(index)
    orders = [tuple(p) for p in passes.values()]
    assert len(orders) == 8 and all(sorted(o) == list(range(50)) for o in orders)
    assert len(set(orders)) == 8  # every pass in an order of its own


def test_stop_ends_the_epoch_when_that_component_is_read_once():
    mix = sources.mixture({"big": component("big", 1000), "small": component("small", 100)},
                          {"big": 0.75, "small": 0.25}, exhausted={"small": "stop"})
    ids = epoch(mix)
    assert len(ids) == 400
    assert sorted(i[1] for i in ids if i[0] == "small") == list(range(100))
    assert sum(i[0] == "big" for i in ids) == 300


def test_a_component_read_in_part_continues_in_the_next_epoch():
    mix = sources.mixture({"big": component("big", 1000), "small": component("small", 100)},
                          {"big": 0.75, "small": 0.25}, exhausted={"small": "stop"})
    pipe = Pipeline(mix, seed=0, num_epochs=4).batch(1)
    big_by_epoch = collections.defaultdict(list)
    for b in pipe:
        name, index, ep = b.meta["sample_ids"][0]
        if name == "big":
            big_by_epoch[ep].append(index)
    three = big_by_epoch[0] + big_by_epoch[1] + big_by_epoch[2]
    assert len(three) == len(set(three)) == 900  # no big sample twice in three epochs ...
    assert set(range(1000)) - set(three) <= set(big_by_epoch[3])  # ... the rest in the 4th


def test_max_repeats_caps_the_passes_of_an_epoch():
    mix = sources.mixture({"big": component("big", 900), "small": component("small", 100)},
                          {"big": 0.5, "small": 0.5}, max_repeats={"small": 3})
    ids = epoch(mix)
    assert sum(i[0].startswith("small") for i in ids) == 300
    assert sum(i[0] == "big" for i in ids) == 300


def test_redistribute_reads_a_component_once_and_gives_its_share_to_the_others():
    mix = sources.mixture({"a": component("a", 600), "b": component("b", 300),
                           "small": component("small", 50)},
                          {"a": 0.4, "b": 0.2, "small": 0.4},
                          exhausted={"small": "redistribute"})
    ids = epoch(mix)
    names = collections.Counter(i[0] for i in ids)
    assert names["small"] == 50 and not any(n.startswith("small#") for n in names)
    assert names["a"] == 600 and names["b"] == 300  # a and b keep their 2:1


def test_token_weights_hold_by_tokens():
    short = sources.from_callable(20_000, F.tokens_of_length(10), name="short")
    long = sources.from_callable(20_000, F.tokens_of_length(90), name="long")
    mix = sources.mixture({"short": short, "long": long}, {"short": 0.7, "long": 0.3},
                          by="tokens")
    batches = take(Pipeline(mix, seed=0).batch(100).options(
        RuntimeOptions(canonical_replicas=C)), 300)
    tokens = collections.Counter()
    for b in batches:
        for sid in b.meta["sample_ids"]:
            tokens[sid[0].split("#")[0]] += 10 if sid[0].startswith("short") else 90
    share = tokens["short"] / sum(tokens.values())
    assert abs(share - 0.7) <= 0.01


def test_a_mixture_of_a_thousand_components_builds_nothing_of_the_epochs_size():
    comps = {f"c{k}": component(f"c{k}", 1_000_000) for k in range(1024)}
    mix = sources.mixture(comps, config=MixtureReadConfig(mode="weighted_random"))
    assert len(mix) == 1024 * 1_000_000
    assert len(pickle.dumps(mix)) < 512 << 10  # what every worker receives
    got = take(Pipeline(mix, seed=0, shuffle=False, chunk_size=64).batch(64), 2)
    assert len(got) == 2


def test_nested_mixtures_hold_both_levels():
    inner = sources.mixture({"x": component("x", 5000), "y": component("y", 500)},
                            {"x": 0.5, "y": 0.5}, name="inner")
    outer = sources.mixture({"inner": inner, "z": component("z", 10_000)},
                            {"inner": 0.4, "z": 0.6})
    got = shares(take(Pipeline(outer, seed=0).batch(500), 40))
    assert abs(got["z"] - 0.6) <= 0.01
    assert abs(got["x"] - 0.2) <= 0.01 and abs(got["y"] - 0.2) <= 0.01


@pytest.mark.parametrize("bad", [{"exhausted": "never"}, {"exhausted": {"nope": "stop"}},
                                 {"max_repeats": 0}, {"max_repeats": True},
                                 {"by": "bytes"}, {"by": "tokens",
                                                   "tokens_per_sample": {"a": 1.0}}])
def test_bad_policies_are_config_errors(bad):
    with pytest.raises(ZephonConfigError):
        sources.mixture({"a": component("a", 10), "b": component("b", 10)}, **bad)


def test_concurrent_views_of_one_mixture_agree():
    mix = sources.mixture({"a": component("a", 1000), "b": component("b", 10)},
                          {"a": 0.5, "b": 0.5})
    ref = [mix.identity(i) for i in range(0, len(mix), 37)]
    got: list = [None] * 4

    def read(t):
        view = mix.view(np.arange(len(mix)), 0)
        got[t] = [view.identity(i) for i in range(0, len(mix), 37)]

    threads = [threading.Thread(target=read, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g == ref for g in got)


def test_counted_tokens_per_sample_make_heavy_tailed_token_shares_exact():
    """A probe of 64 misses the rare long documents of a heavy tail; 'count' reads every
    sample once when the mixture is built, so the token share over an epoch is the
    target."""
    comps = {"heavy": sources.from_callable(20_000, F.heavy_doc, name="heavy"),
             "even": sources.from_callable(20_000, F.even_doc, name="even")}
    mix = sources.mixture(comps, {"heavy": 0.7, "even": 0.3}, by="tokens",
                          tokens_per_sample="count")
    lengths = {"heavy": F.heavy_doc, "even": F.even_doc}
    tokens = collections.Counter()
    view = mix.view(np.arange(len(mix)), 0)
    for n in range(len(mix)):
        name, index = view.identity(n)
        tokens[name.split("#")[0]] += lengths[name.split("#")[0]](index)["tokens"].size
    assert abs(tokens["heavy"] / sum(tokens.values()) - 0.7) <= 0.01
    with pytest.raises(ZephonConfigError, match="'count' or None"):
        sources.mixture(comps, {"heavy": 0.7, "even": 0.3}, by="tokens",
                        tokens_per_sample="probe")
