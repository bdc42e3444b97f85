"""What recording execution statistics costs the hot path, and that what it records stays
exact: each counter has one writer and takes no lock; the time series is filled from
each writer's open bucket, once per bucket (:mod:`zephon.pipeline.stats`)."""

from __future__ import annotations

import threading

import _profile_fns as F
import pytest

import zephon
from zephon import Pipeline, RuntimeOptions, sources
from zephon.pipeline import stats as stats_module
from zephon.pipeline.stats import FIRST_BUCKET_S, recording


class CountingLock:
    """A lock that counts its acquisitions, and by which thread (by name)."""

    def __init__(self, made: list) -> None:
        self._lock = threading.Lock()
        self.by: dict[str, int] = {}
        made.append(self)

    def __enter__(self) -> "CountingLock":
        self._lock.acquire()
        name = threading.current_thread().name
        self.by[name] = self.by.get(name, 0) + 1
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    @property
    def total(self) -> int:
        return sum(self.by.values())


@pytest.fixture
def counted(monkeypatch):
    made: list[CountingLock] = []
    monkeypatch.setattr(stats_module, "Lock", lambda: CountingLock(made))
    return made


def cheap_parts(runner: str, n: int = 4096):
    """Many small parts: ``batch(8)`` fused into the map stage, one batch per part."""
    return Pipeline(sources.from_sequence(list(range(n))), chunk_size=64) \
        .map(F.cheap).batch(8) \
        .options(RuntimeOptions(runner=runner, max_workers=2, execution_tracking="nodes"))


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_recording_takes_the_lock_per_bucket_not_per_part(counted, runner):
    pipe = cheap_parts(runner)
    with recording() as runs:
        batches = len(list(pipe))
    (lock,) = counted
    snap = runs[0].snapshot(report=True)
    parts = snap["nodes"]["stage0"]["units"]
    assert batches == 512 and parts >= 256  # one batch per part, or two
    # Per writer (the stage's engine side, the consumer) one roll per bucket it saw,
    # plus attach, the workers' start/stop events, the end and this snapshot.
    buckets = snap["elapsed_s"] / FIRST_BUCKET_S + 1
    events = len(snap["events"])
    assert lock.total <= 2 * buckets + events + 10, lock.by
    assert not [name for name in lock.by if name.startswith("zephon-stage")], lock.by


def test_thread_workers_report_their_op_time_through_the_engine(counted):
    pipe = Pipeline(sources.from_sequence(list(range(64))), chunk_size=8) \
        .map(F.slow).batch(8) \
        .options(RuntimeOptions(runner="threads", max_workers=2,
                                execution_tracking="stages"))
    assert len(list(pipe)) == 8
    stage = pipe.stats(report=True)["stages"]["stage0"]
    assert stage["busy_s"] >= 64 * F.SLOW_S * 0.9
    (lock,) = counted
    assert not [name for name in lock.by if name.startswith("zephon-stage")], lock.by


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_series_sum_to_the_counters(runner):
    pipe = Pipeline(sources.from_sequence(list(range(600))), chunk_size=8) \
        .map(F.cheap).shuffle(16).map(F.cheap).batch(8) \
        .options(RuntimeOptions(runner=runner, max_workers=2, execution_tracking="nodes"))
    batches = len(list(pipe))
    snap = pipe.stats(report=True)
    series, nodes = snap["series"], snap["nodes"]
    n = len(series["t"])
    assert all(len(v) == n for k, v in series.items() if k not in ("t", "bucket_s"))
    assert sum(series["batches"]) == batches == snap["consumer"]["batches"] == 75
    assert sum(series["steps"]) == batches - 1
    assert sum(series["wait_s"]) == pytest.approx(snap["consumer"]["wait_s"])
    for stage in ("stage0", "stage1"):
        assert sum(series[f"{stage}.items"]) == nodes[stage]["items_out"]
        assert sum(series[f"{stage}.samples"]) == nodes[stage]["items_in"]
        assert max(series[f"{stage}.depth"]) == nodes[stage]["inflight_peak"]
        assert nodes[stage]["inflight"] == 0
    assert nodes["tail"]["delivered"] == batches
    assert nodes["serial1_shuffle"]["items_in"] == nodes["serial1_shuffle"]["items_out"] == 600


def test_batches_land_in_the_buckets_of_their_time():
    steps, step_s = 12, 0.05
    pipe = Pipeline(sources.from_sequence(list(range(400)))).map(F.cheap).batch(8)
    snap = zephon.profile(pipe, steps=steps, step_time=step_s).snapshot
    batches = snap["series"]["batches"]
    assert sum(batches) == steps
    # a step takes at least step_s: a bucket holds at most bucket/step_s + 1 of them
    assert max(batches) <= snap["series"]["bucket_s"] / step_s + 1
    assert sum(1 for b in batches if b) >= (steps - 1) * step_s / snap["series"]["bucket_s"]


def test_snapshots_taken_while_the_run_goes_are_safe_and_monotone():
    pipe = Pipeline(sources.from_sequence(list(range(20_000))), chunk_size=64) \
        .map(F.cheap).shuffle(64).batch(8) \
        .options(RuntimeOptions(runner="threads", max_workers=2, execution_tracking="nodes"))
    it = iter(pipe)
    done, seen, errors = threading.Event(), [], []

    def read() -> None:
        try:
            while not done.is_set():
                snap = it.stats(report=True)
                seen.append((snap["nodes"].get("stage0", {}).get("items_out", 0),
                             snap["consumer"]["batches"], sum(snap["series"]["batches"])))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        batches = sum(1 for _ in it)
    finally:
        done.set()
        reader.join(60)
        it.close()
    assert not errors and not reader.is_alive()
    assert batches == 2500 and len(seen) >= 1
    for column in zip(*seen, strict=True):
        assert list(column) == sorted(column)  # counters only grow
    final = pipe.stats(report=True)
    assert final["nodes"]["stage0"]["items_out"] == 20_000
    assert sum(final["series"]["batches"]) == final["consumer"]["batches"] == batches
