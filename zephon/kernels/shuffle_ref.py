"""Reference index shuffle: the specification of ``kernels/shuffle.pyx``.

Callers: :func:`zephon.pipeline.lanes.epoch_slice` (the positions of an epoch's
visiting order that one chunk reads) and the Parquet source's per-row-group
row orders (:mod:`zephon.pipeline.sources.parquet`).

A seeded bijection ``pi`` of ``[0, n)``, evaluated position by position in O(1)
time and memory, so that no array of size ``n`` ever exists: position ``i`` of
the order visits value ``pi(i)``.

Construction (every operation on unsigned 64-bit integers, wrapping):

- ``mix(z)``: the SplitMix64 finaliser, ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
  z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31`` (a bijection of 64-bit
  words with full avalanche).
- Domain: ``2**b``, the smallest power of two ``>= n`` and ``>= 2**MIN_BITS`` (``b =
  max(MIN_BITS, (n - 1).bit_length())``, ``MIN_BITS = 6``; ``n <= 1`` needs no network).
  On fewer bits eight rounds are too few: the orders of 5 to 7 samples drawn over
  many keys are measurably far from uniform over all permutations; from 64 words on
  they are not (tests/test_kernels_shuffle.py checks it). A word ``x < 2**b`` is split into a high half ``L`` of ``b - b // 2`` bits and a
  low half ``R`` of ``b // 2`` bits.
- Round keys: ``base = mix(key ^ mix(n + GAMMA))`` and ``k[r] = mix(base + (r + 1) *
  GAMMA)`` for ``r < ROUNDS`` (``GAMMA = 0x9E3779B97F4A7C15``, ``ROUNDS = 8``): the
  length is part of the key, so orders of different lengths are unrelated.
- Round ``r`` of the (unbalanced) Feistel network maps ``(L, R)``, of widths
  ``(wl, wr)``, to ``(R, L ^ (mix(R ^ k[r]) & (2**wl - 1)))``, of widths ``(wr, wl)``;
  after the ``ROUNDS`` (even) rounds the word is ``L << wr | R``. Each round is
  invertible, so the network is a permutation ``E`` of ``[0, 2**b)``.
- Cycle walking: ``pi(i)`` is the first of ``E(i), E(E(i)), ...`` below ``n``. It
  exists because ``i`` lies on its own cycle of ``E``, and it makes ``pi`` a
  permutation of ``[0, n)``; for ``n > 32``, ``2**b < 2 n`` and a position costs fewer
  than two network evaluations on average (``64 / n`` below that). The inverse walks ``E``'s inverse the same way.

One limit of the construction, as of every Feistel network on a power-of-two
domain: when both halves have at least two bits, each round is an even
permutation, so ``E`` is always even, and for ``n = 2**b >= 64`` only even
permutations occur. Cycle walking carries a bias of the parity to the other
lengths: it takes the ``k = 2**b - n`` values ``>= n`` out of ``E``'s cycles, so
``pi``'s parity is that of ``k - C``, with ``C`` the number of cycles of ``E``
made only of such values (usually none when ``k`` is small). Over keys, ``pi`` has
the parity of ``k`` with a probability of about ``(1 + (n / 2**b)**2) / 2``: it is
odd 99.6 % of the time for ``n = 255``, even about 80 % for ``n = 100``, and close
to fair only where ``n`` is small against the domain (``n <= 16`` on the 64-word
domain: within 0.04 of one half). tests/test_kernels_shuffle.py measures it. The
marginal statistics (where a value lands, neighbours, prefixes) are unaffected; the
order is part of the stream's definition (and of checkpoints), so the bias stays.

Functions (``n`` an int with ``0 <= n < 2**63``, ``key`` an int with ``0 <= key <
2**64``; anything else is a ``ValueError``):

``permute_range(n, key, start, stop) -> int64 array``
    ``[pi(i) for i in range(start, stop)]`` for ``0 <= start <= stop <= n``.
``permute_positions(n, key, positions) -> int64 array``
    ``pi`` of each entry of an integer array of positions in ``[0, n)`` (any shape,
    flattened to one dimension).
``inverse_positions(n, key, values) -> int64 array``
    the position of each value: ``inverse_positions(n, key, permute_positions(n,
    key, p)) == p``.
``order_key(*words) -> int``
    a 64-bit key from non-negative ints of any size (``order_key(seed, tag, epoch)``):
    pure Python, shared by both implementations.
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["GAMMA", "MIN_BITS", "ROUNDS", "inverse_positions", "order_key", "permute_positions",
           "permute_range"]

GAMMA = 0x9E3779B97F4A7C15
ROUNDS = 8
MIN_BITS = 6
_M64 = (1 << 64) - 1
_MAX_N = (1 << 63) - 1
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix_int(z: int) -> int:
    """``mix`` of one Python int (mod 2**64)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mix(z: np.ndarray) -> np.ndarray:
    """``mix`` of a uint64 array (a new array)."""
    z = z ^ (z >> np.uint64(30))
    z *= _C1
    z ^= z >> np.uint64(27)
    z *= _C2
    z ^= z >> np.uint64(31)
    return z


