"""pack_documents: every document token exactly once per epoch, positions restarting at
every segment, cu_seqlens matching the rows, full rows (greedy) or whole documents (bin
packing), the padding reported, and restore exact at any item (the open bins carry)."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from _resume import END, assert_resumes, passes
from _streams import keys_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon import CheckpointError, OpError, Pipeline, RuntimeOptions, ZephonConfigError, sources
from zephon.checkpoint import decode_state, encode_state

SPAN = 1000  # token = document * SPAN + index within the document


def document(lengths: tuple, i: int) -> dict:
    n = lengths[i]
    return {"tokens": np.arange(n, dtype=np.int64) + SPAN * i,
            "loss_mask": (np.arange(n) % 2).astype(np.int8)}


def pipeline(lengths, seq_len, algorithm, open_bins=4, chunk_size=3, lanes=2, flush=1,
             runner="inline", **kwargs):
    src = sources.from_callable(len(lengths), functools.partial(document, tuple(lengths)))
    opts = RuntimeOptions(runner=runner, canonical_replicas=lanes, flush_every_k_chunks=flush)
    return Pipeline(src, seed=5, chunk_size=chunk_size).pack_documents(
        seq_len, algorithm=algorithm, open_bins=open_bins, **kwargs).batch(1).options(opts)


def lane_row(b) -> tuple:
    """``(lane, row dict)`` of a delivered row (a batch of one)."""
    return b.meta["lane"], {k: v[0] for k, v in b.items()}


def segments(row: dict, pad_id: int = 0) -> list:
    """The row's segments as token arrays, after checking its layout."""
    cu = row["cu_seqlens"]
    seq_len = row["tokens"].size
    assert cu.dtype == row["positions"].dtype == np.int32 and cu.size == seq_len + 1
    n_off = int(np.count_nonzero(cu >= 0))
    offsets = cu[:n_off]
    assert offsets[0] == 0 and (np.diff(offsets) > 0).all() and (cu[n_off:] == -1).all()
    used = int(offsets[-1])
    assert (row["tokens"][used:] == pad_id).all() and (row["positions"][used:] == 0).all()
    out = []
    for a, b in itertools.pairwise(offsets):
        tokens = row["tokens"][a:b]
        assert row["positions"][a:b].tolist() == list(range(b - a))  # restart per segment
        assert (np.diff(tokens) == 1).all() and len(set(tokens // SPAN)) == 1  # one document
        out.append(tokens)
    return out


CASES = st.tuples(
    st.lists(st.integers(0, 30), min_size=1, max_size=40),   # document lengths
    st.integers(2, 16),                                        # seq_len
    st.sampled_from(["greedy", "wrap", "first_fit", "best_fit"]),
    st.integers(1, 5),                                         # open bins
    st.integers(1, 4),                                         # chunk size
    st.integers(1, 3),                                         # lanes
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CASES)
def test_every_token_once_positions_restart_and_rows_are_full_or_documents_whole(case):
    lengths, seq_len, algorithm, open_bins, chunk, lanes = case
    got = keys_of(pipeline(lengths, seq_len, algorithm, open_bins, chunk, lanes), lane_row)
    pieces = [(lane, seg) for lane, row in got for seg in segments(row)]
    delivered = sorted(t for _, seg in pieces for t in seg.tolist())
    assert delivered == sorted(SPAN * i + j for i, n in enumerate(lengths) for j in range(n))
    fills = {}
    for lane, row in got:
        fills.setdefault(lane, []).append(int(row["cu_seqlens"].max()))
    if algorithm in ("greedy", "wrap"):  # every row full but each lane's last
        assert all(f[:-1] == [seq_len] * (len(f) - 1) for f in fills.values())
        return
    for _, seg in pieces:  # a document that fits a row is never split
        doc = int(seg[0]) // SPAN
        if lengths[doc] <= seq_len:
            assert seg.size == lengths[doc]
        else:  # whole rows, then its rest in one piece
            assert seg.size == seq_len or seg.size == lengths[doc] % seq_len


def test_greedy_rows_are_pack_tokens_rows_with_the_last_padded():
    lengths = [3, 7, 1, 9, 4, 4, 2]
    src = sources.from_callable(len(lengths), functools.partial(document, tuple(lengths)))
    base = Pipeline(src, shuffle=False)
    want = [r["tokens"].tolist() for r in base.pack_tokens(6)]
    got = [r["tokens"].tolist() for r in base.pack_documents(6, pad_id=7)]
    assert got[:-1] == want[:-1] and got[-1] == want[-1] + [7] * (6 - len(want[-1]))


def test_best_fit_pads_less_than_first_fit_here_and_stats_report_the_padding():
    lengths = [5, 4, 3, 3, 2, 6, 1, 5, 2, 4, 3]
    fractions = {}
    for algorithm in ("first_fit", "best_fit"):
        pipe = pipeline(lengths, 8, algorithm, open_bins=3, lanes=1, chunk_size=20).options(
            RuntimeOptions(execution_tracking="nodes"))
        it = iter(pipe)
        got = [{k: v[0] for k, v in b.items()} for b in it]
        used = sum(int(r["cu_seqlens"].max()) for r in got)
        node = it.stats()["serial1_pack_documents"]
        assert node["rows"] == len(got) and node["tokens"] == used == sum(lengths)
        assert node["padding_tokens"] == 8 * len(got) - used
        assert node["padding_fraction"] == pytest.approx(1 - used / (8 * len(got)))
        fractions[algorithm] = node["padding_fraction"]
    assert fractions["best_fit"] <= fractions["first_fit"]


def test_bin_packing_emits_a_full_bin_at_once_and_the_fullest_when_bins_run_out():
    src = sources.from_sequence([{"tokens": np.full(n, n)} for n in (5, 3, 6, 4, 2)])
    got = [r["tokens"].tolist() for r in
           Pipeline(src, shuffle=False).pack_documents(8, algorithm="first_fit", open_bins=2)]
    # 5 | 5+3 full -> out; 6 | 6, 4 (two open); 2 fits the 6 -> full -> out; drain: 4
    assert got == [[5] * 5 + [3] * 3, [6] * 6 + [2] * 2, [4] * 4 + [0] * 4]
    got = [r["tokens"].tolist() for r in
           Pipeline(src, shuffle=False).pack_documents(8, algorithm="first_fit", open_bins=1)]
    assert got[1] == [6] * 6 + [0] * 2  # one open bin: the 6 goes out when the 4 needs room


def test_aligned_fields_are_packed_with_the_tokens_and_checked():
    got = keys_of(pipeline([3, 4, 2], 6, "best_fit", lanes=1, aligned=("loss_mask",)),
                  lane_row)
    for _, row in got:
        used = int(row["cu_seqlens"].max())
        want = (row["tokens"][:used] % SPAN) % 2  # document() masks odd indices in
        assert row["loss_mask"][:used].tolist() == want.tolist()
        assert (row["loss_mask"][used:] == 0).all()
    src = sources.from_sequence([{"tokens": np.arange(3), "loss_mask": np.ones(2)}])
    with pytest.raises(OpError, match="'loss_mask' has 2 value"):
        list(Pipeline(src).pack_documents(4, aligned=("loss_mask",)))


@pytest.mark.parametrize("bad, match", [
    (dict(seq_len=1), "seq_len"), (dict(algorithm="next_fit"), "algorithm"),
    (dict(open_bins=0), "open_bins"), (dict(open_bins=5000), "open_bins"),
    (dict(pad_id=-1), "pad_id"), (dict(aligned="loss_mask"), "aligned"),
    (dict(aligned=("positions",)), "named twice"), (dict(drop_remainder=1), "drop_remainder"),
])
def test_bad_arguments_are_refused_by_name(bad, match):
    args = {"seq_len": 8, **bad}
    with pytest.raises(ZephonConfigError, match=match):
        Pipeline(sources.from_sequence([1])).pack_documents(**args)


def test_drop_remainder_drops_only_what_is_open_at_the_end():
    lengths = [3, 4, 5, 2]
    keep = keys_of(pipeline(lengths, 6, "first_fit", lanes=1, chunk_size=10), lane_row)
    drop = keys_of(pipeline(lengths, 6, "first_fit", lanes=1, chunk_size=10,
                            drop_remainder=True), lane_row)
    full = [r for _, r in keep if int(r["cu_seqlens"].max()) == 6]
    assert [r["tokens"].tolist() for _, r in drop] == [r["tokens"].tolist() for r in full]


# -- resume --------------------------------------------------------------------------------

def key(b) -> tuple:
    return (b.meta["lane"], b["tokens"].tolist(), b["positions"].tolist(),
            b["cu_seqlens"].tolist(), list(map(tuple, b.meta["sample_ids"])))


LENGTHS = [(7 * i) % 13 for i in range(60)]


@pytest.mark.parametrize("algorithm", ["greedy", "first_fit", "best_fit"])
def test_restore_at_every_item_is_exact_on_another_runner(algorithm):
    def make(runner="inline"):
        src = sources.from_callable(len(LENGTHS), functools.partial(document, tuple(LENGTHS)))
        return Pipeline(src, seed=3, chunk_size=2).pack_documents(
            6, algorithm=algorithm, open_bins=3).batch(2).options(RuntimeOptions(
                runner=runner, canonical_replicas=3, flush_every_k_chunks=1))

    full, following = passes(make, 2, key)
    carried = False
    for take in [*range(1, len(full)), END]:
        state = assert_resumes(make, take, again=lambda take=take: make(
            "threads" if take % 2 else "inline"), key=key, reference=full,
            following=following).state
        carried |= any(len(v) > 4 for v in decode_state(state)["lanes"].values())
    assert carried  # the states held open bins at their boundaries


def test_a_carried_bin_of_seq_len_tokens_is_refused():
    def make():
        src = sources.from_callable(len(LENGTHS), functools.partial(document, tuple(LENGTHS)))
        return Pipeline(src, seed=3, chunk_size=2).pack_documents(
            6, algorithm="best_fit", open_bins=3).options(RuntimeOptions(
                canonical_replicas=1, flush_every_k_chunks=1))

    pipe = make()
    it = iter(pipe)
    lane = []
    while len(lane) <= 4 or lane[4] < 1:  # until the state holds an open bin
        next(it)
        state = decode_state(pipe.checkpoint())
        lane = state["lanes"]["0"]
    pipe.close()
    # [epoch, k, since, total, bins, pieces, (epoch, p, a, b) per piece, ...]: the first
    # piece stretched to a whole row
    state["lanes"]["0"] = [*lane[:9], lane[8] + 6, *lane[10:]]
    bad = make()
    with pytest.raises(CheckpointError, match="packed bin of"):
        bad.restore(encode_state(state))
        list(bad)
