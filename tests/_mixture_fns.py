"""Module-level sample functions for the mixture tests (process workers import them)."""

from __future__ import annotations

import numpy as np


def row(i):
    return {"i": np.int64(i)}


def tokens_of_length(n):
    """A component whose samples all have ``n`` tokens."""
    return _Tokens(n)


class _Tokens:
    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, i):
        return {"tokens": np.full(self.n, i % 50_000, dtype=np.int32)}


def ramp(epoch):
    """A weight schedule: ``b`` rises from 0.1 by 0.2 an epoch to 0.5."""
    b = min(0.5, 0.1 + 0.2 * epoch)
    return {"a": 1.0 - b, "b": b}


def ramp_faster(epoch):
    b = min(0.5, 0.1 + 0.3 * epoch)
    return {"a": 1.0 - b, "b": b}
