"""Reference view-compaction planning: the specification of ``kernels/compaction.pyx``.

Caller: :class:`zephon.transport.codec.Encoder` (``_place_shared``: forward,
compact or inline the views of regions this process holds a lease on).

``compaction_plan(region_ids, region_sizes, starts, ends, min_forward_bytes,
compact_above_ratio, compact_min_savings_bytes) -> CompactionPlan``

Input: one row per leaf that is a view into an existing shared region: the
region's id and size, and the half-open byte extent ``[start, end)`` the view
touches in it (see :func:`zephon.kernels.types.byte_extent`, correct for any
strides). Per region (ascending id):

- useful bytes = size of the union of its views' extents (overlaps count once);
- ``INLINE``  when useful < ``min_forward_bytes`` (copy the bytes in-band);
- ``COMPACT`` when ``compact_above_ratio`` is not None, size > useful x ratio and
  size - useful >= ``compact_min_savings_bytes`` (copy the useful bytes into a
  fresh region so the big one can be recycled);
- ``FORWARD`` otherwise (send a reference to the region).

Refused (``ValueError``): arrays of different lengths, ``start > end``, an
extent outside ``[0, size]``, one region id given two different sizes, and bad
policy values.
"""

from __future__ import annotations

from zephon.kernels.types import (
    COMPACT,
    FORWARD,
    INLINE,
    CompactionPlan,
    check_compaction_args,
)

__all__ = ["compaction_plan"]


def _union_bytes(extents: list[tuple[int, int]]) -> int:
    """Bytes covered by the union of half-open ``extents`` (overlaps count once)."""
    useful = 0
    run: list[int] | None = None  # [lo, hi) of the run being merged
    for a, b in sorted(extents):
        if a == b:
            continue
        if run is None or a > run[1]:
            if run is not None:
                useful += run[1] - run[0]
            run = [a, b]
        elif b > run[1]:
            run[1] = b
    if run is not None:
        useful += run[1] - run[0]
    return useful


def compaction_plan(region_ids, region_sizes, starts, ends, min_forward_bytes: int,
                    compact_above_ratio: float | None,
                    compact_min_savings_bytes: int) -> CompactionPlan:
    check_compaction_args(min_forward_bytes, compact_above_ratio, compact_min_savings_bytes)
    ids, sizes, lo, hi = ([int(v) for v in column]
                          for column in (region_ids, region_sizes, starts, ends))
    if not len(ids) == len(sizes) == len(lo) == len(hi):
        raise ValueError("compaction_plan: region_ids, region_sizes, starts and ends must have "
                         f"the same length, got {len(ids)}, {len(sizes)}, {len(lo)}, {len(hi)}")
    size_of: dict[int, int] = {}
    extents: dict[int, list[tuple[int, int]]] = {}
    for k, (rid, size, a, b) in enumerate(zip(ids, sizes, lo, hi, strict=True)):
        if size_of.setdefault(rid, size) != size:
            raise ValueError(f"compaction_plan: region {rid} has two sizes "
                             f"({size_of[rid]} and {size})")
        if a > b or a < 0 or b > size:
            raise ValueError(f"compaction_plan: view {k} extent [{a}, {b}) is not inside "
                             f"region {rid} of {size} bytes")
        extents.setdefault(rid, []).append((a, b))

    out_ids, out_sizes, out_useful, out_decision = [], [], [], []
    for rid in sorted(extents):
        useful = _union_bytes(extents[rid])
        size = size_of[rid]
        if useful < min_forward_bytes:
            decision = INLINE
        elif (compact_above_ratio is not None and size > useful * float(compact_above_ratio)
              and size - useful >= compact_min_savings_bytes):
            decision = COMPACT
        else:
            decision = FORWARD
        out_ids.append(rid)
        out_sizes.append(size)
        out_useful.append(useful)
        out_decision.append(decision)
    return CompactionPlan(out_ids, out_sizes, out_useful, out_decision)
