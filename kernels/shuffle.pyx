# cython: language_level=3
"""Compiled index shuffle; behaviour specified by ``zephon.kernels.shuffle_ref``.

Callers: :func:`zephon.pipeline.lanes.epoch_slice` and the Parquet source's
row orders. Each position is walked through the Feistel network on its own in
C, without the GIL: O(1) memory per position, no array of size ``n``. Its orders
are the reference's, limits included (the parity of an order is biased: even for
``n = 2**b >= 64``, leaning to the parity of ``2**b - n`` otherwise).
"""

cimport cython
from libc.stdint cimport int64_t, uint64_t

import numbers

import numpy as np

cimport numpy as cnp

from zephon.kernels.shuffle_ref import MIN_BITS, ROUNDS, order_key, round_keys

cnp.import_array()

__all__ = ["inverse_positions", "order_key", "permute_positions", "permute_range"]

cdef enum:
    NROUNDS = 8

assert ROUNDS == NROUNDS

cdef inline uint64_t _mix(uint64_t z) noexcept nogil:
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EB
    return z ^ (z >> 31)


cdef struct Network:
    uint64_t n
    uint64_t keys[NROUNDS]
    int a   # bits of the high half L
    int c   # bits of the low half R


cdef inline uint64_t _mask(int bits) noexcept nogil:
    return (<uint64_t>1 << bits) - 1


cdef inline uint64_t _encrypt(const Network* net, uint64_t x) noexcept nogil:
    cdef int wl = net.a, wr = net.c, r, t
    cdef uint64_t left = x >> net.c, right = x & _mask(net.c), f
    for r in range(NROUNDS):
        f = _mix(right ^ net.keys[r]) & _mask(wl)
        f ^= left
        left = right
        right = f
        t = wl
        wl = wr
        wr = t
    return (left << wr) | right


cdef inline uint64_t _decrypt(const Network* net, uint64_t y) noexcept nogil:
    cdef int wl = net.a, wr = net.c, r, t
    cdef uint64_t left = y >> net.c, right = y & _mask(net.c), f
    for r in range(NROUNDS - 1, -1, -1):
        f = _mix(left ^ net.keys[r]) & _mask(wr)
        f ^= right
        right = left
        left = f
        t = wl
        wl = wr
        wr = t
    return (left << wr) | right


cdef inline uint64_t _walk(const Network* net, uint64_t x, bint inverse) noexcept nogil:
    if inverse:
        x = _decrypt(net, x)
        while x >= net.n:
            x = _decrypt(net, x)
    else:
        x = _encrypt(net, x)
        while x >= net.n:
            x = _encrypt(net, x)
    return x


cdef inline bint _is_int(object v):
    return type(v) is int or (not isinstance(v, bool) and isinstance(v, numbers.Integral))


cdef object _check(object n, object key):
    if not _is_int(n) or not 0 <= n <= 0x7FFFFFFFFFFFFFFF:
        raise ValueError(f"index shuffle: n must be an int in [0, 2**63), got {n!r}")
    if not _is_int(key) or not 0 <= key <= 0xFFFFFFFFFFFFFFFF:
        raise ValueError(f"index shuffle: key must be an int in [0, 2**64), got {key!r}")
    return int(n), int(key)


# The network of the last (n, key): consecutive chunks of one epoch share it, and its
# round keys cost more than a chunk's positions. Read and written with the GIL held.
cdef Network _last
cdef object _last_id = None


cdef void _network(Network* net, object n, object key):
    global _last_id, _last
    cdef int b, r
    if _last_id is not None and _last_id == (n, key):
        net[0] = _last
        return
    b = max(MIN_BITS, (n - 1).bit_length())
    keys = round_keys(n, key)
    net.n = <uint64_t>n
    net.a = b - b // 2
    net.c = b // 2
    for r in range(NROUNDS):
        net.keys[r] = <uint64_t>keys[r]
    _last = net[0]
    _last_id = (n, key)


@cython.boundscheck(False)
@cython.wraparound(False)
def permute_range(n, key, start, stop):
    """Positions ``[start, stop)`` of the order (see the reference)."""
    n, key = _check(n, key)
    if not _is_int(start) or not _is_int(stop):
        raise ValueError(f"index shuffle: start and stop must be ints, got {start!r}, "
                         f"{stop!r}")
    if not 0 <= start <= stop <= n:
        raise ValueError(f"index shuffle: need 0 <= start <= stop <= n, got start={start}, "
                         f"stop={stop}, n={n}")
    cdef int64_t first = start, count = stop - start, i
    out = np.zeros(count, dtype=np.int64)
    if n <= 1 or count == 0:
        return out
    cdef Network net
    _network(&net, n, key)
    cdef int64_t[::1] o = out
    with nogil:
        for i in range(count):
            o[i] = <int64_t>_walk(&net, <uint64_t>(first + i), False)
    return out


@cython.boundscheck(False)
@cython.wraparound(False)
cdef object _apply(object n, object key, object values, str what, bint inverse):
    n, key = _check(n, key)
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        raise ValueError(f"index shuffle: {what} must be integers, got dtype {arr.dtype}")
    arr = arr.reshape(-1)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= n):
        raise ValueError(f"index shuffle: {what} must lie in [0, {n})")
    out = np.ascontiguousarray(arr, dtype=np.int64).copy()
    if n <= 1 or out.size == 0:
        out[:] = 0
        return out
    cdef Network net
    _network(&net, n, key)
    cdef int64_t[::1] o = out
    cdef Py_ssize_t i, size = o.shape[0]
    with nogil:
        for i in range(size):
            o[i] = <int64_t>_walk(&net, <uint64_t>o[i], inverse)
    return out


def permute_positions(n, key, positions):
    """``pi`` of each position (see the reference)."""
    return _apply(n, key, positions, "positions", False)


def inverse_positions(n, key, values):
    """The position of each value (see the reference)."""
    return _apply(n, key, values, "values", True)
