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


#: ids of component ``b`` start here, so that every sample of a two-part mixture has
#: its own id
B_IDS = 1_000_000


def doc_a(i):
    """A document of component ``a``: 4 to 15 tokens."""
    return {"id": np.int64(i), "tokens": np.full(4 + (i * 7919) % 12, 1, dtype=np.int32)}


def doc_b(i):
    """A document of component ``b``: 10 to 39 tokens."""
    return {"id": np.int64(B_IDS + i),
            "tokens": np.full(10 + (i * 104729) % 30, 2, dtype=np.int32)}


def drop_half_of_a(sample):
    """A filter that keeps every ``b`` and every other ``a``."""
    return int(sample["id"]) >= B_IDS or int(sample["id"]) % 2 == 0


def only_b(sample):
    """A filter that drops every ``a``."""
    return int(sample["id"]) >= B_IDS


def huge_from_2(epoch):
    """A weight schedule of equal weights whose sum overflows a float from epoch 2."""
    return {"a": 1.0, "b": 1.0} if epoch < 2 else {"a": 1e308, "b": 1e308}


def code_then_web(position):
    """A position-keyed schedule: code falls from 0.6 to 0.1 over the first 20,000
    positions, the rest split evenly."""
    code = max(0.1, 0.6 - 0.5 * position / 20_000)
    return {"code": code, "web": (1 - code) / 2, "books": (1 - code) / 2}


def heavy_doc(i):
    """A document whose length is heavy-tailed: most are short, a few are 100x longer."""
    return {"tokens": np.ones(2 + 2_000 // (1 + (i * 7919) % 1_009), dtype=np.int32)}


def even_doc(i):
    """A document of 20 to 39 tokens."""
    return {"tokens": np.ones(20 + (i * 104729) % 20, dtype=np.int32)}
