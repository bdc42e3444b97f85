# cython: language_level=3
"""Compiled resampling; behaviour specified by ``zephon.kernels.resample_ref``.

Two separable passes over a uint8 (H, W, C) array, C 1 or 3 (rows may be strided): the
reference's fixed-point coefficients, computed here in C with the same double
arithmetic, and its order of passes; the horizontal pass writes the columns mirrored
when asked to flip. The passes release the GIL; the vertical pass's accumulator row is
allocated per call.
"""

cimport cython
from libc.math cimport ceil, cos, sin, M_PI
from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.stdlib cimport free, malloc

import numpy as np

from zephon.kernels.resample_ref import FILTER_SUPPORT, own_array, plan

_FILTER_IDS = {"box": 0, "bilinear": 1, "hamming": 2, "bicubic": 3, "lanczos": 4}


cdef inline uint8_t _clip8(int32_t v) noexcept nogil:
    v >>= 22
    if v < 0:
        return 0
    if v > 255:
        return 255
    return <uint8_t>v


cdef inline double _sinc(double x) noexcept nogil:
    if x == 0.0:
        return 1.0
    x = x * M_PI
    return sin(x) / x


cdef double _weight(int f, double x) noexcept nogil:
    if f == 0:
        return 1.0 if (x > -0.5 and x <= 0.5) else 0.0
    if x < 0.0:
        x = -x
    if f == 1:
        return 1.0 - x if x < 1.0 else 0.0
    if f == 2:
        if x == 0.0:
            return 1.0
        if x >= 1.0:
            return 0.0
        x = x * M_PI
        return sin(x) / x * (<double>(<float>0.54) + <double>(<float>0.46) * cos(x))
    if f == 3:
        if x < 1.0:
            return ((-0.5 + 2.0) * x - (-0.5 + 3.0)) * x * x + 1
        if x < 2.0:
            return (((x - 5) * x + 8) * x - 4) * -0.5
        return 0.0
    return _sinc(x) * _sinc(x / 3.0) if x < 3.0 else 0.0


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.cdivision(True)
def coefficients(int in_size, double in0, double in1, int out_size, name):
    """As ``zephon.kernels.resample_ref.coefficients``."""
    cdef int f = _FILTER_IDS[name]
    cdef float in0_f = <float>in0, in1_f = <float>in1
    cdef float diff = in1_f - in0_f
    cdef double scale = (<double>diff) / out_size
    cdef double start = <double>in0_f
    cdef double filterscale = scale if scale > 1.0 else 1.0
    cdef double support = FILTER_SUPPORT[name] * filterscale
    cdef int ksize = <int>ceil(support) * 2 + 1
    bounds_arr = np.zeros((out_size, 2), np.int64)
    kk_arr = np.zeros((out_size, ksize), np.int32)
    cdef int64_t[:, ::1] bounds = bounds_arr
    cdef int32_t[:, ::1] kk = kk_arr
    cdef double ss = 1.0 / filterscale, center, ww, w
    cdef double weights[512]
    cdef int xx, x, xmin, xmax
    if ksize > 512:
        from zephon.kernels.resample_ref import coefficients as ref
        return ref(in_size, in0, in1, out_size, name)
    with nogil:
        for xx in range(out_size):
            center = start + (xx + 0.5) * scale
            xmin = <int>(center - support + 0.5)
            if xmin < 0:
                xmin = 0
            xmax = <int>(center + support + 0.5)
            if xmax > in_size:
                xmax = in_size
            xmax -= xmin
            ww = 0.0
            for x in range(xmax):
                w = _weight(f, (x + xmin - center + 0.5) * ss)
                weights[x] = w
                ww += w
            for x in range(xmax):
                w = weights[x] / ww if ww != 0.0 else weights[x]
                if w < 0:
                    kk[xx, x] = <int32_t>(-0.5 + w * (1 << 22))
                else:
                    kk[xx, x] = <int32_t>(0.5 + w * (1 << 22))
            bounds[xx, 0] = xmin
            bounds[xx, 1] = xmax
    return bounds_arr, kk_arr


