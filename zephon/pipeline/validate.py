"""Auto-validation of user ops before iteration (``auto_validation``), and the choice of
the ops whose calls the global generators are seeded for (``seed_global_rngs``).

Checks, each with an error code, run on the first sample of the source:

- Z001  an op (or the source) cannot be pickled but a stage runs on the
        process runner (or in MTP mode); an *adaptive* stage (autotune, no runner
        pinned) does not count: it stays inline instead;
- Z002  a map/filter op is not deterministic: the same input twice gives
        different outputs, seeded as the run seeds it, or it drew from a global
        generator that is not seeded for it (even when the two outputs happened to
        match). The message names the generator the op drew from when one of
        numpy's, the ``random`` module's or torch's changed state during the calls,
        and the ways out: ``seed_global_rngs`` (``"off"`` is the only mode where a draw
        from them is left unseeded, save torch's under ``"all"`` when torch is imported
        only by the op), ``ctx.rng``, or ``auto_validation="off"``. An op whose output
        changes although its generators were seeded draws from randomness that cannot be
        seeded (see below). Values are compared bit for bit (arrays, tensors), element by
        element (object arrays, containers), by ``==``, and by their pickles for objects
        that compare by identity (no ``__eq__``), so only a real difference counts;
- Z003  a map/filter op mutates its input in place;
- Z004  a map/filter op's output cannot be pickled (a lock, a generator, an open
        file) while a stage runs on the process runner (or in MTP mode; adaptive
        stages do not count, as for Z001); checked
        before Z002, which is not judged for such an output on any runner (its
        objects compare by identity; inline and threads never pickle, so there
        the op just works);
- Z005  a map's outputs for two calls share memory (it writes into a buffer it
        keeps, ``np.multiply(x, 2, out=BUF)``): legal, each output is copied at
        return. Advisory: always a warning, never raised, even under ``strict``.

``strict`` raises :class:`~zephon.errors.ValidationError` listing every issue
but the advisory ones (those are warned about, alone, when nothing else is
wrong); ``warn`` reports them all with ``warnings.warn``; ``off`` skips all of this.

**The global generators** (:mod:`zephon.pipeline.rngs`). The leading ``map`` and
``filter`` ops (those that see the source's samples: up to the first other op) are
probed on the first sample. ``validate(plan, "pickle")`` runs before any worker process
exists; it decides, for every ``map`` and ``filter`` op, the generators seeded before
each of its calls in this run, and returns them (one per op of the spec; the run hands
them to its stage programs: ops are shared by the pipelines derived from one another,
so the decision is never kept on an op):
``seed_global_rngs="auto"`` runs each leading op once on the first sample with all
three generators seeded and takes those whose state the call changed (nothing when
``auto_validation="off"``: no op is probed; an op that is not a leading one, or that
draws only on some samples, needs ``"all"``); ``"all"`` takes all three for every
``map`` and ``filter`` (torch's only when torch is imported then); ``"off"`` none. The
behaviour checks (``validate(plan, "behaviour")``, while workers boot) reuse that call
as the first of the two they compare (one call per op in each phase). Every probe
call seeds the generators as the run will (same identity, same op ordinal), and gives
the consumer's own states back afterwards.

So Z002 still refuses what seeding cannot make exact, as far as the first sample shows
it: a generator the op makes without a seed (``np.random.default_rng()``,
``random.Random()``, ``torch.Generator()``) or keeps between calls (made at import, or
seeded once), ``os.urandom``, the clock, torch's CUDA generators: the two outputs
differ. What no check on one sample can see, an op drawing on other samples only, is
seeded under ``"all"`` and not under ``"auto"``.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from zephon._modules import imported
from zephon.errors import ValidationError, ValidationIssue, ZephonConfigError
from zephon.options.resolve import OUT_OF_PROCESS_RUNNERS
from zephon.pipeline import rngs
from zephon.pipeline.ops import FilterOp, MapOp, OpContext
from zephon.transport.codec import find_unpicklable

__all__ = ["ADVISORY", "Seeded", "decide_global_rngs", "validate"]

#: per op of a spec, the global generators seeded before each of its calls in a run
Seeded = tuple[frozenset[str], ...]

#: Codes that are only ever warned about, even under ``strict``: the run is correct,
#: only slower.
ADVISORY = frozenset({"Z005"})


def _same(a, b) -> bool:
    """Equal values, bit for bit where arrays or tensors are involved (a NaN equals a NaN
    in the same place): dtype, shape and contents. Tensors compare with ``torch.equal``
    (``bool(a == b)`` is ambiguous for them); torch is looked up, never imported."""
    torch = imported("torch")
    if torch is not None and (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)):
        return _same_tensors(torch, a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return _same_arrays(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return _same_leaves(a, b)


def _same_leaves(a, b) -> bool:
    """:func:`_same` for what is neither a tensor, an array nor a pair of containers:
    NumPy scalars by their bits, objects equal by identity only by their pickles, the
    rest by ``==`` (two NaNs are the same)."""
    if isinstance(a, np.generic) and isinstance(b, np.generic):  # NumPy scalars: bits
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if type(a) is type(b) and type(a).__eq__ is object.__eq__ and a is not b:
        return _same_pickles(a, b)  # equal by identity only: compare what they hold
    try:
        return a is b or bool(a == b) or _both_nan(a, b)
    except Exception:  # noqa: BLE001
        return a is b


def _same_tensors(torch, a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or \
            a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b]))


def _same_arrays(a, b) -> bool:
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and
            a.shape == b.shape and a.dtype == b.dtype):
        return False
    if a.dtype.hasobject:  # its bytes are pointers: compare the objects
        return _same(a.tolist(), b.tolist())
    return a.tobytes() == b.tobytes()


def _both_nan(a, b) -> bool:
    """Two float (or complex) NaNs: the same value for this check (``nan != nan``)."""
    return (isinstance(a, (float, complex)) and isinstance(b, (float, complex))
            and a != a and b != b)


def _same_pickles(a, b) -> bool:
    """Whether two objects that compare by identity pickle to the same bytes."""
    try:
        return pickle.dumps(a, protocol=5) == pickle.dumps(b, protocol=5)
    except Exception:  # noqa: BLE001 - an object that cannot be pickled: nothing to judge
        return True


def _drawn_from(before: dict, after: dict) -> frozenset[str]:
    """The generators whose state changed between snapshots ``before`` and ``after``
    (:func:`~zephon.pipeline.rngs.snapshot`); torch's too when the call imported torch and
    then drew from it."""
    drew = {name for name, state in after.items() if name in before and before[name] != state}
    if rngs.TORCH in after and rngs.TORCH not in before and \
            after[rngs.TORCH] != rngs.torch_untouched():
        drew.add(rngs.TORCH)
    return frozenset(drew)


def _labels(names) -> str:
    return " and ".join(rngs.LABELS[n] for n in rngs.GENERATORS if n in names)


#: the ways out through ``ctx`` (the op's second argument), for any randomness
CTX_WAYS = (
    "take ctx as the op's second argument, fn(sample, ctx), and draw from ctx.rng (a "
    "NumPy Generator seeded by the sample identity) instead: numpy: ctx.rng.random() for "
    "np.random.random(); random: rnd = random.Random(int(ctx.rng.integers(2**63))); "
    "torch: g = torch.Generator().manual_seed(int(ctx.rng.integers(2**63))) passed as "
    "generator=g")
#: and switching the check off
CHECK_OFF = (
    "Or switch this check off: RuntimeOptions(auto_validation='off') (or 'warn'); the "
    "stream is then not reproducible")
#: Z002's ways out for a draw from a global generator left unseeded.
WAYS_OUT = (
    "RuntimeOptions(seed_global_rngs='auto') (the default) seeds the global generators an "
    "op is seen drawing from before each of its calls, from the sample's identity, on "
    f"every runner ('all': for every map and filter); or {CTX_WAYS}. {CHECK_OFF}")
#: ... under seed_global_rngs='all', where only torch's can be left unseeded
WAYS_OUT_TORCH = (
    "import torch before iterating: seed_global_rngs='all' seeds torch's generator only "
    "when torch is imported when the run starts (or use seed_global_rngs='auto'); or "
    f"{CTX_WAYS}. {CHECK_OFF}")
#: Z002's ways out for randomness that seeding cannot reach.
UNSEEDABLE = (
    "it draws from randomness that cannot be seeded per call: a generator made without a "
    "seed (np.random.default_rng(), random.Random(), torch.Generator()) or kept between "
    "calls (made at import), os.urandom, the clock, or torch's CUDA generator")
UNSEEDABLE_WAYS = (
    f"make such a generator per call from ctx.rng: {CTX_WAYS}. {CHECK_OFF}")


def _unimportable_main(obj) -> str | None:
    """The name of a function (or class) that ``obj`` pickles by reference to ``__main__``
    when ``__main__`` has no file a spawn worker could import, else None."""

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path and os.path.exists(path):
        return None
    seen = [obj, getattr(obj, "func", None), getattr(obj, "fn", None), type(obj)]
    for item in seen:
        if item is not None and getattr(item, "__module__", None) == "__main__":
            return getattr(item, "__qualname__", repr(item))
    return None


def find_issues(plan, checks: str = "all", seeded: Seeded | None = None,
                keep: bool = True) -> list[ValidationIssue]:
    """``checks``: "pickle" (before workers start), "behaviour" (while they start), "all".
    The behaviour checks seed each op's generators as ``seeded`` says (per op of the
    spec, :func:`decide_global_rngs`; None: none); ``keep=False``: the caller keeps the
    consumer's generator states around them."""
    pipeline, opts = plan.spec, plan.opts
    issues: list[ValidationIssue] = []
    # an adaptive stage whose ops or samples do not pickle stays inline (its executor finds
    # out, see AdaptiveExecutor): only what runs in process workers must pickle
    needs_pickle = opts.mtp_mode or any(s.mode in OUT_OF_PROCESS_RUNNERS for s in plan.stages)
    if needs_pickle and checks in ("pickle", "all"):
        issues.extend(_pickle_issues(pipeline))
    if len(pipeline.source) == 0 or checks == "pickle":
        return issues
    issues.extend(_behaviour_issues(plan, seeded or _none(plan), needs_pickle, keep))
    return issues