def order_key(*words: int) -> int:
    """A 64-bit key absorbing ``words`` (non-negative ints of any size) in order; each
    word is absorbed as its count of 64-bit limbs and then its limbs, so ``(a, b)`` and
    one word made of the same bits give different keys."""
    h = 0x243F6A8885A308D3
    for w in words:
        if isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < 0:
            raise ValueError(f"order_key: words must be ints >= 0, got {w!r}")
        w = int(w)
        limbs = [w & _M64]
        while w > _M64:
            w >>= 64
            limbs.append(w & _M64)
        for limb in (len(limbs), *limbs):
            h = _mix_int((h ^ limb) + GAMMA)
    return h


def _is_int(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, numbers.Integral)


def _check(n: int, key: int) -> tuple[int, int]:
    if not _is_int(n) or not 0 <= n <= _MAX_N:
        raise ValueError(f"index shuffle: n must be an int in [0, 2**63), got {n!r}")
    if not _is_int(key) or not 0 <= key <= _M64:
        raise ValueError(f"index shuffle: key must be an int in [0, 2**64), got {key!r}")
    return int(n), int(key)


def round_keys(n: int, key: int) -> list[int]:
    """The ``ROUNDS`` round keys of the network for ``(n, key)``."""
    base = _mix_int(key ^ _mix_int(n + GAMMA))
    return [_mix_int(base + (r + 1) * GAMMA) for r in range(ROUNDS)]


def _halves(n: int) -> tuple[int, int]:
    """(bits of L, bits of R) of the domain of ``n``."""
    b = max(MIN_BITS, (n - 1).bit_length())
    return b - b // 2, b // 2


def _encrypt(x: np.ndarray, keys: list[int], a: int, c: int) -> np.ndarray:
    wl, wr = a, c
    left, right = x >> np.uint64(c), x & np.uint64((1 << c) - 1)
    for k in keys:
        f = _mix(right ^ np.uint64(k)) & np.uint64((1 << wl) - 1)
        left, right = right, left ^ f
        wl, wr = wr, wl
    return (left << np.uint64(wr)) | right


def _decrypt(y: np.ndarray, keys: list[int], a: int, c: int) -> np.ndarray:
    wl, wr = a, c  # widths of the current (L', R'); ROUNDS is even
    left, right = y >> np.uint64(c), y & np.uint64((1 << c) - 1)
    for k in reversed(keys):
        # forward: (L, R) of widths (wr, wl) went to (R, L ^ F(R)) of widths (wl, wr)
        f = _mix(left ^ np.uint64(k)) & np.uint64((1 << wr) - 1)
        left, right = right ^ f, left
        wl, wr = wr, wl
    return (left << np.uint64(wr)) | right


def _walk(x: np.ndarray, n: int, step) -> np.ndarray:
    """Cycle walking: apply ``step`` to ``x`` once, then again to every entry still
    ``>= n``, until all are below ``n``."""
    y = step(x)
    todo = np.flatnonzero(y >= np.uint64(n))
    while todo.size:
        moved = step(y[todo])
        y[todo] = moved
        todo = todo[moved >= np.uint64(n)]
    return y


def _positions(n: int, values, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.empty(0, dtype=np.uint64)
        raise ValueError(f"index shuffle: {what} must be integers, got dtype {arr.dtype}")
    arr = arr.reshape(-1)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= n):
        raise ValueError(f"index shuffle: {what} must lie in [0, {n})")
    return arr.astype(np.uint64)


def _apply(n: int, key: int, x: np.ndarray, inverse: bool) -> np.ndarray:
    if n <= 1 or x.size == 0:
        return np.zeros(x.size, dtype=np.int64)
    keys, (a, c) = round_keys(n, key), _halves(n)
    fn = _decrypt if inverse else _encrypt
    return _walk(x, n, lambda v: fn(v, keys, a, c)).astype(np.int64)


def permute_range(n: int, key: int, start: int, stop: int) -> np.ndarray:
    """Positions ``[start, stop)`` of the order: ``pi(start), ..., pi(stop - 1)``."""
    n, key = _check(n, key)
    if not _is_int(start) or not _is_int(stop):
        raise ValueError(f"index shuffle: start and stop must be ints, got {start!r}, "
                         f"{stop!r}")
    if not 0 <= start <= stop <= n:
        raise ValueError(f"index shuffle: need 0 <= start <= stop <= n, got start={start}, "
                         f"stop={stop}, n={n}")
    return _apply(n, key, np.arange(int(start), int(stop), dtype=np.uint64), False)


def permute_positions(n: int, key: int, positions) -> np.ndarray:
    """``pi`` of each position (an integer array in ``[0, n)``)."""
    n, key = _check(n, key)
    return _apply(n, key, _positions(n, positions, "positions"), False)


def inverse_positions(n: int, key: int, values) -> np.ndarray:
    """The position of each value (an integer array in ``[0, n)``): ``pi``'s inverse."""
    n, key = _check(n, key)
    return _apply(n, key, _positions(n, values, "values"), True)
