"""A source function whose module imports torch at the top: a worker unpickling a program
that uses it has torch loaded before its first task (tests/test_collate.py)."""

from __future__ import annotations

import torch

from zephon.transport.threads import compute_threads_report


def eager_thread_report(i):
    report = compute_threads_report()
    assert report["torch"] == torch.get_num_threads()
    return {"i": i, "torch": report["torch"], "pools": sorted(report["pools"].items())}
