"""Mixture weights that change over training: a list of steps or a callable of the epoch.
Each epoch's share follows the schedule (within 1 % over 10^5 samples) under every
shuffle setting, interleave mode and runner; a restore mid-epoch resumes exactly; the
schedule is part of the fingerprint; a one-step schedule is the fixed mixture; what a
fixed epoch length cannot do is refused."""

from __future__ import annotations

import collections
import pickle

import _mixture_fns as F
import numpy as np
import pytest
from _resume import assert_resumes
from _streams import sample_ids, take

from zephon import MixtureReadConfig, Pipeline, RuntimeOptions, sources
from zephon.errors import CheckpointError, ZephonConfigError

C = 4  # canonical lanes
SIZES = {"a": 40_000, "b": 400}  # b is 100x smaller than a
STEPS = [(0, {"a": 0.9, "b": 0.1}), (1, {"a": 0.7, "b": 0.3}), (2, {"a": 0.5, "b": 0.5})]
TARGET_B = {0: 0.1, 1: 0.3, 2: 0.5}  # both schedules below


def component(name: str, n: int | None = None):
    return sources.from_callable(SIZES[name] if n is None else n, F.row, name=name)


def mix(weights, **kw):
    return sources.mixture({"a": component("a"), "b": component("b")}, weights, **kw)


def shares_by_epoch(sample_ids) -> dict:
    """epoch -> realized share of ``b`` (a repeat counts for its component)."""
    counts: dict = collections.defaultdict(collections.Counter)
    for name, _, ep in sample_ids:
        counts[ep][name.split("#")[0]] += 1
    return {ep: c["b"] / sum(c.values()) for ep, c in counts.items()}


def three_epochs(source, shuffle=True, opts=None) -> list:
    pipe = Pipeline(source, seed=1, shuffle=shuffle, num_epochs=3, chunk_size=256)
    return sample_ids(pipe.batch(1000).options(opts or RuntimeOptions(canonical_replicas=C)))


@pytest.mark.parametrize("weights", [STEPS, F.ramp], ids=["steps", "callable"])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("mode", ["weighted_random", "weighted_round_robin"])
def test_each_epoch_holds_its_scheduled_share_within_one_percent(weights, shuffle, mode):
    source = mix(weights, config=MixtureReadConfig(mode=mode, seed=3))
    got = three_epochs(source, shuffle)
    assert len(got) == 3 * len(source) > 100_000
    for ep, share in shares_by_epoch(got).items():
        assert abs(share - TARGET_B[ep]) <= 0.01, (ep, share)


def test_the_epoch_length_is_epoch_zeros_and_every_epoch_is_exact():
    source = mix(STEPS)
    assert len(source) == len(mix(STEPS[0][1]))  # 40_000 / 0.9, rounded up
    for ep, (_, weights) in enumerate(STEPS):
        counts = source.epoch_plan(ep)[0]
        assert counts.sum() == len(source)
        assert abs(counts[1] - weights["b"] * len(source)) <= 1


def test_a_one_step_schedule_is_the_fixed_mixture_stream_for_stream():
    fixed, one = mix({"a": 0.9, "b": 0.1}), mix([(0, {"a": 0.9, "b": 0.1})])
    assert three_epochs(one) == three_epochs(fixed)


def test_a_callable_schedule_runs_the_same_stream_in_process_workers():
    ref = three_epochs(mix(F.ramp))
    got = three_epochs(mix(F.ramp), opts=RuntimeOptions(runner="process", max_workers=2,
                                                         canonical_replicas=C))
    assert got == ref


def test_occurrences_run_on_across_epochs_of_a_schedule():
    """A component switched off (weight 0) takes no position; one read in part continues
    where it stopped: no sample of ``a`` is read twice before all of it is read."""
    source = sources.mixture({"a": component("a", 3000), "b": component("b", 1000)},
                             [(0, {"a": 1.0, "b": 0.0}), (1, {"a": 0.4, "b": 0.6})])
    got = sample_ids(Pipeline(source, seed=0, num_epochs=3).batch(500))
    assert {name for name, _, ep in got if ep == 0} == {"a"}
    a_later = [i for name, i, ep in got if name == "a" and ep > 0]
    assert len(a_later) == 2 * 1200  # 0.4 of 3000 positions, two epochs
    assert len(set(a_later)) == len(a_later)  # 2400 of 3000: none twice yet


def test_redistribute_holds_a_component_at_one_pass_and_the_others_take_the_rest():
    source = sources.mixture({"a": component("a", 3000), "b": component("b", 500)},
                             [(0, {"a": 0.9, "b": 0.1}), (1, {"a": 0.5, "b": 0.5})],
                             exhausted={"b": "redistribute"})
    counts = source.epoch_plan(1)[0]
    assert counts.tolist() == [len(source) - 500, 500]
    got = sample_ids(Pipeline(source, seed=0, num_epochs=2).batch(100))
    assert not any(name.startswith("b#") for name, _, _ in got)


