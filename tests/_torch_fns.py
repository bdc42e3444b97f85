"""Op functions for the zephon.torch tests (module level: process workers import them)."""

from __future__ import annotations

import numpy as np


def to_tensor(s):
    """A deterministic map that returns torch tensors (process workers import torch)."""
    import torch

    return {"id": s["id"], "x": torch.from_numpy(s["x"]).float() * 0.5,
            "w": torch.full((3,), float(s["id"]))}


def make_big_sample(i):
    return {"id": i, "x": np.full(1 << 15, i, dtype=np.float32)}


def noisy_tensor(s):
    import torch

    return {**s, "r": torch.rand(2)}


def to_big_tensor(s):
    import torch

    return {"id": s["id"], "t": torch.full((1 << 14,), float(s["id"]))}
