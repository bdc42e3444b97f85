"""What a checkpoint proves about the stream it continues, and the check of it on restore.

The fingerprint (:mod:`zephon.pipeline.fingerprint`) pins the pipeline's definition:
source description, seed, order, chunking, ops. Three things it does not cover still
decide what a restored run delivers:

- the **bytes behind the source**: a token file rewritten in place keeps its name and
  size, so its description (and the fingerprint) stays the same while every sample
  changes;
- **what a source makes of an index**: a custom source's ``identity``, a mixture's
  choice of component, a source whose length its description does not state;
- the **lane mapping**: with several ranks, ``mapping_strategy`` decides which lanes
  share an optimizer step; a merged state restores under any mapping, and the steps
  after the restore would take other samples together.

Every state therefore carries a ``proof`` field, taken with it::

    {"k": K,                      # samples per lane in the digests below
     "next": {"<lane>": hex},     # digest of the identities of the K samples each lane
                                  # reads next: (source name, index, epoch) of each
     "digest": "splitmix64-sum/2",  # how the next digests are made
     "files": {"count": N, "block": B, "digests": [...], "names": [...],
               "stamps": [...] | None} | None,
                                  # the source's files (Source.stamps(): name, size and
                                  # mtime or ETag) as built, one digest per block of B
                                  # files (and each file's stamp when B is 1)
     "parts": [...],              # the lines the fingerprint hashes, for a readable diff
     "mapping": "contiguous" | "interleaved", "dp_degree": G,
     "n": the source's length, "plain": whether it keeps the default identity (name, i)}

Each rank computes ``next`` for the lanes it owns (a lane that ended its pass: the
next pass's first samples; a merged state holds the union,
:func:`zephon.checkpoint.aggregate.merge_states`); ``files`` and ``parts`` come
from rank 0. :func:`verify` runs inside every restore (``Pipeline.restore``,
``it.restore``/``set_state``, ``TorchLoader.load_state_dict``), before anything is
applied: it recomputes the same figures for the lanes this rank reads from the
state's own positions, compares them and raises one
:class:`~zephon.errors.ResumeMismatchError` listing every difference (the files
that changed, were added or removed; the lanes whose next samples differ; the
mapping, when it would give the ranks other lanes than the checkpoint's mapping on
as many dp groups), unless ``RuntimeOptions(resume_accept=...)`` names the kind, in which
case a ``ResumeMismatchWarning`` says what was accepted. A fingerprint mismatch
names the parts that differ (:func:`describe_parts_diff`).

Costs: for a source that keeps the default identity ``(name, i)`` on both sides,
with the same length, the identities are a function of what the fingerprint holds:
a restore does not recompute them. Otherwise ``next`` is ``K`` identities per lane, index arithmetic without a read (all
the lanes of an epoch in one index-shuffle call and one source view, one vectorised
64-bit digest each); the checkpoint's ``files`` are the files as the source saw them
when it was built (a local file source stats its files then), computed once per
plan; a restore stats each local file once more (the files as they are now: a file
rewritten after the restoring pipeline was built is seen too) and reads nothing. A
fingerprint part longer than 1024 characters (a listing of ten thousand files) is
recorded as its head and its SHA-256.

What the proof cannot see: a file rewritten with its size and mtime both kept (its
content is never read here); a source without files (``stamps()`` None) whose items
change under the same identities; an image folder's files, which its description
(and so the fingerprint) lists with their sizes and mtimes already, unless
``fingerprint_mtimes=False`` asked to leave the mtimes out. Only the token-window and
image readers check each read against the size and mtime the source was built with;
the other file readers do not, so a file rewritten during a run changes what the run
reads (the next restore refuses the state).

A state without ``proof`` (checkpoint format version 4) restores as before, with the
fingerprint check only.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import inspect
import re
import warnings
import weakref
from typing import Any, Iterable

import numpy as np

from zephon.errors import CheckpointError, ResumeMismatchError
from zephon.pipeline.engine import is_ended
from zephon.pipeline.lanes import epoch_positions, lane_lengths, owned_lanes
from zephon.pipeline.sources.base import IndexView, Source

__all__ = ["ACCEPTABLE", "NEXT_SAMPLES", "ResumeMismatchWarning", "describe_parts_diff",
           "files_proof", "make_proof", "verify"]

#: samples per lane whose identities a proof records
NEXT_SAMPLES = 8
#: how the ``next`` digests are made (:func:`_digests`); a state made otherwise is refused
DIGEST = "splitmix64-sum/2"
#: longest fingerprint part a proof records whole (see :func:`compact_parts`)
_PART_CHARS = 1024
#: the kinds of difference ``resume_accept`` may name
ACCEPTABLE = ("files", "samples", "mapping")
#: files per digest block: a source of up to this many files is compared file by file
_BLOCKS = 256
_SHOWN = 5  # differences listed per kind
_HEX16S = re.compile(r"(?:[0-9a-f]{16})*")


@functools.lru_cache(maxsize=8)
def _lane_ids(lanes_total: int) -> frozenset:
    """The canonical ids of the lanes ``0 .. lanes_total - 1``."""
    return frozenset(str(lane) for lane in range(lanes_total))


class ResumeMismatchWarning(UserWarning):
    """A restore went on past a difference that ``resume_accept`` named."""


# -- what a lane reads next ---------------------------------------------------------------

def _next_position(plan, entry: tuple | None, start_epoch: int, length: int,
                   end: int | None):
    """``(epoch, lane position)`` of the first sample a lane of ``length`` samples an
    epoch reads after a restore to ``entry`` (its lane state; None: it delivered
    nothing) in a pass that ends before ``end``, or None when it reads none."""
    if entry is not None and is_ended(entry):
        # the lane is done with this pass: what it reads next is the next pass's start
        return None if end is None or not length else (end, 0)
    if entry is None:
        epoch, pos = start_epoch, 0
    elif plan.cursor_resume:
        epoch, pos = entry[0], entry[1]
    else:  # replay: from the boundary's lane chunk
        epoch, pos = entry[0], entry[1] * plan.spec.chunk_size
    if pos >= length:
        epoch, pos = epoch + 1, 0
    if not length:
        return None
    return (end, 0) if end is not None and epoch >= end else (epoch, pos)


def next_identities(plan, lane: int, epoch: int, pos: int, k: int) -> list[tuple]:
    """The identities ``(source name, index, epoch)`` of up to ``k`` samples of ``lane``
    from lane position ``pos`` of ``epoch`` on (across epoch starts, within the pass)."""
    spec = plan.spec
    n = len(spec.source)
    length = plan.lane_length(lane)
    end = plan.pass_end(epoch)
    out: list[tuple] = []
    while len(out) < k and length and (end is None or epoch < end):
        take = min(k - len(out), length - pos)
        names, indices = _identities(spec.source, epoch_positions(
            n, spec.seed, epoch, spec.permute, _lane_positions(plan, [lane], [pos], take)),
            epoch)
        if names is None:
            names = [spec.source.name] * take
        out.extend(zip(names, indices.tolist(), [epoch] * take, strict=True))
        epoch, pos = epoch + 1, 0
    return out


def _lane_positions(plan, lanes, starts, k: int) -> np.ndarray:
    """The epoch positions of lane positions ``start .. start + k - 1`` of each lane (one
    row per lane, flattened)."""
    chunk = plan.spec.chunk_size
    q = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(k, dtype=np.int64)
    chunks, offset = np.divmod(q, chunk)
    lane = np.asarray(lanes, dtype=np.int64)[:, None]
    return ((lane + chunks * plan.lanes) * chunk + offset).ravel()


def _identities(source, indices: np.ndarray, epoch: int) -> tuple[list | None, np.ndarray]:
    """``(names, indices)`` of the identities of the source's ``indices`` in ``epoch``:
    read from the source's view, or straight from the indices for a source that keeps
    the default identity ``(its name, i)`` (then ``names`` is None: every one is the
    source's name)."""
    view = source.view(indices, epoch)
    if type(view) is IndexView and type(source).identity is Source.identity:
        return None, indices
    pairs = [view.identity(m) for m in range(len(indices))]
    return [str(name) for name, _ in pairs], np.array([i for _, i in pairs], dtype=np.int64)


@functools.lru_cache(maxsize=1024)
def _name_key(name: str) -> int:
    """A 64-bit key of a source name (BLAKE2b), folded into each sample's hash."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8", "surrogatepass"),
                                          digest_size=8).digest(), "little")


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_START = np.uint64(0x5A5EED0F5A5EED0F)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on uint64 (wrapping), in place where it can."""
    x = x ^ (x >> _S30)
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


@functools.lru_cache(maxsize=16)
def _places(k: int) -> np.ndarray:
    return (np.arange(1, k + 1, dtype=np.uint64) * _GOLDEN)[None, :]


_MASK = (1 << 64) - 1


def _mix_int(x: int) -> int:
    """:func:`_mix` of one Python int (for a few lanes, where NumPy's per-call cost
    dominates)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _digests_small(keys, indices: np.ndarray, epochs) -> list[str]:
    """:func:`_digests` in plain Python ints: the same digests."""
    rows, k = indices.shape
    key_rows = np.broadcast_to(np.asarray(keys, dtype=np.uint64), (rows, k)).tolist()
    epoch_rows = np.broadcast_to(np.asarray(epochs, dtype=np.uint64), (rows, k)).tolist()
    out = []
    for index_row, key_row, epoch_row in zip(indices.astype(np.uint64).tolist(), key_rows,
                                             epoch_rows, strict=True):
        total = 0
        for j in range(k):
            tag = _mix_int((epoch_row[j] + int(_START)) & _MASK) ^ key_row[j]
            x = _mix_int(_mix_int(index_row[j] ^ tag) ^ (((j + 1) * int(_GOLDEN)) & _MASK))
            total = (total + x) & _MASK
        out.append(f"{_mix_int(total ^ k):016x}")
    return out


def _digests(keys, indices: np.ndarray, epochs) -> list[str]:
    """One digest per row of ``(rows, k)`` matrices of indices, name keys and epochs
    (``keys``/``epochs``: a matrix, or one number for every sample), as 16 hex digits:
    each identity mixed (splitmix64) with its place in the row, the row's mixes summed
    (wrapping) and mixed again. Whole matrices at a time: the cost hardly depends on the
    number of rows (a lane each)."""
    if indices.size <= 16:  # a lane or two
        return _digests_small(keys, indices, epochs)
    with np.errstate(over="ignore"):
        k = indices.shape[1]
        tag = _mix(np.asarray(epochs, dtype=np.uint64) + _START) ^ np.asarray(keys,
                                                                              dtype=np.uint64)
        x = indices.astype(np.uint64)
        x ^= tag
        x = _mix(_mix(x) ^ _places(k))
        h = _mix(x.sum(axis=1, dtype=np.uint64) ^ np.uint64(k))
    return [f"{v:016x}" for v in h.tolist()]


def _digest_of(ids: list[tuple]) -> str:
    """The digest of a list of identities ``(name, index, epoch)``."""
    keys = np.array([[_name_key(str(n)) for n, _, _ in ids]], dtype=np.uint64)
    return _digests(keys, np.array([[i for _, i, _ in ids]], dtype=np.int64),
                    np.array([[e for _, _, e in ids]], dtype=np.int64))[0]


#: what a lane reads next: (the digest of its next samples, (epoch, position) where they
#: start, the first of their identities for a message); a plain tuple, made a lane at a
#: time
_Next = tuple

def lane_digests(plan, lanes, states: dict, start_epoch: int, k: int,
                 detail: bool = False) -> dict[int, _Next]:
    """``lane -> (digest, (epoch, position), first identities)`` of the ``k`` samples each of ``lanes`` reads next from
    ``states`` (lanes that read none are left out; ``detail``: with the first
    identities, for a message). Lanes whose
    next ``k`` samples lie in one epoch are computed together, an epoch at a time (one
    index-shuffle call and one source view for all of them); the others one by one."""
    spec = plan.spec
    lanes = list(lanes)
    lengths: Any = plan_lengths(plan) if len(lanes) > 64 else \
        {lane: plan.lane_length(lane) for lane in lanes}
    together: dict[int, list] = {}
    out: dict[int, _Next] = {}
    end = plan.pass_end(start_epoch)
    for lane in lanes:
        at = _next_position(plan, states.get(lane), start_epoch, int(lengths[lane]), end)
        if at is None:
            continue
        if at[1] + k <= lengths[lane]:
            together.setdefault(at[0], []).append((lane, at[1]))
        else:
            ids = next_identities(plan, lane, at[0], at[1], k)
            out[lane] = (_digest_of(ids), at, ids[:4])
    n = len(spec.source)
    for epoch, group in together.items():
        positions = _lane_positions(plan, [g[0] for g in group], [g[1] for g in group], k)
        names, indices = _identities(
            spec.source, epoch_positions(n, spec.seed, epoch, spec.permute, positions), epoch)
        rows = len(group)
        keys: Any = _name_key(spec.source.name) if names is None else \
            np.array([_name_key(x) for x in names], dtype=np.uint64).reshape(rows, k)
        matrix = np.asarray(indices, dtype=np.int64).reshape(rows, k)
        found = _digests(keys, matrix, epoch)
        for row, (lane, pos) in enumerate(group):
            first = [(spec.source.name if names is None else names[row * k + m],
                      int(matrix[row, m]), epoch) for m in range(min(4, k))] \
                if detail else []
            out[lane] = (found[row], (epoch, pos), first)
    return out


_LENGTHS: "weakref.WeakKeyDictionary[Any, np.ndarray]" = weakref.WeakKeyDictionary()


def plan_lengths(plan) -> np.ndarray:
    """Every lane's samples an epoch under ``plan``, computed once per plan."""
    found = _LENGTHS.get(plan)
    if found is None:
        spec = plan.spec
        found = _LENGTHS[plan] = lane_lengths(len(spec.source), spec.chunk_size, plan.lanes)
    return found


# -- the source's files ------------------------------------------------------------------

_FILES: "weakref.WeakKeyDictionary[Any, dict | None]" = weakref.WeakKeyDictionary()


def plan_files(plan) -> dict | None:
    """The ``files`` part of ``plan``'s proofs, computed once per plan."""
    try:
        return _FILES[plan]
    except KeyError:
        found = _FILES[plan] = files_proof(plan.spec.source.stamps())
        return found


def files_proof(stamps: list | None) -> dict | None:
    """The ``files`` part of a proof from ``Source.stamps()`` (a list of ``(name, size,
    stamp)``), or None for a source without files."""
    if stamps is None:
        return None
    count = len(stamps)
    block = max(1, -(-count // _BLOCKS))
    digests, names = [], []
    for start in range(0, count, block):
        part = stamps[start:start + block]
        h = hashlib.blake2b(digest_size=8)
        for name, size, stamp in part:
            h.update(f"{name}\0{size}\0{stamp}\n".encode("utf-8", "surrogatepass"))
        digests.append(h.hexdigest())
        names.append(str(part[0][0]))
    return {"count": count, "block": block, "digests": digests, "names": names,
            "stamps": [list(s) for s in stamps] if block == 1 else None}


def _files_diff(theirs: dict, ours: dict | None, stamps: list | None) -> list[str]:
    if ours is None:
        return [f"the checkpoint's source had {theirs['count']} file(s); this source "
                "has none"]
    if theirs["digests"] == ours["digests"] and theirs["count"] == ours["count"]:
        return []
    old = theirs.get("stamps")
    if old is not None and stamps is not None and ours["block"] == 1:
        return _stamps_diff([tuple(s) for s in old], list(stamps))
    lines = [f"{theirs['count']} file(s) at the checkpoint, {ours['count']} now"] \
        if theirs["count"] != ours["count"] else []
    block = ours["block"]
    for b, (a, c) in enumerate(zip(theirs["digests"], ours["digests"], strict=False)):
        if a != c and theirs["block"] == block:
            last = min(ours["count"], (b + 1) * block) - 1
            lines.append(f"files {b * block}..{last} (from {ours['names'][b]!r}): a name, "
                         "size or mtime/ETag among them changed")
            if len(lines) >= _SHOWN:
                break
    return lines or ["the files' names, sizes or mtimes/ETags changed"]


def _stamps_diff(old: list[tuple], new: list[tuple]) -> list[str]:
    before = {s[0]: s for s in old}
    after = {s[0]: s for s in new}
    lines = []
    for name in [s[0] for s in old if s[0] not in after][:_SHOWN]:
        lines.append(f"removed: {name}")
    for name in [s[0] for s in new if s[0] not in before][:_SHOWN]:
        lines.append(f"added: {name}")
    for name, size, stamp in new:
        was = before.get(name)
        if was is None or (was[1], was[2]) == (size, stamp):
            continue
        what = (f"size {was[1]} -> {size} bytes" if was[1] != size
                else f"{_show_stamp(was[2])} -> {_show_stamp(stamp)}")
        lines.append(f"changed: {name} ({what})")
        if len(lines) >= 3 * _SHOWN:
            break
    if not lines and [s[0] for s in old] != [s[0] for s in new]:
        lines.append("the same files in another order")
    return lines


def _show_stamp(stamp: str) -> str:
    """A stamp as a reader wants it: a local mtime as a UTC time to the nanosecond."""
    kind, _, value = stamp.partition(":")
    if kind == "mtime" and value.isdigit():
        seconds, ns = divmod(int(value), 10**9)
        when = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
        return f"modified {when:%Y-%m-%d %H:%M:%S}.{ns:09d} UTC"
    return stamp or "no version"


# -- making and checking a proof ---------------------------------------------------------

def make_proof(plan, states: dict, start_epoch: int, lanes: Iterable[int],
               whole: bool = True) -> dict:
    """The proof of a state whose lane states are ``states`` (lane -> entry), for
    ``lanes`` (the ones this rank reads); ``whole``: with the source's files and the
    fingerprint's parts (rank 0's submission and every rank's own state)."""
    k = NEXT_SAMPLES
    nxt = {str(lane): found[0]
           for lane, found in sorted(lane_digests(plan, lanes, states, start_epoch,
                                                  k).items())}
    proof: dict[str, Any] = {"k": k, "digest": DIGEST, "next": nxt, "mapping": plan.mapping,
                             "dp_degree": plan.dp, "n": len(plan.spec.source),
                             "plain": _plain(plan.spec.source)}
    if whole:
        proof["files"] = plan_files(plan)
        proof["parts"] = compact_parts(plan.fingerprint_parts)
    return proof


def _plain(source) -> bool:
    """Whether ``source`` keeps the default identity ``(its name, i)`` of each index: then
    the identities a lane reads are a function of what the fingerprint holds and the
    source's length alone."""
    return type(source).identity is Source.identity and type(source).view is Source.view


def compact_parts(parts) -> list[str]:
    """The fingerprint's parts as a proof records them: a part of more than
    :data:`_PART_CHARS` characters (a source listing ten thousand files) as its
    SHA-256 and its head, so the state stays small and a diff still names the part."""
    out = []
    for part in parts:
        if len(part) > _PART_CHARS:
            head = part[:_PART_CHARS // 2]
            part = f"{head}... (sha256 {hashlib.sha256(part.encode()).hexdigest()[:16]})"
        out.append(part)
    return out


def describe_parts_diff(theirs: Any, ours: list[str]) -> str:
    """What differs between the fingerprint parts a checkpoint recorded and this
    pipeline's, as one phrase ('' when the checkpoint recorded none)."""
    if not isinstance(theirs, list) or not all(isinstance(p, str) for p in theirs):
        return ""
    ours = compact_parts(ours)
    names = ["source", "seed", "order", "chunking", "epochs"]

    def label(i: int, n: int) -> str:
        return names[i] if i < len(names) else \
            ("flush cadence" if i == n - 1 else f"op {i - len(names)}")

    lines = []
    if len(theirs) != len(ours):
        lines.append(f"{len(theirs) - 6} op(s) at the checkpoint, {len(ours) - 6} now")
    for i, (a, b) in enumerate(zip(theirs, ours, strict=False)):
        if a != b:
            lines.append(f"{label(i, len(ours))}: {a[:160]!r} at the checkpoint, now "
                         f"{b[:160]!r}")
            if len(lines) >= _SHOWN:
                break
    return "; ".join(lines)


def _bad(what: str) -> CheckpointError:
    return CheckpointError(f"corrupt checkpoint: proof {what}")


def _next_ok(value: Any, lanes_total: int) -> bool:
    return (isinstance(value, dict) and value.keys() <= _lane_ids(lanes_total)
            and all(type(v) is str for v in value.values())
            and sum(map(len, value.values())) == 16 * len(value)
            and _HEX16S.fullmatch("".join(value.values())) is not None)


#: field -> (its check given the state's lanes_total, what it must be); "n", "plain",
#: "parts" and "files" may be absent (a rank's submission other than rank 0's)
_FIELDS: dict = {
    "k": (lambda v, c: type(v) is int and 0 < v <= 64, "an int in [1, 64]"),
    "digest": (lambda v, c: v == DIGEST, f"{DIGEST!r} (how this zephon makes them)"),
    "next": (_next_ok, "a map of lane ids below lanes_total to 16-digit hex digests"),
    "mapping": (lambda v, c: v in ("contiguous", "interleaved"), "a mapping strategy"),
    "dp_degree": (lambda v, c: type(v) is int and 1 <= v <= c, "an int in [1, lanes_total]"),
    "n": (lambda v, c: type(v) is int and v >= 0, "an int >= 0"),
    "plain": (lambda v, c: type(v) is bool, "True or False"),
    "parts": (lambda v, c: isinstance(v, list) and all(isinstance(x, str) for x in v),
              "a list of strings"),
    "files": (lambda v, c: v is None or _files_ok(v), "None or the files' digests"),
}
_OPTIONAL_FIELDS = ("n", "plain", "parts", "files")


def _check_shape(proof: Any, lanes_total: int) -> dict:
    """The proof, every field checked for type and range against :data:`_FIELDS` (a
    CheckpointError names the first that is wrong)."""
    if not isinstance(proof, dict):
        raise _bad("must be a mapping")
    unknown = sorted(str(key)[:40] for key in proof if key not in _FIELDS)
    if unknown:
        raise _bad(f"has unknown field(s) {unknown[:5]}")
    for name, (ok, what) in _FIELDS.items():
        if name not in proof:
            if name in _OPTIONAL_FIELDS:
                continue
            raise _bad(f"lacks {name!r}")
        if not ok(proof[name], lanes_total):
            raise _bad(f"{name} {proof[name]!r:.60}: must be {what}")
    return proof


def _stamps_ok(stamps: Any, count: int, block: int) -> bool:
    return stamps is None or (
        block == 1 and isinstance(stamps, list) and len(stamps) == count
        and all(isinstance(t, list) and len(t) == 3 and isinstance(t[0], str)
                and type(t[1]) is int and isinstance(t[2], str) for t in stamps))


def _files_ok(files: Any) -> bool:
    if not isinstance(files, dict):
        return False
    count, block = files.get("count"), files.get("block")
    if type(count) is not int or type(block) is not int or count < 0 or block < 1:
        return False
    digests, names = files.get("digests"), files.get("names")
    blocks = -(-count // block)
    return (isinstance(digests, list) and isinstance(names, list)
            and len(digests) == len(names) == blocks
            and all(isinstance(x, str) for x in digests + names)
            and _stamps_ok(files.get("stamps"), count, block))


def verify(decoded: dict, plan, states: dict, start_epoch: int,
           accept: Iterable[str] = ()) -> None:
    """Check a decoded state's proof against ``plan`` for the lanes this rank reads
    (``states``: its checked lane states, before the pass is settled); raises
    :class:`~zephon.errors.ResumeMismatchError` naming every difference whose kind
    ``accept`` does not name (those are warned about instead). A state without a proof
    passes."""
    if "proof" not in decoded:
        return
    proof = _check_shape(decoded["proof"], plan.lanes)
    found: dict[str, list[str]] = {}
    if "files" in proof:
        stamps = plan.spec.source.stamps(now=True)  # as the files are now
        ours = files_proof(stamps)
        if proof["files"] is not None:
            lines = _files_diff(proof["files"], ours, stamps)
        elif ours is not None:
            lines = [f"the checkpoint's source had no files; this one has {ours['count']}"]
        else:
            lines = []
        if lines:
            found["files"] = lines
    if _regrouped(proof, plan):
        found["mapping"] = [
            f"mapping_strategy={proof['mapping']!r} on {proof['dp_degree']} dp group(s) at "
            f"the checkpoint, {plan.mapping!r} on {plan.dp} now: the lanes that share an "
            "optimizer step differ"]
    samples = _samples_diff(proof, plan, states, start_epoch)
    if samples:
        found["samples"] = samples
    _report(found, set(accept))


def _regrouped(proof: dict, plan) -> bool:
    """Whether this rank layout groups the lanes otherwise than the checkpoint's mapping
    would on as many dp groups (one group: every mapping is the one-rank stream)."""
    if proof["mapping"] == plan.mapping or min(proof["dp_degree"], plan.dp) == 1:
        return False
    return any(owned_lanes(plan.lanes, plan.dp, g, proof["mapping"])
               != owned_lanes(plan.lanes, plan.dp, g, plan.mapping) for g in range(plan.dp))


def _samples_diff(proof: dict, plan, states: dict, start_epoch: int) -> list[str]:
    source = plan.spec.source
    if proof.get("plain") and _plain(source) and proof.get("n") == len(source):
        # both sides name index i (name, i): with the same fingerprint (checked) and the
        # same length, every lane reads the same identities; nothing to recompute
        return []
    k, recorded = proof["k"], proof["next"]
    mine = [lane for lane in plan.owned if str(lane) in recorded]
    found = lane_digests(plan, mine, states, start_epoch, k)
    if any(lane not in found or found[lane][0] != recorded[str(lane)] for lane in mine):
        found = lane_digests(plan, mine, states, start_epoch, k, detail=True)
    lines: list[str] = []
    bad = 0
    for lane in mine:
        now = found.get(lane)
        if now is not None and now[0] == recorded[str(lane)]:
            continue
        bad += 1
        if len(lines) >= _SHOWN:
            continue
        if now is None:
            lines.append(f"lane {lane}: the checkpoint recorded samples to come, this "
                         "pipeline has none left in the pass")
        else:
            (epoch, pos), shown = now[1], ", ".join(f"{n}[{i}]" for n, i, _ in now[2])
            lines.append(f"lane {lane} (epoch {epoch}, position {pos}): the next {k} samples "
                         f"are not the checkpoint's (now {shown}, ...)")
    if bad > len(lines):
        lines.append(f"... {bad - len(lines)} more lane(s)")
    return lines


def _outside_zephon() -> int:
    """The ``stacklevel`` of the first caller outside zephon (the user's restore call),
    seen from the ``warnings.warn`` call in :func:`_report`."""
    frame: Any = inspect.currentframe()
    frame = frame.f_back.f_back if frame is not None else None
    level = 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("zephon."):
        frame, level = frame.f_back, level + 1
    return level


_WHY = {"files": "the source's files changed since the checkpoint",
        "samples": "the lanes would read other samples than the checkpoint recorded",
        "mapping": "the lane mapping changed"}


def _report(found: dict[str, list[str]], accept: set) -> None:
    refused = {kind: lines for kind, lines in found.items() if kind not in accept}
    for kind in found.keys() - refused.keys():
        warnings.warn(f"restore accepted ({kind}, resume_accept): {_WHY[kind]}: "
                      + "; ".join(found[kind]), ResumeMismatchWarning,
                      stacklevel=_outside_zephon())
    if not refused:
        return
    lines = [f"{_WHY[kind]}:\n  " + "\n  ".join(v) for kind, v in refused.items()]
    raise ResumeMismatchError(
        "the checkpoint does not continue this pipeline's stream:\n" + "\n".join(lines)
        + f"\n(to restore anyway: RuntimeOptions(resume_accept={tuple(sorted(refused))!r}))",
        kinds=tuple(sorted(refused)), diff=refused)
