"""Mixture weights keyed by the position in the stream, in samples or in tokens.

What it owns
------------
:class:`StreamSchedule`: for a mixture built with ``schedule_unit="samples"`` or
``"tokens"``, which component each *stream position* holds, where the stream is
the mixture read in its own order, epoch after epoch (position ``t = epoch * L +
q`` for the ``q``-th position of an epoch of ``L``). Such a mixture orders itself:
the pipeline reads it in source order (its ``shuffle`` flag then shuffles each
component's passes instead, see :meth:`MixtureSource.ordered`), so the position a
lane reads is the position in the one-rank stream, up to the lanes' interleave
(``canonical lanes x chunk_size`` positions), on every runner and world size.

The schedule
------------
Weights are given at breakpoints ``[(position, {name: w}), ...]`` (the first at 0)
and hold until the next one (``interpolate="step"``) or move linearly to it
(``"linear"``: each component's *sample rate* moves linearly in samples), or come
from a module-level function ``position -> {name: w}`` evaluated every
:data:`CALLABLE_EVERY` samples (the position it is given: samples, or tokens with
``schedule_unit="tokens"``). Weights become sample rates as the mixture's weights
do (with ``by="tokens"``: token shares over tokens per sample). Breakpoints in
tokens are placed in samples from each component's tokens per sample (a step: its
tokens over the segment's mean tokens per sample; linear: over the mean of both
ends' means, exact for a linear move of the rates), so a token-keyed schedule is
as exact as the tokens per sample it is given.

Exact counts, random interleave
-------------------------------
``W_k(x)``, the expected count of component ``k`` in the first ``x`` samples, has a
closed form on every segment (linear or quadratic in ``x``). The stream is cut in
blocks of :data:`BLOCK` samples of ``x``: component ``k`` has ``A_k(b) = floor(W_k(b
* BLOCK) + 1/2)`` positions before block ``b`` and ``A_k(b + 1) - A_k(b)`` in it, so
every stretch of the stream holds each component at its scheduled count within one
sample per component, plus the interleave's noise inside a block. Block ``b``'s
positions start at ``P(b) = sum_k A_k(b)`` (within ``K / 2`` of ``b * BLOCK``); a
seeded bijection of the block (one per block) places a position among the block's
counts, so the interleave is random where the counts are exact. Position ``t`` of
component ``k`` is that component's occurrence ``J = A_k(b) + place``, read as pass
``J // size`` of the component at ``J % size`` (see the mixture). Everything is a
pure function of the position, the schedule and the seed, computed per position in
``O(K)`` (plus a search over the breakpoints): nothing is carried from one position
to the next, so a lane, a restore on any world size and every runner compute the
same stream. A callable's breakpoints are computed in order once per process up to
the farthest position read and kept (``CALLABLE_EVERY`` apart: a restore at 10**9
samples calls it about 250,000 times once).
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.kernels import order_key as _key
from zephon.kernels import permute_positions

__all__ = ["BLOCK", "CALLABLE_EVERY", "SCHEDULE_UNITS", "StreamSchedule"]

#: samples of ``x`` per block: counts exact per block, interleave random within one
BLOCK = 256
#: samples between two evaluations of a callable schedule
CALLABLE_EVERY = 4096
SCHEDULE_UNITS = ("epochs", "samples", "tokens")
INTERPOLATIONS = ("step", "linear")


class StreamSchedule:
    """Component of each stream position under a position-keyed weight schedule (see
    the module docstring).

    Args:
        unit: ``"samples"`` or ``"tokens"`` (what the breakpoints count).
        interpolate: ``"step"`` or ``"linear"``.
        firsts: the breakpoints' positions (increasing, the first 0), or None with ``fn``.
        vectors: each breakpoint's weight vector (components' order), or None with ``fn``.
        fn: ``position -> weight vector`` (checked), or None.
        rates: weight vector -> sample rates summing to 1 (the mixture's ``rates``).
        tokens: each component's tokens per sample (``unit="tokens"``), else None.
    """

    def __init__(self, unit: str, interpolate: str, firsts: list[int] | None,
                 vectors: list[np.ndarray] | None, fn: Callable[[int], np.ndarray] | None,
                 rates: Callable[[np.ndarray], np.ndarray], tokens: np.ndarray | None
                 ) -> None:
        self.unit, self.interpolate = unit, interpolate

        self.fn, self.rates, self.tokens = fn, rates, tokens
        self._lock = threading.Lock()
        if fn is not None:
            self._x: list[float] = []
            self._s: list[np.ndarray] = []
            self._at_token = 0.0
            self._grow(0)
            self._freeze()
        else:
            assert firsts is not None and vectors is not None
            shares = [rates(v) for v in vectors]
            self._x = self._in_samples([float(f) for f in firsts], shares)
            self._s = shares
            self._freeze()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- breakpoints -------------------------------------------------------------------

    def _in_samples(self, firsts: list[float], shares: list[np.ndarray]) -> list[float]:
        """The breakpoints' positions in samples (tokens: placed by tokens per sample)."""
        if self.unit == "samples":
            return firsts
        assert self.tokens is not None
        x = [0.0]
        for i in range(1, len(firsts)):
            span = firsts[i] - firsts[i - 1]
            per = float(shares[i - 1] @ self.tokens)
            if self.interpolate == "linear":
                per = (per + float(shares[i] @ self.tokens)) / 2
            x.append(x[-1] + span / per)
        return x

    def _grow(self, upto: float) -> None:
        """A callable's breakpoints up to ``upto`` samples (and one past it)."""
        assert self.fn is not None
        while not self._x or self._x[-1] <= upto:
            g = len(self._x)
            where = g * CALLABLE_EVERY if self.unit == "samples" else int(self._at_token)
            share = self.rates(self.fn(where))
            if self.unit == "tokens":
                assert self.tokens is not None
                self._at_token += CALLABLE_EVERY * float(share @ self.tokens)
            self._x.append(float(g * CALLABLE_EVERY))
            self._s.append(share)

    def _freeze(self) -> None:
        """The arrays the positions are computed from: breakpoints ``X`` (samples), the
        rates ``S`` there, each segment's slope and ``W`` at every breakpoint."""
        x, s = list(self._x), list(self._s)
        linear = self.interpolate == "linear" and self.fn is None
        xs = np.array(x, dtype=np.float64)
        ss = np.array(s, dtype=np.float64).reshape(len(x), -1)
        slopes = np.zeros_like(ss)
        if linear and len(x) > 1:
            span = np.diff(xs)
            with np.errstate(divide="ignore", invalid="ignore"):
                slopes[:-1] = np.where(span[:, None] > 0, np.diff(ss, axis=0) / span[:, None], 0)
        cum = np.zeros_like(ss)
        for i in range(1, len(x)):
            d = xs[i] - xs[i - 1]
            cum[i] = cum[i - 1] + ss[i - 1] * d + slopes[i - 1] * d * d / 2
        self._X, self._S, self._slopes, self._cum = xs, ss, slopes, cum

    # -- positions ---------------------------------------------------------------------

    def expected(self, x: np.ndarray) -> np.ndarray:
        """``W(x)``: the expected count of each component in the first ``x`` samples
        (rows: the ``x``, columns: the components)."""
        x = np.asarray(x, dtype=np.float64)
        if self.fn is not None and len(x) and float(x.max()) >= self._x[-1]:
            with self._lock:
                if float(x.max()) >= self._x[-1]:
                    self._grow(float(x.max()))
                    self._freeze()
        i = np.searchsorted(self._X, x, side="right") - 1
        d = (x - self._X[i])[:, None]
        return self._cum[i] + self._S[i] * d + self._slopes[i] * d * d / 2

    def _before(self, blocks: np.ndarray) -> np.ndarray:
        """``A(b)``: positions of each component before each block (int64, (m, K))."""
        return np.floor(self.expected(blocks * float(BLOCK)) + 0.5).astype(np.int64)

    def share(self, x: np.ndarray) -> np.ndarray:
        """The scheduled sample rates at ``x`` samples (rows: the ``x``)."""
        x = np.asarray(x, dtype=np.float64)
        self.expected(x)  # (a callable's breakpoints that far)
        i = np.searchsorted(self._X, x, side="right") - 1
        return self._S[i] + self._slopes[i] * (x - self._X[i])[:, None]

    def locate(self, t: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """``(component, occurrence of that component from the stream's start)`` of each
        stream position ``t`` (int64), the interleave within a block seeded by ``seed``."""
        t = np.asarray(t, dtype=np.int64)
        guess = t // BLOCK  # the block is this one or a neighbour: |P(b) - b * BLOCK| <= K / 2
        blocks = np.unique(np.concatenate([guess - 1, guess, guess + 1, guess + 2]))
        blocks = blocks[blocks >= 0]
        before = self._before(blocks)  # A at every candidate block (a read unit: ~20)
        starts = before.sum(axis=1)
        at = np.searchsorted(starts, t, side="right") - 1
        assert (blocks[at + 1] == blocks[at] + 1).all()  # (K <= BLOCK, checked when built)
        b = blocks[at]
        low, high = before[at], before[at + 1]
        counts = high - low
        size = counts.sum(axis=1)
        place = t - low.sum(axis=1)
        for block in np.unique(b).tolist():
            rows = np.flatnonzero(b == block)
            n = int(size[rows[0]])
            if n > 1:
                place[rows] = permute_positions(n, _key(seed, 0x5C, block), place[rows])
        cum = np.cumsum(counts, axis=1)
        comp = (cum > place[:, None]).argmax(axis=1)
        rows = np.arange(len(t))
        occurrence = low[rows, comp] + place - (cum[rows, comp] - counts[rows, comp])
        return comp.astype(np.int64), occurrence.astype(np.int64)

    def describe(self) -> str:
        what = f"fn every {CALLABLE_EVERY}" if self.fn is not None else \
            f"{self.interpolate} at {np.round(self._x, 6).tolist()}"
        return f"{self.unit}-keyed schedule ({what})"


def check_unit(unit: str, interpolate: str) -> None:
    if unit not in SCHEDULE_UNITS:
        raise ZephonConfigError(f"mixture: schedule_unit must be one of {SCHEDULE_UNITS}, "
                                f"got {unit!r}")
    if interpolate not in INTERPOLATIONS:
        raise ZephonConfigError(f"mixture: interpolate must be one of {INTERPOLATIONS}, "
                                f"got {interpolate!r}")
