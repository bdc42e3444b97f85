# cython: language_level=3
"""Compiled buffer packing; behaviour specified by ``zephon.kernels.pack_ref``.

Callers: :class:`zephon.transport.codec.Encoder` (``pack_plan`` + ``pack_copy``
into arena regions, ``_to_regions``, and into in-band frames, ``_packed_frames``).

Speed comes from three places: the plan is one typed pass that looks each
dtype object up once per call (not ``dtype.str`` per leaf); the copy collects
raw pointers with the GIL held and then copies every leaf with the GIL
released; contiguous leaves are one ``memcpy``, strided leaves go through a
loop that first drops unit dimensions and merges dimensions that are
contiguous with respect to each other, then copies runs (or fixed-size items).
"""

cimport cython
cimport numpy as cnp
from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

import numpy as np

from zephon.kernels.pack_ref import as_leaf_array
from zephon.kernels.types import (
    Descriptor, PackPlan, check_pack_args, dtype_token,
)

cnp.import_array()

cdef enum:
    MAXDIMS = 64  # NPY_MAXDIMS of NumPy 2 (32 in NumPy 1)


cdef inline int64_t _align_up(int64_t value, int64_t alignment) noexcept nogil:
    return (value + alignment - 1) & ~(alignment - 1)


@cython.boundscheck(False)
@cython.wraparound(False)
def pack_plan(leaves, min_item_bytes, coalesce, max_coalesced_bytes, min_new_allocation_bytes,
              alignment=64):
    check_pack_args(min_item_bytes, coalesce, max_coalesced_bytes, min_new_allocation_bytes,
                    alignment)
    cdef Py_ssize_t n = len(leaves)
    cdef int64_t min_item = min_item_bytes
    cdef int64_t min_new = min_new_allocation_bytes
    cdef int64_t align = alignment
    cdef int64_t cap = -1 if max_coalesced_bytes is None else max_coalesced_bytes
    cdef bint co = coalesce

    leaf_group = np.full(n, -1, dtype=np.int64)
    leaf_offset = np.zeros(n, dtype=np.int64)
    leaf_nbytes = np.zeros(n, dtype=np.int64)
    leaf_key_arr = np.full(n, -1, dtype=np.int64)
    group_end_arr = np.zeros(n, dtype=np.int64)
    group_useful_arr = np.zeros(n, dtype=np.int64)
    group_key_arr = np.zeros(n, dtype=np.int64)
    open_of_key_arr = np.full(n, -1, dtype=np.int64)
    cdef int64_t[::1] lg = leaf_group
    cdef int64_t[::1] lo = leaf_offset
    cdef int64_t[::1] lnb = leaf_nbytes
    cdef int64_t[::1] lkey = leaf_key_arr
    cdef int64_t[::1] gend = group_end_arr
    cdef int64_t[::1] guse = group_useful_arr
    cdef int64_t[::1] gkey = group_key_arr
    cdef int64_t[::1] okey = open_of_key_arr

    cdef list arrays = [None] * n
    cdef dict key_of_descr = {}     # id(dtype object) -> key index (-1: not eligible)
    cdef dict key_of_str = {}       # dtype str -> key index
    cdef list key_strs = []
    cdef list descr_refs = []       # keeps looked-up dtype objects alive (ids stay unique)
    cdef Py_ssize_t i, g, k, ngroups = 0
    cdef int64_t nb, off
    cdef cnp.ndarray a
    cdef object descr, entry, s

    for i in range(n):
        leaf = leaves[i]
        if isinstance(leaf, cnp.ndarray):
            a = <cnp.ndarray>leaf
        else:
            a = as_leaf_array(leaf, i)
        arrays[i] = a
        nb = cnp.PyArray_NBYTES(a)
        lnb[i] = nb
        descr = <object>cnp.PyArray_DESCR(a)
        entry = key_of_descr.get(id(descr))
        if entry is None:
            descr_refs.append(descr)
            if descr.hasobject or descr.itemsize == 0:
                entry = -1
            else:
                s = dtype_token(descr)
                entry = key_of_str.get(s)
                if entry is None:
                    entry = len(key_strs)
                    key_of_str[s] = entry
                    key_strs.append(s)
            key_of_descr[id(descr)] = entry
        k = entry
        if k < 0 or nb < min_item:
            continue
        lkey[i] = k
        if not co or (cap >= 0 and nb > cap):
            g = ngroups
            ngroups += 1
            gkey[g] = k
        else:
            g = okey[k]
            if g >= 0 and cap >= 0 and _align_up(gend[g], align) + nb > cap:
                g = -1
            if g < 0:
                g = ngroups
                ngroups += 1
                gkey[g] = k
                okey[k] = g
        off = _align_up(gend[g], align)
        lg[i] = g
        lo[i] = off
        gend[g] = off + nb
        guse[g] += nb

    renumber_arr = np.full(max(ngroups, 1), -1, dtype=np.int64)
    cdef int64_t[::1] renumber = renumber_arr
    cdef Py_ssize_t kept = 0
    group_nbytes = []
    group_dtype = []
    for g in range(ngroups):
        if guse[g] >= min_new:
            renumber[g] = kept
            kept += 1
            group_nbytes.append(gend[g])
            group_dtype.append(key_strs[gkey[g]])

    descriptors = [None] * n
    for i in range(n):
        if lg[i] < 0:
            continue
        g = renumber[lg[i]]
        lg[i] = g
        if g < 0:
            lo[i] = 0
            continue
        descriptors[i] = Descriptor(g, lo[i], key_strs[lkey[i]], arrays[i].shape)
    return PackPlan(leaf_group, leaf_offset, leaf_nbytes, group_nbytes, group_dtype,
                    descriptors)


