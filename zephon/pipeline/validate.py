"""Auto-validation of user ops before iteration (``auto_validation``).

Checks, each with an error code, run on the first sample of the source:

- Z001  an op (or the source) cannot be pickled but a stage runs on the
        process runner (or in MTP mode);
- Z002  a map/filter op is not deterministic: the same input twice gives
        different outputs (use ``ctx.rng``, seeded from the sample identity);
- Z003  a map/filter op mutates its input in place.

``strict`` raises :class:`~zephon.errors.ValidationError` listing every issue;
``warn`` reports them with ``warnings.warn``; ``off`` skips all of this.
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
import warnings

import numpy as np

from zephon.errors import ValidationError, ValidationIssue
from zephon.pipeline.ops import FilterOp, MapOp, OpContext

__all__ = ["validate"]


def _same(a, b) -> bool:
    """Equal values, bit for bit where arrays or tensors are involved (a NaN equals a NaN
    in the same place): dtype, shape and contents. Tensors compare with ``torch.equal``
    (``bool(a == b)`` is ambiguous for them); torch is looked up, never imported."""
    torch = sys.modules.get("torch")
    if torch is not None and (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or \
                a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
            return False
        if torch.equal(a, b):
            return True
        if not (a.is_floating_point() or a.is_complex()):
            return False
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        return bool(torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b]))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and \
            a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return a is b


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
    pipeline, opts = plan.pipeline, plan.opts
    issues: list[ValidationIssue] = []
    needs_pickle = opts.mtp_mode or "process" in plan.runners
    if needs_pickle and checks in ("pickle", "all"):
        issues.extend(_pickle_issues(pipeline))
    if len(pipeline.source) == 0 or checks == "pickle":
        return issues
    issues.extend(_behaviour_issues(pipeline))
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


def _behaviour_issues(pipeline) -> list[ValidationIssue]:
    """Z002 (not deterministic) and Z003 (mutates its input) for the leading per-sample
    ops, probed on the first sample."""
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
        before = copy.deepcopy(sample)
        try:
            args = (lambda s: (s, OpContext(sid, pipeline.seed))) if op.with_ctx else \
                (lambda s: (s,))
            first = op.fn(*args(copy.deepcopy(sample)))
            probe = copy.deepcopy(sample)
            second = op.fn(*args(probe))
        except Exception:  # noqa: BLE001 - op errors surface at run time, with the sample id
            break
        if not _same(first, second):
            issues.append(ValidationIssue(
                "Z002", op.name, "not deterministic: the same sample gave two different "
                "outputs; draw randomness from ctx.rng (seeded by the sample identity)"))
        if not _same(probe, before):
            issues.append(ValidationIssue(
                "Z003", op.name, "mutates its input in place; return a new value instead"))
        if isinstance(op, FilterOp):
            if not first:
                break
            continue
        sample = first
    return issues


def validate(plan, checks: str = "all") -> None:
    mode = plan.opts.auto_validation
    if mode == "off":
        return
    issues = find_issues(plan, checks)
    if not issues:
        return
    if mode == "strict":
        raise ValidationError(issues)
    warnings.warn(str(ValidationError(issues)), RuntimeWarning, stacklevel=4)
