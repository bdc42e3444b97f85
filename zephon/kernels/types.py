"""Plain result types and argument checks shared by the kernels and their references.

A compiled kernel and its reference return the *same* objects built here, so
equivalence is plain ``==`` and the transport never needs to know which
implementation ran.

- :class:`PackPlan`: for each leaf, its group (``-1`` = in-band) and aligned
  byte offset in that group; for each group, its dtype and size in bytes; and a
  descriptor per buffer leaf for :func:`rebuild`.
- :class:`CompactionPlan`: per shared region (ascending region id) its useful
  bytes (union of view extents) and the decision INLINE / COMPACT / FORWARD.
- :func:`byte_extent`: the byte range a strided view touches, for any strides.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any, NamedTuple, Sequence

import numpy as np

__all__ = [
    "COMPACT",
    "DECISION_NAMES",
    "FORWARD",
    "INLINE",
    "CompactionPlan",
    "Descriptor",
    "PackPlan",
    "align_up",
    "byte_extent",
    "check_compaction_args",
    "check_pack_args",
    "dtype_from_token",
    "dtype_token",
]

INLINE, COMPACT, FORWARD = 0, 1, 2
DECISION_NAMES = ("inline", "compact", "forward")


class Descriptor(NamedTuple):
    """Where one buffer leaf lives: ``group`` index, byte ``offset``, ``dtype`` token
    (:func:`dtype_token`), ``shape``."""

    group: int
    offset: int
    dtype: str
    shape: tuple


class PackPlan:
    """The outcome of ``pack_plan``; compare with ``==``.

    Attributes: ``leaf_group`` (int64, -1 = in-band), ``leaf_offset`` (int64),
    ``leaf_nbytes`` (int64, logical bytes of each leaf), ``group_nbytes``
    (int64, bytes a group's buffer must hold), ``group_dtype`` (tuple of dtype
    strings), ``descriptors`` (a :class:`Descriptor` per leaf, ``None`` for
    in-band leaves).
    """

    __slots__ = (
        "descriptors",
        "group_dtype",
        "group_nbytes",
        "leaf_group",
        "leaf_nbytes",
        "leaf_offset",
    )

    def __init__(self, leaf_group, leaf_offset, leaf_nbytes, group_nbytes, group_dtype,
                 descriptors):
        self.leaf_group = np.asarray(leaf_group, dtype=np.int64)
        self.leaf_offset = np.asarray(leaf_offset, dtype=np.int64)
        self.leaf_nbytes = np.asarray(leaf_nbytes, dtype=np.int64)
        self.group_nbytes = np.asarray(group_nbytes, dtype=np.int64)
        self.group_dtype = tuple(group_dtype)
        self.descriptors = tuple(descriptors)

    @property
    def n_groups(self) -> int:
        return len(self.group_dtype)

    def inband(self) -> list[int]:
        """Indices of the leaves that travel in-band."""
        return np.flatnonzero(self.leaf_group < 0).tolist()

    def __len__(self) -> int:
        return len(self.leaf_group)

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, PackPlan):
            return NotImplemented
        return (
            np.array_equal(self.leaf_group, other.leaf_group)
            and np.array_equal(self.leaf_offset, other.leaf_offset)
            and np.array_equal(self.leaf_nbytes, other.leaf_nbytes)
            and np.array_equal(self.group_nbytes, other.group_nbytes)
            and self.group_dtype == other.group_dtype
            and self.descriptors == other.descriptors
        )

    def __repr__(self) -> str:
        return (f"PackPlan(leaves={len(self)}, inband={len(self.inband())}, "
                f"groups={list(zip(self.group_dtype, self.group_nbytes.tolist(), strict=True))})")


class CompactionPlan:
    """The outcome of ``compaction_plan``: one row per region, ascending region id."""

    __slots__ = ("decision", "region_id", "region_size", "useful_bytes")

    def __init__(self, region_id, region_size, useful_bytes, decision):
        self.region_id = np.asarray(region_id, dtype=np.int64)
        self.region_size = np.asarray(region_size, dtype=np.int64)
        self.useful_bytes = np.asarray(useful_bytes, dtype=np.int64)
        self.decision = np.asarray(decision, dtype=np.int8)

    def __len__(self) -> int:
        return len(self.region_id)

    def as_dict(self) -> dict[int, tuple[int, str]]:
        """``{region_id: (useful_bytes, "inline" | "compact" | "forward")}``."""
        return {
            int(r): (int(u), DECISION_NAMES[int(d)])
            for r, u, d in zip(self.region_id, self.useful_bytes, self.decision, strict=True)
        }

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, CompactionPlan):
            return NotImplemented
        return all(np.array_equal(getattr(self, k), getattr(other, k)) for k in self.__slots__)

    def __repr__(self) -> str:
        return f"CompactionPlan({self.as_dict()})"


def dtype_token(dtype: np.dtype) -> str:
    """A string that names ``dtype`` exactly: ``dtype.str`` for plain dtypes, the JSON of
    NumPy's array-protocol description (fields, offsets, padding) for structured ones."""
    if dtype.fields is None:
        return dtype.str
    return json.dumps(np.lib.format.dtype_to_descr(dtype))


