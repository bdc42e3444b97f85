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