def _pickle_issues(pipeline) -> list[ValidationIssue]:
    """Z001 for the source and every op that a spawn worker could not receive."""
    issues = []
    for what, obj in [("source", pipeline.source)] + [(op.name, getattr(op, "fn", op))
                                                        for op in pipeline.ops]:
        try:
            pickle.dumps(obj, protocol=5)
        except Exception as exc:  # noqa: BLE001 - pickling can fail with any type; report it
            issues.append(ValidationIssue(
                "Z001", what, f"cannot be pickled for process workers ({type(exc).__name__}: "
                f"{exc}); define it at module level or use runner='threads'"))
            continue
        where = _unimportable_main(obj)
        if where:
            issues.append(ValidationIssue(
                "Z001", what, f"{where} is defined in __main__ of a session without a script "
                "file (python -c, stdin or a notebook): spawn workers cannot import it; "
                "move it to a module file, or use runner='threads'"))
    return issues


class _Call(NamedTuple):
    """The first probe call of a leading op: its input (``sample``, and ``before``, a copy
    to see whether the second call mutates it), its output, the generators it drew
    from, and what of the output does not pickle (None: it all does; found once, an
    output is not pickled again for the behaviour checks)."""

    op: Any
    ordinal: int
    sid: tuple
    sample: Any
    before: Any
    first: Any
    drew: frozenset[str]
    unpicklable: Any = None


