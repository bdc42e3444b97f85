"""The op and accumulator contracts every op implements, and what ops share.

An op is one of two kinds:

- :class:`StatelessOp` (``map``, ``filter``, ``map_batch``): ``apply_one(record,
  seed)`` gives the record's output record, or None to drop it. It runs inside a
  parallel stage (:class:`~zephon.pipeline.program.StageProgram`), possibly in
  another process, one sample at a time; it must be picklable there and
  deterministic (randomness from ``ctx.rng``, seeded by the sample identity; a
  ``map`` or ``filter`` may draw from the global generators when they are seeded for
  it before each call: ``Plan.global_rngs``, :mod:`zephon.pipeline.rngs`).
- :class:`SerialOp` (``shuffle``, ``batch``, ``pack_tokens``): ``start(seed,
  lane, boundary)`` gives an :class:`Accumulator` for one lane, started at the
  lane's first boundary, run serially by the engine (so micro-batch boundaries
  never depend on which worker finished first).

Traits (class attributes) tell the plan what an op needs, so that the plan,
the engine and :mod:`zephon.pipeline.carry` never name a concrete op:
``parallelism`` (workers it asks for), ``preserves_cursor_order`` (False: the
stream needs flush boundaries and replay resume), ``batch_shape_sensitive``
(the unit boundaries it sees matter: its units are never cut), for a
stateless op ``one_to_one`` (one output per input, never dropped), and for a
serial op ``expands`` (it may give more items than it reads) and what its
accumulator holds across a boundary: nothing (it drains there, like a
shuffle), whole records (:class:`HoldsRecords`, like a batch remainder) or
pieces of records (:class:`HoldsPieces`, like a packer's unfinished row),
open bins of pieces (:class:`HoldsBins`, a bin packer's open rows) or its input
records themselves, to hand them on unchanged later (:class:`HoldsQueue`, a
reorder buffer: ``ensure_mixture``). Those four shapes are the checkpoint's carry
vocabulary: a new op that keeps data across a boundary holds one of them.

Fields (:meth:`Op.aligned_with`): an op may say which fields of the records it makes
are aligned element by element with a token array (a chat op's ``loss_mask``, one value
per token), or that it hands a field on as it got it (:data:`PASSES_ON`: a filter, a
shuffle, a reorder buffer); by default it says nothing (a user ``map`` may keep, change
or drop any field). A packer built without ``aligned=`` packs what the op that made its
token field declares (:func:`~zephon.pipeline.plan.upstream_aligned`), so no field an
upstream op made aligned is dropped unasked.

Accumulator lifecycle (per lane): ``start`` at the first Boundary; then
``push(records) -> emitted`` per unit and ``boundary(marker) -> emitted`` at
each later Boundary (what it gives up there); ``drain() -> emitted`` at the end
of the lane. A :class:`CarryingAccumulator` also gives ``carry()`` (the lineage
of what it holds, taken as a marker passes) and takes ``load(held)`` (rebuilt
held records or pieces, put back once, right after ``start``, on a restore).
``describe()`` is the op's part of the pipeline fingerprint.
"""

from __future__ import annotations

import abc
import inspect
import zlib
from collections.abc import Sequence
from typing import Any, Callable, ClassVar, Final, Literal, Union

import numpy as np

from zephon.errors import OpError, ZephonConfigError
from zephon.options._spec import check_int
from zephon.pipeline.records import Boundary, Record

__all__ = ["PASSES_ON", "Accumulator", "Aligned", "CarryingAccumulator", "HoldsBins",
           "HoldsPieces", "HoldsQueue", "HoldsRecords", "Op",
           "OpContext", "SerialOp", "StatelessOp", "check_aligned", "check_int",
           "made_lineage", "op_error", "op_refusal", "pos_lineage", "wants_ctx"]

#: What :meth:`Op.aligned_with` answers for a field the op hands on as it got it.
PASSES_ON: Final = "passes on"
#: An answer of :meth:`Op.aligned_with`: the aligned fields (a tuple), :data:`PASSES_ON`,
#: or None (the op does not say).
Aligned = Union[tuple[str, ...], Literal["passes on"], None]


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode())


class OpContext:
    """What an op may know about the sample it runs on; ``rng`` is seeded from its identity.

    ``rng`` is a NumPy generator seeded from ``[seed, crc32(source), index, epoch]`` for
    the pipeline's first per-sample op (``ordinal`` 0), and from that key plus the op's
    ordinal for each later one (the ordinal counts the ``map``/``filter``/... ops in
    chain order), so two ops drawing on one sample draw independent numbers.
    """

    __slots__ = ("_rng", "ordinal", "sample_id", "seed")

    def __init__(self, sample_id, seed: int, ordinal: int = 0) -> None:
        self.sample_id, self.seed, self.ordinal = sample_id, seed, ordinal
        self._rng: np.random.Generator | None = None

    @property
    def rng(self) -> np.random.Generator:
        if self._rng is None:
            source, index, epoch = self.sample_id
            key = [self.seed, _stable_hash(source), index, epoch]
            if self.ordinal:
                key.append(self.ordinal)
            self._rng = np.random.default_rng(key)
        return self._rng


