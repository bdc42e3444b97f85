"""The hot kernels, compiled when possible, pure Python/NumPy otherwise.

Public names (each documented in its reference module, which is the
specification the compiled version must match):

- ``pack_plan``, ``pack_copy``          (:mod:`zephon.kernels.pack_ref`; called by the
  codec's encoder, :mod:`zephon.transport.codec`, for arena regions and in-band frames)
- ``compaction_plan``                   (:mod:`zephon.kernels.compaction_ref`; called by
  the codec's encoder to forward, compact or inline views of leased regions)
- ``ReorderBuffer``                     (:mod:`zephon.kernels.reorder_ref`; called by
  :mod:`zephon.pipeline.dispatch` to restore sequence order inside a stage)
- ``LaneRoundRobin``                    (:mod:`zephon.kernels.reorder_ref`; called by
  :mod:`zephon.pipeline.engine` for the ordered merge of a rank's lanes)
- ``permute_range``, ``permute_positions``, ``inverse_positions``, ``order_key``
                                        (:mod:`zephon.kernels.shuffle_ref`; the seeded
  index bijection called by :func:`zephon.pipeline.lanes.epoch_slice` for an epoch's
  visiting order and by the Parquet source for its row orders)
- ``item_refcounts``, ``item_refcount``, ``base_refcount``, ``attr_refcount``
                                        (:mod:`zephon.kernels.refcount_ref`; exact
  reference counts for the exclusivity walk of :mod:`zephon.transport.heap`)
- ``fit_place``, ``segment_layout``    (:mod:`zephon.kernels.pack_docs_ref`; called by
  :mod:`zephon.pipeline.ops.pack_documents` to place documents in open bins and lay out packed rows)
- ``distinct_str_ids``                 (:mod:`zephon.kernels.ids_ref`; called by
  :mod:`zephon.jobs.runner` to check that a run's subject ids are unique)
- result types and helpers              (:mod:`zephon.kernels.types`)

One compiled kernel is not selected here: ``zephon._kernels.resample`` (specified by
:mod:`zephon.kernels.resample_ref`, Pillow's resize of a uint8 array), which
:mod:`zephon.vision.decode` calls when it is built and replaces with Pillow itself, not
with the much slower reference, when it is not.

Leaves are rebuilt on the receiving side by the codec's decoder with one
``np.ndarray`` per leaf; that step has no kernel, as a compiled ``rebuild`` is
slower than NumPy making the views itself.

Selection happens once, on first use of one of these names (not at import, so
that the compiled modules, which import :mod:`zephon.kernels.types`, can be
imported on their own without an import cycle): with ``ZEPHON_PURE_PYTHON=1``
the references are used everywhere; otherwise the compiled modules
``zephon._kernels.*``, and if one is missing (a source checkout that was never
built) its reference with a single ``RuntimeWarning``. ``IMPLEMENTATION`` says
which ran: ``"compiled"``, ``"reference"`` or ``"mixed"``; :func:`loaded` says it per
kernel (``python -m zephon --version`` prints both).
"""

from __future__ import annotations

import importlib
import os
import warnings

from zephon.kernels.types import (
    COMPACT,
    DECISION_NAMES,
    FORWARD,
    INLINE,
    CompactionPlan,
    Descriptor,
    PackPlan,
    align_up,
    byte_extent,
)

__all__ = [
    "COMPACT",
    "DECISION_NAMES",
    "FORWARD",
    "IMPLEMENTATION",
    "INLINE",
    "CompactionPlan",
    "Descriptor",
    "LaneRoundRobin",
    "PackPlan",
    "ReorderBuffer",
    "align_up",
    "attr_refcount",
    "base_refcount",
    "byte_extent",
    "compaction_plan",
    "compiled_module",
    "distinct_str_ids",
    "fit_place",
    "inverse_positions",
    "item_refcount",
    "item_refcounts",
    "loaded",
    "order_key",
    "pack_copy",
    "pack_plan",
    "permute_positions",
    "permute_range",
    "segment_layout",
]

_EXPORTS = {
    "pack_plan": "pack", "pack_copy": "pack",
    "compaction_plan": "compaction",
    "ReorderBuffer": "reorder", "LaneRoundRobin": "reorder",
    "permute_range": "shuffle", "permute_positions": "shuffle",
    "inverse_positions": "shuffle", "order_key": "shuffle",
    "item_refcounts": "refcount", "item_refcount": "refcount",
    "base_refcount": "refcount", "attr_refcount": "refcount",
    "fit_place": "pack_docs", "segment_layout": "pack_docs",
    "distinct_str_ids": "ids",
}
_selection: tuple[dict, str] | None = None


def compiled_module(name: str):
    """The compiled module ``zephon._kernels.<name>`` (ImportError if it was not built)."""
    return importlib.import_module(f"zephon._kernels.{name}")


def _reference(name: str):
    return importlib.import_module(f"zephon.kernels.{name}_ref")


def _select() -> tuple[dict, str]:
    global _selection
    if _selection is not None:
        return _selection
    names = ("pack", "compaction", "reorder", "shuffle", "refcount", "pack_docs", "ids")
    if os.environ.get("ZEPHON_PURE_PYTHON") == "1":
        _selection = ({name: _reference(name) for name in names}, "reference")
        return _selection
    chosen, missing = {}, []
    for name in names:
        try:
            chosen[name] = compiled_module(name)
        except ImportError:
            chosen[name] = _reference(name)
            missing.append(name)
    if missing:
        warnings.warn(
            f"zephon: compiled kernels {', '.join(missing)} are not built; using the pure "
            "Python references (much slower). Build with `pip install -e .`.",
            RuntimeWarning, stacklevel=3)
    kind = "compiled" if not missing else ("reference" if len(missing) == len(names)
                                           else "mixed")
    _selection = (chosen, kind)
    return _selection


def loaded() -> dict[str, str]:
    """Which implementation each kernel module runs: ``{name: "compiled" | "reference"}``
    (selecting them if nothing has yet)."""
    chosen = _select()[0]
    return {name: "reference" if module.__name__.endswith("_ref") else "compiled"
            for name, module in chosen.items()}


def __getattr__(name: str):
    if name == "IMPLEMENTATION":
        return _select()[1]
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zephon.kernels' has no attribute {name!r}")
    value = getattr(_select()[0][module], name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
