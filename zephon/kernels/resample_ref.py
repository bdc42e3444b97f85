"""Reference for the resampling kernel: Pillow's convolution resize, bit for bit.

``resample(src, box, size, name)`` resizes the part ``box`` (left, top, right, bottom,
in pixels, fractions allowed) of ``src`` (a uint8 array (H, W, C), C 1 or 3, rows may be
strided) to ``size`` (width, height) as ``Image.resize(size, filter, box=box)`` does for
modes "L" and "RGB": the same filters and supports; the box rounded to single precision
as Pillow's C code takes it; the same coefficients (double precision, normalised per
output pixel, then rounded to 22-bit fixed point); the same two passes, horizontal
first, over only the rows the vertical pass reads, each skipped when it would be the
identity; the same rounding and clipping to 8 bits after each pass. That is Pillow's
resize up to 12.x exactly (tested against Pillow 12.2), except for a region more than
about a hundred times taller than wide that shrinks in height, which Pillow 12 resizes
vertical pass first (one to three off in places). Pillow 13 may run the vertical
pass first for some sizes (it chooses per call); where it does, its intermediate image
is rounded and clipped to 8 bits at another point: a channel here is then within one
of it for box, bilinear and hamming, and can be further off for bicubic and lanczos
where their overshoot was clipped (in our tests a few percent of values differ). ``flip`` mirrors
the output left to right (free in the compiled kernel, which writes the columns in
reverse). The compiled kernel (``zephon._kernels.resample``) must match this bit for
bit. Filters by name: "box", "bilinear", "hamming", "bicubic", "lanczos"
(``nearest`` has no kernel: it stays Pillow's).

Why it exists: Pillow resizes 4-byte pixels (its RGB is stored RGBX), and an array is
copied into a Pillow image and out of it around the call; resizing the decoded uint8
array itself does a quarter less arithmetic and no copies (``zephon.vision.decode``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

__all__ = ["FILTER_SUPPORT", "PRECISION_BITS", "Plan", "coefficients", "filter_weight",
           "own_array", "plan", "resample"]

PRECISION_BITS = 32 - 8 - 2
#: each filter's support at scale 1, in input pixels
FILTER_SUPPORT = {"box": 0.5, "bilinear": 1.0, "hamming": 1.0, "bicubic": 2.0,
                  "lanczos": 3.0}
# Pillow's hamming window constants are C floats (0.54f, 0.46f)
_HAMMING_A, _HAMMING_B = float(np.float32(0.54)), float(np.float32(0.46))


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x *= math.pi
    return math.sin(x) / x


def filter_weight(name: str, x: float) -> float:
    """The filter ``name``'s weight at ``x``."""
    if name == "box":
        return 1.0 if -0.5 < x <= 0.5 else 0.0
    if name == "bilinear":
        x = abs(x)
        return 1.0 - x if x < 1.0 else 0.0
    if name == "hamming":
        x = abs(x)
        if x == 0.0:
            return 1.0
        if x >= 1.0:
            return 0.0
        x *= math.pi
        return math.sin(x) / x * (_HAMMING_A + _HAMMING_B * math.cos(x))
    if name == "bicubic":
        a = -0.5
        x = abs(x)
        if x < 1.0:
            return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
        if x < 2.0:
            return (((x - 5) * x + 8) * x - 4) * a
        return 0.0
    if name == "lanczos":
        return _sinc(x) * _sinc(x / 3.0) if -3.0 < x < 3.0 else 0.0
    raise ValueError(f"resample: unknown filter {name!r}")


