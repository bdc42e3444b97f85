"""A ``batch`` fused into the stage that reads and maps its samples gives exactly the
batches the serial accumulator gives (same samples, same order, same partial batches,
same restore), whatever the sizes, lanes, epochs, flush cadence and runner."""

from __future__ import annotations

import _pipeline_fns as F
import numpy as np
import pytest
from _resume import assert_resumes, passes
from _streams import keys_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon import Pipeline, RuntimeOptions, sources


def batch_key(b):
    return (b.meta["lane"], b.meta["lane_index"], b["id"].tolist(), b["x"].tobytes(),
            b.meta["sample_ids"])


def pair(n, chunk, size, drop_last, epochs, seed=3):
    src = sources.from_callable(n, F.make_sample)
    base = Pipeline(src, seed=seed, chunk_size=chunk, num_epochs=epochs)
    fused = base.map(F.double).batch(size, drop_last=drop_last)
    # a filter that keeps everything blocks the fusion: the accumulator forms the batches
    reference = base.map(F.double).filter(F.keep_all).batch(size, drop_last=drop_last)
    return fused, reference


def test_the_plan_fuses_only_read_map_batch():
    fused, reference = pair(20, 4, 3, False, 1)
    assert fused.plan().fused_batch is not None
    assert "collated in the stage" in fused.explain()
    assert reference.plan().fused_batch is None
    shuffled = Pipeline(sources.from_callable(20, F.make_sample)).shuffle(4).batch(3)
    assert shuffled.plan().fused_batch is None
    assert Pipeline(sources.from_callable(20, F.make_sample)).batch(3).plan().fused_batch


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(n=st.integers(0, 60), chunk=st.integers(1, 9), size=st.integers(1, 11),
       drop_last=st.booleans(), epochs=st.integers(1, 2), lanes=st.integers(1, 3),
       flush=st.sampled_from([None, 1, 3]))
def test_fused_equals_the_accumulator(n, chunk, size, drop_last, epochs, lanes, flush):
    fused, reference = pair(n, chunk, size, drop_last, epochs)
    opts = RuntimeOptions(runner="inline", canonical_replicas=lanes,
                          flush_every_k_chunks=flush)
    assert keys_of(fused.options(opts), batch_key) == keys_of(reference.options(opts),
                                                              batch_key)


@pytest.mark.parametrize("runner", ["threads", "process"])
def test_fused_under_parallel_runners_and_restore(runner):
    fused, reference = pair(97, 5, 4, False, 2)
    expected, following = passes(lambda: reference.options(RuntimeOptions(
        runner="inline", canonical_replicas=2)), 2, batch_key)
    opts = RuntimeOptions(runner=runner, max_workers=2, canonical_replicas=2)
    assert keys_of(fused.options(opts), batch_key) == expected
    assert_resumes(lambda: fused.options(opts), 9, key=batch_key, reference=expected,
                   following=following,
                   again=lambda: fused.options(RuntimeOptions(runner="inline",
                                                              canonical_replicas=2)))


def test_a_fused_batch_is_one_array_per_column():
    fused, _ = pair(40, 8, 8, True, 1)
    for batch in fused.options(RuntimeOptions(runner="process", max_workers=2)):
        assert isinstance(batch["x"], np.ndarray) and batch["x"].shape[0] == 8
