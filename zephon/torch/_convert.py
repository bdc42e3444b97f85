"""numpy columns -> torch tensors, zero-copy.

``torch.from_numpy`` makes a tensor that shares the array's memory and keeps
the array (and through its ``base`` the arena lease) alive, so a region of the
shared-memory arena returns to its worker only when the last tensor over it is
gone. Columns that are not numeric arrays (lists, strings, object arrays, a
dtype torch lacks) are left as they are; an array torch cannot view (negative
strides, a non-native byte order) becomes a tensor of a copy. Arrays zephon hands out may be
read-only views of the arena: torch has no read-only tensors, so the tensor is
writable memory that other views may share; write into a copy if you must
modify a batch in place.
"""

from __future__ import annotations

import warnings

import numpy as np

from zephon.pipeline.ops import Batch
from zephon.torch import _require_torch

__all__ = ["tensor_of", "to_torch"]

_NUMERIC = frozenset("biufc")


def tensor_of(value):
    """``value`` as a tensor when it is a numeric numpy array, else ``value`` itself."""
    if not isinstance(value, np.ndarray) or value.dtype.kind not in _NUMERIC:
        return value
    torch = _require_torch()
    try:
        if value.flags.writeable:
            return torch.from_numpy(value)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            return torch.from_numpy(value)
    except TypeError:  # a dtype torch does not have
        return value
    except ValueError:
        # negative strides or a non-native byte order: torch cannot view it, so it gets a
        # copy in a layout it can (the column is still a tensor, no longer zero-copy)
        fixed = np.ascontiguousarray(value)
        if not fixed.dtype.isnative:
            fixed = fixed.astype(fixed.dtype.newbyteorder("="))
        return torch.from_numpy(fixed)


def to_torch(batch):
    """See :func:`zephon.torch.to_torch`."""
    if isinstance(batch, dict):
        meta = batch._meta if isinstance(batch, Batch) else getattr(batch, "meta", {})
        out = Batch({k: tensor_of(v) for k, v in batch.items()}, meta=meta)
        return out
    return tensor_of(batch)
