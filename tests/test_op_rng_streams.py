"""Each per-sample op draws its own ``ctx.rng`` stream.

Two ops drawing from ``ctx.rng`` on one sample (a random crop, then a colour jitter of
the user's) must not draw the same numbers: the first per-sample op's generator is
seeded from ``[seed, crc32(source), index, epoch]`` as it always was, each later one's
from that key plus its ordinal. The draws are the same on every runner; a checkpoint of
the stream where the ops shared one set of draws is refused by the fingerprint, naming
the op, while every other pipeline's checkpoints restore as they did.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from zephon import Pipeline, RuntimeOptions, sources
from zephon.errors import CheckpointError
from zephon.pipeline.fingerprint import fn_identity
from zephon.pipeline.ops.map import MapOp


def first(sample, ctx):
    return {"v": sample, "a": int(ctx.rng.integers(0, 1 << 30))}


def second(sample, ctx):
    return {**sample, "b": int(ctx.rng.integers(0, 1 << 30))}


def keep_most(sample, ctx):
    return ctx.rng.random() < 0.9


def plain(sample):
    return sample


def build(runner="inline", **kw):
    return (Pipeline(sources.from_sequence(list(range(40)), name="seq"), seed=7, chunk_size=8)
            .map(first).map(plain).filter(keep_most).map(second)
            .options(RuntimeOptions(runner=runner, **kw)))


def expected(key):
    return int(np.random.default_rng(key).integers(0, 1 << 30))


def test_two_ops_draw_independent_numbers_and_the_first_keeps_its_stream():
    rows = list(build())
    assert rows and all(r["a"] != r["b"] for r in rows)
    crc = zlib.crc32(b"seq")
    for r in rows:
        index = r["v"]
        # op 0 (map first): the key it always had; op 3 (map second): the key plus 3
        assert r["a"] == expected([7, crc, index, 0])
        assert r["b"] == expected([7, crc, index, 0, 3])


def test_a_filter_draws_its_own_stream_too():
    crc = zlib.crc32(b"seq")
    kept = {r["v"] for r in build()}
    assert kept == {i for i in range(40)
                    if np.random.default_rng([7, crc, i, 0, 2]).random() < 0.9}


def test_the_draws_are_the_same_on_every_runner():
    inline = list(build())
    assert list(build("threads", max_workers=2)) == inline
    assert list(build("process", max_workers=2)) == inline


def test_only_a_later_op_that_takes_ctx_names_its_stream():
    described = [op.describe() for op in build().ops]
    assert [d.endswith(")") and "ctx.rng stream" in d for d in described] == \
        [False, False, True, True]  # first (op 0), plain (no ctx), keep_most, second
    assert described[2].endswith("ctx.rng stream 2)")
    assert described[3].endswith("ctx.rng stream 3)")


def old_describe(self):
    """``describe()`` of the format before: no op named a stream of its own."""
    return f"{self.kind}({fn_identity(self.fn)})"


def test_a_checkpoint_of_the_shared_draws_is_refused_naming_the_op(monkeypatch):
    real = MapOp.describe
    with monkeypatch.context() as m:
        m.setattr(MapOp, "describe", old_describe)
        it = iter(build())
        next(it)
        state = it.checkpoint()
        it.close()
    assert MapOp.describe is real
    fresh = build()
    with pytest.raises(CheckpointError, match=r"ctx\.rng stream"):
        fresh.restore(state)


def test_a_pipeline_with_one_drawing_op_restores_its_old_checkpoints(monkeypatch):
    def one_op():
        return Pipeline(sources.from_sequence(list(range(20)), name="seq"), seed=7,
                        chunk_size=4).map(first).map(plain)

    with monkeypatch.context() as m:
        m.setattr(MapOp, "describe", old_describe)
        old_state_pipe = one_op()
        it = iter(old_state_pipe)
        head = [next(it) for _ in range(5)]
        state = it.checkpoint()
        it.close()
    # one drawing op, the first: its description (and its draws) are those of before
    assert [op.describe() for op in one_op().ops] == [old_describe(op) for op in one_op().ops]
    resumed = one_op()
    resumed.restore(state)
    assert head + list(resumed) == list(one_op())
