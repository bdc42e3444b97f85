"""Packed rows in batches: the packer's short last row never stacks with full rows.

``pack_tokens(L).batch(B)``: every batch is an array of rows; all are ``(B, L)`` but, at a
lane's end, its last batch of full rows and then its short row, alone. With
``drop_last=True`` both go and every batch is ``(B, L)`` (what a compiled training step
wants); nothing is lost before a lane's end. ``pack_documents`` pads its last row, so its
batches always stack.
"""

from __future__ import annotations

import collections

import _pipeline_fns as F
import numpy as np
import pytest
from _resume import assert_resumes_at

from zephon import Pipeline, RuntimeOptions, ZephonConfigError, sources
from zephon.pipeline.training import to_training

L, B, C = 16, 3, 2


def pipe(tail, runner="inline", n=61, epochs=1, **extra):
    base = Pipeline(sources.from_callable(n, F.ragged_tokens), seed=3, chunk_size=4,
                    num_epochs=epochs)
    return tail(base).options(RuntimeOptions(runner=runner, max_workers=2,
                                             canonical_replicas=C, **extra))


def packed_rows(epochs=1, n=61) -> dict:
    """Each lane's packed rows (``pack_tokens`` alone), by lane."""
    it = pipe(lambda p: p.pack_tokens(L).batch(1), n=n, epochs=epochs)
    out = collections.defaultdict(list)
    for b in it:
        out[b.meta["lane"]].append(b["tokens"][0].tolist())
    return dict(out)


def tokens(batch) -> list:
    return batch["tokens"].tolist()


def by_lane(batches) -> dict:
    out = collections.defaultdict(list)
    for b in batches:
        out[b.meta["lane"]].append(b)
    return dict(out)


@pytest.mark.parametrize("runner", ["inline", "process"])
@pytest.mark.parametrize("n", [61, 64, 7])
def test_every_batch_stacks_and_only_a_lanes_end_is_short(runner, n):
    rows = packed_rows(n=n)
    batches = list(pipe(lambda p: p.pack_tokens(L).batch(B), runner, n=n))
    for lane, items in by_lane(batches).items():
        assert all(isinstance(b["tokens"], np.ndarray) for b in items), lane
        shapes = [b["tokens"].shape for b in items]
        short = [r for r in rows[lane] if len(r) < L]
        tail = shapes[-1:] if short else []
        if short:  # the short row: alone, last
            assert tail == [(1, len(short[0]))], (lane, shapes)
        body = shapes[:len(shapes) - len(tail)]
        assert all(s == (B, L) for s in body[:-1]), (lane, shapes)
        assert not body or (body[-1][1] == L and 1 <= body[-1][0] <= B), (lane, shapes)
        # the rows, in order, are the packer's
        assert [r for b in items for r in b["tokens"].tolist()] == rows[lane]


def test_the_tokens_of_an_epoch_are_the_sources_whatever_the_batching():
    src = sources.from_callable(61, F.ragged_tokens)
    want = collections.Counter(t for i in range(61) for t in src.get(i)["tokens"].tolist())
    batches = list(pipe(lambda p: p.pack_tokens(L).batch(B)))
    got = collections.Counter(t for b in batches for t in b["tokens"].reshape(-1).tolist())
    assert got == want


@pytest.mark.parametrize("size", [1, B])
@pytest.mark.parametrize("epochs", [1, 2])
def test_drop_last_gives_only_full_batches_and_loses_nothing_before_a_lanes_end(size, epochs):
    rows = packed_rows(epochs=epochs)
    batches = list(pipe(lambda p: p.pack_tokens(L).batch(size, drop_last=True),
                        epochs=epochs))
    assert {b["tokens"].shape for b in batches} == {(size, L)}
    for lane, items in by_lane(batches).items():
        full = [r for r in rows[lane] if len(r) == L]
        got = [r for b in items for r in b["tokens"].tolist()]
        assert got == full[:len(full) - len(full) % size], lane  # a prefix: the lane's head


def test_a_shuffle_between_packer_and_batch_still_puts_the_short_row_last_alone():
    batches = list(pipe(lambda p: p.pack_tokens(L).shuffle(5).batch(B)))
    for lane, items in by_lane(batches).items():
        lengths = [len(r) for b in items for r in b["tokens"]]
        assert all(x == L for x in lengths[:-1]), (lane, lengths)
        if lengths[-1] < L:
            assert items[-1]["tokens"].shape[0] == 1
    dropped = list(pipe(lambda p: p.pack_tokens(L).shuffle(5).batch(B, drop_last=True)))
    assert {b["tokens"].shape for b in dropped} == {(B, L)}


def test_to_training_takes_every_batch_of_packed_rows():
    # the ragged last batch used to fail there: "inhomogeneous shape"
    for b in pipe(lambda p: p.pack_tokens(L).batch(B)):
        out = to_training(b)
        assert out["labels"].shape == b["tokens"].shape


def test_documents_batched_unpacked_are_refused_by_to_training_naming_the_fix():
    # what tokenize(...).batch(n) gives: rows of their own lengths, kept as a list
    batch = next(iter(pipe(lambda p: p.batch(B))))
    assert isinstance(batch["tokens"], list)
    with pytest.raises(ZephonConfigError, match=r"'tokens' is ragged.*pack_tokens or "
                                                r"pack_documents"):
        to_training(batch)


def test_the_torch_loader_gives_tensors_of_one_shape_with_drop_last():
    pytest.importorskip("torch")
    import zephon.torch as zt

    loader = zt.loader(pipe(lambda p: p.pack_tokens(L).batch(B, drop_last=True)),
                       to_training=True)
    assert {tuple(b["input_ids"].shape) for b in loader} == {(B, L)}


def test_a_resume_across_the_short_row_is_exact():
    make = lambda: pipe(lambda p: p.pack_tokens(L).batch(B), flush_every_k_chunks=1)  # noqa: E731
    assert_resumes_at(make, key=tokens)  # every cut, the end of the pass included


@pytest.mark.parametrize("algorithm", ["greedy", "best_fit"])
def test_pack_documents_batches_always_stack(algorithm):
    for drop in (False, True):
        batches = list(pipe(lambda p, drop=drop: p.pack_documents(L, algorithm=algorithm)
                            .batch(B, drop_last=drop)))
        shapes = [b["tokens"].shape for b in batches]
        assert all(isinstance(b["tokens"], np.ndarray) for b in batches)
        assert all(s[1] == L for s in shapes)
        if drop:
            assert set(shapes) == {(B, L)}