def coefficients(in_size: int, in0: float, in1: float, out_size: int,
                 name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(bounds, kk)``: per output pixel the first input pixel and the count it reads
    (``bounds``, shape (out_size, 2)), and its fixed-point weights (``kk``, shape
    (out_size, ksize), int32)."""
    in0_f, in1_f = np.float32(in0), np.float32(in1)  # Pillow's box is C floats
    scale = float(np.float32(in1_f - in0_f)) / out_size
    start = float(in0_f)
    filterscale = max(scale, 1.0)
    support = FILTER_SUPPORT[name] * filterscale
    ksize = math.ceil(support) * 2 + 1
    bounds = np.zeros((out_size, 2), np.int64)
    kk = np.zeros((out_size, ksize), np.int32)
    ss = 1.0 / filterscale
    for xx in range(out_size):
        center = start + (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        weights = [filter_weight(name, (x + xmin - center + 0.5) * ss) for x in range(xmax)]
        total = 0.0
        for w in weights:
            total += w
        for x, w in enumerate(weights):
            w = w / total if total != 0.0 else w
            kk[xx, x] = int(-0.5 + w * (1 << PRECISION_BITS)) if w < 0 else \
                int(0.5 + w * (1 << PRECISION_BITS))
        bounds[xx] = (xmin, xmax)
    return bounds, kk


def _pass(src: np.ndarray, bounds: np.ndarray, kk: np.ndarray, axis: int) -> np.ndarray:
    """One pass along ``axis`` (1: columns, 0: rows) with integer arithmetic."""
    moved = np.moveaxis(src, axis, 0).astype(np.int64)  # (n, other, C)
    out = np.empty((bounds.shape[0], *moved.shape[1:]), np.int64)
    for i in range(bounds.shape[0]):
        lo, count = int(bounds[i, 0]), int(bounds[i, 1])
        out[i] = np.tensordot(kk[i, :count].astype(np.int64), moved[lo:lo + count],
                              axes=(0, 0)) + (1 << (PRECISION_BITS - 1))
    clipped = np.clip(out >> PRECISION_BITS, 0, 255).astype(np.uint8)
    return np.moveaxis(clipped, 0, axis)


class Plan(NamedTuple):
    """What one resize does: which passes run, their coefficients (the vertical pass's
    first input row counted from ``first``, the first row the horizontal pass reads),
    and the rows ``first:last`` that pass reads."""

    need_h: bool
    need_v: bool
    bounds_h: np.ndarray
    kk_h: np.ndarray
    bounds_v: np.ndarray
    kk_v: np.ndarray
    first: int
    last: int


def plan(src: np.ndarray, box: tuple[float, float, float, float], size: tuple[int, int],
         name: str, coefficients_of: Callable = coefficients) -> Plan:
    """The :class:`Plan` of resizing ``src``'s ``box`` to ``size`` with filter ``name``
    (``coefficients_of``: :func:`coefficients`, or the compiled kernel's copy of it)."""
    if src.ndim != 3 or src.dtype != np.uint8 or src.shape[2] not in (1, 3):
        raise ValueError("resample: src must be a uint8 array (H, W, 1 or 3)")
    height, width = src.shape[:2]
    left, top, right, bottom = (float(np.float32(v)) for v in box)
    out_w, out_h = size
    need_h = out_w != width or left != 0 or right != out_w
    need_v = out_h != height or top != 0 or bottom != out_h
    bounds_h, kk_h = coefficients_of(width, left, right, out_w, name)
    bounds_v, kk_v = coefficients_of(height, top, bottom, out_h, name)
    first, last = 0, height
    if need_h:
        first = int(bounds_v[0, 0])
        last = int(bounds_v[-1, 0] + bounds_v[-1, 1])
        bounds_v = bounds_v.copy()
        bounds_v[:, 0] -= first
    return Plan(need_h, need_v, bounds_h, kk_h, bounds_v, kk_v, first, last)


def own_array(out: np.ndarray, src: np.ndarray) -> np.ndarray:
    """``out`` as a new C-contiguous array, never memory of ``src`` (with neither pass,
    or a mirrored single column, ``out`` is ``src`` or a view of it, and ``src`` may be
    a decoder's buffer that its next decode overwrites)."""
    if np.shares_memory(out, src):
        return np.array(out, order="C", copy=True)
    return np.ascontiguousarray(out)


def resample(src: np.ndarray, box: tuple[float, float, float, float],
             size: tuple[int, int], name: str, flip: bool = False) -> np.ndarray:
    """``src``'s ``box`` resized to ``size`` (width, height), mirrored left to right when
    ``flip``: a new C-contiguous uint8 array (height, width, C)."""
    p = plan(src, box, size, name)
    out = _pass(src[p.first:p.last], p.bounds_h, p.kk_h, axis=1) if p.need_h else src
    if p.need_v:
        out = _pass(out, p.bounds_v, p.kk_v, axis=0)
    return own_array(out[:, ::-1] if flip else out, src)
