"""``max_workers`` is a maximum: no stage ever runs more workers than an explicit value,
under every ``worker_allocation``, and ``explain()`` says how each count was derived."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _pipeline_fns as F
import zephon.options as zo
from zephon import Pipeline, RuntimeOptions, sources


@settings(max_examples=200, deadline=None)
@given(mode=st.sampled_from(["fit_to_ops", "per_stage_fixed", "global"]),
       cap=st.integers(1, 64), weights=st.lists(st.integers(1, 200), min_size=1, max_size=6))
def test_no_stage_exceeds_an_explicit_max_workers(mode, cap, weights):
    o = RuntimeOptions(worker_allocation=mode, max_workers=cap)
    assert all(1 <= w <= cap for w in zo.resolve_stage_workers(o, weights))


def test_fit_to_ops_is_unchanged_without_max_workers():
    assert zo.resolve_stage_workers(RuntimeOptions(), [2, 5, 1]) == [2, 5, 1]
    assert zo.resolve_stage_workers(RuntimeOptions(max_workers=4), [2, 5, 1]) == [2, 4, 1]


def test_the_running_pipeline_honours_the_cap_and_explains_it():
    pipe = (Pipeline(sources.from_callable(40, F.make_sample), chunk_size=4)
            .map(F.double, parallelism=3).map(F.double, parallelism=2).batch(4)
            .options(RuntimeOptions(runner="process", max_workers=4)))
    text = pipe.explain()
    assert "workers=4 (fit_to_ops: sum of op parallelism 5, capped by max_workers=4)" in text
    it = iter(pipe)
    next(it)
    pools = [ex.pool for ex in it.engine.executors.values()]
    assert [len(p.workers) for p in pools] == [4]
    it.close()
    one = Pipeline(sources.from_callable(8, F.make_sample)).map(F.double).options(
        RuntimeOptions(runner="process", max_workers=2))
    assert "max_workers=2 is only a cap here" in one.explain()


@pytest.mark.parametrize("mode", ["per_stage_fixed", "global"])
def test_explain_names_the_allocation(mode):
    pipe = Pipeline(sources.from_callable(8, F.make_sample)).map(F.double, parallelism=2) \
        .options(RuntimeOptions(runner="threads", max_workers=3, worker_allocation=mode))
    assert f"({mode}:" in pipe.explain()
