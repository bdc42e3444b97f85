"""Auto-validation of user ops before iteration (``auto_validation``).

Checks, each with an error code, run on the first sample of the source:

- Z001  an op (or the source) cannot be pickled but a stage runs on the
        process runner (or in MTP mode); an *adaptive* stage (autotune, no runner
        pinned) does not count: it stays inline instead;
- Z002  a map/filter op is not deterministic: the same input twice gives
        different outputs, or it drew from a global RNG (even when the two outputs
        happened to match). The message names the global RNG the op drew from when
        one of numpy's, the ``random`` module's or torch's changed state during
        the calls, and the ways out: draw from ``ctx.rng`` (seeding a third-party
        library from it, one line each), or ``auto_validation="off"``. Values are
        compared bit for bit (arrays, tensors), element by element (object arrays,
        containers), by ``==``, and by their pickles for objects that compare by
        identity (no ``__eq__``), so only a real difference counts;
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
"""

from __future__ import annotations

import copy
import os
import pickle
import random
import sys
import warnings

import numpy as np

from zephon.errors import ValidationError, ValidationIssue
from zephon.pipeline.ops import FilterOp, MapOp, OpContext
from zephon.transport.codec import find_unpicklable

__all__ = ["ADVISORY", "validate"]

#: Codes that are only ever warned about, even under ``strict``: the run is correct,
#: only slower.
ADVISORY = frozenset({"Z005"})


def _same(a, b) -> bool:
    """Equal values, bit for bit where arrays or tensors are involved (a NaN equals a NaN
    in the same place): dtype, shape and contents. Tensors compare with ``torch.equal``
    (``bool(a == b)`` is ambiguous for them); torch is looked up, never imported."""
    torch = sys.modules.get("torch")
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


