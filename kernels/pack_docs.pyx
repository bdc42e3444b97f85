# cython: language_level=3
"""Compiled document packing; behaviour specified by ``zephon.kernels.pack_docs_ref``.

Callers: :mod:`zephon.pipeline.packing` (the ``pack_documents`` op). The bin
search is a loop over at most ``max_bins`` open bins per document in C, without
the GIL (the reference builds a Python list of candidates per document); the
row layout fills the positions and offsets in one pass.
"""

cimport cython
from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free, malloc

import numpy as np

cimport numpy as cnp

from zephon.kernels.pack_docs_ref import CU_SENTINEL, check_fit_args

cnp.import_array()

__all__ = ["CU_SENTINEL", "fit_place", "segment_layout"]


cdef inline Py_ssize_t _fullest(const int64_t* fill, Py_ssize_t k) noexcept nogil:
    cdef Py_ssize_t j, at = 0
    for j in range(1, k):
        if fill[j] > fill[at]:
            at = j
    return at


cdef inline void _drop(int64_t* ids, int64_t* fill, Py_ssize_t j, Py_ssize_t k) noexcept nogil:
    cdef Py_ssize_t m
    for m in range(j, k - 1):
        ids[m] = ids[m + 1]
        fill[m] = fill[m + 1]


@cython.boundscheck(False)
@cython.wraparound(False)
cdef void _place(const int64_t* lengths, Py_ssize_t n, int64_t* ids, int64_t* fill,
                 Py_ssize_t k, int64_t next_id, int64_t seq_len, Py_ssize_t max_bins,
                 bint best, int64_t* target, int64_t* closed) noexcept nogil:
    cdef Py_ssize_t i, j, at
    cdef int64_t size
    for i in range(n):
        size = lengths[i]
        closed[i] = -1
        at = -1
        for j in range(k):
            if fill[j] + size <= seq_len:
                if not best:
                    at = j
                    break
                if at < 0 or fill[j] > fill[at]:
                    at = j
        if at >= 0:
            fill[at] += size
            target[i] = ids[at]
            if fill[at] == seq_len:
                closed[i] = ids[at]
                _drop(ids, fill, at, k)
                k -= 1
            continue
        if k == max_bins:
            at = _fullest(fill, k)
            closed[i] = ids[at]
            _drop(ids, fill, at, k)
            k -= 1
        ids[k] = next_id
        fill[k] = size
        target[i] = next_id
        next_id += 1
        k += 1


def fit_place(lengths, fills, seq_len, max_bins, best):
    """Where each document goes among the open bins (see the reference)."""
    cdef cnp.ndarray[int64_t, ndim=1, mode="c"] lens = np.ascontiguousarray(lengths,
                                                                           dtype=np.int64)
    cdef cnp.ndarray[int64_t, ndim=1, mode="c"] fl = np.ascontiguousarray(fills, dtype=np.int64)
    check_fit_args(lens, fl, seq_len, max_bins)
    cdef Py_ssize_t n = lens.shape[0], k = fl.shape[0], j, cap = max_bins
    cdef int64_t size = seq_len
    cdef bint by_fill = best
    target = np.empty(n, dtype=np.int64)
    closed = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] t = target
    cdef int64_t[::1] c = closed
    cdef int64_t* ids = <int64_t*>malloc(cap * sizeof(int64_t))
    cdef int64_t* fill = <int64_t*>malloc(cap * sizeof(int64_t))
    if ids == NULL or fill == NULL:
        free(ids)
        free(fill)
        raise MemoryError("fit_place: no memory for the open bins")
    try:
        for j in range(k):
            ids[j] = j
            fill[j] = fl[j]
        if n:
            with nogil:
                _place(&lens[0], n, ids, fill, k, k, size, cap, by_fill, &t[0], &c[0])
    finally:
        free(ids)
        free(fill)
    return target, closed


@cython.boundscheck(False)
@cython.wraparound(False)
def segment_layout(lengths, seq_len):
    """Positions and fixed-length offsets of one packed row (see the reference)."""
    cdef cnp.ndarray[int64_t, ndim=1, mode="c"] lens = np.ascontiguousarray(lengths,
                                                                           dtype=np.int64)
    if seq_len < 1:
        raise ValueError(f"segment_layout: seq_len must be >= 1, got {seq_len}")
    cdef Py_ssize_t m = lens.shape[0], s, i, total = 0
    cdef int64_t length
    cdef int64_t cap = seq_len
    for s in range(m):
        length = lens[s]
        if length < 1:
            raise ValueError(f"segment_layout: a segment of {length} token(s)")
        total += length
    if total > cap:
        raise ValueError(f"segment_layout: segments of {total} tokens exceed seq_len={seq_len}")
    positions = np.zeros(cap, dtype=np.int32)
    cu = np.full(cap + 1, CU_SENTINEL, dtype=np.int32)
    cdef int32_t[::1] pos = positions
    cdef int32_t[::1] off = cu
    cdef Py_ssize_t at = 0
    with nogil:
        off[0] = 0
        for s in range(m):
            for i in range(lens[s]):
                pos[at + i] = <int32_t>i
            at += lens[s]
            off[s + 1] = <int32_t>at
    return positions, cu