def test_a_restore_mid_epoch_resumes_exactly_and_holds_the_schedule():
    def pipe():
        return Pipeline(mix(F.ramp), seed=5, num_epochs=3, chunk_size=64).shuffle(512) \
            .batch(500).options(RuntimeOptions(canonical_replicas=C))

    mid = len(mix(F.ramp)) // 500 + 40  # well inside epoch 1
    # a pass is three epochs of 40k samples: the small pipelines check the pass after it
    resumed = assert_resumes(pipe, mid, key=lambda b: sample_ids([b]), next_pass=False)
    assert abs(shares_by_epoch([s for b in resumed.rest for s in b])[2] - 0.5) <= 0.01


@pytest.mark.parametrize("other", [
    [(0, {"a": 0.9, "b": 0.1}), (1, {"a": 0.7, "b": 0.3}), (3, {"a": 0.5, "b": 0.5})],
    [(0, {"a": 0.9, "b": 0.1}), (1, {"a": 0.6, "b": 0.4})],
    {"a": 0.9, "b": 0.1},
    F.ramp,
], ids=["later-step", "other-weights", "fixed", "callable"])
def test_the_fingerprint_changes_with_the_schedule_and_a_checkpoint_refuses_it(other):
    def pipe(weights):
        return Pipeline(mix(weights), seed=0).batch(100)

    assert pipe(STEPS).fingerprint() == pipe(list(STEPS)).fingerprint()
    assert pipe(other).fingerprint() != pipe(STEPS).fingerprint()
    it = iter(pipe(STEPS))
    next(it)
    state = it.checkpoint()
    it.close()
    with pytest.raises(CheckpointError):
        pipe(other).restore(state)


def test_two_callables_are_two_schedules():
    assert Pipeline(mix(F.ramp)).fingerprint() != Pipeline(mix(F.ramp_faster)).fingerprint()
    assert Pipeline(mix(F.ramp)).fingerprint() == Pipeline(mix(F.ramp)).fingerprint()


def test_a_schedule_pickles_small_and_its_cache_stays_behind():
    source = mix(F.ramp)
    source.epoch_plan(50)
    blob = pickle.dumps(source)
    assert len(blob) < 4096
    again = pickle.loads(blob)
    assert [again.epoch_plan(e)[2].tolist() for e in (3, 50)] == \
        [source.epoch_plan(e)[2].tolist() for e in (3, 50)]


@pytest.mark.parametrize("weights, kw", [
    ([(1, {"a": 1, "b": 1})], {}),                              # does not start at 0
    ([(0, {"a": 1, "b": 1}), (0, {"a": 1, "b": 2})], {}),       # not increasing
    ([(0, {"a": 1, "b": 1}), (2.5, {"a": 1, "b": 2})], {}),     # not an integer epoch
    ([(0, {"a": 1})], {}),                                      # does not name b
    ([(0, {"a": 0, "b": 0})], {}),                              # nothing positive
    ([(0, {"a": 1, "b": -1})], {}),                             # negative
    ([(0, {"a": 1, "b": 1}), {"a": 1, "b": 1}], {}),            # not a step
    ("a", {}),                                                  # not weights at all
    ([(0, {"a": 0.9, "b": 0.1}), (1, {"a": 0.5, "b": 0.5})], {"exhausted": {"b": "stop"}}),
    ([(0, {"a": 0.9, "b": 0.1}), (1, {"a": 0, "b": 1})],  # b once cannot fill the epoch
     {"exhausted": {"b": "redistribute"}}),
])
def test_schedules_a_fixed_epoch_length_cannot_hold_are_config_errors(weights, kw):
    with pytest.raises(ZephonConfigError):
        mix(weights, **kw)


def test_a_callable_giving_bad_weights_names_the_epoch():
    source = mix(lambda e: {"a": 1.0, "b": 1.0} if e < 7 else {"a": 1.0})
    source.epoch_plan(6)
    with pytest.raises(ZephonConfigError, match="epoch 7"):
        source.epoch_plan(7)


def test_a_schedule_over_a_thousand_components_builds_nothing_of_the_epochs_size():
    comps = {f"c{k}": component(f"c{k}", 1_000_000) for k in range(1024)}
    later = {f"c{k}": 1.0 + (k % 3) for k in range(1024)}
    source = sources.mixture(comps, [(0, dict.fromkeys(comps, 1.0)), (1, later)],
                             config=MixtureReadConfig(mode="weighted_random"))
    assert len(source) == 1024 * 1_000_000
    assert len(pickle.dumps(source)) < 1 << 20  # what every worker receives
    got = take(Pipeline(source, seed=0, shuffle=False, chunk_size=64)
               .batch(64), 2)
    assert len(got) == 2
    view = source.view(np.array([0, len(source) - 1]), 5)  # epoch 5: closed form
    assert [view.identity(n)[0] in comps for n in range(2)] == [True, True]
