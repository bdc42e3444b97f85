"""``to_training``: the tensors a causal language model trains on, from a packed batch.

What it owns: one pure function of a batch of packed rows (``pack_documents`` rows
batched: ``tokens [B, S]``, ``positions [B, S]``, ``cu_seqlens [B, S + 1]`` padded
with -1, optionally an aligned ``loss_mask [B, S]``; or plain ``pack_tokens`` rows,
read as one document per row) to NumPy arrays; ``zephon.torch.to_training`` and
``zephon.torch.loader(pipe, to_training=True)`` give the same as torch tensors.

The rules, for row ``b`` and slot ``t`` (a *segment* is a document, or the part of one
in this row; its first token has position 0):

- ``labels[b, t] = tokens[b, t + 1]`` when slot ``t + 1`` is a token of the same
  segment, else ``ignore_index``: padding predicts nothing, the last token of a
  segment does not predict the next segment's first (nor, in the row's last slot,
  anything); with a ``loss_mask`` field, a label whose target has ``loss_mask == 0``
  (a chat prompt token) is ``ignore_index`` too;
- ``loss_mask``: ``labels != ignore_index`` (bool); ``num_valid_tokens`` its count
  (the divisor of a mean loss over the batch);
- ``attention_mask``: 1 on tokens, 0 on padding (int64);
- ``position_ids``: the rows' ``positions`` (int64);
- ``cu_seqlens`` (int32): the segments' offsets in the batch flattened to ``B * S``
  slots, as ``flash_attn_varlen_func`` takes them: each row's segments, then its
  padding as one segment of its own (so the offsets end at ``B * S`` and padding
  attends only to padding); ``max_seqlen`` the longest of them;
- ``input_ids``: the tokens (int64).

Nothing here is random or stateful; the batch is not modified.
"""

from __future__ import annotations

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.pipeline.records import Batch

__all__ = ["IGNORE_INDEX", "OPTIONS", "check_options", "to_training"]

#: The label of a position that predicts nothing (``torch.nn.functional.cross_entropy``'s
#: default ``ignore_index``).
IGNORE_INDEX = -100
#: The keyword arguments of :func:`to_training` (what a loader's ``to_training=dict(...)``
#: may set).
OPTIONS = ("field", "ignore_index", "loss_mask")


def check_options(options) -> dict:
    """``to_training=`` of a loader as keyword arguments: True (the defaults) or a dict of
    :data:`OPTIONS`; a ZephonConfigError names anything else."""
    if options is True:
        return {}
    if not isinstance(options, dict) or any(k not in OPTIONS for k in options):
        raise ZephonConfigError(f"to_training must be True, False or a dict with keys among "
                                f"{OPTIONS}, got {options!r}")
    return dict(options)


def _column(batch, name: str, shape: tuple | None = None) -> np.ndarray | None:
    if name not in batch:
        return None
    column = batch[name]
    if isinstance(column, list) and len({np.shape(row) for row in column}) > 1:
        lengths = sorted({len(row) for row in column})
        raise ZephonConfigError(
            f"to_training: column {name!r} is ragged (rows of {lengths[0]} to {lengths[-1]} "
            "items, so batch() kept them as a list): pack the documents into rows of one "
            "length first (pack_tokens or pack_documents), or pad them with "
            "batch(collate_fn=...)")
    value = np.asarray(column)
    if shape is not None and value.shape != shape:
        raise ZephonConfigError(f"to_training: column {name!r} has shape {value.shape}, "
                                f"expected {shape}")
    return value


