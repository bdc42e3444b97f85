"""The batched read of token windows gives exactly the batches of the window-by-window
read: same dtype, shape, values and ids, for any order, dtype, runner and message size;
a file that changed is still the same named error."""

from __future__ import annotations

import os

import _pipeline_fns as F
import numpy as np
import pytest
from _resume import assert_resumes, passes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon import Pipeline, RuntimeOptions, sources
from zephon.pipeline.collate import collate
from zephon.pipeline.sources import SourceError


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    rng = np.random.default_rng(3)
    rng.integers(0, 50_000, 64 * 37 + 11, dtype=np.uint16).tofile(d / "t16.bin")
    np.save(d / "t32.npy", rng.integers(0, 1 << 31, 33 * 29 + 5, dtype=np.uint32))
    return d


def _sources(files):
    return [sources.token_windows(str(files / "t16.bin"), 37),
            sources.token_windows(str(files / "t32.npy"), 29, dtype=None)]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), which=st.sampled_from([0, 1]))
def test_get_batch_equals_collating_windows(files, data, which):
    src = _sources(files)[which]
    indices = data.draw(st.one_of(
        st.lists(st.integers(0, len(src) - 1), min_size=1, max_size=40),
        st.integers(0, len(src) - 1).flatmap(
            lambda a: st.integers(a, len(src) - 1).map(lambda b: list(range(a, b + 1))))))
    got = src.get_batch(np.asarray(indices))
    want = collate([src.get(i) for i in indices])
    assert list(got) == list(want) == ["tokens"]
    assert got["tokens"].dtype == want["tokens"].dtype
    assert got["tokens"].shape == want["tokens"].shape == (len(indices), src.seq_len)
    assert np.array_equal(got["tokens"], want["tokens"])


def test_get_batch_declines_what_the_window_read_must_name(files, tmp_path):
    src = _sources(files)[0]
    assert src.get_batch(np.array([0, len(src)])) is None  # out of range: get() says which
    assert src.get_batch(np.array([], dtype=np.int64)) is None
    assert src.sample_nbytes() == 37 * 2
    path = tmp_path / "t.bin"
    np.arange(4096, dtype=np.uint16).tofile(path)
    moved = sources.token_windows(str(path), seq_len=64)
    assert moved.get_batch([3, 4])["tokens"][0, 0] == 192
    os.utime(path, ns=(1, 1))  # rewritten in place
    assert moved.get_batch([5]) is None
    with pytest.raises(SourceError, match=r"t\.bin, window 5: the file changed"):
        moved.get(5)


def key(b):
    return (b.meta["lane"], b.meta["lane_index"], list(b.meta["sample_ids"]),
            b["tokens"].dtype.str, b["tokens"].shape, b["tokens"].tolist())


GROUPED = RuntimeOptions(runner="process", max_workers=2, worker_allocation="per_stage_fixed",
                         canonical_replicas=2)


@pytest.mark.parametrize("shuffle", [False, True])
def test_batched_and_grouped_streams_equal_the_window_by_window_one(files, shuffle):
    """Window by window (a map makes every sample go through an op), a batched read per
    batch (inline) and many batches per message (process): one stream."""
    from zephon.pipeline.engine import Plan
    from zephon.pipeline.program import batches_per_message

    src = _sources(files)[0]
    pipe = Pipeline(src, seed=4, chunk_size=5, shuffle=shuffle, num_epochs=2).batch(3)
    assert batches_per_message(src, 3, Plan(pipe.spec, GROUPED).stages[0]) > 1
    inline = RuntimeOptions(runner="inline", canonical_replicas=2)
    rows = [key(b) for b in Pipeline(src, seed=4, chunk_size=5, shuffle=shuffle,
                                     num_epochs=2).map(F.identity).batch(3).options(inline)]
    assert [key(b) for b in pipe.options(inline)] == rows
    assert [key(b) for b in pipe.options(GROUPED)] == rows


def test_grouped_windows_resume_mid_message(files):
    src = _sources(files)[1]
    pipe = Pipeline(src, seed=7, chunk_size=4, shuffle=True).batch(3)
    expected, following = passes(lambda: pipe.options(RuntimeOptions(
        runner="inline", canonical_replicas=2)), 2, key)
    assert_resumes(lambda: pipe.options(GROUPED), 5, key=key, reference=expected,
                   following=following)


def test_a_mapped_stage_sends_many_batches_a_message_and_the_same_stream(files):
    """Per-sample ops on the process runner: the batches travel several to a message
    (a message costs the consumer about as much as 20 cheap samples), and the stream, a
    resume in the middle of a message included, is the inline one."""
    from zephon.pipeline.engine import Plan
    from zephon.pipeline.program import OPS_GROUP_SAMPLES, batches_per_message

    src = _sources(files)[0]
    mapped = Pipeline(src, seed=4, chunk_size=5, shuffle=True, num_epochs=2) \
        .map(F.identity).batch(3)
    per = batches_per_message(src, 3, Plan(mapped.spec, GROUPED).stages[0])
    assert per == -(-OPS_GROUP_SAMPLES // 3)
    inline = RuntimeOptions(runner="inline", canonical_replicas=2)
    rows = [key(b) for b in mapped.options(inline)]
    assert [key(b) for b in mapped.options(GROUPED)] == rows
    expected, following = passes(lambda: mapped.options(inline), 2, key)
    assert_resumes(lambda: mapped.options(GROUPED), 7, key=key, reference=expected,
                   following=following)
