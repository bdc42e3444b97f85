"""numpy columns -> torch tensors, zero-copy, in the dtypes training code takes.

``torch.from_numpy`` makes a tensor that shares the array's memory and keeps
the array (and through its ``base`` the arena lease) alive, so a region of the
shared-memory arena returns to its worker only when the last tensor over it is
gone. A batch is converted through its structure: the values of a
:class:`~zephon.Batch` or dict, the items of a
:class:`~zephon.pipeline.records.BatchList`, list or tuple, the fields of a
namedtuple, recursively (``.meta`` is kept). Values that are not numeric arrays
(strings, object arrays, a dtype torch lacks) are left as they are; an array
torch cannot view (negative strides, a non-native byte order) becomes a tensor
of a copy. Arrays zephon hands out may be read-only views of the arena: torch
has no read-only tensors, so the tensor is writable memory that other views may
share; write into a copy if you must modify a batch in place.

Dtypes: ``uint16`` and ``uint32`` arrays (token ids of a ``uint16`` token file)
become ``int64`` tensors, a copy: ``nn.Embedding`` and ``cross_entropy`` take
no unsigned indices. ``uint8`` stays ``uint8`` (images), ``uint64`` stays
``uint64`` (``int64`` cannot hold all of it). ``keep_dtypes=True`` keeps every
dtype as stored (and zero-copy).
"""

from __future__ import annotations

import warnings

import numpy as np

from zephon.pipeline.records import Batch, BatchList
from zephon.torch import _require_torch

__all__ = ["TRAINING_DTYPES", "map_leaves", "tensor_of", "to_torch"]

_NUMERIC = frozenset("biufc")
#: stored dtype -> the dtype its tensor gets unless keep_dtypes (widening, lossless)
TRAINING_DTYPES = {np.dtype(np.uint16): np.dtype(np.int64),
                   np.dtype(np.uint32): np.dtype(np.int64)}


def tensor_of(value, keep_dtypes: bool = False):
    """``value`` as a tensor when it is a numeric numpy array, else ``value`` itself; an
    unsigned ``uint16``/``uint32`` array becomes ``int64`` unless ``keep_dtypes``."""
    if not isinstance(value, np.ndarray) or value.dtype.kind not in _NUMERIC:
        return value
    torch = _require_torch()
    if not keep_dtypes:
        wanted = TRAINING_DTYPES.get(value.dtype.newbyteorder("="))
        if wanted is not None:
            value = value.astype(wanted)
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


def map_leaves(value, fn):
    """``value`` with ``fn`` applied to every leaf through its structure (dict values, list
    and tuple items, namedtuple fields, recursively); a Batch or BatchList keeps its type
    and ``meta``."""
    if isinstance(value, dict):
        out = {k: map_leaves(v, fn) for k, v in value.items()}
        return Batch(out, meta=value._meta) if isinstance(value, Batch) else out
    if isinstance(value, list):
        items = [map_leaves(v, fn) for v in value]
        return BatchList(items, meta=value._meta) if isinstance(value, BatchList) else items
    if isinstance(value, tuple):
        items = [map_leaves(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return fn(value)


def _convert(value, keep: bool):
    return map_leaves(value, lambda leaf: tensor_of(leaf, keep))


def to_torch(batch, *, keep_dtypes: bool = False):
    """See :func:`zephon.torch.to_torch`."""
    if isinstance(batch, dict) and not isinstance(batch, Batch):
        meta = getattr(batch, "meta", {})
        return Batch(_convert(dict(batch), keep_dtypes), meta=meta)
    return _convert(batch, keep_dtypes)