def _layout(batch, field: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``tokens [B, S]``, ``cu_seqlens [B, S + 1]`` and ``positions [B, S]`` of a batch (a
    row without a layout is one segment of ``S`` tokens)."""
    tokens = _column(batch, field)
    if tokens is None or tokens.ndim != 2 or tokens.shape[1] < 1:
        shown = None if tokens is None else tokens.shape
        raise ZephonConfigError(f"to_training: the batch needs a 2-D token column {field!r} "
                                f"(rows x seq_len), got {shown}")
    rows, seq_len = tokens.shape
    cu = _column(batch, "cu_seqlens", (rows, seq_len + 1))
    if cu is None:
        cu = np.full((rows, seq_len + 1), -1, dtype=np.int64)
        cu[:, 0], cu[:, 1] = 0, seq_len
    positions = _column(batch, "positions", (rows, seq_len))
    if positions is None:
        positions = np.broadcast_to(np.arange(seq_len), (rows, seq_len))
    return tokens, cu.astype(np.int64), positions


def _flat_offsets(cu: np.ndarray, valid: np.ndarray, seq_len: int) -> np.ndarray:
    """Segment offsets over the flattened batch, each row's padding a segment of its own."""
    rows = cu.shape[0]
    r, i = np.nonzero(cu[:, 1:] >= 0)  # segment i of row r exists: it starts at cu[r, i]
    starts = cu[r, i] + r * seq_len
    padded = np.nonzero(valid < seq_len)[0]
    starts = np.sort(np.concatenate([starts, valid[padded] + padded * seq_len]))
    return np.append(starts, rows * seq_len).astype(np.int32)


def to_training(batch, *, field: str = "tokens", ignore_index: int = IGNORE_INDEX,
                loss_mask: str = "loss_mask") -> dict:
    """The training arrays of a batch of packed rows (see the module docstring).

    Args:
        batch: a batch of packed rows (a :class:`~zephon.Batch` or dict of columns).
        field: the token column.
        ignore_index: the label of positions that predict nothing.
        loss_mask: the name of an aligned mask column combined with the labels when the
            batch has it (chat: 1 on the tokens to learn).

    Returns:
        ``{"input_ids", "labels", "loss_mask", "attention_mask", "position_ids",
        "cu_seqlens", "max_seqlen", "num_valid_tokens"}``, a :class:`~zephon.Batch` with
        the input's ``meta`` when the input is one.

    Raises:
        ZephonConfigError: no 2-D token column, or a layout column of another shape.

    Examples:
        >>> src = sources.from_sequence([{"tokens": np.arange(n) + 10 * n} for n in (3, 2)])
        >>> rows = Pipeline(src, shuffle=False).pack_documents(6, algorithm="first_fit")
        >>> out = to_training(next(iter(rows.batch(1))))
        >>> out["labels"].tolist(), out["cu_seqlens"].tolist(), out["num_valid_tokens"]
        ([[31, 32, -100, 21, -100, -100]], [0, 3, 5, 6], 3)
    """
    tokens, cu, positions = _layout(batch, field)
    rows, seq_len = tokens.shape
    valid = cu.max(axis=1)  # tokens per row: the last offset (the sentinel is -1)
    real = np.arange(seq_len) < valid[:, None]
    starts = np.zeros((rows, seq_len + 1), dtype=bool)
    r, i = np.nonzero(cu[:, 1:] >= 0)
    starts[r, cu[r, i]] = True
    predicts = real[:, 1:] & ~starts[:, 1:seq_len]  # slot t + 1 continues t's segment
    mask = _column(batch, loss_mask, (rows, seq_len))
    if mask is not None:
        predicts &= mask[:, 1:] != 0
    ids = tokens.astype(np.int64)  # first: -100 has no place in uint16 tokens
    labels = np.full((rows, seq_len), ignore_index, dtype=np.int64)
    labels[:, :-1] = np.where(predicts, ids[:, 1:], ignore_index)
    offsets = _flat_offsets(cu, valid, seq_len)
    out = {
        "input_ids": ids,
        "labels": labels,
        "loss_mask": labels != ignore_index,
        "attention_mask": real.astype(np.int64),
        "position_ids": np.asarray(positions, dtype=np.int64),
        "cu_seqlens": offsets,
        "max_seqlen": int(np.diff(offsets).max()),
        "num_valid_tokens": int(np.count_nonzero(labels != ignore_index)),
    }
    return Batch(out, meta=dict(batch.meta)) if isinstance(batch, Batch) else out