#: the first calls ``validate(plan, "pickle")`` made under seed_global_rngs="auto", for
#: the behaviour checks of the same plan to reuse (taken once)
_FIRST_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _leading(pipeline):
    """``(ordinal, op)`` of the leading ``map`` and ``filter`` ops (they see raw samples;
    their ordinal among the per-sample ops is their place in the pipeline)."""
    for ordinal, op in enumerate(pipeline.ops):
        if not isinstance(op, MapOp) or type(op) not in (MapOp, FilterOp):
            return
        yield ordinal, op


#: unlocked probe calls made again when another thread changed the generators meanwhile
PROBE_ATTEMPTS = 4


def _call(op, value, sid, seed: int, ordinal: int, which: frozenset[str],
          guard: bool = False) -> tuple:
    """``(output, drew)``: ``op`` on ``value`` with the generators ``which`` seeded as the
    run seeds them, and the generators the call drew from. The callers keep the
    consumer's states around all of their calls (:func:`_kept`), not around each: two
    calls drawing from a generator left unseeded draw different numbers, as two samples
    of the run would.

    ``guard`` (a seeded op probed while the run's threads may already run seeded calls):
    the whole call holds the seeded calls' lock, as theirs do, so neither disturbs the
    other. Every other probe runs the op's code without the lock (it may wait on other
    pipelines' threads, whose seeded calls take the lock): the plant and the two
    snapshots take it, and a call during which another thread planted or restored the
    generators (:func:`~zephon.pipeline.rngs.changes` moved) is made again on a fresh
    copy, up to :data:`PROBE_ATTEMPTS` times, so those plants are not taken for the
    op's draws. Draws by other code of the process at that moment (a training step on
    another thread) cannot be told apart; see :mod:`zephon.pipeline.rngs`."""
    if guard and which:
        with rngs.hold():
            return _observed_call(op, value, sid, seed, ordinal, which)
    pristine = copy.deepcopy(value)
    for attempt in range(PROBE_ATTEMPTS):
        arg = value if attempt == 0 else copy.deepcopy(pristine)
        with rngs.LOCK:
            rngs.plant(which, rngs.global_seeds(seed, sid, ordinal))
            marks, before = rngs.snapshot(), rngs.changes()
        out = op.fn(*((arg, OpContext(sid, seed, op.ordinal)) if op.with_ctx else (arg,)))
        with rngs.LOCK:
            after, moved = rngs.snapshot(), rngs.changes() != before
        if not moved:
            break
    return out, _drawn_from(marks, after)