cdef struct CopyJob:
    char* src
    char* dst
    int ndim
    Py_ssize_t itemsize
    Py_ssize_t nbytes
    cnp.npy_intp* shape
    cnp.npy_intp* strides
    bint contiguous


cdef inline void _copy_items(char* dst, const char* src, Py_ssize_t count, Py_ssize_t stride,
                             Py_ssize_t itemsize) noexcept nogil:
    cdef Py_ssize_t j
    if itemsize == 8:
        for j in range(count):
            memcpy(dst + j * 8, src + j * stride, 8)
    elif itemsize == 4:
        for j in range(count):
            memcpy(dst + j * 4, src + j * stride, 4)
    elif itemsize == 2:
        for j in range(count):
            memcpy(dst + j * 2, src + j * stride, 2)
    elif itemsize == 1:
        for j in range(count):
            dst[j] = src[j * stride]
    else:
        for j in range(count):
            memcpy(dst + j * itemsize, src + j * stride, itemsize)


cdef void _copy_leaf(CopyJob* job) noexcept nogil:
    cdef Py_ssize_t dims[MAXDIMS]
    cdef Py_ssize_t strd[MAXDIMS]
    cdef Py_ssize_t idx[MAXDIMS]
    cdef int nd = 0, d
    cdef Py_ssize_t itemsize = job.itemsize
    cdef char* dst = job.dst
    cdef const char* base
    if job.nbytes == 0:
        return
    if job.contiguous:
        memcpy(job.dst, job.src, job.nbytes)
        return
    # Drop unit dimensions, then merge a dimension into the next inner one when
    # stepping it is the same as running through the whole inner one.
    for d in range(job.ndim):
        if job.shape[d] != 1:
            dims[nd] = job.shape[d]
            strd[nd] = job.strides[d]
            nd += 1
    if nd == 0:
        memcpy(dst, job.src, itemsize)
        return
    cdef int w = nd - 1
    d = nd - 2
    # Collapse from the innermost pair outwards into positions [.., w].
    while d >= 0:
        if strd[d] == strd[w] * dims[w]:
            dims[w] = dims[w] * dims[d]
        else:
            w -= 1
            dims[w] = dims[d]
            strd[w] = strd[d]
        d -= 1
    # Dimensions now live in [w, nd); shift them to [0, nd - w).
    cdef int m = nd - w
    for d in range(m):
        dims[d] = dims[w + d]
        strd[d] = strd[w + d]
        idx[d] = 0
    nd = m
    cdef Py_ssize_t inner = dims[nd - 1]
    cdef Py_ssize_t inner_stride = strd[nd - 1]
    cdef Py_ssize_t run = inner * itemsize
    base = job.src
    while True:
        if inner_stride == itemsize:
            memcpy(dst, base, run)
        else:
            _copy_items(dst, base, inner, inner_stride, itemsize)
        dst += run
        d = nd - 2
        while d >= 0:
            idx[d] += 1
            base += strd[d]
            if idx[d] < dims[d]:
                break
            base -= strd[d] * dims[d]
            idx[d] = 0
            d -= 1
        if d < 0:
            break


