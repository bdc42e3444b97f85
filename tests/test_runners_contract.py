"""The stage-executor contract (zephon.runners.contract): every executor implements it,
writes what its units cost to its one meter, and hands a failed unit back as the one
failure envelope (zephon.transport.failure.UnitFailure)."""

from __future__ import annotations

import pytest
from _executors import make_executor
from _pipeline_fns import square_unit

from zephon.runners.contract import MovableExecutor, StageExecutor, StageMeter
from zephon.transport.failure import UnitFailure


class _Observer:
    """What the run statistics see of a meter: each recording and each worker event."""

    def __init__(self) -> None:
        self.units: list[tuple] = []
        self.events: list[tuple] = []

    def ran(self, *args) -> None:
        self.units.append(args)

    def event(self, kind: str, worker: int) -> None:
        self.events.append((kind, worker))


def _make(runner: str, meter: StageMeter):
    return make_executor(runner, square_unit, workers=2 if runner == "threads" else 1,
                         meter=meter, tracking="stages")


@pytest.mark.parametrize("runner", ["inline", "threads", "process", "adaptive"])
def test_every_executor_implements_the_contract_and_writes_its_one_meter(runner):
    meter = StageMeter()
    observer = _Observer()
    meter.observer = observer
    ex = _make(runner, meter)
    try:
        assert isinstance(ex, StageExecutor) and ex.meter is meter
        assert ex.adaptive == (runner == "adaptive")
        assert isinstance(ex, MovableExecutor) == (runner == "adaptive")
        assert ex.runner == ("inline" if runner == "adaptive" else runner)
        assert ex.workers >= 1 and ex.max_workers >= 1 and ex.booting >= 0
        assert (ex.pids() != []) == (runner == "process")
        for seq in range(3):
            ex.submit(0, seq, seq)
        got = sorted(ex.get(0)[:2] for _ in range(3))
    finally:
        ex.close()
    assert got == [(0, 0), (1, 1), (2, 4)]
    units, op_s, _, demand_units, parked = meter.reading()
    assert units == 3 and op_s >= 0 and parked == 0
    assert demand_units == (3 if runner == "adaptive" else 0)  # an adaptive stage's inline CPU
    assert len(observer.units) == 3
    assert ("stop", 0) in observer.events


def _fails(payload):
    raise KeyError(payload)


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_a_failed_unit_comes_back_as_its_failure_envelope(runner):
    ex = make_executor(runner, _fails)
    try:
        ex.submit(0, 5, "x")
        seq, result, _ = ex.get(0)
    finally:
        ex.close()
    assert seq == 5 and type(result) is UnitFailure and len(result) == 0
    assert type(result.error) is KeyError and result.done == []
    assert (result.task_id is not None) == (runner == "process")
