"""mixture: components sampled at given rates, in O(1) per position.

What it owns
------------
A mixture's weights are **sampling rates**: the expected share of each component
in the output. An epoch of the mixture is ``L`` positions, of which exactly
``c_k`` (the largest-remainder rounding of ``w_k * L``) belong to component
``k``; whatever order the pipeline visits the positions in (its seeded epoch
permutation or source order), every epoch holds each component at its share, and
every stretch of the stream holds it up to sampling noise.

The epoch length comes from the per-component exhaustion policy
(``exhausted``):

- ``"repeat"`` (default): a component that runs out is read again, each new
  pass in a new seeded order, to hold its share; ``max_repeats`` (per
  component or one for all) caps how many passes an epoch may take of it;
- ``"stop"``: the epoch ends when this component has been read once;
- ``"redistribute"``: the component is read at most once per epoch; the share
  it cannot fill goes to the other components in proportion to their weights.

With only ``repeat`` components, the epoch ends when the component that needs
the most positions to be read once (largest ``size / weight``) has been read
once; a ``stop`` component, or a cap, ends it sooner. So a tiny weight makes a
long epoch: one longer than :data:`MAX_EPOCH` (``2**53`` positions, where the
counts stop being exact in float64) is refused when the mixture is built, naming
the weights and the component; one longer than :data:`LONG_EPOCH` (``2**32``: more
samples than a run of 8.8e12 tokens in 2048-token windows reads, so the epoch's end
will in all likelihood never come) is a ``UserWarning``. A sample's place in its
component's run of occurrences is an int64 below ``(epoch + 1) * L``: an epoch of ``L``
positions holds epochs ``0`` to ``(2**63 - 1) // L - 1`` (1023 at ``L`` near 2**53,
about 2**31 at 2**32), and reading a later one is a ZephonConfigError naming that range
(never a wrapped, negative number). Weights are ratios: only their proportions count,
also where their sum is past what a float64 holds (``1e308`` each is equal weights).
Components are never cut
short across epochs: a component read only in part in one epoch continues where
it stopped in the next (its occurrence count runs on, ``J = epoch * c_k + j``),
so every sample is read before any is read again.

Weights by tokens (``by="tokens"``): the weights are shares of tokens; each
component's sample rate is its token weight over its mean tokens per sample,
given (``tokens_per_sample``), known to the source (with the default
``token_count``: :meth:`~zephon.pipeline.sources.base.Source.known_tokens_per_sample`,
``token_windows``' ``seq_len``), or measured on a seeded sample of up to
:data:`TOKEN_PROBE` samples per component (``token_count``, default: the length
of the ``"tokens"`` field; ``tokens_per_sample="count"``: every sample counted once, when
the mixture is built): exact when the probe is the whole component, else an
estimate, and then a ``UserWarning`` names the probe's size, each estimated mean
with its standard error and the standard error this gives each token share (from
the probe's spread: lengths rarer than about 1 in :data:`TOKEN_PROBE` samples are
likely missed by the probe, and not in it). Weights over ``tokens_per_sample`` whose
ratio gives a component a sample rate of 0 next to the others in float64 (a ratio past
1e308: an epoch past :data:`MAX_EPOCH`) are a ZephonConfigError naming both, like a
ratio of weights that makes an epoch too long.

Component names are non-empty strings, and the names a mixture's samples carry (its
components', a nested mixture's replaced by its own: :meth:`MixtureSource.record_names`)
are distinct, and none is another's repeat name ``"<name>#<r>"`` (``r >= 1`` without a
leading 0): either would give two samples one identity (one ``ctx.rng``, one id, one
component for ``ensure_mixture``); both are refused when the mixture is built, naming
the name and the components that carry it.

Weights that change over training (a *schedule*)
------------------------------------------------
The unit of a schedule is the epoch: every epoch holds exact counts, so ``weights``
may also be a list of steps ``[(first_epoch, {name: w}), ...]`` (the first at epoch
0, each in force until the next) or a callable ``epoch -> {name: w}`` (a pure
function of the epoch; module level, or a picklable object, for process workers).
In a schedule a weight may be 0 (the component is off in that epoch), at least one
is positive. What defines the stream is the schedule itself: the steps, or the
callable by its identity (:func:`~zephon.pipeline.fingerprint.fn_identity`), are
part of :meth:`MixtureSource.describe` and hence of the pipeline's fingerprint, so a
checkpoint restores only under the same schedule, and resumes exactly (a position
of an epoch is computed from the epoch and the schedule alone: there is no other
state to checkpoint).

The pipeline's epoch length is one number for a run (lanes, positions and
checkpoints are defined over it), so under a schedule the epoch length ``L`` is
the one epoch 0's weights give (exactly as for fixed weights, so a one-step
schedule is the fixed-weight mixture, stream for stream), and every other epoch
*fits* its weights to ``L``: the largest-remainder rounding of ``rate_k * L``,
where a component that its share would read more often than its policy allows
(``redistribute``: once per epoch; ``max_repeats``: that many passes) is held at
that limit and its excess goes to the others in proportion to their rates.
``stop`` ends an epoch early, which a fixed length cannot do: it is refused in a
schedule (``redistribute`` reads a component at most once per epoch). A
component's occurrences still run on across epochs, ``J = sum of its counts in
the earlier epochs + j``: closed form over the steps of a list; a callable is
called once per epoch (cached per process) to sum them.

Weights keyed by the position in the stream (``schedule_unit="samples"`` or
``"tokens"``: a run shorter than an epoch, weights a trainer sets) are
:mod:`zephon.pipeline.sources.stream_schedule`'s: there an epoch is every
component's size once (``sum of sizes`` positions), every component repeats, and the
mixture orders itself.

Where a position lands (:class:`~zephon.options.MixtureReadConfig` ``mode``):

- ``weighted_random``: a seeded bijection of ``[0, L)`` per epoch takes
  position ``p`` to a place in the concatenation of the components' counts, so
  the interleave is random with exact counts;
- ``weighted_round_robin``: the smooth deterministic schedule in which
  component ``k`` has had ``floor((x * c_k + L // 2) / L)`` of the first
  ``P(x)`` positions; a position is found by a binary search over ``x``
  (``O(K log L)`` per position: prefer ``weighted_random`` for hundreds of
  components).

Every quantity is computed per position, vectorised over the positions of a read
unit (:meth:`MixtureSource.view`): nothing of size ``L`` is built, at start-up or
in a worker, and the source pickles as its components, weights and counts.

The component-local index of occurrence ``J`` is pass ``J // size`` at place
``J % size``: the first pass in the component's own order
(``within_component="as_is"``) or a seeded order (``"shuffle"``), every later
pass in a seeded order of its own. A sample read a second time within one epoch
is named ``"<component>#<r>"`` (``r``: the repeat within the epoch), so that its
identity, and hence its ``ctx.rng``, differ from the first read's.
"""

