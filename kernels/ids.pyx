# cython: language_level=3
"""Distinct string ids, checked without building a Python set.

Specification: :mod:`zephon.kernels.ids_ref` (this module must match it; a hash
match is answered 0, "decide exactly", which the reference answers only for equal
items). Caller: :func:`zephon.jobs.runner._subject_ids`.

One pass over the list hashes each string's code units (FNV-1a over the bytes,
seeded with their count, then the SplitMix64 finalizer; bit 0 set so that 0 marks a
free slot); equal Python strings have equal kind, length and code units, so equal
items have equal hashes. The hashes are partitioned by their top bits (a counting
pass and a scatter, both sequential) and each part, about 1024 hashes, is checked in
an open-addressing table that stays in cache, instead of one cache miss per id in a
table of the whole list.
"""

from libc.stdint cimport uint8_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset


cdef extern from "Python.h":
    ctypedef struct PyObject
    Py_ssize_t PyList_GET_SIZE(object o)
    PyObject *PyList_GET_ITEM(object o, Py_ssize_t i)
    bint PyUnicode_CheckExact(PyObject *o)
    int PyUnicode_READY(PyObject *o) except -1
    Py_ssize_t PyUnicode_GET_LENGTH(PyObject *o)
    int PyUnicode_KIND(PyObject *o)
    void *PyUnicode_DATA(PyObject *o)


cdef inline uint64_t _finish(uint64_t z) noexcept nogil:
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL
    return (z ^ (z >> 31)) | 1


cdef int _distinct(uint64_t *h, Py_ssize_t n, uint64_t *part, Py_ssize_t *start,
                   int bits) noexcept nogil:
    """1: no two of ``h[:n]`` equal; 0: two are; -2: out of memory."""
    cdef Py_ssize_t parts = (<Py_ssize_t>1) << bits, i, b, m, cap, biggest = 0
    cdef uint64_t mask, slot, v
    cdef int shift = 64 - bits
    cdef uint64_t *table
    for b in range(parts + 1):
        start[b] = 0
    for i in range(n):
        start[(h[i] >> shift) + 1] += 1
    for b in range(parts):
        if start[b + 1] > biggest:
            biggest = start[b + 1]
        start[b + 1] += start[b]
    for i in range(n):  # start[b] walks to the end of part b ...
        b = h[i] >> shift
        part[start[b]] = h[i]
        start[b] += 1
    for b in range(parts - 1, 0, -1):  # ... and is set back to its beginning
        start[b] = start[b - 1]
    start[0] = 0
    cap = 16
    while cap < 2 * biggest:
        cap <<= 1
    table = <uint64_t *>malloc(cap * sizeof(uint64_t))
    if table == NULL:
        return -2
    for b in range(parts):
        m = start[b + 1] - start[b]
        cap = 16
        while cap < 2 * m:
            cap <<= 1
        mask = cap - 1
        memset(table, 0, cap * sizeof(uint64_t))
        for i in range(start[b], start[b + 1]):
            v = part[i]
            slot = v & mask
            while table[slot] != 0:
                if table[slot] == v:
                    free(table)
                    return 0
                slot = (slot + 1) & mask
            table[slot] = v
    free(table)
    return 1


def distinct_str_ids(list ids):
    """-1: an item is not a non-empty exact str; 1: all distinct; 0: maybe not (see
    :mod:`zephon.kernels.ids_ref`)."""
    cdef Py_ssize_t n = PyList_GET_SIZE(ids), i, k, nbytes
    cdef PyObject *s
    cdef const uint8_t *p
    cdef uint64_t hv
    cdef int bits = 1, verdict  # at least 2 parts: a shift by 64 bits is undefined
    while bits < 16 and ((<Py_ssize_t>1) << (bits + 10)) < n:
        bits += 1  # parts of about 1024 hashes, at most 2^16 parts
    cdef uint64_t *h = <uint64_t *>malloc((n + 1) * sizeof(uint64_t))
    cdef uint64_t *part = <uint64_t *>malloc((n + 1) * sizeof(uint64_t))
    cdef Py_ssize_t *start = <Py_ssize_t *>malloc(
        (((<Py_ssize_t>1) << bits) + 1) * sizeof(Py_ssize_t))
    try:
        if h == NULL or part == NULL or start == NULL:
            raise MemoryError()
        for i in range(n):
            s = PyList_GET_ITEM(ids, i)
            if not PyUnicode_CheckExact(s):
                return -1
            PyUnicode_READY(s)  # a no-op but for a string of the legacy C API
            k = PyUnicode_GET_LENGTH(s)
            if k == 0:
                return -1
            nbytes = k * PyUnicode_KIND(s)
            p = <const uint8_t *>PyUnicode_DATA(s)
            hv = 0xcbf29ce484222325ULL ^ <uint64_t>nbytes
            for k in range(nbytes):
                hv = (hv ^ p[k]) * 0x100000001b3ULL
            h[i] = _finish(hv)
        with nogil:
            verdict = _distinct(h, n, part, start, bits)
        if verdict == -2:
            raise MemoryError()
        return verdict
    finally:
        free(h)
        free(part)
        free(start)