def _observed_call(op, value, sid, seed: int, ordinal: int, which: frozenset[str]) -> tuple:
    """One call with the seeds planted and the generators compared (the caller holds the
    lock)."""
    rngs.plant(which, rngs.global_seeds(seed, sid, ordinal))
    marks = rngs.snapshot()
    out = op.fn(*((value, OpContext(sid, seed, op.ordinal)) if op.with_ctx else (value,)))
    return out, _drawn_from(marks, rngs.snapshot())


def _kept(keep: bool = True):
    """The consumer's states of the generators (torch's when torch is imported), given
    back when the probes are done (a generator a probe imported keeps its state).
    ``keep=False``: the caller keeps them around more than this (:func:`validate` takes
    one keep around both phases: each save and give-back of NumPy's state costs ~40 us).
    A pipeline that an op iterates during a probe is validated with a keep of its own, so
    its probes never show as the outer op's draws."""
    if not keep:
        return contextlib.nullcontext()
    return rngs.kept(frozenset(g for g in rngs.GENERATORS
                               if g != rngs.TORCH or imported(rngs.TORCH) is not None))


def _first_calls(pipeline, which: Callable[[Any], frozenset[str]],
                 keep: bool = True) -> list[_Call]:
    """The first probe call of each leading op on the first sample (each op gets the
    output of the one before it; a filter that drops it ends the walk), seeded for
    ``which(op)``; the walk also ends at an op that raises, at an output that cannot be
    pickled (nothing after it is judged) and at a sample that cannot be copied."""
    with _kept(keep):
        return _walk(pipeline, which)


