"""The hot kernels, compiled when possible, pure Python/NumPy otherwise.

Public names (each documented in its reference module, which is the
specification the compiled version must match):

- ``pack_plan``, ``pack_copy``, ``rebuild``  (:mod:`zephon.kernels.pack_ref`)
- ``compaction_plan``                       (:mod:`zephon.kernels.compaction_ref`)
- ``ReorderBuffer``, ``LaneRoundRobin``     (:mod:`zephon.kernels.reorder_ref`)
- result types and helpers                  (:mod:`zephon.kernels.types`)

Selection happens once, at import: with ``ZEPHON_PURE_PYTHON=1`` the references
are used everywhere; otherwise the compiled modules ``zephon._kernels.*``, and
if one is missing (a source checkout that was never built) its reference with
a single ``RuntimeWarning``. ``IMPLEMENTATION`` says which ran: ``"compiled"``,
``"reference"`` or ``"mixed"``.
"""

from __future__ import annotations

import importlib
import os
import warnings

from zephon.kernels import compaction_ref, pack_ref, reorder_ref
from zephon.kernels.types import (
    COMPACT, DECISION_NAMES, FORWARD, INLINE, CompactionPlan, Descriptor, PackPlan, align_up,
    byte_extent,
)

__all__ = [
    "pack_plan", "pack_copy", "rebuild", "compaction_plan", "ReorderBuffer", "LaneRoundRobin",
    "PackPlan", "CompactionPlan", "Descriptor", "INLINE", "COMPACT", "FORWARD",
    "DECISION_NAMES", "byte_extent", "align_up", "IMPLEMENTATION", "compiled_module",
]

_REFERENCES = {"pack": pack_ref, "compaction": compaction_ref, "reorder": reorder_ref}


def compiled_module(name: str):
    """The compiled module ``zephon._kernels.<name>`` (ImportError if it was not built)."""
    return importlib.import_module(f"zephon._kernels.{name}")


def _select():
    if os.environ.get("ZEPHON_PURE_PYTHON") == "1":
        return dict(_REFERENCES), "reference"
    chosen, missing = {}, []
    for name, ref in _REFERENCES.items():
        try:
            chosen[name] = compiled_module(name)
        except ImportError:
            chosen[name] = ref
            missing.append(name)
    if missing:
        warnings.warn(
            f"zephon: compiled kernels {', '.join(missing)} are not built; using the pure "
            "Python references (much slower). Build with `pip install -e .`.",
            RuntimeWarning, stacklevel=3)
    kind = "compiled" if not missing else ("reference" if len(missing) == 3 else "mixed")
    return chosen, kind


_modules, IMPLEMENTATION = _select()
pack_plan = _modules["pack"].pack_plan
pack_copy = _modules["pack"].pack_copy
rebuild = _modules["pack"].rebuild
compaction_plan = _modules["compaction"].compaction_plan
ReorderBuffer = _modules["reorder"].ReorderBuffer
LaneRoundRobin = _modules["reorder"].LaneRoundRobin
del _modules
