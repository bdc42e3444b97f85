"""``pack_tokens(seq_len, field, drop_remainder, aligned)``: rows of ``seq_len`` tokens
(serial, holds pieces).

Concatenates the token arrays (``value[field]``, flattened) of the lane's
records and cuts rows of exactly ``seq_len`` tokens, each a
``{field: array, *aligned}`` record: every ``aligned`` field (a chat ``loss_mask``, one
number per token) is cut exactly as the tokens are (a record whose aligned field has
not one value per token is an OpError naming it); the record's other fields are not
part of a row. The pieces of an unfinished row stay across
boundaries and epoch starts (they are the boundary's carry). The stream's final
remainder is a last short row, dropped with ``drop_remainder=True``; it is a
:class:`ShortRow` record, which a ``batch`` after the packer (directly, or through a
``shuffle``) never stacks with full rows: it is a batch of its own after them, and
``drop_last=True`` drops it (:mod:`zephon.pipeline.ops.batch`). A row may
hold tokens of several records and a record's tokens may span several rows:
the op does not preserve cursor order (replay resume) and may give more items
than it reads (``expands``). A record with no tokens contributes nothing (and is
not among a row's ``sample_ids``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zephon.errors import OpError, ZephonConfigError
from zephon.pipeline.ops.base import (
    Aligned,
    CarryingAccumulator,
    HoldsPieces,
    check_aligned,
    check_int,
    op_refusal,
)
from zephon.pipeline.records import Boundary, Record

__all__ = ["PackTokensOp", "ShortRow"]


class ShortRow(Record):
    """The lane's last packed row of the run when it has fewer than ``seq_len`` tokens (a
    record like any other; its type is the mark ``batch`` reads). It lives in the
    engine's process, where serial ops run: a stage after the packer makes new records,
    which are plain again."""

    __slots__ = ()


class PackTokensOp(HoldsPieces):
    """``pack_tokens(seq_len, field, drop_remainder)``: rows of exactly ``seq_len`` tokens."""

    kind = "pack_tokens"
    preserves_cursor_order = False
    expands = True

    def __init__(self, seq_len: int, field: str = "tokens", drop_remainder: bool = False,
                 aligned=()) -> None:
        self.seq_len = check_int("pack_tokens", "seq_len", seq_len, 1)
        if not isinstance(field, str) or not field:
            raise ZephonConfigError(f"pack_tokens: field must be a non-empty string, got {field!r}")
        if not isinstance(drop_remainder, bool):
            raise ZephonConfigError(f"pack_tokens: drop_remainder must be True or False, got "
                                    f"{drop_remainder!r}")
        self.field, self.drop_remainder = field, drop_remainder
        self.aligned = check_aligned("pack_tokens", field, aligned)

    def describe(self) -> str:
        aligned = f", aligned={list(self.aligned)}" if self.aligned else ""
        tail = ", drop_remainder=True" if self.drop_remainder else ""
        return f"pack_tokens({self.seq_len}, {self.field!r}{aligned}{tail})"

    def aligned_with(self, field: str) -> Aligned:
        return self.aligned if field == self.field else ()

    def start(self, seed: int, lane: int, boundary: Boundary) -> _PackState:
        return _PackState(self)

    def tokens(self, record: Record) -> np.ndarray:
        """The flat token array of an input record (an OpError naming the sample if it has
        no such field)."""
        try:
            return np.asarray(record.value[self.field]).reshape(-1)
        except (KeyError, TypeError, IndexError) as exc:
            raise OpError(f"op pack_tokens failed on sample {record.ids[0]}: no token field "
                          f"{self.field!r} ({exc})", op="pack_tokens",
                          sample_id=record.ids[0]) from exc

    def column(self, record: Record, name: str) -> np.ndarray:
        """The flat aligned field ``name`` of an input record: numbers, one per token (an
        OpError naming the sample and the field otherwise)."""
        try:
            values = np.asarray(record.value[name]).reshape(-1)
        except (KeyError, TypeError, IndexError) as exc:
            raise op_refusal(self, record, f"no aligned field {name!r} ({exc})") from exc
        n = self.tokens(record).size
        if values.size != n:
            raise op_refusal(self, record, f"aligned field {name!r} has {values.size} "
                             f"value(s) for {n} token(s) of {self.field!r}")
        if values.dtype.kind not in "biuf" and values.size:
            raise op_refusal(self, record, f"aligned field {name!r} holds {values.dtype} "
                             "values, not numbers")
        return values

    def aligned_values(self, pieces) -> dict:
        """The aligned fields of the row made of ``pieces`` (``(record, a, b)`` each: values
        ``[a, b)`` of that record), cut as its tokens are."""
        out = {}
        for name in self.aligned:
            parts = [self.column(r, name)[a:b] for r, a, b in pieces]
            out[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return out

    def made_size(self) -> int:
        return self.seq_len

    def piece_length(self, record: Record) -> int:
        return self.tokens(record).size

    def remake(self, pieces: list, lin: Any) -> Record:
        row = np.concatenate([self.tokens(r)[a:b] for r, a, b in pieces])
        ids = [i for r, _, _ in pieces for i in r.ids]
        value = {self.field: row}
        if self.aligned:
            value.update(self.aligned_values(pieces))
        return Record(value, ids, pieces[-1][0].pos, lin)


class _PackState(CarryingAccumulator):
    """Cuts rows of exactly ``seq_len`` tokens from the concatenated inputs; the pieces of
    an unfinished row stay across boundaries (they are the boundary's carry). A piece is
    tokens ``[a, a + len)`` of one input record: ``arrays[i]`` (a view), ``recs[i]``,
    ``starts[i]`` (parallel lists: a tuple per piece cost more than the rest of a push)."""

    def __init__(self, op: PackTokensOp) -> None:
        super().__init__()
        self.op, self.seq_len, self.field = op, op.seq_len, op.field
        self.arrays: list[np.ndarray] = []
        self.recs: list[Record] = []
        self.starts: list[int] = []
        self.count = 0

    def _row(self) -> Record:
        arrays, recs = self.arrays, self.recs
        row = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)  # one piece: a view
        ids = recs[0].ids if len(recs) == 1 else [i for r in recs for i in r.ids]
        value = {self.field: row}
        if self.op.aligned:
            value.update(self.op.aligned_values(
                [(r, a, a + t.size) for t, r, a in zip(arrays, recs, self.starts, strict=True)]))
        out = Record(value, ids, recs[-1].pos)
        if self.tracks:
            out.lin = self._pieces()
        self.arrays, self.recs, self.starts, self.count = [], [], [], 0
        return out

    def _pieces(self) -> list:
        return [(self.lineage(r), a, a + t.size)
                for t, r, a in zip(self.arrays, self.recs, self.starts, strict=True)]

    def push(self, records: list) -> list:
        out = []
        seq_len, field = self.seq_len, self.field
        for r in records:
            try:
                tokens = np.asarray(r.value[field]).reshape(-1)
            except (KeyError, TypeError, IndexError):
                tokens = self.op.tokens(r)  # raises the OpError naming the sample
            n = tokens.size
            if n == 0:  # nothing to pack: not a piece (a carried piece has 1+ tokens)
                continue
            need = seq_len - self.count
            if n < need:  # the common case: the row is not full yet
                self.arrays.append(tokens)
                self.recs.append(r)
                self.starts.append(0)
                self.count += n
                continue
            a = 0
            while n - a >= need:  # this record completes a row
                b = a + need
                self.arrays.append(tokens if a == 0 and b == n else tokens[a:b])
                self.recs.append(r)
                self.starts.append(a)
                out.append(self._row())
                a, need = b, seq_len
            if a < n:
                self.arrays.append(tokens[a:])
                self.recs.append(r)
                self.starts.append(a)
                self.count = n - a
        return out

    def boundary(self, marker: Boundary) -> list:
        return []

    def carry(self) -> list:
        return self._pieces()

    def load(self, held: list) -> None:
        """Put back rebuilt pieces: ``(record, a, b)`` each."""
        self.arrays = [self.op.tokens(r)[a:b] for r, a, b in held]
        self.recs = [r for r, _, _ in held]
        self.starts = [a for _, a, _ in held]
        self.count = sum(b - a for _, a, b in held)

    def drain(self) -> list:
        if not self.arrays or self.op.drop_remainder:
            self.arrays, self.recs, self.starts, self.count = [], [], [], 0
            return []
        row = self._row()
        return [ShortRow(row.value, row.ids, row.pos, row.lin)]
