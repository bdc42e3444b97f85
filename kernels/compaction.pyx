# cython: language_level=3
"""Compiled view-compaction planning; behaviour specified by ``zephon.kernels.compaction_ref``.

Caller: :class:`zephon.transport.codec.Encoder` (``_place_shared``: forward,
compact or inline the views of regions this process holds a lease on).

Ordering by (region, start) is the cost that matters. ``np.lexsort`` of two keys
costs ~10x one ``argsort`` of int64 here, so the views are ranked densely by
region (one argsort of the ids and a C pass), and the combined key
``rank * (max_size + 1) + start`` is sorted once; ``lexsort`` remains the
fallback when that key could overflow int64. A single GIL-free pass then
checks sizes, merges overlapping extents and decides per region.
"""

cimport cython
from libc.stdint cimport int64_t, int8_t

import numpy as np

from zephon.kernels.types import CompactionPlan, check_compaction_args

cdef enum:
    INLINE = 0
    COMPACT = 1
    FORWARD = 2


@cython.boundscheck(False)
@cython.wraparound(False)
cdef object _order_by_region_then_start(object ids_arr, object sizes_arr, object lo_arr):
    cdef Py_ssize_t n = ids_arr.shape[0], j
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    by_id_arr = np.argsort(ids_arr).astype(np.int64, copy=False)
    cdef const int64_t[::1] by_id = by_id_arr
    cdef const int64_t[::1] ids = ids_arr
    cdef const int64_t[::1] lo = lo_arr
    cdef int64_t max_size = sizes_arr.max()
    key_arr = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] key = key_arr
    cdef int64_t rank = 0
    cdef int64_t stride = max_size + 1
    cdef int64_t limit
    with nogil:
        for j in range(1, n):
            if ids[by_id[j]] != ids[by_id[j - 1]]:
                rank += 1
    # rank * stride + start must stay below 2**63 for every view.
    limit = (<int64_t>0x7FFFFFFFFFFFFFFF - max_size) // stride if stride > 0 else 0
    if stride <= 0 or rank > limit:
        return np.lexsort((lo_arr, ids_arr)).astype(np.int64, copy=False)
    rank = 0
    with nogil:
        key[by_id[0]] = lo[by_id[0]]
        for j in range(1, n):
            if ids[by_id[j]] != ids[by_id[j - 1]]:
                rank += 1
            key[by_id[j]] = rank * stride + lo[by_id[j]]
    return np.argsort(key_arr).astype(np.int64, copy=False)


@cython.boundscheck(False)
@cython.wraparound(False)
def compaction_plan(region_ids, region_sizes, starts, ends, min_forward_bytes,
                    compact_above_ratio, compact_min_savings_bytes):
    check_compaction_args(min_forward_bytes, compact_above_ratio, compact_min_savings_bytes)
    ids_arr = np.ascontiguousarray(region_ids, dtype=np.int64).reshape(-1)
    sizes_arr = np.ascontiguousarray(region_sizes, dtype=np.int64).reshape(-1)
    lo_arr = np.ascontiguousarray(starts, dtype=np.int64).reshape(-1)
    hi_arr = np.ascontiguousarray(ends, dtype=np.int64).reshape(-1)
    cdef Py_ssize_t n = ids_arr.shape[0]
    if not (n == sizes_arr.shape[0] == lo_arr.shape[0] == hi_arr.shape[0]):
        raise ValueError("compaction_plan: region_ids, region_sizes, starts and ends must have "
                         f"the same length, got {n}, {sizes_arr.shape[0]}, {lo_arr.shape[0]}, "
                         f"{hi_arr.shape[0]}")
    cdef const int64_t[::1] ids = ids_arr
    cdef const int64_t[::1] sizes = sizes_arr
    cdef const int64_t[::1] lo = lo_arr
    cdef const int64_t[::1] hi = hi_arr
    cdef Py_ssize_t k, bad = -1
    with nogil:
        for k in range(n):
            if lo[k] > hi[k] or lo[k] < 0 or hi[k] > sizes[k]:
                bad = k
                break
    if bad >= 0:
        raise ValueError(f"compaction_plan: view {bad} extent [{lo[bad]}, {hi[bad]}) is not "
                         f"inside region {ids[bad]} of {sizes[bad]} bytes")

    order_arr = _order_by_region_then_start(ids_arr, sizes_arr, lo_arr)
    cdef const int64_t[::1] order = order_arr
    out_id_arr = np.empty(n, dtype=np.int64)
    out_size_arr = np.empty(n, dtype=np.int64)
    out_useful_arr = np.empty(n, dtype=np.int64)
    out_decision_arr = np.empty(n, dtype=np.int8)
    cdef int64_t[::1] out_id = out_id_arr
    cdef int64_t[::1] out_size = out_size_arr
    cdef int64_t[::1] out_useful = out_useful_arr
    cdef int8_t[::1] out_decision = out_decision_arr

    cdef int64_t min_forward = min_forward_bytes
    cdef int64_t min_savings = compact_min_savings_bytes
    cdef bint compaction = compact_above_ratio is not None
    cdef double ratio = float(compact_above_ratio) if compaction else 0.0
    cdef Py_ssize_t nout = 0, j, p
    cdef int64_t rid, size, useful, cur_lo, cur_hi, a, b
    cdef bint have
    cdef int64_t conflict_region = 0, conflict_a = 0, conflict_b = 0
    cdef bint conflict = False
    with nogil:
        j = 0
        while j < n:
            p = order[j]
            rid = ids[p]
            size = sizes[p]
            useful = 0
            have = False
            cur_lo = cur_hi = 0
            while j < n and ids[order[j]] == rid:
                p = order[j]
                if sizes[p] != size:
                    conflict = True
                    conflict_region, conflict_a, conflict_b = rid, size, sizes[p]
                    break
                a = lo[p]
                b = hi[p]
                j += 1
                if a == b:
                    continue
                if not have or a > cur_hi:
                    if have:
                        useful += cur_hi - cur_lo
                    cur_lo, cur_hi = a, b
                    have = True
                elif b > cur_hi:
                    cur_hi = b
            if conflict:
                break
            if have:
                useful += cur_hi - cur_lo
            out_id[nout] = rid
            out_size[nout] = size
            out_useful[nout] = useful
            if useful < min_forward:
                out_decision[nout] = INLINE
            elif compaction and <double>size > <double>useful * ratio \
                    and size - useful >= min_savings:
                out_decision[nout] = COMPACT
            else:
                out_decision[nout] = FORWARD
            nout += 1
    if conflict:
        raise ValueError(f"compaction_plan: region {conflict_region} has two sizes "
                         f"({conflict_a} and {conflict_b})")
    return CompactionPlan(out_id_arr[:nout], out_size_arr[:nout], out_useful_arr[:nout],
                          out_decision_arr[:nout])
