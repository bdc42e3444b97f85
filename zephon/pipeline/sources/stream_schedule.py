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
:data:`CALLABLE_EVERY` samples and held in between (the position it is given:
samples, or tokens with ``schedule_unit="tokens"``). Weights become sample rates
as the mixture's weights do (with ``by="tokens"``: token shares over tokens per
sample). Breakpoints in tokens are placed in samples from each component's tokens
per sample (a step: its tokens over the segment's mean tokens per sample; linear:
over the mean of both ends' means), so a token-keyed schedule is as exact as the
tokens per sample it is given. Every breakpoint lands on a multiple of
:data:`BLOCK` samples (the nearest; a trainer's change: the next), so no block
straddles one: a component switched off holds no position past its step.

Exact counts, random interleave
-------------------------------
``W_k(x)``, the expected count of component ``k`` in the first ``x`` samples, has a
closed form on every segment (linear or quadratic in ``x``). The stream is cut in
blocks of :data:`BLOCK` samples of ``x``: component ``k`` has ``A_k(b) = floor(W_k(b
* BLOCK) + 1/2)`` positions before block ``b`` and ``A_k(b + 1) - A_k(b)`` in it, so
every stretch of the stream holds each component at its scheduled count within one
sample per component, plus the interleave's noise inside a block. Block ``b``'s
positions start at ``P(b) = sum_k A_k(b)`` (within ``K / 2`` of ``b * BLOCK``); a
seeded bijection of the block (one per block) deals its positions out to the
block's counts, so the interleave is random where the counts are exact, and the
positions a component gets take its occurrences in order (``A_k(b)``, ``A_k(b) +
1``, ...): a component's occurrences rise with the position, so a pass of it (``J //
size``) is read whole before the next begins. Everything is a pure function of the
position, the schedule and the seed, computed per read unit in ``O(K)`` per
position (plus a search over the breakpoints, and the unit's blocks dealt whole):
nothing is carried from one position to the next, so a lane, a restore on any
world size and every runner compute the same stream. Positions stop at
:data:`MAX_POSITION` (2**48: float64 keeps the counts exact there).

A callable's breakpoints are computed in order up to the farthest position read, once
per process (``position / CALLABLE_EVERY`` calls: 15,259 for 10**9 samples) and kept;
they do not travel in a pickle.

Weights a trainer sets
----------------------
:meth:`StreamSchedule.with_overrides` is the schedule with the weights changed from
given positions on: each ``(position, weights)`` holds from its position (rounded up
to a block) until the next one, replacing what the schedule said there. The
overrides travel in the pipeline's state, not in its definition (see
:meth:`~zephon.pipeline.iterator.PipelineIterator.set_mixture_weights`).
"""

from __future__ import annotations

import threading
from typing import Callable, Mapping, NamedTuple

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.kernels import order_key as _key
from zephon.kernels import permute_positions

__all__ = ["BLOCK", "CALLABLE_EVERY", "MAX_POSITION", "SCHEDULE_UNITS", "StreamSchedule",
           "override_vector"]

#: samples of ``x`` per block: counts exact per block, interleave random within one
BLOCK = 256
#: samples between two evaluations of a callable schedule (a multiple of BLOCK)
CALLABLE_EVERY = 1 << 16
#: the last stream position: counts of up to 2**48 stay exact in float64 arithmetic
MAX_POSITION = 1 << 48
SCHEDULE_UNITS = ("epochs", "samples", "tokens")
INTERPOLATIONS = ("step", "linear")


class _Arrays(NamedTuple):
    """One consistent view of the breakpoints (read at once, replaced at once)."""

    x: np.ndarray  # breakpoints, samples (float64, increasing, multiples of BLOCK)
    rates: np.ndarray  # (n, K) sample rates there
    slopes: np.ndarray  # (n, K) rate change per sample on the segment after each
    cum: np.ndarray  # (n, K) W at each breakpoint
    end: float  # W is known below this (a callable's last evaluation; inf otherwise)


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
        self.overrides: tuple[tuple[int, np.ndarray], ...] = ()
        self._lock = threading.Lock()
        if fn is not None:
            self._given_x: list[float] = []
            self._given: list[np.ndarray] = []
            self._at_token = 0.0
        else:
            assert firsts is not None and vectors is not None
            shares = [rates(v) for v in vectors]
            self._given_x = self._in_samples([float(f) for f in firsts], shares)
            self._given = shares
        self._arrays: _Arrays | None = self._build(0.0)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_lock"] = None
        if self.fn is not None:  # rebuilt where it is read (a callable's growth stays here)
            state["_given_x"], state["_given"], state["_at_token"] = [], [], 0.0
            state["_arrays"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)  # (a callable's arrays: built at the first read, once
        self._lock = threading.Lock()  # the mixture its ``rates`` belongs to is whole)

    # -- breakpoints -------------------------------------------------------------------

    def _in_samples(self, firsts: list[float], shares: list[np.ndarray]) -> list[float]:
        """The breakpoints' positions in samples (tokens: placed by tokens per sample),
        each on the nearest multiple of :data:`BLOCK`."""
        x = [0.0]
        for i in range(1, len(firsts)):
            span = firsts[i] - firsts[i - 1]
            if self.unit == "tokens":
                assert self.tokens is not None
                per = float(shares[i - 1] @ self.tokens)
                if self.interpolate == "linear":
                    per = (per + float(shares[i] @ self.tokens)) / 2
                span /= per
            x.append(x[-1] + span)
        return [float(round(v / BLOCK) * BLOCK) for v in x]

    def _grow(self, upto: float) -> None:
        """A callable's breakpoints past ``upto`` samples."""
        assert self.fn is not None
        while not self._given_x or self._given_x[-1] <= upto:
            g = len(self._given_x)
            where = g * CALLABLE_EVERY if self.unit == "samples" else int(self._at_token)
            share = self.rates(self.fn(where))
            if self.unit == "tokens":
                assert self.tokens is not None
                self._at_token += CALLABLE_EVERY * float(share @ self.tokens)
            self._given_x.append(float(g * CALLABLE_EVERY))
            self._given.append(share)

    def _build(self, upto: float) -> _Arrays:
        """The arrays positions are computed from, covering ``upto`` samples (a callable
        grown to twice as far, so that growing costs O(1) a position over a run), the
        overrides applied."""
        end = np.inf
        if self.fn is not None:
            last = float(self.overrides[-1][0]) if self.overrides else 0.0
            self._grow(max(upto * 2, upto + CALLABLE_EVERY, last + CALLABLE_EVERY))
            end = self._given_x[-1] if not self.overrides else np.inf  # (held after one)
        x, s = list(self._given_x), list(self._given)
        linear = self.interpolate == "linear" and self.fn is None
        changes: list = []  # each holds from its position until the next (one pass: a
        for at, vector in self.overrides:  # run may make thousands); at one position the last
            if changes and changes[-1][0] == float(at):
                changes.pop()
            changes.append((float(at), vector))
        if changes:  # what the schedule said from the first change on is replaced
            inside = _rate_before(x, s, linear, changes[0][0])
            keep = int(np.searchsorted(np.array(x), changes[0][0], side="left"))
            x, s = x[:keep], s[:keep]
            for at_x, vector in changes:
                if linear:  # the segment before ``at`` moves as it did, up to ``at``
                    x.append(at_x)
                    s.append(inside)
                x.append(at_x)
                s.append(vector)
                inside = vector  # (held until the next change)
        xs = np.array(x, dtype=np.float64)
        ss = np.array(s, dtype=np.float64).reshape(len(x), -1)
        slopes = np.zeros_like(ss)
        span = np.diff(xs)
        if linear and len(x) > 1:
            with np.errstate(divide="ignore", invalid="ignore"):
                slopes[:-1] = np.where(span[:, None] > 0,
                                       np.diff(ss, axis=0) / span[:, None], 0.0)
        pieces = ss[:-1] * span[:, None] + slopes[:-1] * (span * span / 2)[:, None]
        cum = np.concatenate([np.zeros((1, ss.shape[1])), np.cumsum(pieces, axis=0)])
        return _Arrays(xs, ss, slopes, cum, float(end))

    def _covering(self, upto: float) -> _Arrays:
        """The arrays, grown (a callable) to cover ``upto`` samples."""
        arrays = self._arrays
        if arrays is not None and upto < arrays.end:
            return arrays
        with self._lock:
            arrays = self._arrays
            if arrays is None or upto >= arrays.end:
                arrays = self._arrays = self._build(upto)
            return arrays

    def with_overrides(self, overrides) -> "StreamSchedule":
        """This schedule with ``overrides`` (``(position in samples, weight vector)``, in
        order of position) each holding from its position, rounded up to a multiple of
        :data:`BLOCK`, on (see the module docstring)."""
        clone = StreamSchedule.__new__(StreamSchedule)
        clone.__dict__.update(self.__dict__)
        clone._given_x, clone._given = list(self._given_x), list(self._given)
        clone._lock = threading.Lock()
        clone.overrides = tuple((-(-int(at) // BLOCK) * BLOCK,
                                 self.rates(np.asarray(v, dtype=np.float64)))
                                for at, v in overrides)
        clone._arrays = clone._build(0.0)
        return clone

    # -- positions ---------------------------------------------------------------------

    def expected(self, x: np.ndarray) -> np.ndarray:
        """``W(x)``: the expected count of each component in the first ``x`` samples
        (rows: the ``x``, columns: the components)."""
        x = np.asarray(x, dtype=np.float64)
        arrays = self._covering(float(x.max()) if len(x) else 0.0)
        i = np.searchsorted(arrays.x, x, side="right") - 1
        d = (x - arrays.x[i])[:, None]
        return arrays.cum[i] + arrays.rates[i] * d + arrays.slopes[i] * d * d / 2

    def share(self, x: np.ndarray) -> np.ndarray:
        """The scheduled sample rates at ``x`` samples (rows: the ``x``)."""
        x = np.asarray(x, dtype=np.float64)
        arrays = self._covering(float(x.max()) if len(x) else 0.0)
        i = np.searchsorted(arrays.x, x, side="right") - 1
        return arrays.rates[i] + arrays.slopes[i] * (x - arrays.x[i])[:, None]

    def _before(self, blocks: np.ndarray) -> np.ndarray:
        """``A(b)``: positions of each component before each block (int64, (m, K))."""
        return np.floor(self.expected(blocks * float(BLOCK)) + 0.5).astype(np.int64)

    def first_block_from(self, t: int) -> int:
        """The first block whose positions all lie at or past stream position ``t`` (a
        block starts at ``P(b) = sum_k A_k(b)``, within ``K / 2`` of ``b * BLOCK``)."""
        b = -(-int(t) // BLOCK)
        while int(self._before(np.array([b])).sum()) < t:
            b += 1
        return b

    def block_start(self, b: int) -> int:
        """``P(b)``: the stream position where block ``b`` starts."""
        return int(self._before(np.array([b])).sum())

    def locate(self, t: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """``(component, occurrence of that component from the stream's start)`` of each
        stream position ``t`` (int64), the interleave within a block seeded by ``seed``."""
        t = np.asarray(t, dtype=np.int64)
        if len(t) and (int(t.min()) < 0 or int(t.max()) > MAX_POSITION):
            raise ZephonConfigError(f"mixture: stream position {int(t.max())} is past the "
                                    f"last a position-keyed schedule counts exactly "
                                    f"(2**48 = {MAX_POSITION})")
        guess = t // BLOCK  # the block is this one or a neighbour: |P(b) - b * BLOCK| <= K / 2
        blocks = np.unique(np.concatenate([guess - 1, guess, guess + 1, guess + 2]))
        blocks = blocks[blocks >= 0]
        before = self._before(blocks)  # A at every candidate block (a read unit: a few)
        starts = before.sum(axis=1)
        at = np.searchsorted(starts, t, side="right") - 1
        comp = np.empty(len(t), dtype=np.int64)
        occurrence = np.empty(len(t), dtype=np.int64)
        for j in np.unique(at).tolist():
            rows = np.flatnonzero(at == j)
            low, high = before[j], before[j + 1]
            if blocks[j + 1] != blocks[j] + 1 or (high < low).any():
                raise ZephonConfigError(f"mixture: the schedule's counts at block "
                                        f"{int(blocks[j])} do not rise (a rate below what "
                                        f"float64 separates at this position)")
            k, n = self._deal(low, high, int(blocks[j]), seed)
            local = t[rows] - starts[j]
            comp[rows] = k[local]
            occurrence[rows] = low[k[local]] + n[local]
        return comp, occurrence

    @staticmethod
    def _deal(low: np.ndarray, high: np.ndarray, block: int,
              seed: int) -> tuple[np.ndarray, np.ndarray]:
        """The block's positions dealt out: each one's component and its rank among that
        component's positions in the block (so occurrences rise with the position)."""
        counts = high - low
        size = int(counts.sum())
        places = np.arange(size, dtype=np.int64)
        if size > 1:
            places = permute_positions(size, _key(seed, 0x5C, block), places)
        k = np.searchsorted(np.cumsum(counts), places, side="right")
        order = np.argsort(k, kind="stable")  # positions grouped by component, in order
        rank = np.empty(size, dtype=np.int64)
        first = np.concatenate([[0], np.cumsum(np.bincount(k, minlength=len(counts)))])
        rank[order] = np.arange(size) - first[k[order]]
        return k, rank

    def describe(self) -> str:
        what = f"fn every {CALLABLE_EVERY}" if self.fn is not None else \
            f"{self.interpolate} at {np.asarray(self._given_x, dtype=np.int64).tolist()}"
        return f"{self.unit}-keyed schedule ({what})"


def _rate_before(x: list[float], s: list[np.ndarray], linear: bool, at: float) -> np.ndarray:
    """The rates the segment ending at ``at`` reaches there, from the left (``x``, ``s``:
    the breakpoints; an earlier override at ``at`` itself does not count: a second one
    there replaces it, leaving the segment before it as it was)."""
    i = int(np.searchsorted(np.array(x), at, side="left")) - 1
    if i < 0:
        return s[0]
    if not linear or i + 1 >= len(x) or x[i + 1] == x[i]:
        return s[i]
    f = (at - x[i]) / (x[i + 1] - x[i])
    return s[i] + (s[i + 1] - s[i]) * f


def check_unit(unit: str, interpolate: str) -> None:
    if unit not in SCHEDULE_UNITS:
        raise ZephonConfigError(f"mixture: schedule_unit must be one of {SCHEDULE_UNITS}, "
                                f"got {unit!r}")
    if interpolate not in INTERPOLATIONS:
        raise ZephonConfigError(f"mixture: interpolate must be one of {INTERPOLATIONS}, "
                                f"got {interpolate!r}")


def override_vector(names: list[str], weights) -> np.ndarray:
    """A trainer's weights as a vector in the components' order: every component named,
    each weight 0 or a positive finite number, one positive."""
    if not isinstance(weights, Mapping) or set(weights) != set(names):
        got = list(weights) if isinstance(weights, Mapping) else weights
        raise ZephonConfigError(f"set_mixture_weights: the weights must name exactly the "
                                f"components {names}, got {got!r:.200}")
    vector = []
    for name in names:
        w = weights[name]
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)) \
                or not 0 <= float(w) < float("inf"):
            raise ZephonConfigError(f"set_mixture_weights: the weight of {name!r} must be 0 "
                                    f"or a positive finite number, got {w!r:.60}")
        vector.append(float(w))
    if not any(vector):
        raise ZephonConfigError("set_mixture_weights: the weights are all 0; at least one "
                                "must be positive")
    return np.array(vector)
