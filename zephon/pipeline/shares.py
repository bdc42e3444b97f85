"""Mixture weights as shares: the one place weights become proportions.

Both the mixture source (its epoch counts) and ``ensure_mixture`` (its target) turn
weights into shares here, so the two always agree on the very same floats. Only the
weights' proportions count, also where their sum overflows a float: such weights are
scaled by their largest first, while ordinary weights are divided by their sum (the
stream depends on these exact floats, so this rule must not change).
"""

from __future__ import annotations

import numpy as np

__all__ = ["weight_shares"]


def weight_shares(v: np.ndarray) -> np.ndarray:
    """``v`` (non-negative, finite, one positive) over its sum; over its largest first
    where the sum overflows (weights near 1e308)."""
    with np.errstate(over="ignore"):
        total = v.sum()
    if not np.isfinite(total):
        v = v / v.max()
        total = v.sum()
    return v / total
