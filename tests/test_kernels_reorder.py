"""Ordered merge: ReorderBuffer and LaneRoundRobin, kernel == reference, restore, refusals."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.kernels import reorder_ref

compiled = pytest.importorskip("zephon._kernels.reorder", reason="kernels not built")
IMPLS = {"compiled": compiled, "reference": reorder_ref}


def shuffled_windows(n, window, rng):
    order = []
    for start in range(0, n, window):
        chunk = list(range(start, min(n, start + window)))
        rng.shuffle(chunk)
        order.extend(chunk)
    return order


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 300), st.integers(1, 40), st.integers(0, 2**32), st.integers(0, 50))
def test_reorder_kernel_equals_reference_and_restores_order(n, window, seed, start):
    rng = random.Random(seed)
    arrivals = [start + s for s in shuffled_windows(n, window, rng)]
    capacity = window + rng.randint(0, 5)
    logs = {}
    for name, m in IMPLS.items():
        buf = m.ReorderBuffer(capacity, cursor=start)
        log = []
        for seq in arrivals:
            buf.push(seq, ("item", seq))
            if rng.random() < 0.5:
                log.append(("pending", tuple(buf.pending()), len(buf)))
            log.append(("pop", tuple(buf.pop_ready()), buf.cursor))
        log.append(("state", buf.state()))
        logs[name] = log
        rng = random.Random(seed)  # same coin flips for the other implementation
        shuffled_windows(n, window, rng)
        rng.randint(0, 5)
        emitted = [item for entry in log if entry[0] == "pop" for item in entry[1]]
        assert emitted == [("item", start + s) for s in range(n)]
        assert len(buf) == 0 and buf.state() == {"cursor": start + n}
    assert logs["compiled"] == logs["reference"]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(st.integers(-2, 40), st.booleans()), max_size=60))
def test_reorder_errors_match_reference(capacity, ops):
    bufs = {name: m.ReorderBuffer(capacity) for name, m in IMPLS.items()}
    for seq, pop in ops:
        outcomes = {}
        for name, buf in bufs.items():
            try:
                buf.push(seq, seq)
                outcomes[name] = ("ok", buf.pop_ready() if pop else None)
            except ValueError as exc:
                outcomes[name] = ("error", str(exc))
        assert outcomes["compiled"] == outcomes["reference"]
        assert bufs["compiled"].pending() == bufs["reference"].pending()


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_reorder_refusals_leave_state_unchanged(impl):
    m = IMPLS[impl]
    buf = m.ReorderBuffer(4, cursor=10)
    buf.push(11, "b")
    with pytest.raises(ValueError, match="below the emit cursor"):
        buf.push(9, "x")
    with pytest.raises(ValueError, match="beyond the window"):
        buf.push(14, "x")
    with pytest.raises(ValueError, match="duplicate seq 11"):
        buf.push(11, "x")
    with pytest.raises(ValueError, match="must be an int"):
        buf.push(True, "x")
    with pytest.raises(ValueError, match="must be an int"):
        buf.push(12.0, "x")
    assert buf.pending() == [11] and buf.pop_ready() == [] and buf.cursor == 10
    buf.push(10, "a")
    assert buf.pop_ready() == ["a", "b"] and buf.cursor == 12
    with pytest.raises(ValueError, match="below"):
        buf.push(11, "again")  # already emitted
    with pytest.raises(ValueError, match="capacity"):
        m.ReorderBuffer(0)
    with pytest.raises(ValueError, match="cursor"):
        m.ReorderBuffer(4, cursor=-1)
    with pytest.raises(ValueError, match="2 seqs but 1 items"):
        buf.push_many([12, 13], ["x"])


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_reorder_checkpoint_restore_continues_exactly(impl):
    m = IMPLS[impl]
    buf = m.ReorderBuffer(8)
    buf.push_many([2, 0, 1, 5], "cabf")
    assert buf.pop_ready() == ["a", "b", "c"]
    state = buf.state()  # held item 5 is in flight, not state: replay re-produces it
    again = m.ReorderBuffer.from_state(8, state)
    again.push_many([4, 3, 5], "edf")
    assert again.pop_ready() == ["d", "e", "f"] and again.cursor == 6
    assert None is not again.state()


def test_reorder_none_items_are_items():
    for m in IMPLS.values():
        buf = m.ReorderBuffer(3)
        buf.push(1, None)
        buf.push(0, None)
        assert buf.pop_ready() == [None, None]


lane_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 4), st.integers()),
        st.tuples(st.just("exhaust"), st.integers(0, 4), st.none()),
        st.tuples(st.just("pop"), st.none(), st.none()),
        st.tuples(st.just("state"), st.none(), st.none()),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.integers(1, 4), st.permutations([0, 1, 2, 3]).map(lambda p: p[:3])),
       lane_ops)
def test_lane_round_robin_kernel_equals_reference(lanes, ops):
    rrs = {name: m.LaneRoundRobin(lanes) for name, m in IMPLS.items()}
    for op, lane, value in ops:
        outcomes = {}
        for name, rr in rrs.items():
            try:
                if op == "push":
                    rr.push(lane, value)
                    outcomes[name] = None
                elif op == "exhaust":
                    rr.mark_exhausted(lane)
                    outcomes[name] = None
                elif op == "pop":
                    outcomes[name] = (rr.pop_ready(), rr.cursor, rr.done, rr.pending())
                else:
                    state = rr.state()
                    outcomes[name] = state
                    rrs[name] = type(rr).from_state(lanes, state)
                    # FIFO contents are not state; re-push what was pending (replay)
                    for l, count in rr.pending().items():
                        for _ in range(count):
                            rrs[name].push(l, "replayed")
            except ValueError as exc:
                outcomes[name] = ("error", str(exc))
        assert outcomes["compiled"] == outcomes["reference"]


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_lane_round_robin_is_strict(impl):
    m = IMPLS[impl]
    rr = m.LaneRoundRobin([4, 6, 5])
    rr.push(6, "6a")
    rr.push(5, "5a")
    assert rr.pop_ready() == []  # lane 4 must go first
    rr.push(4, "4a")
    rr.push(4, "4b")
    assert rr.pop_ready() == [(4, "4a"), (6, "6a"), (5, "5a"), (4, "4b")]
    assert rr.cursor == 1  # waiting for lane 6
    rr.mark_exhausted(6)
    rr.push(5, "5b")
    assert rr.pop_ready() == [(5, "5b")]  # 6 skipped only because it is exhausted
    assert rr.state() == {"cursor": 0, "exhausted": [6]}
    with pytest.raises(ValueError, match="exhausted"):
        rr.push(6, "late")
    with pytest.raises(ValueError, match="unknown lane 7"):
        rr.push(7, "x")
    for lane in (4, 5):
        rr.mark_exhausted(lane)
    assert rr.pop_ready() == [] and rr.done
    with pytest.raises(ValueError):
        m.LaneRoundRobin(0)
    with pytest.raises(ValueError):
        m.LaneRoundRobin([1, 1])
    with pytest.raises(ValueError):
        m.LaneRoundRobin(3, cursor=3)
