"""One executor of each kind over a test's program (the tests of the executor contract
and of the dispatch make them the same way)."""

from __future__ import annotations

from zephon import RuntimeOptions
from zephon.pipeline.engine import pool_config
from zephon.runners.contract import StageMeter
from zephon.runners.executors import (
    AdaptiveExecutor,
    InlineExecutor,
    ProcessExecutor,
    ThreadExecutor,
)


def make_executor(runner: str, program, *, workers: int = 1, meter: StageMeter | None = None,
                  tracking: str = "off"):
    """An executor of ``runner`` ("inline", "threads", "process" or "adaptive") running
    ``program`` on ``workers`` threads or processes, writing to ``meter`` (None: its own);
    process workers time their units when ``tracking`` is on."""
    config = pool_config(RuntimeOptions(execution_tracking=tracking))
    if runner == "inline":
        return InlineExecutor(program, meter=meter)
    if runner == "threads":
        return ThreadExecutor(program, workers, meter=meter)
    if runner == "process":
        return ProcessExecutor(program, workers, config=config, meter=meter)
    return AdaptiveExecutor(program, lambda n, m: ProcessExecutor(
        program, n, config=config, meter=m), meter=meter)
