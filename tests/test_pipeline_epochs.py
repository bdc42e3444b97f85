"""Epochs that advance: each ``iter(pipe)`` continues after the last item the previous run
delivered (a complete pass: the next epoch), ``set_epoch`` re-runs an epoch exactly,
``restore`` sets where the next run starts, and ``zephon.torch.loader`` agrees."""

from __future__ import annotations

import _pipeline_fns as F
import pytest
from _resume import END, assert_resumes, passes
from _streams import keys_of

from zephon import CheckpointError, Pipeline, RuntimeOptions, ZephonConfigError, sources
from zephon.checkpoint import decode_state, encode_state


def pipeline(epochs=1, chain="replay", **opts):
    base = Pipeline(sources.from_callable(37, F.make_sample), seed=9, chunk_size=4,
                    num_epochs=epochs).map(F.jitter)
    base = base.shuffle(5).batch(3) if chain == "replay" else base.batch(3)
    return base.options(RuntimeOptions(canonical_replicas=2, **opts))


def key(b):
    return (b.meta["lane"], b.meta["lane_index"], tuple(b.meta["sample_ids"]),
            tuple(b["draw"].tolist()))


def epochs_of(batches) -> set:
    return {e for b in batches for _, _, e in b[2]}


@pytest.mark.parametrize("chain", ["replay", "cursor"])
def test_three_loops_see_three_epochs(chain):
    pipe = pipeline(chain=chain)
    runs = [keys_of(pipe, key) for _ in range(3)]
    assert [epochs_of(p) for p in runs] == [{0}, {1}, {2}]
    orders = [[s[1] for b in p for s in b[2]] for p in runs]
    assert sorted(orders[0]) == sorted(orders[1]) == sorted(orders[2]) == list(range(37))
    assert orders[0] != orders[1] != orders[2]
    draws = [sorted(d for b in p for d in b[3]) for p in runs]  # ctx.rng per epoch
    assert draws[0] != draws[1] != draws[2]
    # each pass is what a fresh pipeline gives for that epoch
    for epoch, got in enumerate(runs):
        fresh = pipeline(chain=chain)
        fresh.set_epoch(epoch)
        assert keys_of(fresh, key) == got


def test_a_pass_is_num_epochs_epochs():
    pipe = pipeline(epochs=2)
    first, second = keys_of(pipe, key), keys_of(pipe, key)
    assert epochs_of(first) == {0, 1} and epochs_of(second) == {2, 3}
    assert [b[1] for b in first if b[0] == 0] == list(range(len([b for b in first
                                                                 if b[0] == 0])))


@pytest.mark.parametrize("chain", ["replay", "cursor"])
def test_a_loop_left_early_is_continued_by_the_next(chain):
    reference = keys_of(pipeline(chain=chain), key)
    pipe = pipeline(chain=chain)
    head = []
    for b in pipe:
        head.append(key(b))
        if len(head) == 5:
            break
    assert head + keys_of(pipe, key) == reference
    assert epochs_of(keys_of(pipe, key)) == {1}  # then the next epoch


def test_a_pass_consumed_to_its_last_item_goes_on_with_the_next():
    reference = keys_of(pipeline(), key)
    pipe = pipeline()
    it = iter(pipe)
    got = [key(next(it)) for _ in range(len(reference))]  # never asked for one more
    it.close()
    assert got == reference
    nxt = keys_of(pipe, key)
    assert epochs_of(nxt) == {1} and len(nxt) == len(reference)


def test_set_epoch_reruns_an_epoch_exactly():
    pipe = pipeline()
    runs = [keys_of(pipe, key) for _ in range(3)]
    pipe.set_epoch(1)
    assert keys_of(pipe, key) == runs[1]
    assert keys_of(pipe, key) == runs[2]  # and goes on from there
    pipe.set_epoch(0)
    it = iter(pipe)
    assert key(next(it)) == runs[0][0]
    pipe.set_epoch(2)  # a live run restarts there
    assert [key(b) for b in it] == runs[2]
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ZephonConfigError, match="set_epoch"):
            pipe.set_epoch(bad)


@pytest.mark.parametrize("chain", ["replay", "cursor"])
def test_resume_across_an_epoch_change_is_exact(chain):
    first, second, third = passes(lambda: pipeline(chain=chain), 3, key)
    n = len(first)

    def after_a_pass():  # a pipeline whose next run is pass 1
        pipe = pipeline(chain=chain)
        keys_of(pipe)
        return pipe

    def again():
        return pipeline(chain=chain, runner="threads", max_workers=2)

    for cut in (n - 1, END, n, n + 1, n + 7):
        if cut in (n - 1, END):  # in pass 0, or right after its last item
            state = assert_resumes(lambda: pipeline(chain=chain), cut, again=again, key=key,
                                   reference=first, following=second).state
        else:  # in pass 1 (at n: a run of it that delivered nothing yet)
            state = assert_resumes(after_a_pass, cut - n, again=again, key=key,
                                   reference=second, following=third).state
        assert decode_state(state)["start_epoch"] == (1 if cut >= n else 0), cut


def test_a_state_epoch_outside_its_pass_is_refused():
    pipe = pipeline()
    keys_of(pipe, key)
    it = iter(pipe)
    next(it)
    state = decode_state(it.checkpoint())
    it.close()
    lane, entry = next(iter(state["lanes"].items()))
    assert state["start_epoch"] == 1 and entry[0] == 1
    for epoch in (0, 2):
        bad = {**state, "lanes": {lane: [epoch, *entry[1:]]}}
        with pytest.raises(CheckpointError, match="epoch"):
            pipeline().restore(encode_state(bad))
    without = {k: v for k, v in state.items() if k != "start_epoch"}
    with pytest.raises(CheckpointError, match="start_epoch"):
        pipeline().restore(encode_state(without))


def test_torch_loader_follows_the_same_rule():
    pytest.importorskip("torch")
    zt = pytest.importorskip("zephon.torch")
    reference = passes(pipeline, 3, key)
    loader = zt.loader(pipeline())
    try:
        got = [[key(b) for b in loader] for _ in range(3)]
    finally:
        loader.close()
    assert [epochs_of(p) for p in got] == [{0}, {1}, {2}]
    assert [[k[:3] for k in p] for p in got] == [[k[:3] for k in p] for p in reference]


@pytest.mark.parametrize("pin", [False, True])
def test_torch_loader_left_early_continues_after_what_it_handed_out(pin):
    pytest.importorskip("torch")
    zt = pytest.importorskip("zephon.torch")
    import warnings

    reference = keys_of(pipeline(), key)
    loader = zt.loader(pipeline(), pin_memory=pin, prefetch=4)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # pinning without an accelerator
            head = []
            for b in loader:
                head.append(key(b)[:3])
                if len(head) == 4:
                    break
            loader.close()  # the pinning thread took more than it handed out
            rest = [key(b)[:3] for b in loader]
            following = [key(b)[:3] for b in loader]
    finally:
        loader.close()
    assert head + rest == [k[:3] for k in reference]
    assert epochs_of(following) == {1}