def _walk(pipeline, which: Callable[[Any], frozenset[str]],
          guard: bool = False) -> list[_Call]:
    """:func:`_first_calls` without keeping the consumer's states."""
    calls: list[_Call] = []
    try:
        sample = pipeline.source.get(0)
    except Exception:  # noqa: BLE001 - reading errors surface at run time, with the sample id
        return calls
    name, index = pipeline.source.identity(0)
    sid = (name, index, 0)
    for ordinal, op in _leading(pipeline):
        try:
            before = copy.deepcopy(sample)
        except Exception:  # noqa: BLE001 - a sample that cannot be copied (a lock in it)
            break  # the checks need copies of it; inline and threads run it as it is
        try:
            first, drew = _first_call(op, sample, sid, pipeline.seed, ordinal, which, guard)
        except Exception:  # noqa: BLE001 - op errors surface at run time, with the sample id
            break
        unpicklable = find_unpicklable(first, "output")
        calls.append(_Call(op, ordinal, sid, sample, before, first, drew, unpicklable))
        if unpicklable is not None:
            break  # objects that do not pickle compare by identity: nothing more to judge
        if isinstance(op, FilterOp):
            if not first:
                break
            continue
        sample = first
    return calls


def _first_call(op, sample, sid, seed: int, ordinal: int,
                which: Callable[[Any], frozenset[str]], guard: bool = False) -> tuple:
    """One probe call; made again when it imported torch (torch's generator could not be
    seeded before it), so the output is the one the run gives."""
    had_torch = imported(rngs.TORCH) is not None
    first, drew = _call(op, copy.deepcopy(sample), sid, seed, ordinal, which(op), guard)
    if not had_torch and imported(rngs.TORCH) is not None and rngs.TORCH in which(op) | drew:
        first, drew = _call(op, copy.deepcopy(sample), sid, seed, ordinal, which(op), guard)
    return first, drew


def _behaviour_issues(plan, seeded: Seeded, needs_pickle: bool = False,
                      keep: bool = True) -> list[ValidationIssue]:
    """Z004 (output cannot be pickled, process runners), Z002 (not deterministic), Z005
    (outputs share a buffer) and Z003 (mutates its input) for the leading per-sample ops,
    probed on the first sample: a second call of each op, seeded as ``seeded`` says,
    against its first (the pickle phase's, else made now)."""
    with _kept(keep):
        calls = _FIRST_CALLS.pop(plan, None)
        if calls is None:
            calls = _walk(plan.spec, _seeded_for(plan, seeded), guard=True)
        return _second_calls(plan, seeded, calls, needs_pickle)


def _second_calls(plan, seeded: Seeded, calls: list[_Call],
                  needs_pickle: bool) -> list[ValidationIssue]:
    """The issues of each first call in ``calls`` and of a second call of its op."""
    pipeline, mode = plan.spec, plan.opts.seed_global_rngs
    seeded_for = _seeded_for(plan, seeded)
    issues: list[ValidationIssue] = []
    for c in calls:
        which = seeded_for(c.op)
        unpicklable = c.unpicklable
        if unpicklable is not None:
            if needs_pickle:
                issues.append(ValidationIssue(
                    "Z004", c.op.name, f"its output cannot be pickled for process workers: "
                    f"{unpicklable[0]} ({unpicklable[1]}); return plain data (arrays, "
                    "numbers, strings, containers of them), or use runner='threads'"))
            break
        try:
            probe = copy.deepcopy(c.sample)
            second, drew = _call(c.op, probe, c.sid, pipeline.seed, c.ordinal, which,
                                 guard=True)
        except Exception:  # noqa: BLE001 - op errors surface at run time, with the sample id
            break
        unseeded = (c.drew | drew) - which
        issues.extend(_output_issues(c.op, c.first, second, unseeded, which, mode))
        if not _same(probe, c.before):
            issues.append(ValidationIssue(
                "Z003", c.op.name, "mutates its input in place; return a new value instead"))
    return issues