@cython.boundscheck(False)
@cython.wraparound(False)
def pack_copy(leaves, plan, buffers):
    cdef Py_ssize_t n = len(leaves)
    if n != len(plan):
        raise ValueError(f"pack_copy: {n} leaves but the plan has {len(plan)}")
    cdef Py_ssize_t ngroups = plan.n_groups
    if len(buffers) != ngroups:
        raise ValueError(f"pack_copy: {len(buffers)} buffers but the plan has {ngroups} groups")
    cdef int64_t[::1] lg = plan.leaf_group
    cdef int64_t[::1] lo = plan.leaf_offset
    cdef int64_t[::1] lnb = plan.leaf_nbytes
    cdef int64_t[::1] gnb = plan.group_nbytes
    cdef Py_buffer* views = <Py_buffer*>malloc(max(ngroups, 1) * sizeof(Py_buffer))
    cdef CopyJob* jobs = <CopyJob*>malloc(max(n, 1) * sizeof(CopyJob))
    cdef Py_ssize_t acquired = 0, njobs = 0, i, g
    cdef cnp.ndarray a
    cdef list keep = []
    if views == NULL or jobs == NULL:
        free(views)
        free(jobs)
        raise MemoryError()
    try:
        for g in range(ngroups):
            try:
                PyObject_GetBuffer(buffers[g], &views[g], PyBUF_WRITABLE)
            except BufferError as exc:
                raise TypeError(f"pack_copy: buffer {g} is not a writable contiguous "
                                f"buffer ({exc})") from None
            acquired += 1
            if views[g].len < gnb[g]:
                raise ValueError(f"pack_copy: buffer {g} holds {views[g].len} bytes, the plan "
                                 f"needs {gnb[g]}")
        for i in range(n):
            g = lg[i]
            if g < 0:
                continue
            leaf = leaves[i]
            if isinstance(leaf, cnp.ndarray):
                a = <cnp.ndarray>leaf
            else:
                a = as_leaf_array(leaf, i)
                keep.append(a)
            if cnp.PyArray_NBYTES(a) != lnb[i]:
                raise ValueError(f"pack_copy: leaf {i} has {cnp.PyArray_NBYTES(a)} bytes, the "
                                 f"plan says {lnb[i]}")
            jobs[njobs].src = <char*>cnp.PyArray_DATA(a)
            jobs[njobs].dst = <char*>views[g].buf + lo[i]
            jobs[njobs].ndim = cnp.PyArray_NDIM(a)
            jobs[njobs].itemsize = cnp.PyArray_ITEMSIZE(a)
            jobs[njobs].nbytes = lnb[i]
            jobs[njobs].shape = cnp.PyArray_DIMS(a)
            jobs[njobs].strides = cnp.PyArray_STRIDES(a)
            jobs[njobs].contiguous = cnp.PyArray_IS_C_CONTIGUOUS(a)
            njobs += 1
        with nogil:
            for i in range(njobs):
                _copy_leaf(&jobs[i])
    finally:
        for g in range(acquired):
            PyBuffer_Release(&views[g])
        free(views)
        free(jobs)