def _global_rng_states() -> dict[str, object]:
    """The state of each global RNG an op could draw from by mistake, by the name the
    Z002 message gives it: numpy's, the ``random`` module's and (when imported) torch's."""
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple)
    states: dict[str, object] = {
        "numpy's global RNG (np.random)": (legacy[1].tobytes(), *legacy[2:]),
        "the random module's global RNG": random.getstate(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        states["torch's global RNG (torch.rand, torchvision's random transforms)"] = \
            torch.random.get_rng_state().numpy().tobytes()
    return states


def _drawn_from(before: dict, after: dict) -> list[str]:
    """The global RNGs whose state changed between ``before`` and ``after``."""
    return [name for name, state in after.items() if before.get(name, state) != state]


#: Z002's ways out (``ctx`` is the op's second argument).
WAYS_OUT = (
    "take ctx as the op's second argument, fn(sample, ctx), and draw from ctx.rng (a "
    "NumPy Generator seeded by the sample identity) instead: numpy: ctx.rng.random() for "
    "np.random.random(); random: rnd = random.Random(int(ctx.rng.integers(2**63))); "
    "torch: g = torch.Generator().manual_seed(int(ctx.rng.integers(2**63))) passed as "
    "generator=g, or, for a library that takes no generator (torchvision's random "
    "transforms), torch.manual_seed(int(ctx.rng.integers(2**63))) before calling it (it "
    "reseeds the global RNG of the process the op runs in: run the stage on the process "
    "runner, whose workers own theirs, not inline or on threads). Or switch this check "
    "off: RuntimeOptions(auto_validation='off') (or 'warn'); the stream is then not "
    "reproducible")


def _unimportable_main(obj) -> str | None:
    """The name of a function (or class) that ``obj`` pickles by reference to ``__main__``
    when ``__main__`` has no file a spawn worker could import, else None."""
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path and os.path.exists(path):
        return None
    seen = [obj, getattr(obj, "func", None), getattr(obj, "fn", None), type(obj)]
    for item in seen:
        if item is not None and getattr(item, "__module__", None) == "__main__":
            return getattr(item, "__qualname__", repr(item))
    return None


def find_issues(plan, checks: str = "all") -> list[ValidationIssue]:
    """``checks``: "pickle" (before workers start), "behaviour" (while they start), "all"."""
    pipeline, opts = plan.spec, plan.opts
    issues: list[ValidationIssue] = []
    # an adaptive stage whose ops or samples do not pickle stays inline (its executor finds
    # out, see AdaptiveExecutor): only what runs in process workers must pickle
    needs_pickle = opts.mtp_mode or any(s.mode == "process" for s in plan.stages)
    if needs_pickle and checks in ("pickle", "all"):
        issues.extend(_pickle_issues(pipeline))
    if len(pipeline.source) == 0 or checks == "pickle":
        return issues
    issues.extend(_behaviour_issues(pipeline, needs_pickle))
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


def _behaviour_issues(pipeline, needs_pickle: bool = False) -> list[ValidationIssue]:
    """Z004 (output cannot be pickled, process runners), Z002 (not deterministic), Z005
    (outputs share a buffer) and Z003 (mutates its input) for the leading per-sample ops,
    probed on the first sample."""
    issues: list[ValidationIssue] = []
    try:
        sample = pipeline.source.get(0)
    except Exception:  # noqa: BLE001 - reading errors surface at run time, with the sample id
        return issues
    name, index = pipeline.source.identity(0)
    sid = (name, index, 0)
    for op in pipeline.ops:
        if not isinstance(op, MapOp) or type(op) not in (MapOp, FilterOp):
            break  # only the leading per-sample ops see raw samples
        try:
            before = copy.deepcopy(sample)
        except Exception:  # noqa: BLE001 - a sample that cannot be copied (a lock in it)
            break  # the checks need copies of it; inline and threads run it as it is
        try:
            first, second, probe, drawn = _probe(op, sample, sid, pipeline.seed)
        except Exception:  # noqa: BLE001 - op errors surface at run time, with the sample id
            break
        unpicklable = find_unpicklable(first, "output")
        if unpicklable is not None:
            if needs_pickle:
                issues.append(ValidationIssue(
                    "Z004", op.name, f"its output cannot be pickled for process workers: "
                    f"{unpicklable[0]} ({unpicklable[1]}); return plain data (arrays, "
                    "numbers, strings, containers of them), or use runner='threads'"))
            break  # objects that do not pickle compare by identity: nothing more to judge
        issues.extend(_output_issues(op, first, second, drawn))
        if not _same(probe, before):
            issues.append(ValidationIssue(
                "Z003", op.name, "mutates its input in place; return a new value instead"))
        if isinstance(op, FilterOp):
            if not first:
                break
            continue
        sample = first
    return issues


def _probe(op, sample, sid, seed: int) -> tuple:
    """``(first, second, probe, drawn)``: ``op`` run twice on copies of ``sample`` (the
    second copy, ``probe``, kept to see whether it mutated it), and the global RNGs it
    drew from meanwhile."""
    args = (lambda s: (s, OpContext(sid, seed))) if op.with_ctx else (lambda s: (s,))
    before = _global_rng_states()
    first = op.fn(*args(copy.deepcopy(sample)))
    probe = copy.deepcopy(sample)
    second = op.fn(*args(probe))
    return first, second, probe, _drawn_from(before, _global_rng_states())


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


def _output_issues(op, first, second, drawn: list[str]) -> list[ValidationIssue]:
    """Z002 and Z005 from two outputs of ``op`` for the same sample (each call got its
    own copy of the sample, so memory the outputs share is the op's own; ``drawn``: the
    global RNGs that changed state during the calls)."""
    issues = []
    if not _same(first, second):
        cause = (f"it drew from {' and '.join(drawn)}" if drawn else
                 "it draws from a global RNG (torch's, as torchvision's random transforms "
                 "do, numpy's np.random, the random module's) or reads the clock")
        issues.append(ValidationIssue(
            "Z002", op.name, f"not deterministic: its output changed between two runs on "
            f"the same sample: {cause}. Ways out: {WAYS_OUT}"))
    elif drawn:  # equal this time by chance (a flip with p=0.5): the stream still varies
        issues.append(ValidationIssue(
            "Z002", op.name, f"not deterministic: it drew from {' and '.join(drawn)} (its "
            "two outputs on the same sample happened to match, but a draw changes the "
            f"stream from one run to the next). Ways out: {WAYS_OUT}"))
    if any(np.may_share_memory(a, b) for a in _arrays(first) for b in _arrays(second)):
        issues.append(ValidationIssue(
            "Z005", op.name, "returns arrays that share memory between outputs (a buffer "
            "it keeps and writes again, e.g. np.multiply(x, 2, out=BUF)): legal, but each "
            "such output is copied when the op returns, once per sample; return a fresh "
            "array instead (advisory: a warning, never raised)"))
    return issues


def validate(plan, checks: str = "all") -> None:
    mode = plan.opts.auto_validation
    if mode == "off":
        return
    issues = find_issues(plan, checks)
    errors = [i for i in issues if i.code not in ADVISORY]
    if mode == "strict" and errors:
        raise ValidationError(errors)
    if mode == "strict":
        issues = [i for i in issues if i.code in ADVISORY]
    if issues:
        warnings.warn(str(ValidationError(issues)), RuntimeWarning, stacklevel=4)
