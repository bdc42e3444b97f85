"""Runners: where pipeline stages execute (inline, threads, process; MTP in
:mod:`zephon.runners.mtp`)."""

from zephon.runners.executors import (
    AdaptiveExecutor,
    InlineExecutor,
    ProcessExecutor,
    ThreadExecutor,
)

__all__ = ["AdaptiveExecutor", "InlineExecutor", "ProcessExecutor", "ThreadExecutor"]