from __future__ import annotations

import bisect
import copy
import math
import threading
import warnings
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.kernels import order_key as _key
from zephon.kernels import permute_positions
from zephon.options._spec import check_positive
from zephon.pipeline.fingerprint import fn_identity
from zephon.pipeline.shares import weight_shares
from zephon.pipeline.sources.base import Source
from zephon.pipeline.sources.stream_schedule import BLOCK, StreamSchedule, check_unit

__all__ = ["EXHAUSTION_POLICIES", "LONG_EPOCH", "MAX_EPOCH", "TOKEN_PROBE", "MixtureSource",
           "WeightSchedule"]

EXHAUSTION_POLICIES = ("repeat", "stop", "redistribute")
#: samples per component read at construction to estimate tokens per sample
TOKEN_PROBE = 64
#: the longest epoch: its counts are exact in float64 and ``epoch * c_k`` stays in int64
#: for 1024 epochs (epochs 0 to 1023; a later one is refused when read); weights that need
#: more are refused
MAX_EPOCH = 2 ** 53
#: a longer epoch is a warning: more samples than a run of 8.8e12 tokens in windows of
#: 2048 reads, so its end (and its exact counts) will in all likelihood never be reached
LONG_EPOCH = 2 ** 32
#: products ``x * c_k`` stay exact in int64 below this epoch length
_EXACT_L = 3_037_000_499
_INT64_MAX = 2 ** 63 - 1

#: what ``weights=`` accepts: fixed weights, steps ``(first_epoch, weights)``, or a callable
Weights = Union[Mapping[str, float], Sequence[tuple[int, Mapping[str, float]]],
                Callable[[int], Mapping[str, float]], None]


def permute(n: int, key: int, positions: np.ndarray) -> np.ndarray:
    """The seeded bijection of ``[0, n)`` (the index-shuffle kernel) at ``positions``."""
    positions = np.asarray(positions, dtype=np.int64)
    if n <= 1:
        return np.zeros(len(positions), dtype=np.int64)
    return permute_positions(int(n), key, positions)


class WeightSchedule:
    """The weights of every epoch (see the module docstring): fixed, a list of steps
    ``(first_epoch, {name: w})``, or a callable ``epoch -> {name: w}``.

    ``at(epoch)`` is the weight vector (in the components' order) of one epoch;
    ``spans(epoch)`` covers the epochs before ``epoch`` as ``(epochs, vector)`` runs of
    equal weights: one run per step of a list, one per epoch of a callable."""

    def __init__(self, names: list[str], weights: Weights, unit: str = "epoch") -> None:
        self.names, self.unit = names, unit
        #: the component a name that samples of a nested mixture carry belongs to
        #: (``{inner name: name}``, set by the mixture; what ``ensure_mixture`` counts)
        self.aliases: dict[str, str] = {}
        self.fn: Callable[[int], Mapping[str, float]] | None = None
        self.firsts: list[int] = [0]
        if weights is None:
            self.vectors = [np.ones(len(names))]
        elif isinstance(weights, Mapping):
            self.vectors = [self._vector(weights, "weight", positive=True)]
        elif callable(weights):
            self.fn, self.vectors = weights, []
        elif isinstance(weights, (list, tuple)):
            self.firsts, self.vectors = self._steps(weights)
        else:
            raise ZephonConfigError(f"mixture: weights must be a mapping, a list of "
                                    f"(first_epoch, weights) steps or a callable of the "
                                    f"epoch, got {type(weights).__name__}")

    @property
    def fixed(self) -> bool:
        """True for one weight vector for every epoch."""
        return self.fn is None and len(self.vectors) == 1

    def at(self, epoch: int) -> np.ndarray:
        if self.fn is not None:
            return self._vector(self.fn(epoch), f"weight ({self.unit} {epoch})", positive=False)
        return self.vectors[bisect.bisect_right(self.firsts, epoch) - 1]

    def spans(self, epoch: int):
        """``(epochs, vector)`` runs covering the epochs ``[0, epoch)`` in order."""
        if self.fn is not None:
            yield from ((1, self.at(e)) for e in range(epoch))
            return
        ends = [*self.firsts[1:], max(epoch, self.firsts[-1])]
        for first, end, vector in zip(self.firsts, ends, self.vectors, strict=True):
            if first >= epoch:
                return
            yield min(end, epoch) - first, vector

    def describe(self) -> str:
        if self.fn is not None:
            return f"schedule {fn_identity(self.fn)}"
        steps = [f"{first}: {v.tolist()}"
                 for first, v in zip(self.firsts, self.vectors, strict=True)]
        return "schedule {" + ", ".join(steps) + "}"

    def _steps(self, steps) -> tuple[list[int], list[np.ndarray]]:
        firsts: list[int] = []
        vectors: list[np.ndarray] = []
        for step in steps:
            if not (isinstance(step, (list, tuple)) and len(step) == 2
                    and isinstance(step[1], Mapping)):
                raise ZephonConfigError(f"mixture: a weight step is (first_{self.unit}, "
                                        f"{{name: weight}}), got {step!r}")
            first = step[0]
            if isinstance(first, bool) or not isinstance(first, (int, np.integer)) or \
                    first < (firsts[-1] + 1 if firsts else 0):
                raise ZephonConfigError(f"mixture: weight steps need increasing integer "
                                        f"first {self.unit}s >= 0, got {first!r} after "
                                        f"{firsts[-1] if firsts else None!r}")
            firsts.append(int(first))
            vectors.append(self._vector(step[1], f"weight (from {self.unit} {first})",
                                        positive=False))
        if not firsts or firsts[0] != 0:
            raise ZephonConfigError(f"mixture: the first weight step must start at "
                                    f"{self.unit} 0, got {firsts[:1]}")
        return firsts, vectors

    def _vector(self, weights, what: str, *, positive: bool) -> np.ndarray:
        if not isinstance(weights, Mapping) or set(weights) != set(self.names):
            got = list(weights) if isinstance(weights, Mapping) else weights
            raise ZephonConfigError(f"mixture: {what}s must name exactly the components "
                                    f"{self.names}, got {got!r}")
        check = _positive if positive else _non_negative
        vector = np.array([check(weights[k], f"{what} of {k!r}") for k in self.names])
        if not vector.any():
            raise ZephonConfigError(f"mixture: {what}s are all 0; at least one must be "
                                    f"positive")
        return vector


