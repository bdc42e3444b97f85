"""The hand-off between the pump thread and the consumer: its bounds (items and bytes),
what ``close()`` does to a side that waits, and a run closed from another thread while
its consumer waits for an item."""

from __future__ import annotations

import threading
import time

import pytest

from zephon import IteratorClosedError, Pipeline, RuntimeOptions, sources
from zephon.pipeline.iterator import Handoff, HandoffClosed

from _pipeline_fns import slow_identity


def in_thread(fn, *args):
    """Run ``fn(*args)`` in a daemon thread; returns (thread, box) where box gets
    ``("ok", value)`` or ``("raised", exc)``."""
    box: list = []

    def run():
        try:
            box.append(("ok", fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box.append(("raised", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_items_come_out_in_order_and_the_depth_bounds_the_producer():
    h = Handoff(depth=3)
    for k in range(3):
        assert h.put(k)
    t, box = in_thread(h.put, 3)  # full: waits
    t.join(0.3)
    assert t.is_alive() and not box
    assert h.get() == 0 and h.get() == 1  # half free: the producer is let in
    t.join(5)
    assert box == [("ok", True)]
    assert [h.get(), h.get()] == [2, 3]


def test_bytes_bound_the_producer_but_one_item_always_fits():
    h = Handoff(depth=100, byte_limit=100)
    assert h.put("big", 1000)  # an empty hand-off admits any item
    t, box = in_thread(h.put, "small", 10)
    t.join(0.3)
    assert t.is_alive(), "an item was admitted past the byte bound"
    assert h.get() == "big"
    t.join(5)
    assert box == [("ok", True)] and h.get() == "small" and h.used == 0


def test_the_stream_ends_after_the_items_before_its_end_or_error():
    h = Handoff(depth=4)
    assert h.put("a") and h.finish()
    assert h.get() == "a"
    with pytest.raises(StopIteration):
        h.get()
    h = Handoff(depth=4)
    assert h.put("a") and h.fail(ValueError("boom"))
    assert h.get() == "a"
    with pytest.raises(ValueError, match="boom"):
        h.get()


def test_close_wakes_a_waiting_producer_and_consumer_for_good():
    full = Handoff(depth=1)
    full.put(0)
    producer, pbox = in_thread(full.put, 1)
    empty = Handoff(depth=1)
    consumer, cbox = in_thread(empty.get)
    time.sleep(0.2)
    full.close()
    empty.close()
    producer.join(5)
    consumer.join(5)
    assert pbox == [("ok", False)]
    assert cbox and cbox[0][0] == "raised" and isinstance(cbox[0][1], HandoffClosed)
    assert full.put(2) is False and full.used == 0
    with pytest.raises(HandoffClosed):
        full.get()


def test_a_run_closed_from_another_thread_ends_the_consumer_waiting_in_it():
    # The consumer waits for an item the worker will not have for a minute; closing the
    # run from another thread ends that wait (it used to wait on the queue for ever) with
    # the closed error, not a silent end of the stream a loop would take for an epoch's.
    # The first sample is instant: validation runs the op on it in this process. An endless
    # pass: at a finite pass's tail an item is handed on once the next one is known.
    pipe = Pipeline(sources.from_sequence([0.0, 60.0, 60.0]), shuffle=False,
                    num_epochs=None) \
        .map(slow_identity, parallelism=1) \
        .options(RuntimeOptions(runner="process", max_workers=1, shutdown_mode="hard"))
    it = iter(pipe)
    try:
        assert next(it) == 0.0
        consumer, box = in_thread(next, it)
        time.sleep(1.0)
        assert consumer.is_alive() and not box, box
    finally:
        it.close()
    consumer.join(30)
    assert not consumer.is_alive(), "next() still waits after close()"
    assert box and box[0][0] == "raised" and isinstance(box[0][1], IteratorClosedError)
    assert "close()" in str(box[0][1]) and it.closed


def test_two_consumers_share_the_items_without_losing_or_repeating_one():
    h = Handoff(depth=4)
    got: list = []
    lock = threading.Lock()

    def consume():
        while True:
            try:
                item = h.get()
            except HandoffClosed:
                return
            with lock:
                got.append(item)

    consumers = [threading.Thread(target=consume, daemon=True) for _ in range(2)]
    for t in consumers:
        t.start()
    for k in range(2000):
        assert h.put(k)
    deadline = time.monotonic() + 30
    while len(got) < 2000 and time.monotonic() < deadline:
        time.sleep(0.01)
    h.close()
    for t in consumers:
        t.join(5)
    assert not any(t.is_alive() for t in consumers)
    assert sorted(got) == list(range(2000))
