"""The batch stream is identical whatever the runner, workers, prefetch or restore cut.

The differential property compares every configuration with the uninterrupted
inline run of the same pipeline; a fast profile runs by default, a larger one
with ``-m slow``."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _pipeline_fns as F
from _resume import assert_resumes, passes
from _streams import keys_of
from zephon import Pipeline, RuntimeOptions, sources


def ids_of(item):
    if isinstance(item, dict) and "id" in item and np.ndim(item["id"]) == 1:
        return [int(v) for v in item["id"]]
    if isinstance(item, dict) and "id" in item:
        return [int(item["id"])]
    return [int(t) for t in np.ravel(item["tokens"])]


def signature(item):
    """A comparable form of an output item (batches, rows or samples)."""
    out = []
    for key in sorted(item):
        value = item[key]
        if isinstance(value, np.ndarray):
            out.append((key, value.dtype.str, value.shape, value.tobytes()))
        else:
            out.append((key, repr(value)))
    return tuple(out)


CHAINS = {
    "map-batch": lambda p: p.map(F.double).batch(3),
    "filter-batch": lambda p: p.filter(F.keep_most).batch(3),
    "filter-shuffle-batch": lambda p: p.filter(F.keep_most).shuffle(6).batch(4),
    "ctx-map-batch-mapbatch": lambda p: p.map(F.noisy).batch(2).map_batch(F.total),
    "pack": lambda p: p.map(F.double).pack_tokens(5).batch(2),
    "shuffle-only": lambda p: p.shuffle(3),
    "map-only": lambda p: p.map(F.double, parallelism=2),
}


def build(n, chunk, chain, seed=7, epochs=1):
    return CHAINS[chain](Pipeline(sources.from_callable(n, F.make_sample), seed=seed,
                                  chunk_size=chunk, num_epochs=epochs))


@pytest.mark.parametrize("chain", sorted(CHAINS))
@pytest.mark.parametrize("runner,workers", [("threads", 3), ("process", 2)])
def test_runners_agree_with_inline(chain, runner, workers):
    pipe = build(41, 4, chain)
    lanes = {"canonical_replicas": 2}
    reference = keys_of(pipe.options(RuntimeOptions(runner="inline", **lanes)), signature)
    assert reference
    got = keys_of(pipe.options(RuntimeOptions(runner=runner, max_workers=workers,
                                              prefetch_batches=3, default_stage_prefetch=2,
                                              **lanes)), signature)
    assert got == reference


def test_every_sample_exactly_once_per_epoch():
    pipe = Pipeline(sources.from_callable(53, F.make_sample), seed=1, chunk_size=5,
                    num_epochs=2).shuffle(7).batch(4)
    seen = collections.Counter()
    for batch in pipe.options(RuntimeOptions(runner="threads", canonical_replicas=3)):
        for source, index, epoch in batch.meta["sample_ids"]:
            seen[(index, epoch)] += 1
        assert batch.meta["lane"] in (0, 1, 2)
    assert seen == collections.Counter({(i, e): 1 for i in range(53) for e in range(2)})


def restore_cut(pipe, uninterrupted, cut, second):
    """Restore ``pipe`` cut after ``cut`` items into ``second``; ``uninterrupted`` holds
    the first and the second pass (a cut at the end of the first: its last item)."""
    reference, following = uninterrupted
    assert_resumes(lambda: pipe, cut, again=lambda: second, key=signature,
                   reference=reference, following=following)


profile = settings(max_examples=12, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _differential(data):
    n = data.draw(st.integers(0, 60), label="n")
    chunk = data.draw(st.integers(1, 9), label="chunk")
    lanes = data.draw(st.sampled_from([1, 2, 4]), label="C")
    chain = data.draw(st.sampled_from(sorted(CHAINS)), label="chain")
    epochs = data.draw(st.sampled_from([1, 2]), label="epochs")
    pipe = build(n, chunk, chain, seed=data.draw(st.integers(0, 100)), epochs=epochs)
    reference, following = passes(lambda: pipe.options(RuntimeOptions(
        runner="inline", canonical_replicas=lanes)), 2, signature)

    def random_opts(label):
        runner = data.draw(st.sampled_from(["inline", "threads", "process"]), label=label)
        return RuntimeOptions(
            runner=runner, canonical_replicas=lanes,
            max_workers=data.draw(st.integers(1, 3)),
            prefetch_batches=data.draw(st.integers(1, 6)),
            default_stage_prefetch=data.draw(st.integers(1, 4)),
            flush_every_k_chunks=data.draw(st.sampled_from([None])))

    cut = data.draw(st.integers(0, len(reference)), label="cut")
    # restored at the end of the pass, a run goes on with the next pass
    restore_cut(pipe.options(random_opts("first runner")), (reference, following), cut,
                pipe.options(random_opts("second runner")))


@profile
@given(st.data())
def test_differential_restore_under_another_runner(data):
    _differential(data)


@pytest.mark.slow
@pytest.mark.ci
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_differential_restore_under_another_runner_medium(data):
    _differential(data)


@pytest.mark.slow
@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_differential_restore_under_another_runner_large(data):
    _differential(data)


def test_explicit_flush_cadence_changes_boundaries_not_content():
    base = Pipeline(sources.from_callable(40, F.make_sample), seed=3, chunk_size=2).batch(4)
    every2 = [b["id"].tolist() for b in base.options(RuntimeOptions(flush_every_k_chunks=2))]
    never = [b["id"].tolist() for b in base.options(RuntimeOptions(flush_every_k_chunks=0))]
    assert sorted(sum(every2, [])) == sorted(sum(never, [])) == list(range(40))
    # a flush boundary is a resume point, not a cut: every batch is full either way
    assert all(len(b) == 4 for b in never) and all(len(b) == 4 for b in every2)
    assert base.options(RuntimeOptions(flush_every_k_chunks=2)).fingerprint() != \
        base.options(RuntimeOptions(flush_every_k_chunks=0)).fingerprint()


def test_non_deterministic_mode_says_so_and_delivers_everything():
    pipe = Pipeline(sources.from_callable(30, F.make_sample), chunk_size=3).map(
        F.double, parallelism=2).options(RuntimeOptions(runner="threads", deterministic=False))
    assert "NON-DETERMINISTIC" in pipe.explain()
    assert sorted(int(s["id"]) for s in pipe) == list(range(30))


def test_explain_reports_the_resolved_plan():
    pipe = Pipeline(sources.from_callable(10, F.make_sample)).map(F.double, parallelism=3) \
        .shuffle(4).batch(2).map_batch(F.total).options(RuntimeOptions(
            max_workers=5, per_stage_runner={1: "threads"}, per_stage_prefetch={1: 7},
            worker_allocation="per_stage_fixed", allow_latency_flush_in_deterministic=False))
    text = pipe.explain()
    assert "stage 0: read, map(double)[parallelism=3]: runner=process, workers=5 " \
        "(per_stage_fixed: max_workers=5), depth=4 units/lane" in text
    assert "stage 1: map_batch(total)[parallelism=1]: runner=threads, workers=5 " \
        "(per_stage_fixed: max_workers=5), depth=7 units/lane" in text
    assert "latency_flush=off" in text and "flush: every 8 chunks of a lane" in text
    assert "resume: replay from the last flush boundary" in text
    assert "resume points: batches stay full across them" in text
    assert "serial 1: shuffle(4)" in text and "serial 2: batch(2, drop_last=False)" in text
    assert "  " not in text.replace("\n  ", "\n")  # no double spaces inside a line


def test_op_queue_capacity_bounds_items_in_flight():
    F.reset_concurrency()
    pipe = Pipeline(sources.from_callable(24, F.make_sample), shuffle=False, chunk_size=1) \
        .map(F.track_concurrency, parallelism=4)
    # (validation off: it runs the op on the first sample while the workers start)
    tight = [int(s["id"]) for s in pipe.options(RuntimeOptions(
        runner="threads", op_queue_capacity=1, auto_validation="off"))]
    assert F.peak_concurrency() == 1
    F.reset_concurrency()
    loose = [int(s["id"]) for s in pipe.options(RuntimeOptions(
        runner="threads", op_queue_capacity=16, auto_validation="off"))]
    assert F.peak_concurrency() > 1 and tight == loose == list(range(24))
    assert "op_queue=1 items/lane" in pipe.options(RuntimeOptions(op_queue_capacity=1)).explain()


def test_mixture_config_option_is_the_default_read_policy():
    from zephon import MixtureReadConfig

    a = sources.from_sequence([{"id": i} for i in range(20)], name="a")
    b = sources.from_sequence([{"id": 100 + i} for i in range(20)], name="b")
    mix = sources.mixture({"a": a, "b": b})
    plain = Pipeline(mix, shuffle=False)
    rr = [s["id"] for s in plain]
    random_opts = RuntimeOptions(mixture_config=MixtureReadConfig(mode="weighted_random",
                                                                  seed=9))
    drawn = [s["id"] for s in plain.options(random_opts)]
    assert sorted(drawn) == sorted(rr) and drawn != rr
    assert plain.fingerprint() != plain.options(random_opts).fingerprint()
    own = sources.mixture({"a": a, "b": b}, config=MixtureReadConfig(seed=1))
    assert [s["id"] for s in Pipeline(own, shuffle=False).options(random_opts)] == rr


def test_a_slow_head_of_line_unit_stalls_lookahead_instead_of_overflowing():
    # Unit 0 is slow; every later unit finishes at once and frees its slot. Lookahead must
    # stop at the reorder window instead of running seq numbers (and held results) past it.
    pipe = Pipeline(sources.from_callable(200, F.make_sample), shuffle=False, chunk_size=1) \
        .map(F.slow_first, parallelism=2)
    opts = RuntimeOptions(runner="threads", max_workers=2, default_stage_prefetch=2,
                          auto_validation="off")
    assert [int(s["id"]) for s in pipe.options(opts)] == list(range(200))


def test_plan_is_resolved_once_per_definition(monkeypatch):
    from zephon import MixtureReadConfig
    from zephon.pipeline.sources import MixtureSource

    a = sources.from_sequence([{"id": i} for i in range(30)], name="a")
    b = sources.from_sequence([{"id": 100 + i} for i in range(30)], name="b")
    pipe = Pipeline(sources.mixture({"a": a, "b": b}), shuffle=False).options(
        RuntimeOptions(mixture_config=MixtureReadConfig(mode="weighted_random", seed=4)))
    schedules = []
    original = MixtureSource.configured

    def configured(self, opts):  # counts the configurations that made a new source
        out = original(self, opts)
        if out is not self:
            schedules.append(1)
        return out

    monkeypatch.setattr(MixtureSource, "configured", configured)
    it = iter(pipe)
    head = [next(it) for _ in range(5)]
    state = pipe.checkpoint()
    pipe.close()
    pipe.explain()
    pipe.fingerprint()
    assert len(schedules) == 1  # the mixture was configured once, not per call
    assert pipe.plan() is pipe.plan()
    assert pipe.batch(2).plan() is not pipe.plan()  # a new definition gets its own plan
    again = pipe.options(pipe.runtime)
    again.restore(state)
    assert head + list(again) == list(pipe.options(pipe.runtime))