class MixtureSource(Source):
    """Components sampled at their weights (see the module docstring)."""

    def __init__(self, components: Mapping[str, Source], weights: Weights,
                 config, name: str, *, exhausted: str | Mapping[str, str] = "repeat",
                 max_repeats: float | Mapping[str, float] | None = None,
                 by: str = "samples", tokens_per_sample: Mapping[str, float] | str | None = None,
                 token_count: Callable[[Any], int] | None = None,
                 schedule_unit: str = "epochs", interpolate: str = "step") -> None:
        from zephon.options import MixtureReadConfig

        check_unit(schedule_unit, interpolate)
        self.schedule_unit, self.interpolate = schedule_unit, interpolate
        self._take_components(components)
        self._take_weights(weights, exhausted, max_repeats)
        if by not in ("samples", "tokens"):
            raise ZephonConfigError(f"mixture: by must be 'samples' or 'tokens', got {by!r}")
        self.by, self.token_count = by, token_count
        unit_tokens = self._tokens(tokens_per_sample) \
            if by == "tokens" or schedule_unit == "tokens" else None
        #: tokens per sample of each component: what by="tokens" weighs (None: by samples)
        self.tokens_per_sample = unit_tokens if by == "tokens" else None
        #: ... and what places a token-keyed schedule's steps (None: not token-keyed)
        self.unit_tokens = unit_tokens if schedule_unit == "tokens" else None
        self.shuffle_passes = False  # set by ordered(): the pipeline's shuffle flag
        self.own_config = config is not None  # else RuntimeOptions.mixture_config applies
        self.config, self.name = config or MixtureReadConfig(), name
        what = self._count_epoch()
        if self.length > LONG_EPOCH and schedule_unit == "epochs":
            warnings.warn(f"mixture {name!r}: {what} make an epoch of {self.length} positions, "
                          f"more than {LONG_EPOCH} (2**32): its end, where each component's "
                          f"count is exact, will in all likelihood never be reached; raise "
                          f"the smallest weights, or end the epoch sooner with "
                          f"exhausted='stop' or max_repeats=", UserWarning, stacklevel=3)
        self.cum = _cumulative(self.counts)
        self._epochs: dict = {}  # epoch -> (counts, cum, occurrences before it)
        self._lock = threading.Lock()
        self.stream = self._stream() if schedule_unit != "epochs" else None
        if self.stream is None and not self.schedule.fixed and self.schedule.fn is None:
            for vector in self.schedule.vectors:  # every step fits the epoch, or fails now
                self._fit(vector)

    def _take_components(self, components: Mapping[str, Source]) -> None:
        """The components and their names, checked: at least one, named by non-empty
        strings, their record names distinct."""
        if not components:
            raise ZephonConfigError("mixture: at least one component is needed")
        self.names = list(components)
        bad = [n for n in self.names if not isinstance(n, str) or not n]
        if bad:
            raise ZephonConfigError(f"mixture: component names must be non-empty strings "
                                    f"(a sample's identity and what ensure_mixture counts), "
                                    f"got {bad[0]!r}")
        self.components = [components[k] for k in self.names]
        nested = [n for n, c in zip(self.names, self.components, strict=True)
                  if isinstance(c, MixtureSource) and c.stream is not None]
        if nested:
            raise ZephonConfigError(f"mixture: component {nested[0]!r} is a mixture with a "
                                    f"position-keyed schedule: its positions are the stream's, "
                                    f"which a mixture around it would not keep; flatten it "
                                    f"into one mixture")
        _check_record_names(self.names, self.components)

    def _take_weights(self, weights: Weights, exhausted, max_repeats) -> None:
        """The weight schedule (with the names a nested mixture's records go by), epoch 0's
        weights and each component's exhaustion policy and repeat bound."""
        self.schedule = WeightSchedule(self.names, weights, self.schedule_unit.rstrip("s"))
        self.schedule.aliases = {inner: n for n, c in zip(self.names, self.components,
                                                            strict=True)
                                 if isinstance(c, MixtureSource) for inner in c.record_names()}
        self.weights = self.schedule.at(0)
        self.policies = _per_component(self.names, exhausted, "exhausted", _policy)
        if self.schedule_unit != "epochs" and (set(self.policies) != {"repeat"}
                                               or max_repeats is not None):
            raise ZephonConfigError(
                f"mixture: a {self.schedule_unit}-keyed schedule reads every component as "
                f"often as its share asks (exhausted='repeat', no max_repeats): it has no "
                f"epoch for a component to end or be capped in; got exhausted={exhausted!r}, "
                f"max_repeats={max_repeats!r}")
        if not self.schedule.fixed and "stop" in self.policies:
            raise ZephonConfigError("mixture: exhausted='stop' ends an epoch early, which a "
                                    "weight schedule cannot (its epochs have one length); "
                                    "use 'redistribute' (read at most once per epoch)")
        self.max_repeats = np.array(_per_component(self.names, max_repeats, "max_repeats",
                                                   _repeats))

    def _count_epoch(self) -> str:
        """Epoch 0's length and per-component counts (every component must hold a
        sample); returns the words naming what set them, for messages."""
        self.sizes = np.array([len(c) for c in self.components], dtype=np.int64)
        if np.any(self.sizes == 0):
            empty = [n for n, s in zip(self.names, self.sizes.tolist(), strict=True) if not s]
            raise ZephonConfigError(f"mixture: component(s) {empty} have no samples")
        what = f"the weights {dict(zip(self.names, self.weights.tolist(), strict=True))}"
        if self.schedule_unit != "epochs":  # an epoch: every component's size once
            self.counts, self.length = self.sizes.copy(), int(self.sizes.sum())
            return what
        if self.tokens_per_sample is not None:
            what += f" with tokens_per_sample {self._tokens_named()}"
        self.counts = epoch_counts(self.sizes, self.rates(), self.policies, self.max_repeats,
                                   self.names, what)
        self.length = int(self.counts.sum())
        return what

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_epochs"], state["_lock"] = {}, None  # rebuilt where the source is read
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _stream(self) -> StreamSchedule:
        """The position-keyed schedule (see :mod:`~zephon.pipeline.sources.stream_schedule`)."""
        sched = self.schedule
        if len(self.names) > BLOCK:
            raise ZephonConfigError(f"mixture: a {self.schedule_unit}-keyed schedule holds at "
                                    f"most {BLOCK} components (a block of {BLOCK} positions "
                                    f"gives each its count), got {len(self.names)}")
        if any(isinstance(c, MixtureSource) for c in self.components):
            raise ZephonConfigError(f"mixture: a {self.schedule_unit}-keyed schedule reads its "
                                    f"components at stream positions; a nested mixture has "
                                    f"positions of its own: flatten it into this mixture")
        if sched.fn is not None:  # (a bound method: it pickles with the callable)
            return StreamSchedule(self.schedule_unit, self.interpolate, None, None, sched.at,
                                  self.rates, self.unit_tokens)
        return StreamSchedule(self.schedule_unit, self.interpolate, sched.firsts,
                              sched.vectors, None, self.rates, self.unit_tokens)

    def with_weight_overrides(self, overrides) -> "MixtureSource":
        """This mixture with weights a trainer set (``(position, weight vector)`` in order,
        see :meth:`StreamSchedule.with_overrides`); it describes itself as before (the
        overrides are run state, not the pipeline's definition)."""
        if self.stream is None:
            raise ZephonConfigError(
                f"set_mixture_weights: mixture {self.name!r} keys its weights by the epoch; "
                f"weights a trainer sets need a position-keyed schedule: build it with "
                f"schedule_unit='samples' (or 'tokens')")
        clone = copy.copy(self)
        clone.stream = self.stream.with_overrides(overrides)
        return clone

    def orders_itself(self) -> bool:
        """True for a position-keyed schedule: the pipeline reads it in its own order."""
        return self.stream is not None

    def ordered(self, shuffle: bool) -> "MixtureSource":
        """This mixture as a pipeline with ``shuffle`` reads it (a position-keyed
        schedule: in its own order, each component's passes shuffled with ``shuffle``)."""
        if self.stream is None or shuffle == self.shuffle_passes:
            return self
        clone = copy.copy(self)
        clone.shuffle_passes = shuffle
        return clone

    # -- what the epoch holds -------------------------------------------------------------

    def rates(self, weights: np.ndarray | None = None) -> np.ndarray:
        """Each component's share of the output's samples (sums to 1) under ``weights``
        (default: epoch 0's)."""
        weights = self.weights if weights is None else weights
        w = weight_shares(weights)
        if self.tokens_per_sample is not None:
            tokens = self.tokens_per_sample
            with np.errstate(over="ignore", under="ignore"):
                rate = w / tokens
                if not np.isfinite(rate).all():  # a subnormal tokens_per_sample
                    rate = w / (tokens / tokens.min())
            w = weight_shares(rate)
            lost = (weights > 0) & ~(w > 0)
            if lost.any():
                raise ZephonConfigError(
                    f"mixture: the weights {dict(zip(self.names, weights.tolist(), strict=True))}"
                    f" with tokens_per_sample {self._tokens_named()} give component(s) "
                    f"{[n for n, x in zip(self.names, lost, strict=True) if x]} a sample rate "
                    f"below what a float64 holds next to the others (a ratio past 1e308): an "
                    f"epoch reading them would be longer than the 2**53 positions it may hold. "
                    f"Check tokens_per_sample (each component's mean tokens per sample), or "
                    f"raise those weights")
        return w

    def _tokens_named(self) -> dict:
        assert self.tokens_per_sample is not None
        return dict(zip(self.names, self.tokens_per_sample.tolist(), strict=True))

    def _tokens(self, given: Mapping[str, float] | str | None) -> np.ndarray:
        if isinstance(given, str):
            if given != "count":
                raise ZephonConfigError(f"mixture: tokens_per_sample must be a mapping, "
                                        f"'count' or None, got {given!r}")
            count = self.token_count or _token_field_length
            return np.array([self._counted(comp, count) for comp in self.components])
        if given is not None:
            if set(given) != set(self.names):
                raise ZephonConfigError(f"mixture: tokens_per_sample must name exactly the "
                                        f"components {self.names}, got {list(given)}")
            return np.array([_positive(given[k], f"tokens_per_sample of {k!r}")
                             for k in self.names])
        count = self.token_count or _token_field_length
        probes = [self._probe(k, comp, count) for k, comp in enumerate(self.components)]
        means = np.array([mean for mean, _ in probes])
        errors = [error for _, error in probes]
        if any(e is not None for e in errors):
            self._note_probe(means, errors)
        return means

    def _counted(self, comp: Source, count) -> float:
        """Mean tokens per sample of ``comp`` over every sample (``tokens_per_sample=
        "count"``): known to the source (with the default ``token_count``), else
        counted, every sample read once."""
        known = comp.known_tokens_per_sample() if self.token_count is None else None
        if known is not None:
            return max(1.0, float(known))
        total = sum(count(comp.get(i)) for i in range(len(comp)))
        return max(1.0, total / len(comp))

    def _probe(self, k: int, comp: Source, count) -> tuple[float, float | None]:
        """``(mean tokens per sample, its standard error)`` of component ``k``: exact
        (error None) where the source knows it (:meth:`Source.known_tokens_per_sample`,
        with the default ``token_count``) or the probe reads the whole component; else
        measured on a seeded probe of :data:`TOKEN_PROBE` samples, the error from the
        probe's spread (sampling without replacement)."""
        known = comp.known_tokens_per_sample() if self.token_count is None else None
        if known is not None:
            return max(1.0, float(known)), None
        n = len(comp)
        probe = permute(n, _key(0x70, k), np.arange(min(n, TOKEN_PROBE)))
        lengths = np.array([count(comp.get(int(i))) for i in probe.tolist()], dtype=np.float64)
        if not len(lengths):
            return 1.0, None
        mean = max(1.0, float(lengths.mean()))
        if len(lengths) == n:
            return mean, None
        m = len(lengths)
        error = float(lengths.std(ddof=1)) / math.sqrt(m) * math.sqrt((n - m) / (n - 1))
        return mean, error

    def _note_probe(self, means: np.ndarray, errors: list[float | None]) -> None:
        """Warn that token shares rest on a probe: the probe's size, each estimated mean
        with its standard error, and the standard error this gives each token share
        (first order: a share ``t_k`` moves by ``t_k (d_k - sum_j t_j d_j)`` for relative
        errors ``d`` of the means)."""
        rel = np.array([0.0 if e is None else e / m for e, m in zip(errors, means, strict=True)])
        t = weight_shares(self.weights)
        spread = float(np.sum((t * rel) ** 2))
        sd = t * np.sqrt(np.maximum(spread - (t * rel) ** 2 + ((1 - t) * rel) ** 2, 0.0))
        tokens = ", ".join(f"{n!r}: {m:.4g}" + (" (exact)" if e is None else f" ± {e:.2g}")
                           for n, m, e in zip(self.names, means.tolist(), errors, strict=True))
        shares = ", ".join(f"{n!r} {a:.3f} ± {b:.3f}"
                           for n, a, b in zip(self.names, t.tolist(), sd.tolist(), strict=True))
        warnings.warn(
            f"mixture(by='tokens'): tokens per sample estimated from a probe of {TOKEN_PROBE} "
            f"samples per component, ± one standard error from the probe's spread (lengths "
            f"rarer than about 1 in {TOKEN_PROBE} samples are likely missed, and not in it): "
            f"{tokens}; the token share of {shares}; give tokens_per_sample= (each "
            f"component's mean tokens per sample, or 'count': every sample counted once) "
            f"for exact shares", UserWarning, stacklevel=5)

    # -- what each epoch of a schedule holds ----------------------------------------------

    def epoch_plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(counts, cumulative counts, occurrences before)`` of ``epoch``: positions per
        component, their running sum from 0, and each component's positions in the
        epochs before (where its occurrences continue)."""
        if (int(epoch) + 1) * self.length > _INT64_MAX:
            last = _INT64_MAX // self.length - 1
            raise ZephonConfigError(
                f"mixture {self.name!r}: epoch {epoch} of {self.length} positions numbers its "
                f"samples past 2**63 (int64): an epoch this long holds epochs 0 to {last} "
                f"only; raise the smallest weights, or end the epoch sooner with "
                f"exhausted='stop' or max_repeats=")
        if self.schedule.fixed:
            return self.counts, self.cum, epoch * self.counts
        with self._lock:
            plan = self._epochs.get(epoch)
            if plan is None:
                counts = self._fit(self.schedule.at(epoch))
                before = np.zeros(len(self.names), dtype=np.int64)
                for epochs, vector in self.schedule.spans(epoch):
                    before += epochs * self._fit(vector)
                plan = self._epochs[epoch] = (counts, _cumulative(counts), before)
            return plan

    def _fit(self, weights: np.ndarray) -> np.ndarray:
        """The counts of an epoch under ``weights``: epoch 0's weights give the mixture's
        own counts, others are fitted to its length (see the module docstring)."""
        if np.array_equal(weights, self.weights):
            return self.counts
        key = ("fit", weights.tobytes())
        counts = self._epochs.get(key)
        if counts is None:
            limits = np.where([p == "redistribute" for p in self.policies], self.sizes,
                              np.floor(self.max_repeats * self.sizes))
            counts = self._epochs[key] = fitted_counts(
                self.length, self.rates(weights), limits,
                f"the weights {dict(zip(self.names, weights.tolist(), strict=True))}")
        return counts

    def record_names(self) -> list[str]:
        """The component names this mixture's samples carry in their identity (without a
        repeat's ``"#<r>"``): its components' names, a nested mixture's replaced by the
        names that mixture's samples carry."""
        names: list[str] = []
        for n, c in zip(self.names, self.components, strict=True):
            names.extend(c.record_names() if isinstance(c, MixtureSource) else [n])
        return names

    # -- the Source contract --------------------------------------------------------------

    def configured(self, opts) -> "Source":
        components = {n: c.configured(opts) for n, c in zip(self.names, self.components,
                                                             strict=True)}
        changed = any(a is not b for a, b in zip(components.values(), self.components,
                                                 strict=True))
        if self.own_config or opts.mixture_config is None or \
                opts.mixture_config == self.config:
            if not changed:
                return self
            clone = copy.copy(self)
            clone.components = list(components.values())
            return clone
        clone = copy.copy(self)
        clone.components, clone.config = list(components.values()), opts.mixture_config
        return clone

    def __len__(self) -> int:
        return self.length

    def view(self, indices: np.ndarray, epoch: int) -> "_MixtureView":
        return _MixtureView(self, np.asarray(indices, dtype=np.int64), epoch)

    def get(self, i: int) -> Any:
        return self.view(np.array([i]), 0).get(0)

    def identity(self, i: int) -> tuple[str, int]:
        return self.view(np.array([i]), 0).identity(0)

    def stamps(self, now: bool = False) -> list[tuple[str, int, str]] | None:
        """The components' files, each name prefixed with its component's (None when no
        component has files), see :meth:`Source.stamps`."""
        out: list[tuple[str, int, str]] = []
        any_files = False
        for name, comp in zip(self.names, self.components, strict=True):
            found = comp.stamps(now)
            if found is not None:
                any_files = True
                out.extend((f"{name}/{f}", size, stamp) for f, size, stamp in found)
        return out if any_files else None

    def describe(self) -> str:
        parts = ", ".join(
            f"{n}: {c.describe()} x{w:g} ({p}"
            + (f", max_repeats={m:g}" if math.isfinite(m) else "") + f"; {c_k}/epoch)"
            for n, c, w, p, m, c_k in zip(self.names, self.components, self.weights,
                                          self.policies, self.max_repeats,
                                          self.counts.tolist(), strict=True))
        tokens = self.tokens_per_sample
        by = "" if tokens is None else f"; by tokens {np.round(tokens, 3).tolist()}"
        schedule = "" if self.schedule.fixed else f"; {self.schedule.describe()}"
        if self.stream is not None:
            schedule += f"; {self.stream.describe()}" + (
                "; passes shuffled" if self.shuffle_passes else "")
        return f"MixtureSource({parts}; {self.config.to_dict()}{by}{schedule})"

    # -- positions -> (component, occurrence) ---------------------------------------------

    def locate(self, positions: np.ndarray, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(component, occurrence within the epoch)`` of each position of ``epoch``
        (a position-keyed schedule: the occurrence from the stream's start)."""
        if self.stream is not None:
            return self.stream.locate(epoch * self.length + positions, self.config.seed)
        counts, cum, _ = self.epoch_plan(epoch)
        if self.config.mode == "weighted_random":
            place = permute(self.length, _key(self.config.seed, 0x3D, epoch), positions)
            comp = np.searchsorted(cum, place, side="right") - 1
            return comp, place - cum[comp]
        return _round_robin(counts, self.length, positions)

    def local(self, comp: np.ndarray, occurrence: np.ndarray,
              epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(component index, pass, repeat within the epoch)`` of each occurrence (a
        position-keyed schedule: the repeat is the pass, from the stream's start)."""
        sizes = self.sizes[comp]
        if self.stream is not None:
            run = occurrence
            first_pass = np.zeros(len(comp), dtype=np.int64)
        else:
            before = self.epoch_plan(epoch)[2][comp]
            run = before + occurrence  # occurrences run on across epochs
            first_pass = before // sizes
        passes, place = run // sizes, run % sizes
        index = place.copy()
        shuffled = passes > 0 if self.config.within_component == "as_is" and \
            not self.shuffle_passes else np.ones(len(place), dtype=bool)
        if shuffled.any():  # each (component, pass) in a seeded order of its own
            where = np.flatnonzero(shuffled)
            pairs, inverse = np.unique(np.stack([comp[where], passes[where]], axis=1),
                                       axis=0, return_inverse=True)
            inverse = inverse.reshape(-1)
            for g, (k, p) in enumerate(pairs.tolist()):
                members = where[inverse == g]
                index[members] = permute(int(self.sizes[k]),
                                         _key(self.config.seed, 0x51, k, p), place[members])
        return index, passes, passes - first_pass


class _MixtureView:
    """The samples of one read unit: their components and indices, computed at once."""

    __slots__ = ("comp", "index", "mix", "nested", "passes", "repeat")

    def __init__(self, mix: MixtureSource, positions: np.ndarray, epoch: int) -> None:
        if len(positions) and (positions.min() < 0 or positions.max() >= mix.length):
            raise IndexError(f"mixture {mix.name!r}: position out of range [0, {mix.length})")
        self.mix = mix
        self.comp, occurrence = mix.locate(positions, epoch)
        self.index, self.passes, self.repeat = mix.local(self.comp, occurrence, epoch)
        self.nested = self._nest() if any(isinstance(c, MixtureSource)
                                          for c in mix.components) else None
        # per-sample reads index Python lists: a NumPy scalar per field costs more
        self.comp, self.index = self.comp.tolist(), self.index.tolist()
        self.repeat = self.repeat.tolist()

    def identity(self, n: int) -> tuple[str, int]:
        if self.nested is not None and n in self.nested:  # names its own components
            view, m = self.nested[n]
            return view.identity(m)
        k, r = self.comp[n], self.repeat[n]
        return (self.mix.names[k] if r == 0 else f"{self.mix.names[k]}#{r}"), self.index[n]

    def get(self, n: int) -> Any:
        if self.nested is not None and n in self.nested:
            view, m = self.nested[n]
            return view.get(m)
        return self.mix.components[self.comp[n]].get(self.index[n])

    def _nest(self) -> dict | None:
        """``n -> (view, place in it)`` for the samples of nested mixtures: one view per
        nested component and pass the unit touches."""
        nested: dict = {}
        for k, component in enumerate(self.mix.components):
            if not isinstance(component, MixtureSource):
                continue
            members = np.flatnonzero(self.comp == k)
            for p in np.unique(self.passes[members]).tolist():
                group = members[self.passes[members] == p]
                view = component.view(self.index[group], int(p))
                nested.update({int(n): (view, m) for m, n in enumerate(group.tolist())})
        return nested or None


def epoch_counts(sizes: np.ndarray, rates: np.ndarray, policies: list[str],
                 max_repeats, names: Sequence[str] | None = None,
                 what: str = "the weights") -> np.ndarray:
    """Positions per epoch of each component (see the module docstring): integers
    summing to the epoch length, at most :data:`MAX_EPOCH` (else a ZephonConfigError
    naming ``what`` and the component that makes the epoch that long).

    A ``redistribute`` component that its rate would read more than once is
    *saturated*: it takes exactly its size, and the other components share the rest of
    the epoch in proportion to their rates. The epoch's other part ``L'`` is the
    tightest bound among the unsaturated components (``stop``: one pass; a
    ``max_repeats`` cap: that many passes), or with no bound the positions that read
    each of them at least once."""
    sizes = sizes.astype(np.float64)
    caps = np.array([1.0 if p == "stop" else float(m)
                     for p, m in zip(policies, max_repeats, strict=True)])
    spread = np.array([p == "redistribute" for p in policies])
    saturated = np.zeros(len(sizes), dtype=bool)
    once, live = np.zeros(len(sizes)), np.zeros(len(sizes), dtype=bool)
    for _ in range(len(sizes) + 1):  # each round saturates one more component, or ends
        live = ~saturated & (rates > 0)  # a 0 weight (a schedule's) takes no position
        if not live.any():
            rest, rho = 0.0, np.zeros(len(sizes))
            break
        rho = np.where(live, rates, 0.0) / rates[live].sum()
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            once = np.where(live, sizes / rho, 0.0)
            bound = np.where(live & np.isfinite(caps) & ~spread, caps * once, np.inf)
        rest = float(bound.min()) if np.isfinite(bound).any() else float(once.max())
        over = live & spread & (rho * rest > sizes * (1 + 1e-12))
        if not over.any():
            break
        saturated |= over
    with np.errstate(invalid="ignore", over="ignore"):
        quota = np.where(saturated, sizes, rho * rest)
        length = float(quota.sum())
    if not length <= MAX_EPOCH:  # also inf and nan: a weight ratio past what a float holds
        driver = int(np.argmax(np.where(live, once, -1.0)))
        _too_long(length, driver, sizes, rho, list(names or range(len(sizes))), what)
    total = max(1, round(length))
    counts = np.floor(quota * total / max(quota.sum(), 1e-300)).astype(np.int64)
    frac = np.where(saturated, -1.0, quota * total / max(quota.sum(), 1e-300) - counts)
    short = total - int(counts.sum())
    if short > 0:
        counts[np.argsort(-frac, kind="stable")[:short]] += 1
    limit = np.where(saturated, sizes, np.where(np.isfinite(caps) & ~spread,
                                               np.floor(caps * sizes), np.inf))
    counts = np.minimum(counts, limit).astype(np.int64)
    if counts.sum() == 0:
        counts[int(np.argmax(rates))] = 1
    return counts


def _too_long(length: float, k: int, sizes: np.ndarray, rho: np.ndarray, names: list,
              what: str) -> None:
    """Refuse an epoch longer than :data:`MAX_EPOCH`, naming the component whose share
    makes it that long and the ways out."""
    size = (f"about {length:.3g} positions" if math.isfinite(length)
            else "more positions than a float64 counts")
    raise ZephonConfigError(
        f"mixture: {what} make an epoch of {size}: component {names[k]!r} "
        f"({int(sizes[k])} samples at a share of {float(rho[k]):.3g}) takes that many to be "
        f"read once, more than the 2**53 an epoch may hold. Raise its weight, or end the "
        f"epoch sooner with exhausted='stop' or max_repeats= on the other components "
        f"(a component whose share then rounds to 0 positions is not read)")


def fitted_counts(length: int, rates: np.ndarray, limits: np.ndarray, what: str) -> np.ndarray:
    """``length`` positions shared by ``rates`` (largest-remainder rounding), a component
    held at its limit (positions per epoch its policy allows) when its share exceeds it,
    the excess going to the others in proportion to their rates."""
    held = np.zeros(len(rates), dtype=bool)
    free, room, share = held, float(length), np.zeros(len(rates))
    for _ in range(len(rates) + 1):  # each round holds one more component, or ends
        free = ~held & (rates > 0)
        room = float(length - limits[held].sum())
        if not free.any() or room < 0:
            break
        share = np.where(free, rates, 0.0) * (room / rates[free].sum())
        over = free & (share > limits)
        if not over.any():
            break
        held |= over
    if room < 0 or (room > 0 and not free.any()):
        raise ZephonConfigError(f"mixture: {what} cannot fill an epoch of {length} "
                                f"positions: the components their policies allow hold "
                                f"{int(limits[rates > 0].sum())} at most")
    counts = np.where(held, limits, 0).astype(np.int64)
    counts[free] = _largest_remainder(share[free], round(room))
    return counts


def _largest_remainder(quota: np.ndarray, total: int) -> np.ndarray:
    counts = np.floor(quota).astype(np.int64)
    short = total - int(counts.sum())
    if short > 0:
        counts[np.argsort(-(quota - counts), kind="stable")[:short]] += 1
    return counts


def _cumulative(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

def _round_robin(counts: np.ndarray, length: int, positions: np.ndarray):
    """Component and occurrence of each position in the smooth schedule: component ``k``
    has had ``A_k(x) = floor((x c_k + L // 2) / L)`` of the first ``P(x) = sum_k A_k(x)``
    positions; position ``p`` is the ``(p - P(x))``-th (by component) of the components
    that step between ``x`` and ``x + 1``, for the ``x`` with ``P(x) <= p < P(x + 1)``."""
    positions = np.asarray(positions, dtype=np.int64)
    c = counts.astype(object) if length > _EXACT_L else counts
    half = length // 2

    def filled(x):  # (m, K): A_k(x) per position
        return (x[:, None] * c[None, :] + half) // length

    lo = np.zeros(len(positions), dtype=np.int64)
    hi = np.full(len(positions), length, dtype=np.int64)
    while True:  # smallest x with P(x + 1) > p
        todo = lo < hi
        if not todo.any():
            break
        mid = (lo + hi) // 2
        ahead = filled(mid + 1).sum(axis=1) > positions
        hi = np.where(todo & ahead, mid, hi)
        lo = np.where(todo & ~ahead, mid + 1, lo)
    before, after = filled(lo), filled(lo + 1)
    steps = (after > before).astype(np.int64)
    rank = positions - before.sum(axis=1).astype(np.int64)
    comp = (np.cumsum(steps, axis=1) > rank[:, None]).argmax(axis=1)
    occurrence = before[np.arange(len(positions)), comp].astype(np.int64)
    return comp.astype(np.int64), occurrence


def _check_record_names(names: list[str], components: list[Source]) -> None:
    """Refuse component names that would clash in sample identities: the same name carried
    by two components (a nested mixture's records carry its own components' names), or a
    name that is another's repeat name (``"<name>#<r>"``, ``r >= 1``, no leading 0)."""
    owner: dict[str, str] = {}
    for n, c in zip(names, components, strict=True):
        for carried in (c.record_names() if isinstance(c, MixtureSource) else [n]):
            if carried in owner:
                raise ZephonConfigError(
                    f"mixture: the name {carried!r} is carried by the samples of two "
                    f"components ({_whose(owner[carried], names, components)} and "
                    f"{_whose(n, names, components)}): their samples' identities "
                    f"(ids, ctx.rng, what ensure_mixture counts) would clash; rename one "
                    f"of them")
            owner[carried] = n
    for carried, n in owner.items():
        stem, sep, r = carried.rpartition("#")
        if sep and stem in owner and r.isascii() and r.isdigit() and r[0] != "0":
            raise ZephonConfigError(
                f"mixture: the name {carried!r} (of {_whose(n, names, components)}) "
                f"is the name a repeat of {stem!r} takes (a sample read again within an epoch "
                f"is named '<name>#<r>'): their identities would clash; rename it (e.g. "
                f"{stem + '_' + r!r})")


def _whose(n: str, names: list[str], components: list[Source]) -> str:
    nested = isinstance(components[names.index(n)], MixtureSource)
    return f"the nested mixture {n!r}" if nested else f"component {n!r}"


def _positive(value, what: str) -> float:
    return check_positive("mixture", what, value)


def _non_negative(value, what: str) -> float:
    """0, or a positive finite number (a weight of a schedule: 0 switches a component
    off for its epochs)."""
    if value == 0 and not isinstance(value, bool):
        return 0.0
    try:
        return _positive(value, what)
    except ZephonConfigError:
        raise ZephonConfigError(f"mixture: {what} must be 0 or a positive finite number, "
                                f"got {value!r}") from None

def _policy(value, what: str) -> str:
    if value not in EXHAUSTION_POLICIES:
        raise ZephonConfigError(f"mixture: {what} must be one of {EXHAUSTION_POLICIES}, "
                                f"got {value!r}")
    return value


def _repeats(value, what: str) -> float:
    if value is None:
        return math.inf
    return _positive(value, what)


def _per_component(names: list[str], value, what: str, check) -> list:
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in names]
        if unknown:
            raise ZephonConfigError(f"mixture: {what} names unknown component(s) {unknown}; "
                                    f"the components are {names}")
        default = "repeat" if check is _policy else None
        return [check(value.get(n, default), f"{what}[{n!r}]") for n in names]
    return [check(value, what) for _ in names]


def _token_field_length(sample) -> int:
    """Tokens of a sample for ``by="tokens"`` without a ``token_count``: the length of
    its ``"tokens"`` field (an array or a sequence), else of its ``"text"`` field
    split on white space."""
    if isinstance(sample, Mapping):
        if "tokens" in sample:
            return int(np.asarray(sample["tokens"]).size)
        if "text" in sample:
            return len(str(sample["text"]).split())
    raise ZephonConfigError("mixture(by='tokens'): a sample has no 'tokens' or 'text' "
                            "field; give token_count= or tokens_per_sample=")
