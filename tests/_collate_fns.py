"""Sample and op functions for tests/test_collate.py (module level: spawn workers import them)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Pair(NamedTuple):
    image: np.ndarray
    label: int


def image_label(i):
    """An ``(image, label)`` tuple, as a torchvision-style dataset gives."""
    return (np.full((2, 3), i, dtype=np.float32), i % 5)


def pair(i):
    return Pair(np.full(2, i, dtype=np.int16), i)


def ragged_list(i):
    return {"ids": list(range(i % 3 + 1))}


def sum_collate(values):
    """A user collate_fn: the sum of the images and the labels."""
    return {"total": float(sum(float(v[0].sum()) for v in values)),
            "labels": [v[1] for v in values]}


def thread_report(i):
    """The compute threads this worker's libraries use, as data (imports torch here)."""
    import torch  # noqa: F401 - imported by the op, as a torch map would

    from zephon.transport.threads import compute_threads_report

    report = compute_threads_report()
    return {"i": i, "torch": report["torch"], "pools": sorted(report["pools"].items())}


def numpy_only_report(i):
    """The same without importing torch (does the worker import it on its own?)."""
    import sys

    from zephon.transport.threads import compute_threads_report

    return {"i": i, "torch_loaded": "torch" in sys.modules,
            "pools": sorted(compute_threads_report()["pools"].items())}


def identity_map(sample):
    return sample


def job_thread_report(subject):
    """A job's view of its worker's compute threads (imports torch, as a torch job would)."""
    import torch

    from zephon.transport.threads import compute_threads_report

    return {"torch": torch.get_num_threads(),
            "pools": sorted(compute_threads_report()["pools"].items())}


def double_images(batch):
    """A map_batch over a tuple batch that returns a plain list."""
    return [batch[0] * 2, batch[1]]


def ragged_tuple(i):
    return tuple(range(i % 3 + 1))
