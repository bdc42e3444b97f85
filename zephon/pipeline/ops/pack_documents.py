"""``pack_documents(seq_len, ...)``: document-aware packing (serial, holds bins).

What it owns: turning a lane's stream of documents (records with a token array under
``field``) into rows of exactly ``seq_len`` slots that keep the documents' structure.
Every row is ``{field: tokens, "positions": int32, "cu_seqlens": int32, *aligned}``:

- ``field``: the row's tokens, then ``pad_id`` up to ``seq_len`` (the tokens' dtype);
- ``positions``: 0, 1, ... within every segment of the row (a document, or the part of
  one that fell into this row), 0 on the padding;
- ``cu_seqlens``: the segments' offsets ``0, l0, l0 + l1, ..., n`` (``n`` tokens in the
  row), then :data:`CU_SENTINEL` (-1) up to ``seq_len + 1`` entries, so rows stack into
  batches; ``cu_seqlens[cu_seqlens >= 0]`` are the row's offsets;
- each ``aligned`` field (e.g. a chat ``loss_mask`` aligned with the tokens) packed
  like the tokens, 0 on the padding.

Algorithms (``algorithm=``):

- ``greedy`` (alias ``wrap``): concatenation, as ``pack_tokens`` does: every row holds
  ``seq_len`` tokens, a document may be split across rows (its continuation is a new
  segment of the next row, positions from 0: attention cannot reach the previous row);
  only the lane's last row of the run is padded.
- ``first_fit`` / ``best_fit``: bin packing over at most ``open_bins`` open bins. A
  document of ``n <= seq_len`` tokens is never split: it goes into the first open bin
  it fits (first fit) or the fullest one it fits (best fit; ties: the earliest opened);
  a bin it fills exactly is emitted at once; when it fits none, a new bin opens, and
  when ``open_bins`` are open the fullest is emitted first. A document longer than
  ``seq_len`` is cut into whole rows of ``seq_len`` (emitted at once) and its rest,
  placed like a document. Rows hold at most ``seq_len`` tokens; the rest is padding.
  The placement is the ``fit_place`` kernel (:mod:`zephon.kernels.pack_docs_ref`).

A document is a 1-D integer array (a ``[1, n]`` one is read as its row); one with no
tokens contributes nothing. A batch (``pack_documents`` after ``batch()``) or an
already packed row is refused: its documents would be packed as one. The row a record makes is a pure
function of the record sequence, never of how the engine grouped the records.

Invariants and lifecycle (the carry design of :mod:`zephon.pipeline.carry`): the open
bins (greedy: the one unfinished row) are kept across flush boundaries and epoch starts
inside a run: at a boundary nothing is emitted, and the lineage of every open bin,
``(lineage, a, b)`` per piece, is the boundary's carry, so a restore rebuilds the bins
exactly and the replayed stream equals the uninterrupted one. No token is dropped
mid-run: only at the run's end (:meth:`_DocPackState.drain`) are the open bins emitted,
in the order they opened (or dropped, with ``drop_remainder=True``). A bin never holds
``seq_len`` tokens (a full one is emitted), so every carried bin has ``1 .. seq_len - 1``
tokens and a lane carries at most ``open_bins`` of them (greedy: 1).

Statistics: with ``execution_tracking="nodes"``, the op's node in ``stats()`` counts
``rows``, ``tokens`` and ``padding_tokens`` and gives ``padding_fraction``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from zephon.errors import OpError, ZephonConfigError
from zephon.kernels import fit_place, segment_layout
from zephon.kernels.pack_docs_ref import CU_SENTINEL
from zephon.pipeline.ops.base import (
    Aligned,
    CarryingAccumulator,
    HoldsBins,
    check_aligned,
    check_int,
)
from zephon.pipeline.records import Batch, Boundary, Record

__all__ = ["ALGORITHMS", "CU_SENTINEL", "MAX_OPEN_BINS", "PackDocumentsOp"]

#: ``algorithm=`` names; ``wrap`` is ``greedy``.
ALGORITHMS = ("greedy", "wrap", "first_fit", "best_fit")
#: The most open bins a lane may keep (each is part of every replay checkpoint).
MAX_OPEN_BINS = 1024
#: Keys every packed row has besides its token field.
LAYOUT_KEYS = ("positions", "cu_seqlens")


def _sample_error(record: Record, what: str) -> OpError:
    sid = record.ids[0]
    return OpError(f"op pack_documents failed on sample {sid}: {what}", op="pack_documents",
                   sample_id=sid)


class PackDocumentsOp(HoldsBins):
    """``pack_documents(seq_len, ...)``: rows of ``seq_len`` slots keeping documents whole."""

    kind = "pack_documents"
    preserves_cursor_order = False
    expands = True

    def __init__(self, seq_len: int, field: str = "tokens", algorithm: str = "greedy",
                 open_bins: int = 32, pad_id: int = 0, aligned=(),
                 drop_remainder: bool = False) -> None:
        self.seq_len = check_int("pack_documents", "seq_len", seq_len, 2)
        if not isinstance(field, str) or not field:
            raise ZephonConfigError(f"pack_documents: field must be a non-empty string, got "
                                    f"{field!r}")
        if algorithm not in ALGORITHMS:
            raise ZephonConfigError(f"pack_documents: algorithm must be one of {ALGORITHMS}, "
                                    f"got {algorithm!r}")
        self.open_bins = check_int("pack_documents", "open_bins", open_bins, 1)
        if self.open_bins > MAX_OPEN_BINS:
            raise ZephonConfigError(f"pack_documents: open_bins must be <= {MAX_OPEN_BINS}, "
                                    f"got {open_bins!r}")
        self.pad_id = check_int("pack_documents", "pad_id", pad_id, 0)
        if not isinstance(drop_remainder, bool):
            raise ZephonConfigError(f"pack_documents: drop_remainder must be True or False, "
                                    f"got {drop_remainder!r}")
        self.field = field
        self.aligned = check_aligned("pack_documents", field, aligned, LAYOUT_KEYS)
        self.algorithm = "greedy" if algorithm == "wrap" else algorithm
        self.drop_remainder = drop_remainder

    @property
    def carried_bins(self) -> int:
        """The most bins a lane holds at a boundary (greedy: its one unfinished row)."""
        return 1 if self.algorithm == "greedy" else self.open_bins

    def describe(self) -> str:
        bins = "" if self.algorithm == "greedy" else f", open_bins={self.open_bins}"
        aligned = f", aligned={list(self.aligned)}" if self.aligned else ""
        tail = ", drop_remainder=True" if self.drop_remainder else ""
        return (f"pack_documents({self.seq_len}, {self.field!r}, {self.algorithm}{bins}, "
                f"pad_id={self.pad_id}{aligned}{tail})")

    def aligned_with(self, field: str) -> Aligned:
        return self.aligned if field == self.field else ()

    def start(self, seed: int, lane: int, boundary: Boundary) -> "_DocPackState":
        return _DocPackState(self)

    def made_size(self) -> int:
        return self.seq_len

    def piece_length(self, record: Record) -> int:
        return self.tokens(record).size

    def remake(self, pieces: list, lin: Any) -> Record:
        return self.make_row(pieces, lin)

    def column(self, record: Record, name: str) -> np.ndarray:
        """The flat array ``name`` of an input record: integers for the tokens, numbers
        for an aligned field, anything when empty, one row (1-D, or ``[1, n]``) (an
        OpError naming the sample otherwise, or when it has no such field)."""
        try:
            values = np.asarray(record.value[name])
        except (KeyError, TypeError, IndexError) as exc:
            raise _sample_error(record, f"no field {name!r} ({exc})") from exc
        if values.ndim > 1 and max(values.shape[:-1]) > 1:
            raise _sample_error(record, f"field {name!r} has shape {values.shape}: a "
                                "document is a 1-D array")
        values = values.reshape(-1)
        kinds, what = ("iu", "integer token ids") if name == self.field else \
            ("biuf", "numbers")
        if values.dtype.kind not in kinds and values.size:
            raise _sample_error(record, f"field {name!r} holds {values.dtype} values "
                                f"({values[:3].tolist()!r:.60}), not {what}")
        return values

    def tokens(self, record: Record) -> np.ndarray:
        """The flat token array of an input record (refused: a batch, a packed row)."""
        value = record.value
        if isinstance(value, Batch):
            raise _sample_error(record, f"the input is a batch of {len(record.ids)} samples: "
                                "pack_documents takes documents, put it before batch()")
        if isinstance(value, Mapping) and all(k in value for k in LAYOUT_KEYS):
            raise _sample_error(record, f"the input is already packed (it has "
                                f"{' and '.join(LAYOUT_KEYS)})")
        return self.column(record, self.field)

    def _packed(self, name: str, pieces: list, total: int, pad: int) -> np.ndarray:
        arrays = []
        for r, a, b in pieces:
            values = self.column(r, name)
            if name != self.field and values.size != self.tokens(r).size:
                raise _sample_error(r, f"field {name!r} has {values.size} value(s) for "
                                    f"{self.tokens(r).size} token(s)")
            arrays.append(values[a:b])
        out = np.empty(self.seq_len, dtype=np.result_type(*arrays))
        np.concatenate(arrays, out=out[:total])
        if total < self.seq_len:
            if out.dtype.kind in "iu" and not np.iinfo(out.dtype).min <= pad <= \
                    np.iinfo(out.dtype).max:
                raise _sample_error(pieces[-1][0], f"pad_id {pad} does not fit the "
                                    f"{out.dtype} tokens of field {name!r}")
            out[total:] = pad
        return out

    def row(self, pieces: list) -> dict:
        """The value of the row made of ``pieces`` (``(record, a, b)``: tokens ``[a, b)``
        of that record, one segment each)."""
        lengths = np.fromiter((b - a for _, a, b in pieces), dtype=np.int64, count=len(pieces))
        total = int(lengths.sum())
        positions, cu = segment_layout(lengths, self.seq_len)
        value = {self.field: self._packed(self.field, pieces, total, self.pad_id),
                 "positions": positions, "cu_seqlens": cu}
        for name in self.aligned:
            value[name] = self._packed(name, pieces, total, 0)
        return value

    def make_row(self, pieces: list, lin: Any = None) -> Record:
        """The row record of ``pieces`` (what the packer emits, and what a restore rebuilds
        for an accumulator after it)."""
        ids = pieces[0][0].ids if len(pieces) == 1 else [i for r, _, _ in pieces for i in r.ids]
        return Record(self.row(pieces), ids, pieces[-1][0].pos, lin)


class _Bin:
    __slots__ = ("fill", "pieces")

    def __init__(self) -> None:
        self.pieces: list = []  # (record, a, b)
        self.fill = 0

    def add(self, record: Record, a: int, b: int) -> None:
        self.pieces.append((record, a, b))
        self.fill += b - a


class _DocPackState(CarryingAccumulator):
    """The open bins of one lane, in the order they opened (see the module docstring)."""

    def __init__(self, op: PackDocumentsOp) -> None:
        super().__init__()
        self.op, self.seq_len = op, op.seq_len
        self.bins: list[_Bin] = []
        self.stats: Any = None
        self.node = ""

    def count_into(self, stats, node: str) -> None:
        """Count rows, tokens and padding of what it emits in ``stats`` under ``node``."""
        self.stats, self.node = stats, node

    def _emit(self, pieces: list, out: list) -> None:
        lin = [(self.lineage(r), a, b) for r, a, b in pieces] if self.tracks else None
        out.append(self.op.make_row(pieces, lin))
        if self.stats is not None:
            tokens = sum(b - a for _, a, b in pieces)
            self.stats.add(self.node, rows=1, tokens=tokens,
                           padding_tokens=self.seq_len - tokens)

    def push(self, records: list) -> list:
        out: list = []
        if self.op.algorithm == "greedy":
            for r in records:
                self._wrap(r, out)
        else:
            self._fit(records, out)
        return out

    def _wrap(self, r: Record, out: list) -> None:
        n, a, seq_len = self.op.tokens(r).size, 0, self.seq_len
        while a < n:
            if not self.bins:
                self.bins.append(_Bin())
            row = self.bins[0]
            b = min(n, a + seq_len - row.fill)
            row.add(r, a, b)
            a = b
            if row.fill == seq_len:
                self.bins.clear()
                self._emit(row.pieces, out)

    def _fit(self, records: list, out: list) -> None:
        """Whole rows of long documents go out at once; the rest of each document is an
        item the kernel places, replayed here in record order."""
        seq_len = self.seq_len
        items: list = []  # (record, a, b) of the documents' parts that go to a bin
        order: list = []  # per record: its whole rows, then its item (or None)
        for r in records:
            n = self.op.tokens(r).size
            whole = n - n % seq_len
            rows = [[(r, a, a + seq_len)] for a in range(0, whole, seq_len)]
            order.append((rows, len(items) if n > whole else None))
            if n > whole:
                items.append((r, whole, n))
        if items:
            lengths = np.fromiter((b - a for _, a, b in items), np.int64, len(items))
            fills = np.fromiter((b.fill for b in self.bins), np.int64, len(self.bins))
            target, closed = fit_place(lengths, fills, seq_len, self.op.open_bins,
                                       self.op.algorithm == "best_fit")
            target, closed = target.tolist(), closed.tolist()
        by_id = dict(enumerate(self.bins))
        for rows, i in order:
            for pieces in rows:
                self._emit(pieces, out)
            if i is not None:
                self._place(by_id, items[i], target[i], closed[i], out)

    def _place(self, by_id: dict, item: tuple, target: int, closed: int, out: list) -> None:
        if closed >= 0 and closed != target:  # the fullest bin makes room
            self._close(by_id.pop(closed), out)
        if target not in by_id:
            by_id[target] = _Bin()
            self.bins.append(by_id[target])
        by_id[target].add(*item)
        if closed == target:  # filled exactly
            self._close(by_id.pop(target), out)

    def _close(self, done: _Bin, out: list) -> None:
        self.bins.remove(done)
        self._emit(done.pieces, out)

    def boundary(self, marker: Boundary) -> list:
        return []

    def carry(self) -> list:
        return [[(self.lineage(r), a, b) for r, a, b in done.pieces] for done in self.bins]

    def load(self, bins: list) -> None:
        """Put back rebuilt bins: a list of ``(record, a, b)`` pieces each."""
        self.bins = []
        for pieces in bins:
            self.bins.append(_Bin())
            for piece in pieces:
                self.bins[-1].add(*piece)

    def drain(self) -> list:
        out: list = []
        bins, self.bins = self.bins, []
        if not self.op.drop_remainder:
            for done in bins:
                self._emit(done.pieces, out)
        return out
