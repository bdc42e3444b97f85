"""Collation: the samples of a micro-batch into one batch value.

What ``Pipeline.batch()`` makes of its samples' values. Pure functions of the
values; never imports torch (a column of torch tensors is stacked with the torch
already imported by whoever made them).
"""

from __future__ import annotations

import numpy as np

from zephon.errors import ZephonConfigError

__all__ = ["collate", "collate_column"]


def collate(values: list) -> dict:
    """Dict samples -> dict of stacked arrays (lists where values are ragged or not numeric).

    A column of torch tensors of one shape, dtype and device is stacked with
    ``torch.stack`` as a column of arrays is with ``np.stack``."""
    if not values:
        return {}
    if not all(isinstance(v, dict) for v in values):
        raise ZephonConfigError("batch: samples must be dicts to be collated, got "
                                f"{type(next(v for v in values if not isinstance(v, dict))).__name__}")
    import sys

    keys = list(values[0])
    out = {}
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)  # never imports torch
    for key in keys:
        column = [v.get(key) for v in values]
        if tensor is not None and all(isinstance(c, tensor) for c in column):
            if len({(c.shape, c.dtype, c.device) for c in column}) == 1:
                out[key] = sys.modules["torch"].stack(column)
            else:
                out[key] = column
            continue
        out[key] = collate_column(column)
    return out


def collate_column(column: list):
    """One column of a batch: a stacked array when every value is numeric with one shape
    and dtype, else the list itself (the rule :func:`collate` applies to non-tensors)."""
    arrays = [np.asarray(c) for c in column
              if isinstance(c, (np.ndarray, np.generic, int, float, bool))]
    if len(arrays) == len(column) and len({(a.shape, a.dtype) for a in arrays}) == 1:
        return np.stack(arrays)
    return column
