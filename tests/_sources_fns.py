"""Module-level functions for the source tests (process workers import them)."""

from __future__ import annotations

import json

import numpy as np


def decode_wds(sample):
    """A webdataset sample -> numeric fields (what a user's map does)."""
    meta = json.loads(sample["json"])
    return {"n": np.int64(meta["n"]), "src": np.int64(1)}


def pick_parquet(row):
    return {"n": np.int64(row["id"]), "src": np.int64(0)}


def from_mixture(sample):
    return decode_wds(sample) if "__key__" in sample else pick_parquet(sample)


def _source_base():
    from zephon.pipeline.sources.base import Source
    return Source


class InPlaceIndices(_source_base()):
    """A custom source whose columnar read works on its indices in place (what a user's
    ``get_batch`` may do) and reports whether it could."""

    name = "inplace"

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def get(self, i: int) -> dict:
        return {"i": np.int64(i), "batched": np.bool_(False)}

    def identity(self, i: int):
        return self.name, i

    def get_batch(self, indices):
        indices %= self.n  # raises on a read-only array
        return {"i": np.asarray(indices, dtype=np.int64),
                "batched": np.ones(len(indices), dtype=bool)}
