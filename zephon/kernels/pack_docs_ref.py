"""Reference document packing: the specification of ``kernels/pack_docs.pyx``.

Callers: :mod:`zephon.pipeline.ops.pack_documents` (the ``pack_documents`` op): where each
document goes among a bounded set of open bins (``fit_place``), and the
per-row positions and boundaries of a packed row (``segment_layout``).

``fit_place(lengths, fills, seq_len, max_bins, best) -> (target, closed)``
    Places documents, in order, into open bins of capacity ``seq_len``.
    ``lengths`` (int64, each in ``[1, seq_len - 1]``: whole rows never reach a
    bin) are the documents; ``fills`` (int64, each in ``[1, seq_len - 1]``,
    at most ``max_bins`` of them) the token counts of the bins open now, in the
    order they opened. Bins are named by ordinals: the open ones ``0 ..
    len(fills) - 1``, each new one the next ordinal. For document ``i`` of
    length ``L``, the candidates are the open bins with ``fill + L <=
    seq_len``; ``best=False`` (first fit) takes the first candidate in opening
    order, ``best=True`` (best fit) the fullest one (ties: the earliest).
    A bin that a document fills exactly closes after it (``closed[i]`` is
    ``target[i]``). With no candidate, a new bin opens for the document; when
    ``max_bins`` bins are open, the fullest (ties: the earliest) closes first
    (``closed[i]`` is that bin, not ``target[i]``). ``closed[i]`` is -1 when
    no bin closes at document ``i``. Bins left open are the caller's to keep.
    Refused with ``ValueError``: ``seq_len < 2``, ``max_bins < 1``, more open
    bins than ``max_bins``, a length or fill outside ``[1, seq_len - 1]``.

``segment_layout(lengths, seq_len) -> (positions, cu_seqlens)``
    The layout of one packed row whose segments have ``lengths`` (int64, each
    >= 1, summing to at most ``seq_len``): ``positions`` (int32, ``seq_len``)
    counts 0, 1, ... within every segment and is 0 on the padding after them;
    ``cu_seqlens`` (int32, ``seq_len + 1``) holds the offsets ``0, l0, l0 +
    l1, ..., sum`` and then :data:`CU_SENTINEL` (-1) up to its fixed length, so
    rows stack. Refused with ``ValueError``: a length below 1, a sum above
    ``seq_len``, ``seq_len < 1``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CU_SENTINEL", "check_fit_args", "fit_place", "segment_layout"]

#: What fills a row's ``cu_seqlens`` after its last offset.
CU_SENTINEL = -1


def check_fit_args(lengths: np.ndarray, fills: np.ndarray, seq_len: int, max_bins: int) -> None:
    """The argument checks of :func:`fit_place` (shared with the compiled kernel)."""
    if seq_len < 2:
        raise ValueError(f"fit_place: seq_len must be >= 2, got {seq_len}")
    if max_bins < 1:
        raise ValueError(f"fit_place: max_bins must be >= 1, got {max_bins}")
    if fills.size > max_bins:
        raise ValueError(f"fit_place: {fills.size} open bins, more than max_bins={max_bins}")
    for name, values in (("length", lengths), ("fill", fills)):
        if values.size and (values.min() < 1 or values.max() > seq_len - 1):
            bad = values[(values < 1) | (values > seq_len - 1)][0]
            raise ValueError(f"fit_place: a {name} of {int(bad)} is outside [1, {seq_len - 1}]")


def _fullest(open_fill: list) -> int:
    """Index (in opening order) of the fullest open bin, the earliest on a tie."""
    return max(range(len(open_fill)), key=lambda j: (open_fill[j], -j))


def fit_place(lengths, fills, seq_len: int, max_bins: int, best: bool):
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    fills = np.ascontiguousarray(fills, dtype=np.int64)
    check_fit_args(lengths, fills, seq_len, max_bins)
    open_id = list(range(fills.size))  # ordinals of the open bins, in opening order
    open_fill = [int(f) for f in fills]
    next_id = fills.size
    target = np.empty(lengths.size, dtype=np.int64)
    closed = np.full(lengths.size, -1, dtype=np.int64)
    for i, n in enumerate(lengths.tolist()):
        fits = [j for j, f in enumerate(open_fill) if f + n <= seq_len]
        if fits:
            j = max(fits, key=lambda c: (open_fill[c], -c)) if best else fits[0]
            open_fill[j] += n
            target[i] = open_id[j]
            if open_fill[j] == seq_len:
                closed[i] = open_id[j]
                del open_id[j], open_fill[j]
            continue
        if len(open_id) == max_bins:
            j = _fullest(open_fill)
            closed[i] = open_id[j]
            del open_id[j], open_fill[j]
        open_id.append(next_id)
        open_fill.append(n)
        target[i] = next_id
        next_id += 1
    return target, closed


def segment_layout(lengths, seq_len: int):
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if seq_len < 1:
        raise ValueError(f"segment_layout: seq_len must be >= 1, got {seq_len}")
    if lengths.size and lengths.min() < 1:
        raise ValueError(f"segment_layout: a segment of {int(lengths.min())} token(s)")
    total = int(lengths.sum())
    if total > seq_len:
        raise ValueError(f"segment_layout: segments of {total} tokens exceed seq_len={seq_len}")
    cu = np.full(seq_len + 1, CU_SENTINEL, dtype=np.int32)
    cu[0] = 0
    cu[1:lengths.size + 1] = np.cumsum(lengths)
    positions = np.zeros(seq_len, dtype=np.int32)
    starts = np.repeat(cu[:lengths.size], lengths)
    positions[:total] = np.arange(total, dtype=np.int32) - starts
    return positions, cu
