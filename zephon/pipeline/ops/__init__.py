"""The ops of a pipeline: one module per op, behind the contracts of :mod:`.base`.

- :mod:`.map`: ``map``, ``filter``, ``map_batch`` (StatelessOp)
- :mod:`.shuffle`: ``shuffle`` (SerialOp, holds nothing across a boundary)
- :mod:`.batch`: ``batch`` and :func:`make_batch` (HoldsRecords)
- :mod:`.pack_tokens`: ``pack_tokens`` (HoldsPieces)
- :mod:`.pack_documents`: ``pack_documents`` (HoldsBins)
- :mod:`.ensure_mixture`: ``ensure_mixture`` (HoldsQueue: a reorder buffer)

``tokenize`` and ``tokenize_chat`` (batched StatelessOps) live in
:mod:`zephon.pipeline.text` and register themselves there with :func:`register`,
as an op defined outside this package does (importing them needs nothing of
the ``text`` extra; running them does).

Adding an op
------------
1. Write ``zephon/pipeline/ops/<name>.py``: a class subclassing
   :class:`~.base.StatelessOp` (``apply_one``) or :class:`~.base.SerialOp`
   (``start`` returning an :class:`~.base.Accumulator`; an op that keeps data
   across a boundary subclasses :class:`~.base.HoldsRecords` or
   :class:`~.base.HoldsPieces`, :class:`~.base.HoldsBins` or
   :class:`~.base.HoldsQueue` and returns a
   :class:`~.base.CarryingAccumulator`), with a unique ``kind``, its traits and a
   ``describe()`` that names everything defining its output (the fingerprint); an op
   that makes token arrays with fields aligned to them, or hands its input's fields on
   unchanged, says so with ``aligned_with()`` (what a packer after it packs).
2. Register it: add the class to :data:`BUILTIN_OPS` below (an op defined
   outside zephon calls :func:`register`). The plan refuses an op whose class is
   not registered under its kind.
3. Give it a builder method on :class:`~zephon.pipeline.Pipeline` (the public
   name: ``self._with(TheOp(...))``).

The plan (:mod:`zephon.pipeline.plan`), the engine, the dispatch and the carry
(:mod:`zephon.pipeline.carry`) read only the contracts and traits. Three places
name a built-in op for what only it does: the plan fuses ``batch`` into the
stage that reads, the stage program names the op that made an unpicklable
value (a ``filter`` makes none), and validation probes ``map`` and ``filter``
on the first sample.
"""

from __future__ import annotations

from zephon.errors import OpError, ZephonConfigError
from zephon.pipeline.ops.base import (
    PASSES_ON,
    Accumulator,
    CarryingAccumulator,
    HoldsBins,
    HoldsPieces,
    HoldsQueue,
    HoldsRecords,
    Op,
    OpContext,
    SerialOp,
    StatelessOp,
)
from zephon.pipeline.ops.batch import BatchOp, make_batch
from zephon.pipeline.ops.ensure_mixture import EnsureMixtureOp
from zephon.pipeline.ops.map import FilterOp, MapBatchOp, MapOp
from zephon.pipeline.ops.pack_documents import PackDocumentsOp
from zephon.pipeline.ops.pack_tokens import PackTokensOp
from zephon.pipeline.ops.shuffle import ShuffleOp

__all__ = ["BUILTIN_OPS", "PASSES_ON", "REGISTRY", "Accumulator", "BatchOp", "CarryingAccumulator",
           "EnsureMixtureOp", "FilterOp", "HoldsBins", "HoldsPieces", "HoldsQueue",
           "HoldsRecords", "MapBatchOp", "MapOp",
           "Op", "OpContext", "OpError", "PackDocumentsOp", "PackTokensOp", "SerialOp",
           "ShuffleOp", "StatelessOp",
           "check_registered", "make_batch", "register"]

#: kind -> the op class registered under it
REGISTRY: dict[str, type[Op]] = {}


def register(cls: type[Op]) -> type[Op]:
    """Register op class ``cls`` under its ``kind`` (usable as a class decorator).

    Checks that it fulfils one contract: exactly one of StatelessOp or SerialOp, no
    abstract method left, a ``kind`` that is a non-empty identifier, and a kind no other
    class holds (the kind starts its ``describe()``, so two classes under one kind could
    share a fingerprint, and a checkpoint of one would restore into the other).
    Registering the same class again is a no-op.

    Raises:
        ZephonConfigError: naming the class and what it lacks.
    """
    name = f"{cls.__module__}.{cls.__qualname__}"
    if not isinstance(cls, type) or issubclass(cls, StatelessOp) == issubclass(cls, SerialOp):
        raise ZephonConfigError(f"op class {name} must subclass exactly one of "
                                "StatelessOp and SerialOp (zephon.pipeline.ops.base)")
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if abstract:
        raise ZephonConfigError(f"op class {name} does not implement {', '.join(abstract)}")
    kind = cls.__dict__.get("kind")
    if not isinstance(kind, str) or not kind.isidentifier():
        raise ZephonConfigError(f"op class {name} must set its own kind (an identifier), "
                                f"got {kind!r}")
    held = REGISTRY.get(kind)
    if held is not None and held is not cls:
        raise ZephonConfigError(f"op kind {kind!r} of {name} is already registered by "
                                f"{held.__module__}.{held.__qualname__}")
    REGISTRY[kind] = cls
    return cls


def check_registered(op: Op) -> None:
    """Refuse an op whose class is not the one registered under its kind."""
    cls = type(op)
    if REGISTRY.get(cls.kind) is not cls:
        raise ZephonConfigError(
            f"op {op!r} of class {cls.__module__}.{cls.__qualname__} is not a registered "
            "op: register its class with zephon.pipeline.ops.register (see "
            "zephon.pipeline.ops)")


#: The ops zephon defines, registered at import (the one place an op is added).
BUILTIN_OPS: tuple[type[Op], ...] = (MapOp, FilterOp, MapBatchOp, ShuffleOp, BatchOp,
                                     PackTokensOp, PackDocumentsOp, EnsureMixtureOp)
for _op in BUILTIN_OPS:
    register(_op)