def wants_ctx(fn: Callable) -> bool:
    """Whether ``fn`` takes two positional arguments (the sample and its ``ctx``)."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2


def op_refusal(op: Op, record: Record, what: str) -> OpError:
    """The OpError of ``op`` failing on ``record`` for the reason ``what``, naming its
    sample(s)."""
    sample = record.ids[0] if len(record.ids) == 1 else list(record.ids)  # a plain list
    shown = sample if not isinstance(sample, list) or len(sample) <= 4 else \
        f"[{sample[0]}, ..., {sample[-1]}] ({len(sample)} samples)"
    return OpError(f"op {op.name} failed on sample {shown}: {what}", op=op.name,
                   sample_id=sample)


def op_error(op: Op, record: Record, exc: BaseException) -> OpError:
    """The OpError of ``op`` failing on ``record`` with ``exc``, naming its sample(s)."""
    return op_refusal(op, record, f"{type(exc).__name__}: {exc}")


def check_aligned(kind: str, field: str, aligned: Sequence[str],
                  reserved: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A packer's ``aligned=`` checked: distinct non-empty field names, none of them its
    token ``field`` or a key it makes itself (``reserved``)."""
    if isinstance(aligned, str) or not isinstance(aligned, Sequence) or \
            not all(isinstance(a, str) and a for a in aligned):
        raise ZephonConfigError(f"{kind}: aligned must be a sequence of field names, "
                                f"got {aligned!r}")
    names = tuple(aligned)
    clash = [a for a in names if a in (field, *reserved)] or \
        [a for a in names if names.count(a) > 1]
    if clash or field in reserved:
        keys = ", ".join(map(repr, (field, *reserved)))
        raise ZephonConfigError(f"{kind}: field {clash[0] if clash else field!r} is named "
                                f"twice (the row's keys are {keys} and aligned {names})")
    return names


class Op(abc.ABC):
    """An op of a pipeline (see the module docstring for the traits)."""

    #: the op's name in the registry, ``explain()``, statistics and the fingerprint
    kind: ClassVar[str] = "op"
    #: True for a :class:`StatelessOp`, False for a :class:`SerialOp`
    stateless: ClassVar[bool]
    #: workers the op asks for (summed over a stage)
    parallelism: int = 1
    #: False: the op carries history across samples (a restore replays from a boundary)
    preserves_cursor_order: ClassVar[bool] = True
    #: True: the op sees units whole (their boundaries matter to it)
    batch_shape_sensitive: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self.kind

    def describe(self) -> str:
        """The op's part of the pipeline fingerprint: everything that defines its output."""
        return self.name

    def aligned_with(self, field: str) -> Aligned:
        """What the op says of the fields aligned with the token array ``field`` of the
        records it gives: a tuple of field names when it makes ``field`` (each holds one
        value per token, a chat op's ``loss_mask``; empty: none), :data:`PASSES_ON` when it
        hands ``field`` and the fields beside it on as it got them, None when it does not
        say (the default: a user function may keep, change or drop any field)."""
        return None


class StatelessOp(Op):
    """A per-record op run inside a parallel stage."""

    stateless = True
    #: True: exactly one output record per input record, never dropped (a ``batch``
    #: right after such ops can be formed where the samples are read)
    one_to_one: ClassVar[bool] = False

    #: True: the stage hands the op every record of a dispatch part at once
    #: (:meth:`apply_many`; ``tokenize`` makes one tokenizer call per part)
    batched: ClassVar[bool] = False

    @abc.abstractmethod
    def apply_one(self, r: Record, seed: int) -> Record | None:
        """This op on one record: its output record, or None when the sample is dropped.
        A stage runs each sample through all of its ops before the next sample
        (:class:`~zephon.pipeline.program.StageProgram`)."""

    def apply_many(self, records: list, seed: int) -> list:
        """This op on every record of a part, in order (a ``batched`` op overrides it; the
        first failing sample's error is raised, with the records before it)."""
        out = []
        for r in records:
            made = self.apply_one(r, seed)
            if made is not None:
                out.append(made)
        return out


class SerialOp(Op):
    """An op run by one accumulator per lane in the engine's process."""

    stateless = False
    #: what its accumulator holds across a boundary: None (nothing), "records", "pieces",
    #: "bins" or "queue"
    holds: ClassVar[str | None] = None
    #: True: it may give more items than it reads samples (no static bound per segment)
    expands: ClassVar[bool] = False

    @abc.abstractmethod
    def start(self, seed: int, lane: int, boundary: Boundary) -> Accumulator:
        """A new accumulator for ``lane``, at the lane's first boundary ``boundary``."""


