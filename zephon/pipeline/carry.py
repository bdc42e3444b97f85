"""What the accumulators hold at a boundary: its lineage, its encoding, its rebuilding.

A flush boundary is a resume point (a replay starts there), but ``batch``,
the packers and ``ensure_mixture`` keep what they hold across it (see :mod:`zephon.pipeline.ops`).
So a replay state records, with its boundary, the *carry*: for each carrying
accumulator of the lane, in chain order, the lineage of what it held when the
boundary marker passed it. A restore rebuilds those records from their lineage
(re-reading the samples through the ops upstream of the accumulator: sources
are random access, stateless ops deterministic, ``ctx.rng`` seeded by the
sample's identity) and puts them back before the segment replays.

Layout (:func:`~zephon.pipeline.plan.carry_layout`, ``plan.carry_layout``) is a
pure function of the plan's steps: one
slot per carrying accumulator (an op that
:class:`~zephon.pipeline.ops.base.HoldsRecords`,
:class:`~zephon.pipeline.ops.base.HoldsPieces`,
:class:`~zephon.pipeline.ops.base.HoldsBins` or
:class:`~zephon.pipeline.ops.base.HoldsQueue`), each with the *shape* of the
records entering it:

- ``("sample",)``: a sample through the stateless ops; lineage ``(epoch, p)``;
- ``("run", size)``: a fused micro-batch (``read -> map* -> batch``): the
  ``size`` lane positions ending at ``(epoch, p)``; lineage ``(epoch, p)``;
- ``("records", size, inner)``: a record a serial op holding records made of
  ``size`` records (a ``batch``): its members' lineages;
- ``("pieces", size, inner)``: a record a serial op holding pieces made of
  ``size`` tokens (a packed row): ``(lineage, a, b)`` per piece (tokens
  ``[a, b)`` of that input record);
- ``("bins", size, bins, inner)``: a record a serial op holding bins made
  (a ``pack_documents`` row of 1 to ``size`` tokens), pieces as for
  ``pieces``; what such an op holds is up to ``bins`` open bins of pieces;
- ``("queue", most, inner)``: what a reorder buffer holds (``ensure_mixture``,
  :class:`~zephon.pipeline.ops.base.HoldsQueue`): up to ``most`` of its input
  records, in the order it holds them. It makes no records (it hands on those it
  reads), so the records after it have the shape of those before it.

A fused batch's slot holds the count of samples held (always the lane positions
just before the boundary); a ``batch`` slot the lineages of fewer than ``size``
records; a ``pack_tokens`` slot the pieces of fewer than ``seq_len`` tokens; a
``pack_documents`` slot its open bins (each of 1 to ``seq_len - 1`` tokens); an
``ensure_mixture`` slot the lineages of up to its buffer's bound of records. An
op that holds nothing (a ``shuffle`` drains at a boundary) has no slot.

Encoding (:func:`encode_carry`) is a flat list of non-negative ints appended to
the lane's replay entry (``[epoch, k, since, total, *carry]``): a record is
``epoch, p`` or ``m`` followed by its ``m`` members (pieces: member, ``a``,
``b``; a ``bins`` slot: the count of bins, then each bin as a row; a ``queue``
slot: the count of records, then each record).
:func:`decode_carry` reads it back strictly against the plan: every
count exact (a held batch record has exactly ``size`` members, a packed row
exactly ``seq_len`` tokens), every position inside the lane, at or after the
run's first epoch and before the boundary, nothing left over; anything else is
a :class:`~zephon.errors.CheckpointError`. :class:`Rebuilder` turns decoded
lineage into records; a rebuilt record a filter now drops, or a piece beyond
its record's tokens, is a CheckpointError too (the state is not this
pipeline's).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from zephon.errors import CheckpointError
from zephon.pipeline.lanes import ReadUnit, _joined, lane_source_index, positions_before
from zephon.pipeline.ops import HoldsBins, HoldsPieces, HoldsRecords
from zephon.pipeline.plan import SerialStep, carrier, maker
from zephon.pipeline.records import Record
from zephon.transport.failure import UnitFailure

__all__ = ["Rebuilder", "carry_bounds", "decode_carry", "encode_carry", "held_units"]

#: Records or pieces one entry of a carry may list (far above any real batch or row).
MAX_ITEMS = 1 << 20


def _encode(shape: tuple, lin: Any, out: list) -> None:
    kind = shape[0]
    if kind in ("sample", "run"):
        out.extend((int(lin[0]), int(lin[1])))
    elif kind == "records":
        out.append(len(lin))
        for member in lin:
            _encode(shape[2], member, out)
    else:
        out.append(len(lin))
        for member, a, b in lin:
            _encode(shape[-1], member, out)
            out.extend((int(a), int(b)))


def encode_carry(layout: tuple, carry: tuple) -> tuple:
    """The flat ints of a boundary's carry (one entry per slot of ``layout``)."""
    out: list = []
    for (where, shape), held in zip(layout, carry, strict=True):
        if where == "count":
            out.append(int(held))
        elif shape[0] == "queue":  # a reorder buffer's records, in its order
            out.append(len(held))
            if shape[2][0] in ("sample", "run"):  # positions: thousands at each boundary
                out.extend(map(int, itertools.chain.from_iterable(held)))
            else:
                for member in held:
                    _encode(shape[2], member, out)
        elif shape[0] == "bins":  # the packer's open bins, each a row of pieces
            out.append(len(held))
            for pieces in held:
                _encode(shape, pieces, out)
        else:
            _encode(shape, held, out)
    return tuple(out)