def _tuplify(descr):
    """JSON lists back to NumPy's descr form: fields are (name, type[, shape]) tuples,
    a nested structured type is a list of fields, a name with a title is a pair."""
    if not isinstance(descr, list):
        return descr
    out = []
    for field in descr:
        name, kind, *shape = field
        name = tuple(name) if isinstance(name, list) else name
        out.append((name, _tuplify(kind), *(tuple(s) for s in shape)))
    return out


def dtype_from_token(token: str) -> np.dtype:
    """Inverse of :func:`dtype_token`."""
    if token.startswith("["):
        return np.lib.format.descr_to_dtype(_tuplify(json.loads(token)))
    return np.dtype(token)


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) & ~(alignment - 1)


def byte_extent(offset: int, shape: Sequence[int], strides: Sequence[int],
                itemsize: int) -> tuple[int, int]:
    """``(lo, hi)``: the half-open byte range a view touches, relative to its region.

    ``offset`` is the byte offset of the view's first element (``a[0, 0, ...]``)
    in the region. Negative strides reach below it, zero strides repeat it; an
    empty view touches nothing (``lo == hi == offset``).
    """
    if any(int(s) == 0 for s in shape):
        return offset, offset
    lo = hi = offset
    for n, st in zip(shape, strides, strict=True):
        span = (int(n) - 1) * int(st)
        if span < 0:
            lo += span
        else:
            hi += span
    return lo, hi + int(itemsize)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_pack_args(min_item_bytes, coalesce, max_coalesced_bytes, min_new_allocation_bytes,
                    alignment) -> None:
    """ValueError for a policy value the packer cannot honour."""
    if not _is_int(min_item_bytes) or min_item_bytes < 0:
        raise ValueError(f"pack_plan: min_item_bytes must be an int >= 0, got {min_item_bytes!r}")
    if not isinstance(coalesce, bool):
        raise ValueError(f"pack_plan: coalesce must be True or False, got {coalesce!r}")
    if max_coalesced_bytes is not None and (
        not _is_int(max_coalesced_bytes) or max_coalesced_bytes < 1
    ):
        raise ValueError(
            f"pack_plan: max_coalesced_bytes must be None or an int >= 1, "
            f"got {max_coalesced_bytes!r}")
    if not _is_int(min_new_allocation_bytes) or min_new_allocation_bytes < 0:
        raise ValueError(
            "pack_plan: min_new_allocation_bytes must be an int >= 0, "
            f"got {min_new_allocation_bytes!r}")
    if not _is_int(alignment) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"pack_plan: alignment must be a power of two, got {alignment!r}")


def check_compaction_args(min_forward_bytes, compact_above_ratio,
                          compact_min_savings_bytes) -> None:
    if not _is_int(min_forward_bytes) or min_forward_bytes < 0:
        raise ValueError(
            f"compaction_plan: min_forward_bytes must be an int >= 0, got {min_forward_bytes!r}")
    if compact_above_ratio is not None and (
        isinstance(compact_above_ratio, bool)
        or not isinstance(compact_above_ratio, numbers.Real)
        or not math.isfinite(compact_above_ratio) or compact_above_ratio < 1.0
    ):
        raise ValueError(
            "compaction_plan: compact_above_ratio must be None or a finite number >= 1, "
            f"got {compact_above_ratio!r}")
    if not _is_int(compact_min_savings_bytes) or compact_min_savings_bytes < 0:
        raise ValueError(
            "compaction_plan: compact_min_savings_bytes must be an int >= 0, "
            f"got {compact_min_savings_bytes!r}")
