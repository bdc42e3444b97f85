"""An op that raises ``SystemExit`` or ``KeyboardInterrupt`` follows the rule of any op
exception, on every runner: the items before the failing sample are delivered, then the
exception is raised as itself (``SystemExit`` keeps its code), and the op ran once on
that sample (never re-run as if its worker had crashed). Real runs: process workers,
the MTP subprocess, an adaptive stage moved to process workers; the op's runs on the
failing sample are counted in a file, whatever process ran it."""

from __future__ import annotations

import _op_fns as O
import _pipeline_fns as F
import pytest
from _procs import HANG_S, wait_gone

from zephon import Pipeline, RuntimeOptions, sources

N = 24

RUNNERS = {
    "inline": dict(runner="inline"),
    "threads": dict(runner="threads", max_workers=2),
    "process": dict(runner="process", max_workers=2),
    "mtp": dict(mtp_mode=True, runner="process", max_workers=2),
    # worker_allocation="autotune", the runner not pinned: inline until moved, and the
    # test moves it to two process workers before the first item
    "adaptive": dict(worker_allocation="autotune"),
}


def _pipe(op, **opts):
    return (Pipeline(sources.from_callable(N, F.make_sample), seed=3, chunk_size=3)
            .map(op).options(RuntimeOptions(**opts)))


def _run(pipe, adaptive: bool):
    """(ids delivered, the exception raised, process pids seen) of one run."""
    got: list[int] = []
    pids: list[int] = []
    with iter(pipe) as it:
        if adaptive:
            ex = it.engine.executors[0]
            ex.to_process(2, wait=True)
            pids += ex.pids()
            assert ex.runner == "process"
        try:
            for s in it:
                got.append(int(s["id"]))
        except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt
            return got, exc, pids
    return got, None, pids


@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt"])
@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_an_op_that_exits_is_an_op_error_in_stream_order_on_every_runner(
        tmp_path, monkeypatch, runner, kind):
    monkeypatch.setenv("ZEPHON_TEST_DIR", str(tmp_path))  # before any worker starts
    monkeypatch.setenv("ZEPHON_EXIT_KIND", kind)
    reference = [int(s["id"]) for s in _pipe(F.double, runner="inline")]
    before = reference[:reference.index(O.EXIT_AT)]
    assert before, reference  # the failing sample is not the first one

    got, exc, pids = _run(_pipe(O.exit_at, **RUNNERS[runner]), runner == "adaptive")
    assert type(exc).__name__ == kind, (runner, repr(exc))
    if kind == "SystemExit":
        assert exc.code == 3, (runner, exc.code)
    assert got == before, (runner, got, before)
    runs = (tmp_path / "exit-runs").read_text().split()
    assert len(runs) == 1, (runner, runs)  # run once, never retried as a crash
    if runner == "adaptive":
        assert int(runs[0]) in pids  # it ran in a process worker
    assert not wait_gone(pids, HANG_S)