def _arrays(value, depth: int = 0, limit: int = 64) -> list[np.ndarray]:
    """The NumPy arrays in ``value`` (dicts, lists, tuples; at most ``limit``)."""
    if isinstance(value, np.ndarray):
        return [value] if value.size else []
    if depth > 8:
        return []
    items = value.values() if isinstance(value, dict) else \
        value if isinstance(value, (list, tuple)) else ()
    out: list[np.ndarray] = []
    for item in items:
        out.extend(_arrays(item, depth + 1, limit - len(out)))
        if len(out) >= limit:
            break
    return out


def _output_issues(op, first, second, unseeded: frozenset[str], seeded: frozenset[str],
                   mode: str) -> list[ValidationIssue]:
    """Z002 and Z005 from two outputs of ``op`` for the same sample (each call got its
    own copy of the sample, so memory the outputs share is the op's own; ``unseeded``:
    the global generators that changed state during the calls without being seeded for
    the op, ``seeded``: those seeded before each call)."""
    issues = []
    ways = WAYS_OUT_TORCH if mode == "all" else WAYS_OUT
    if not _same(first, second):
        issues.append(ValidationIssue(
            "Z002", op.name, "not deterministic: its output changed between two runs on "
            f"the same sample: {_cause(unseeded, seeded, mode)}"))
    elif unseeded:  # equal this time by chance (a flip with p=0.5): the stream still varies
        issues.append(ValidationIssue(
            "Z002", op.name, f"not deterministic: it drew from {_labels(unseeded)}, which "
            f"seed_global_rngs={mode!r} does not seed for it (its two outputs on the same "
            "sample happened to match, but a draw changes the stream from one run to the "
            f"next). Ways out: {ways}"))
    if any(np.may_share_memory(a, b) for a in _arrays(first) for b in _arrays(second)):
        issues.append(ValidationIssue(
            "Z005", op.name, "returns arrays that share memory between outputs (a buffer "
            "it keeps and writes again, e.g. np.multiply(x, 2, out=BUF)): legal, but each "
            "such output is copied when the op returns, once per sample; return a fresh "
            "array instead (advisory: a warning, never raised)"))
    return issues


def _cause(unseeded: frozenset[str], seeded: frozenset[str], mode: str) -> str:
    """Why two outputs of an op differ, with the ways out."""
    if unseeded:
        return (f"it drew from {_labels(unseeded)}, which seed_global_rngs={mode!r} does "
                f"not seed for it. Ways out: {WAYS_OUT_TORCH if mode == 'all' else WAYS_OUT}")
    if seeded:
        return (f"{_labels(seeded)} {'was' if len(seeded) == 1 else 'were'} seeded from "
                f"the sample's identity before each call, so {UNSEEDABLE}. Ways out: "
                f"{UNSEEDABLE_WAYS}")
    if mode != "off":  # no global draw was seen: the randomness is of another kind
        return f"{UNSEEDABLE}. Ways out: {UNSEEDABLE_WAYS}"
    return ("it draws from randomness nothing seeds for it: a global RNG under "
            "seed_global_rngs='off' (torch's, as torchvision's random transforms do, "
            "numpy's np.random, the random module's), a generator made without a seed or "
            "kept between calls, os.urandom or the clock. Ways out: "
            f"{WAYS_OUT}")


def decide_global_rngs(plan, keep: bool = True) -> Seeded:
    """Decide, for every ``map`` and ``filter`` op of ``plan``, the global generators seeded
    before each of its calls in the run about to start (``plan.global_rngs``, see the
    module docstring); under ``seed_global_rngs="auto"`` with validation on, this runs
    each leading op once on the first sample (the behaviour checks reuse the call)."""
    opts, pipeline = plan.opts, plan.spec
    drew: dict[int, frozenset[str]] = {}
    if opts.seed_global_rngs == "auto" and opts.auto_validation != "off" and \
            len(pipeline.source) > 0:
        # all three seeded (torch's as soon as it is imported, by the op's first call too)
        calls = _first_calls(pipeline, lambda op: rngs.chosen("all", None), keep)
        _FIRST_CALLS[plan] = calls
        for c in calls:
            drew[id(c.op)] = drew.get(id(c.op), frozenset()) | c.drew
    return tuple(
        rngs.chosen(opts.seed_global_rngs, drew.get(id(op))) if type(op) in (MapOp, FilterOp)
        else frozenset() for op in pipeline.ops)