class _Reader:
    """Reads a flat carry strictly: every value an int within its bounds, in order."""

    def __init__(self, ints: list, where: str, bounds: dict) -> None:
        self.ints, self.i, self.where, self.bounds = ints, 0, where, bounds

    def fail(self, what: str):
        raise CheckpointError(f"corrupt checkpoint: {self.where} carry: {what}")

    def int(self, what: str, low: int, high: int) -> int:
        if self.i >= len(self.ints):
            self.fail(f"ends before its {what}")
        value = self.ints[self.i]
        if type(value) is not int or not low <= value <= high:
            self.fail(f"{what} = {value!r:.40} is outside [{low}, {high}]")
        self.i += 1
        return value

    def position(self, shape: tuple) -> tuple:
        b = self.bounds
        epoch = self.int("epoch", b["first_epoch"], b["epoch"])
        p = self.int("lane position", 0, max(0, b["length"] - 1))
        if (epoch, p) >= (b["epoch"], b["pos"]):
            self.fail(f"position ({epoch}, {p}) is not before its boundary "
                      f"({b['epoch']}, {b['pos']})")
        if shape[0] == "run" and (epoch - b["first_epoch"]) * b["length"] + p + 1 < shape[1]:
            self.fail(f"a batch of {shape[1]} ending at ({epoch}, {p}) starts before the run")
        return (epoch, p)

    def record(self, shape: tuple, held: bool = False) -> Any:
        """The lineage of one record of ``shape`` (``held``: an accumulator's remainder,
        which is short, instead of one of its full outputs)."""
        kind = shape[0]
        if kind in ("sample", "run"):
            return self.position(shape)
        size = shape[1]
        if kind == "queue":  # only ever what a reorder buffer holds
            m = self.int("queued records", 0, min(size, MAX_ITEMS))
            return [self.record(shape[2]) for _ in range(m)]
        if kind == "records":
            m = self.int("batch members", 0, size - 1) if held else \
                self.int("batch members", size, size)
            return [self.record(shape[2]) for _ in range(m)]
        if kind == "bins":
            return self.bins(shape, held)
        pieces, tokens = self.pieces(shape)
        if (held and tokens >= size) or (not held and tokens != size) or (not held and not pieces):
            self.fail(f"a packed {'remainder' if held else 'row'} of {tokens} token(s) with "
                      f"seq_len={size}")
        return pieces

    def pieces(self, shape: tuple) -> tuple:
        """A packed row's pieces (members of ``shape[-1]``) and their token count."""
        m = self.int("packed pieces", 0, min(shape[1], MAX_ITEMS))
        pieces, tokens = [], 0
        for _ in range(m):
            member = self.record(shape[-1])
            a = self.int("piece start", 0, MAX_ITEMS * 1024)
            b = self.int("piece end", a + 1, MAX_ITEMS * 1024)
            tokens += b - a
            pieces.append((member, a, b))
        return pieces, tokens

    def bins(self, shape: tuple, held: bool) -> list:
        """A ``pack_documents`` row (1 to ``seq_len`` tokens), or what the packer held (up
        to ``shape[2]`` open bins of 1 to ``seq_len - 1`` tokens each)."""
        size = shape[1]
        count = self.int("open bins", 0, shape[2]) if held else 1
        rows = []
        for _ in range(count):
            pieces, tokens = self.pieces(shape)
            if not 1 <= tokens <= size - held:
                self.fail(f"a packed {'bin' if held else 'row'} of {tokens} token(s) with "
                          f"seq_len={size}")
            rows.append(pieces)
        return rows if held else rows[0]