@cython.boundscheck(False)
@cython.wraparound(False)
cdef void _horizontal(const uint8_t[:, :, :] src, uint8_t[:, :, ::1] dst, int row0,
                      const int64_t[:, ::1] bounds, const int32_t[:, ::1] kk,
                      bint flip) noexcept nogil:
    cdef Py_ssize_t yy, xx, x, c
    cdef int channels = src.shape[2]
    cdef int xmin, count
    cdef int32_t s0, s1, s2, k
    cdef const uint8_t* p
    cdef uint8_t* q
    cdef Py_ssize_t last = dst.shape[1] - 1
    for yy in range(dst.shape[0]):
        for xx in range(dst.shape[1]):
            q = &dst[yy, last - xx, 0] if flip else &dst[yy, xx, 0]
            xmin = <int>bounds[xx, 0]
            count = <int>bounds[xx, 1]
            s0 = s1 = s2 = 1 << 21
            p = &src[yy + row0, xmin, 0]
            if channels == 3:
                for x in range(count):
                    k = kk[xx, x]
                    s0 += p[0] * k
                    s1 += p[1] * k
                    s2 += p[2] * k
                    p += 3
                q[0] = _clip8(s0)
                q[1] = _clip8(s1)
                q[2] = _clip8(s2)
            else:
                for x in range(count):
                    s0 += p[x] * kk[xx, x]
                q[0] = _clip8(s0)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef int _vertical(const uint8_t[:, :, :] src, uint8_t[:, :, ::1] dst, int col0,
                   const int64_t[:, ::1] bounds, const int32_t[:, ::1] kk) noexcept nogil:
    cdef Py_ssize_t yy, xx, y, c
    cdef int width = dst.shape[1] * dst.shape[2]
    cdef int ymin, count
    cdef int32_t k
    cdef int32_t* acc = <int32_t*>malloc(max(width, 1) * sizeof(int32_t))
    cdef const uint8_t* row
    cdef Py_ssize_t offset = col0 * src.shape[2]
    if acc == NULL:
        return -1
    for yy in range(dst.shape[0]):
        ymin = <int>bounds[yy, 0]
        count = <int>bounds[yy, 1]
        for xx in range(width):
            acc[xx] = 1 << 21
        for y in range(count):
            k = kk[yy, y]
            row = &src[ymin + y, 0, 0] + offset
            for xx in range(width):
                acc[xx] += row[xx] * k
        for xx in range(width):
            (&dst[yy, 0, 0])[xx] = _clip8(acc[xx])
    free(acc)
    return 0


def resample(src, box, size, name, flip=False):
    """``src``'s ``box`` resized to ``size`` (width, height), as the reference."""
    src = np.asarray(src)
    p = plan(src, box, size, name, coefficients)
    if src.strides[2] != 1 or src.strides[1] != src.shape[2]:
        src = np.ascontiguousarray(src)
    out = src
    if p.need_h:
        out = np.empty((p.last - p.first, size[0], src.shape[2]), np.uint8)
        _horizontal_any(src, out, p.first, p.bounds_h, p.kk_h, flip)
    elif flip:
        out = src[:, ::-1]
    if p.need_v:
        res = np.empty((size[1], out.shape[1], src.shape[2]), np.uint8)
        _vertical_any(np.ascontiguousarray(out), res, 0, p.bounds_v, p.kk_v)
        out = res
    return own_array(out, src)


def _horizontal_any(src, dst, int row0, bounds, kk, bint flip):
    cdef const uint8_t[:, :, :] s = src
    cdef uint8_t[:, :, ::1] d = dst
    cdef const int64_t[:, ::1] b = np.ascontiguousarray(bounds, np.int64)
    cdef const int32_t[:, ::1] k = np.ascontiguousarray(kk, np.int32)
    with nogil:
        _horizontal(s, d, row0, b, k, flip)


def _vertical_any(src, dst, int col0, bounds, kk):
    cdef const uint8_t[:, :, :] s = src
    cdef uint8_t[:, :, ::1] d = dst
    cdef const int64_t[:, ::1] b = np.ascontiguousarray(bounds, np.int64)
    cdef const int32_t[:, ::1] k = np.ascontiguousarray(kk, np.int32)
    cdef int failed
    with nogil:
        failed = _vertical(s, d, col0, b, k)
    if failed:
        raise MemoryError("resample: no memory for a row of the vertical pass")