def _refuse_nested(plan, seeded: Seeded) -> Seeded:
    """``seeded``, unless this run starts inside a seeded call of another pipeline's op
    (or the probe of one: :func:`~zephon.pipeline.rngs.held_here`, the op iterates a
    pipeline of its own) and would run seeded calls on other threads of this process
    (a threads or process stage puts the engine on a pump thread): they would wait for
    ever for the lock the outer call holds, so this raises instead of hanging. An inline
    run stays on this thread (the lock is re-entrant), and process workers seed their
    own generators."""
    if not rngs.held_here() or not any(seeded) or plan.opts.mtp_mode:
        return seeded
    modes = {stage.mode for stage in plan.stages}
    if not modes & {"threads", *OUT_OF_PROCESS_RUNNERS}:
        return seeded
    stage_of = {id(op): stage.mode for stage in plan.stages for op in stage.ops}
    names = [op.name for op, which in zip(plan.spec.ops, seeded, strict=True)
             if which and stage_of.get(id(op)) not in OUT_OF_PROCESS_RUNNERS]
    if not names:
        return seeded
    raise ZephonConfigError(
        f"a pipeline iterated inside a seeded op's call runs {', '.join(names)} seeded "
        "for the global generators on other threads of this process, which would wait for "
        "ever for the lock the outer call holds: run the inner pipeline with "
        "runner='inline' or runner='process', or the outer op unseeded "
        "(seed_global_rngs='off', and draw from ctx.rng)")


def _none(plan) -> Seeded:
    """No op seeded."""
    return tuple(frozenset() for _ in plan.spec.ops)


def _seeded_for(plan, seeded: Seeded) -> Callable[[Any], frozenset[str]]:
    """``op -> the generators seeded for it`` (``seeded``: per op of the spec)."""
    decided = {id(op): which for op, which in zip(plan.spec.ops, seeded, strict=True)}
    return lambda op: decided.get(id(op), frozenset())


def _report(mode: str, issues: list[ValidationIssue]) -> None:
    """Raise (``strict``) or warn about ``issues`` (advisory ones are only warned about)."""
    errors = [i for i in issues if i.code not in ADVISORY]
    if mode == "strict" and errors:
        raise ValidationError(errors)
    if mode == "strict":
        issues = [i for i in issues if i.code in ADVISORY]
    if issues:
        warnings.warn(str(ValidationError(issues)), RuntimeWarning, stacklevel=4)


def validate(plan, checks: str = "all", seeded: Seeded | None = None) -> Seeded:
    """The checks ``checks`` ("pickle", "behaviour" or "all") under ``auto_validation``.

    Returns:
        The global generators seeded per op of the spec for the run: "pickle" and "all"
        decide them (:func:`decide_global_rngs`, after the pickle checks); "behaviour"
        checks under ``seeded`` (the "pickle" phase's decision) and returns it.
    """
    mode = plan.opts.auto_validation
    if checks == "behaviour":
        seeded = seeded or _none(plan)
        if mode != "off":
            _report(mode, find_issues(plan, "behaviour", seeded))
        return seeded
    issues = find_issues(plan, "pickle") if mode != "off" else []
    if checks == "pickle":
        _report(mode, issues)
        return _refuse_nested(plan, decide_global_rngs(plan))
    with _kept():  # one save and give-back of the consumer's states for both phases
        seeded = _refuse_nested(plan, decide_global_rngs(plan, keep=False))
        if mode != "off":  # the pickle checks are done: the behaviour ones follow them
            issues += find_issues(plan, "behaviour", seeded, keep=False)
    if mode != "off":
        _report(mode, issues)
    return seeded
