"""Streams made comparable: the suite's one way to turn a run into a list of keys.

Batches hold arrays and views that do not compare with ``==``, so a test compares
streams through a *key*: a function of one item that returns something comparable (its
ids, its lane and position, a signature of every column). :func:`keys_of` runs a whole
pass through a key, :func:`take` the first items of a run and closes it (for endless
streams and for the head of a run). The keys every file needs live here too:
:func:`id_key` (the ``id`` column), :func:`lane_key` (where the item stands and which
samples it holds) and :func:`batch_key` (all of it, every column included).

Each call to :func:`keys_of` or :func:`take` on a pipeline is one run of it: the next
call goes on after what that run delivered (after a whole pass: the next pass).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

__all__ = ["batch_key", "id_key", "identity", "keys_of", "lane_key", "sample_ids", "take"]


def identity(item: Any) -> Any:
    """The item itself (the key of items that compare with ``==``)."""
    return item


def keys_of(items: Iterable, key: Callable[[Any], Any] = identity) -> list:
    """Every item of ``items`` through ``key``: a whole run when ``items`` is a pipeline
    (or a loader), the rest of it when it is an iterator, each element of a list."""
    return [key(item) for item in items]


def take(pipe: Iterable, n: int, key: Callable[[Any], Any] = identity) -> list:
    """The first ``n`` items of a new run of ``pipe`` through ``key``; the run is closed
    afterwards (also when taking fails), so an endless stream can be sampled."""
    it = iter(pipe)
    try:
        return [key(next(it)) for _ in range(n)]
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def id_key(batch) -> list:
    """The batch's ``id`` column as a list."""
    return np.asarray(batch["id"]).tolist()


def _samples(batch) -> tuple:
    return tuple(tuple(s) if isinstance(s, (list, tuple)) else s
                 for s in batch.meta["sample_ids"])


def lane_key(batch) -> tuple:
    """Where the batch stands (its lane and its index in the lane) and the samples it
    holds (``meta["sample_ids"]``)."""
    return batch.meta["lane"], batch.meta["lane_index"], _samples(batch)


def _column(value) -> Any:
    if isinstance(value, np.ndarray):
        return value.dtype.str, value.shape, value.tolist()
    if isinstance(value, (list, tuple)):
        return tuple(_column(v) for v in value)
    return value


def batch_key(batch) -> tuple:
    """All of the batch: :func:`lane_key` and every column (dtype, shape and values of an
    array, element by element for a list), by column name."""
    return (*lane_key(batch), tuple(sorted((k, _column(v)) for k, v in batch.items())))


def sample_ids(batches: Iterable) -> list:
    """Every sample id the batches hold (``meta["sample_ids"]``), in stream order, each
    as a tuple."""
    return [tuple(s) for b in batches for s in b.meta["sample_ids"]]