class HoldsRecords(SerialOp):
    """A serial op whose accumulator holds fewer than :meth:`made_size` whole records
    across a boundary, and makes each output record of exactly that many (a batch)."""

    holds = "records"

    @abc.abstractmethod
    def made_size(self) -> int:
        """Records per record it makes (all but the stream's last)."""

    @abc.abstractmethod
    def remake(self, members: list, lin: Any) -> Record:
        """The record it made of ``members`` (rebuilt on a restore), with lineage ``lin``."""


class HoldsPieces(SerialOp):
    """A serial op whose accumulator holds pieces ``(record, a, b)`` (tokens ``[a, b)`` of
    a record) of fewer than :meth:`made_size` tokens across a boundary, and makes each
    output record of exactly that many tokens (a packer)."""

    holds = "pieces"

    @abc.abstractmethod
    def made_size(self) -> int:
        """Tokens per record it makes (all but the stream's last)."""

    @abc.abstractmethod
    def piece_length(self, record: Record) -> int:
        """Tokens of an input record (a piece of it lies within ``[0, piece_length)``)."""

    @abc.abstractmethod
    def remake(self, pieces: list, lin: Any) -> Record:
        """The record it made of ``pieces`` (rebuilt on a restore), with lineage ``lin``."""


class HoldsBins(SerialOp):
    """A serial op whose accumulator holds up to :attr:`carried_bins` open bins of pieces
    ``(record, a, b)`` across a boundary, each of 1 to :meth:`made_size` - 1 tokens, and
    makes records of 1 to :meth:`made_size` tokens (a bin packer: ``pack_documents``)."""

    holds = "bins"

    @property
    @abc.abstractmethod
    def carried_bins(self) -> int:
        """The most bins a lane holds at a boundary."""

    @abc.abstractmethod
    def made_size(self) -> int:
        """The most tokens of a record it makes (its slots per row)."""

    @abc.abstractmethod
    def piece_length(self, record: Record) -> int:
        """Tokens of an input record (a piece of it lies within ``[0, piece_length)``)."""

    @abc.abstractmethod
    def remake(self, pieces: list, lin: Any) -> Record:
        """The record it made of ``pieces`` (rebuilt on a restore), with lineage ``lin``."""


class HoldsQueue(SerialOp):
    """A serial op whose accumulator holds up to :attr:`carried_records` of its input
    records across a boundary and emits its input records themselves, unchanged, in an
    order of its own (a reorder buffer: ``ensure_mixture``). What it emits has the shape
    of what it reads: to the carry it is transparent, except for what it holds."""

    holds = "queue"

    def aligned_with(self, field: str) -> Aligned:
        return PASSES_ON  # it emits its input records themselves

    @property
    @abc.abstractmethod
    def carried_records(self) -> int:
        """The most records a lane holds at a boundary."""


class Accumulator(abc.ABC):
    """One lane's state of a :class:`SerialOp` (see the module docstring)."""

    def count_into(self, stats, node: str) -> None:  # noqa: B027 - an optional hook
        """Count what it emits in the run's node statistics ``stats`` under ``node``
        (called once, at the lane's first boundary; ``stats`` is None unless
        ``execution_tracking="nodes"``). Most accumulators count nothing of their own."""

    @abc.abstractmethod
    def push(self, records: list) -> list:
        """The records it emits after taking ``records`` (a unit), in order."""

    @abc.abstractmethod
    def boundary(self, marker: Boundary) -> list:
        """What it gives up at a later boundary ``marker`` (a shuffle drains)."""

    @abc.abstractmethod
    def drain(self) -> list:
        """What it gives up at the end of the lane."""


def pos_lineage(record: Record) -> Any:
    """The lineage of a sample record (or of a fused batch: the lane positions up to its
    ``pos``): its lane position."""
    return record.pos


def made_lineage(record: Record) -> Any:
    """The lineage of a record an accumulator made: what it recorded on ``lin``."""
    return record.lin


class CarryingAccumulator(Accumulator):
    """An accumulator that keeps what it holds across boundaries (its op
    :class:`HoldsRecords`, :class:`HoldsPieces`, :class:`HoldsBins` or
    :class:`HoldsQueue`).

    The engine sets, before any push: ``lineage`` (how to take an input record's
    lineage: :func:`pos_lineage` for sample records, :func:`made_lineage` for records
    an earlier accumulator made) and ``tracks`` (whether a record it makes must record
    its members' lineage on ``lin``: a later accumulator may hold it)."""

    def __init__(self) -> None:
        self.lineage: Callable[[Record], Any] = pos_lineage
        self.tracks = False

    @abc.abstractmethod
    def carry(self) -> list:
        """The lineage of what it holds now (records, or ``(lineage, a, b)`` pieces)."""

    @abc.abstractmethod
    def load(self, held: list) -> None:
        """Put back what it held at the boundary a restore starts at (rebuilt records, or
        ``(record, a, b)`` pieces)."""