def carry_bounds(plan, lane: int, epoch: int, k: int, first_epoch: int) -> dict:
    """What a carry held at boundary ``(epoch, k)`` of ``lane`` may refer to, for
    :func:`decode_carry` (``first_epoch``: the run's first epoch)."""
    return {"epoch": epoch, "pos": k * plan.spec.chunk_size, "first_epoch": first_epoch,
            "length": plan.lane_length(lane)}


def decode_carry(layout: tuple, ints: list, where: str, bounds: dict) -> list:
    """The carry slots encoded in ``ints``, checked (see the module docstring).

    ``bounds``: ``epoch``/``pos`` (the boundary: epoch and lane position), ``first_epoch``
    (the run's first epoch) and ``length`` (the lane's samples per epoch)."""
    reader = _Reader(ints, where, bounds)
    slots: list = []
    for slot, shape in layout:
        if slot == "count":
            b = bounds
            before = (b["epoch"] - b["first_epoch"]) * b["length"] + b["pos"]
            slots.append(reader.int("held samples", 0, min(shape - 1, before)))
        else:
            slots.append(reader.record(shape, held=True))
    if reader.i != len(ints):
        reader.fail(f"{len(ints) - reader.i} value(s) left over")
    return slots


class Rebuilder:
    """Records of one lane rebuilt from their lineage, through the plan's ops, in the
    engine's process (``program``: the plan's :class:`StageProgram`)."""

    def __init__(self, plan, program, lane: int) -> None:
        self.plan, self.program, self.lane = plan, program, lane
        p = plan.spec
        self.where = (len(p.source), p.seed, p.permute, p.chunk_size, plan.lanes, lane)

    def fail(self, what: str):
        raise CheckpointError(f"lane {self.lane}: restoring the carry failed: {what}: the "
                              "state does not belong to this pipeline and data")

    def _stage(self, stage: int, unit) -> Record:
        out = self.program((stage, unit))
        if type(out) is UnitFailure:  # the op's own error, raised as the inline runner would
            raise out.error
        if len(out) != 1:
            self.fail(f"stage {stage} gave {len(out)} record(s) for one carried record")
        return out[0]

    def _base(self, pos: tuple) -> Record:
        epoch, p = pos
        fused = self.plan.fused_batch
        if fused is not None:
            parts = positions_before(*self.where, epoch, p + 1, fused.size)
            if sum(len(u) for u in parts) != fused.size:
                self.fail(f"no batch of {fused.size} ends at {pos}")
            return self._stage(0, _joined(parts))
        index = lane_source_index(*self.where, epoch, p)
        return self._stage(0, ReadUnit(epoch, p, np.array([index], dtype=np.int64)))

    def record(self, i: int, lin: Any) -> Record:
        """The record entering ``plan.steps[i]`` whose lineage is ``lin``."""
        steps = self.plan.steps
        j, stages = i - 1, []
        op = None
        while j >= 0:
            step = steps[j]
            if isinstance(step, SerialStep):
                op = maker(step)  # a queue hands on the records it read: look past it
                if op is not None:
                    break
            else:
                stages.append(step.stage)
            j -= 1
        stages.reverse()
        if j < 0:
            rec = self._base(lin)
            stages = stages[1:]  # stage 0 read it
        elif isinstance(op, HoldsRecords):
            rec = op.remake([self.record(j, m) for m in lin], lin)
        else:  # pieces, or a bin's row of pieces
            assert isinstance(op, (HoldsPieces, HoldsBins))
            rec = op.remake([self.piece(j, m) for m in lin], lin)
        for stage in stages:
            rec = self._stage(stage, [rec])  # a map keeps the lineage (``lin``)
        return rec

    def piece(self, i: int, lin: tuple) -> tuple:
        """``(record, a, b)``: a packer's piece rebuilt (its record enters step ``i``)."""
        member, a, b = lin
        rec = self.record(i, member)
        op = carrier(self.plan.steps[i])
        assert isinstance(op, (HoldsPieces, HoldsBins))
        n = op.piece_length(rec)
        if b > n:
            self.fail(f"a piece of tokens [{a}, {b}) of a record of {n} token(s)")
        return rec, a, b


def held_units(plan, lane: int, epoch: int, k: int, count: int) -> list:
    """Read units of the ``count`` samples a fused batch held at boundary ``(epoch, k)``."""
    p = plan.spec
    return positions_before(len(p.source), p.seed, p.permute, p.chunk_size, plan.lanes, lane,
                            epoch, k * p.chunk_size, count) if count else []

