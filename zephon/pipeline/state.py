"""The checkpoint state of a pipeline run: what it holds and how it is checked.

A run's local state is a dict::

    {"fingerprint": str, "lanes_total": C, "resume": "cursor" | "replay",
     "start_epoch": the run's first epoch (lanes without an entry start there),
     "group": dp group (one rank's state) | "world": ranks (a merged state),
     "dp_degree": G, "mapping": "contiguous" | "interleaved"  (a rank's own state),
     "mixture": [[position, [weight, ...]], ...]   (weights a trainer set, if any),
     "lanes": {"<lane>": [epoch, pos, total]                 (cursor resume)
                         [epoch, k, since, total, *carry]    (replay)
                         [total]}}                           (ended)

holding the delivered position of every owned lane that delivered something
(see :mod:`zephon.pipeline.engine` for what the numbers mean, and
:mod:`zephon.pipeline.carry` for the carry: what the accumulators held at the
boundary, as flat non-negative ints), or that has ended: ``[total]`` says the
lane delivered its last item of the pass (``total`` items; 0 for a lane with
none), so nothing more of it comes in this pass. A run covers the epochs of one
pass, ``[start_epoch, pass end)`` (``Plan.pass_end``). The bytes around it
(magic, version, checksum, compression) belong to :mod:`zephon.checkpoint`,
which refuses by name a state of another format version (version 2 holds partial
batches at every boundary and no carry, version 3 no ended lanes).

Where a run starts (:func:`settle`): the lane states it was given, except that a
start whose every lane has ended (or holds no sample at all) is the next pass's
beginning. It is decided from the state alone, so every rank restoring the same
merged state agrees: a rank whose own lanes have ended while other ranks' have not
runs the (empty) rest of the pass, and the next run of every rank is the next
pass. A rank's own state (or a live run's record on several dp groups) does not
say whether the other groups' lanes have ended, so it never skips to the next pass.

Two kinds of state restore: a merged one (``checkpoint()``: every lane, from
the multi-rank exchange, or from the one rank) restores under any rank layout;
a rank's own state (:func:`rank_state`, ``it.get_state()``: its owned lanes
only, with its ``group``, ``dp_degree`` and ``mapping``) restores only on a rank
of that same layout and group, since the lanes it lacks would silently start
over elsewhere.

:func:`check_state` trusts nothing: every field must have the exact type and a
value this pipeline can have produced (lane ids within ``[0, C)``, epochs within
the run's pass, positions within the lane's epoch, counts that cannot exceed
what the lane holds, a carry that decodes exactly against the plan), or a
:class:`~zephon.errors.CheckpointError` says which field is wrong. A restore is
all or nothing: nothing is applied until the whole state has been checked.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from zephon.errors import CheckpointError
from zephon.pipeline.carry import carry_bounds, decode_carry
from zephon.pipeline.engine import is_ended
from zephon.pipeline.proof import describe_parts_diff, make_proof, verify

__all__ = ["MAX_COUNT", "Position", "RunStart", "check_run", "check_state", "first_unread",
           "local_state", "position", "rank_state", "settle"]

#: No count in a state can be larger (items, positions, epochs): 2**48 items is far
#: beyond any real run, and keeps every figure exact in JSON and msgpack alike.
MAX_COUNT = 1 << 48
_REQUIRED = ("fingerprint", "lanes_total", "lanes", "resume", "start_epoch")
_OPTIONAL = ("group", "world", "dp_degree", "mapping", "proof", "mixture")
_LANE_ID = re.compile(r"0|[1-9][0-9]{0,5}")  # canonical decimal, ASCII only


class RunStart(NamedTuple):
    """Where a run starts: the lane states, the epoch lanes without one start at, and the
    mixture weights a trainer set (``(stream position, weight vector)`` pairs in order:
    :meth:`~zephon.pipeline.iterator.PipelineIterator.set_mixture_weights`)."""

    states: dict
    start_epoch: int
    mixture: tuple = ()


class Position(NamedTuple):
    """Where a run stands, as this rank knows it (:func:`position`).

    ``rank_batches``/``rank_samples``: the items (batches, with a ``batch`` op) the lanes
    this rank reads have delivered in the run, and the source samples they consumed for
    it; ``batches``/``samples``: the same over every lane, the other ranks' lanes counted
    as the restored checkpoint had them (exact right after a restore, and on one rank);
    ``epoch``: the epoch this rank's lanes are in (the earliest of them); ``start_epoch``:
    the run's first epoch. A run is one pass (``num_epochs`` epochs): the counts start
    at 0 with each pass. The samples are None when the pipeline resumes by replay (a
    packer or a shuffle buffer: what was consumed is not a count a state holds).
    """

    epoch: int
    start_epoch: int
    rank_batches: int
    batches: int
    rank_samples: int | None
    samples: int | None


def _lane_counts(plan, lane: int, entry: tuple, start: int, end: int | None):
    """``(items delivered, samples consumed or None, epoch or None)`` of one lane entry."""
    length = plan.lane_length(lane)
    if is_ended(entry):
        return entry[0], None if end is None else (end - start) * length, None
    if plan.cursor_resume:
        return entry[2], (entry[0] - start) * length + entry[1], entry[0]
    return entry[3], None, entry[0]


def position(plan, states: dict[int, tuple], start_epoch: int) -> Position:
    """The :class:`Position` of a run whose lane states are ``states``."""
    end = plan.pass_end(start_epoch)
    owned = set(plan.owned)
    batches = rank_batches = 0
    samples: int | None = 0
    rank_samples: int | None = 0
    epochs = []
    for lane, entry in states.items():
        items, used, epoch = _lane_counts(plan, lane, entry, start_epoch, end)
        batches += items
        samples = None if samples is None or used is None else samples + used
        if lane in owned:
            rank_batches += items
            rank_samples = None if rank_samples is None or used is None else rank_samples + used
            if epoch is not None:
                epochs.append(epoch)
    if not plan.cursor_resume:
        samples = rank_samples = None
    epoch = min(epochs) if epochs else start_epoch
    if len(epochs) < len(owned) and any(lane not in states for lane in owned):
        epoch = start_epoch  # a lane that delivered nothing yet is at the run's start
    return Position(epoch, start_epoch, rank_batches, batches, rank_samples, samples)


def settle(start: RunStart, plan) -> RunStart:
    """Where a run from ``start`` goes on: ``start`` itself, or the next pass's beginning
    when it has lane states and every one of the plan's ``C`` lanes has ended (or is
    dealt no sample), which only a state of every lane can say."""
    end = plan.pass_end(start.start_epoch)
    states = start.states
    if end is None or not states:
        return start
    for lane in range(plan.lanes):
        if not is_ended(states.get(lane)) and plan.lane_length(lane) > 0:
            return start
    return RunStart({}, end, start.mixture)


def first_unread(plan, start: RunStart) -> int:
    """The first stream position past every position a lane of ``start`` has consumed
    for what it delivered (the pipeline reads its source in source order: a mixture that
    orders itself), in samples of the stream (``epoch * len(source) + position``).

    A lane's position ``p`` of epoch ``e`` is source position ``((p // cs) * C + lane) *
    cs + p % cs`` (chunks of ``cs`` dealt round robin to ``C`` lanes). A cursor state
    has consumed its positions before ``p`` (the previous epoch's last one at ``p = 0``),
    a replay state (a packer) possibly up to the end of its flush segment (the epoch's
    end when it flushes at epochs only); a lane without a state has consumed nothing,
    an ended lane its whole pass."""
    n, cs, lanes = len(plan.spec.source), plan.spec.chunk_size, plan.lanes
    end = plan.pass_end(start.start_epoch)

    def past(lane: int, epoch: int, p: int) -> int:  # one past lane position p - 1
        if p <= 0:
            return 0 if epoch <= start.start_epoch else \
                past(lane, epoch - 1, plan.lane_length(lane))
        last = min(p, plan.lane_length(lane)) - 1
        return epoch * n + ((last // cs) * lanes + lane) * cs + last % cs + 1

    out = 0
    for lane in range(lanes):
        entry = start.states.get(lane)
        if entry is None:
            continue
        if is_ended(entry):
            out = max(out, (start.start_epoch if end is None else end) * n)
        elif plan.cursor_resume:
            out = max(out, past(lane, entry[0], entry[1]))
        else:
            every = plan.flush_every
            p = (entry[1] + every) * cs if every else plan.lane_length(lane)
            out = max(out, past(lane, entry[0], p))
    return out


def local_state(plan, states: dict[int, tuple], start_epoch: int = 0,
                whole: bool | None = None, mixture: tuple = ()) -> dict:
    """The state dict of this rank's owned lanes under ``plan`` (its fingerprint, lanes,
    resume mode and proof, :mod:`zephon.pipeline.proof`), in a run that started at
    ``start_epoch``; ``whole``: the proof holds the source's files and the fingerprint's
    parts too (None: on global rank 0 only, whose proof a merged state keeps)."""
    lanes = {str(lane): list(states[lane]) for lane in plan.owned if lane in states}
    if whole is None:
        whole = plan.opts.global_rank == 0
    local = {"fingerprint": plan.fingerprint, "lanes_total": plan.lanes, "lanes": lanes,
             "group": plan.group, "resume": "cursor" if plan.cursor_resume else "replay",
             "start_epoch": start_epoch,
             "proof": make_proof(plan, states, start_epoch, plan.owned, whole)}
    if mixture:
        local["mixture"] = [[at, list(weights)] for at, weights in mixture]
    return local


def rank_state(plan, states: dict[int, tuple], start_epoch: int = 0,
               mixture: tuple = ()) -> dict:
    """This rank's own state, restorable without any exchange on a rank of the same
    layout: :func:`local_state` plus the layout that says which lanes it owns."""
    return dict(local_state(plan, states, start_epoch, whole=True, mixture=mixture),
                dp_degree=plan.dp, mapping=plan.mapping)


def _int(value: Any, what: str, low: int = 0, high: int = MAX_COUNT) -> int:
    if type(value) is not int:
        raise CheckpointError(f"corrupt checkpoint: {what} must be an int, got "
                              f"{type(value).__name__} {value!r:.60}")
    if not low <= value <= high:
        raise CheckpointError(f"corrupt checkpoint: {what} = {value} is outside "
                              f"[{low}, {high}]")
    return value


def check_state(decoded: Any, plan) -> dict[int, tuple]:
    """The lane states of a decoded checkpoint, checked against ``plan`` (see
    :func:`check_run`)."""
    return check_run(decoded, plan).states


def check_run(decoded: Any, plan, accept: Any = None) -> RunStart:
    """Where the run of a decoded checkpoint goes on: its lane states and first epoch,
    checked against ``plan`` (its fingerprint first); raises
    :class:`~zephon.errors.CheckpointError` naming the first field that is wrong, and
    :class:`~zephon.errors.ResumeMismatchError` when its proof does not hold
    (:func:`zephon.pipeline.proof.verify`; ``accept``: the kinds of difference to let
    through, None: the options' ``resume_accept``)."""
    lanes, mode = _check_header(decoded, plan)
    start = _int(decoded["start_epoch"], "start_epoch", 0, MAX_COUNT - 1)
    end = plan.pass_end(start)
    entries = decoded["lanes"]
    if not isinstance(entries, dict):
        raise CheckpointError(f"corrupt checkpoint: lanes must be a mapping, got "
                              f"{type(entries).__name__}")
    if len(entries) > lanes:
        raise CheckpointError(f"corrupt checkpoint: {len(entries)} lane entries for {lanes} "
                              "lanes")
    epochs = (start, MAX_COUNT if end is None else end - 1)
    states: dict[int, tuple] = {}
    for key, value in entries.items():
        if not isinstance(key, str) or not _LANE_ID.fullmatch(key):
            raise CheckpointError(f"corrupt checkpoint: lane id {key!r:.40} is not a lane "
                                  "number in canonical form")
        lane = _int(int(key), f"lane id {key}", 0, lanes - 1)
        where = f"lane {lane}"
        if not isinstance(value, list):
            raise CheckpointError(f"corrupt checkpoint: {where} must be a list, got "
                                  f"{type(value).__name__}")
        if len(value) == 1:
            states[lane] = _ended_lane(value, where, plan, lane, (start, end))
        elif mode == "cursor":
            states[lane] = _cursor_lane(value, where, plan.lane_length(lane), epochs)
        else:
            states[lane] = _replay_lane(value, where, plan, lane, epochs)
    mixture = _mixture(decoded.get("mixture", []), plan)
    verify(decoded, plan.with_mixture(mixture), states, start,
           plan.opts.resume_accept if accept is None else accept)
    return settle(RunStart(states, start, mixture), plan)


def _mixture(value: Any, plan) -> tuple:
    """The weights a trainer set, checked: ``[[position, [weight per component]], ...]``
    in order of position, each weight 0 or positive and finite, one positive."""
    if not isinstance(value, list):
        raise CheckpointError(f"corrupt checkpoint: mixture must be a list, got "
                              f"{type(value).__name__}")
    names = getattr(plan.spec.source, "names", None)
    if value and getattr(plan.spec.source, "stream", None) is None:
        raise CheckpointError("checkpoint holds mixture weights a trainer set, but this "
                              "pipeline's source is no mixture with a position-keyed schedule")
    out: list = []
    for n, entry in enumerate(value):
        where = f"mixture entry {n}"
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list)):
            raise CheckpointError(f"corrupt checkpoint: {where} must be [position, weights]")
        at = _int(entry[0], f"{where} position", out[-1][0] if out else 0)
        weights = entry[1]
        if len(weights) != len(names or ()) or any(
                type(w) not in (int, float) or not 0 <= w < float("inf") for w in weights) \
                or not any(weights):
            raise CheckpointError(f"corrupt checkpoint: {where} must hold {len(names or ())} "
                                  f"weights, each 0 or positive and finite, one positive")
        out.append((at, tuple(float(w) for w in weights)))
    return tuple(out)


def _check_header(decoded: Any, plan) -> tuple[int, str]:
    """Check the fields around the lane entries; returns (canonical lanes, resume mode)."""
    if not isinstance(decoded, dict):
        raise CheckpointError("corrupt checkpoint: the state is not a mapping")
    for key in _REQUIRED:
        if key not in decoded:
            raise CheckpointError(f"checkpoint lacks {key!r}: not a pipeline state")
    unknown = sorted(str(k)[:40] for k in decoded if k not in _REQUIRED + _OPTIONAL)
    if unknown:
        raise CheckpointError(f"corrupt checkpoint: unknown field(s) {unknown[:5]}")
    theirs = decoded["fingerprint"]
    if not isinstance(theirs, str):
        raise CheckpointError("corrupt checkpoint: fingerprint is not a string")
    fingerprint = plan.fingerprint
    if theirs != fingerprint:
        proof = decoded.get("proof")
        diff = describe_parts_diff(proof.get("parts") if isinstance(proof, dict) else None,
                                   list(plan.fingerprint_parts))
        raise CheckpointError(
            f"checkpoint is from a different pipeline (its fingerprint {theirs[:12]} is not "
            f"this pipeline's {fingerprint[:12]}: "
            + (diff or "source, ops, seed, chunking or flush differ") + ")")
    lanes = _int(decoded["lanes_total"], "lanes_total", 1)
    if lanes != plan.lanes:
        raise CheckpointError(
            f"checkpoint has canonical_replicas={lanes}, this pipeline {plan.lanes}: the number "
            "of canonical lanes must not change across a restore")
    if "group" in decoded:  # a rank's own state: only for the lanes of its layout
        _check_layout(decoded, plan, lanes)
    elif "dp_degree" in decoded or "mapping" in decoded:
        raise CheckpointError("corrupt checkpoint: a rank layout (dp_degree, mapping) "
                              "without its group")
    if "world" in decoded:  # a merged state: how many ranks it was merged from
        _int(decoded["world"], "world", 1, MAX_COUNT)
    mode = "cursor" if plan.cursor_resume else "replay"
    if decoded["resume"] != mode:
        raise CheckpointError(f"checkpoint resumes by {decoded.get('resume')!r}, this pipeline "
                              f"by {mode!r}")
    return lanes, mode


def _check_layout(decoded: dict, plan, lanes: int) -> None:
    """A rank's own state holds only the lanes its dp group owned: it restores only on a
    rank of the same group, ``dp_degree`` and mapping."""
    group = _int(decoded["group"], "group", 0, lanes - 1)
    theirs = (group, decoded.get("dp_degree"), decoded.get("mapping"))
    ours = (plan.group, plan.dp, plan.mapping)
    if theirs != ours:
        raise CheckpointError(
            f"checkpoint is one rank's own state (dp group {theirs[0]} of dp_degree "
            f"{theirs[1]!r:.20}, {theirs[2]!r:.20} mapping), this rank reads dp group "
            f"{ours[0]} of {ours[1]} ({ours[2]!r}): restore the merged checkpoint() instead")


def _ended_lane(value: list, where: str, plan, lane: int, run: tuple) -> tuple:
    """An ended lane entry: ``[items delivered]`` in a pass that ends."""
    start, end = run
    if end is None:
        raise CheckpointError(f"corrupt checkpoint: {where} is marked ended, but this "
                              "pipeline's pass never ends (num_epochs=None)")
    bound = MAX_COUNT if plan.expands else min(MAX_COUNT, (end - start) * plan.lane_length(lane))
    return (_int(value[0], f"{where} items delivered", 0, bound),)


def _cursor_lane(value: list, where: str, length: int, epochs: tuple) -> tuple:
    """A cursor-resume lane entry: ``[epoch, position, items delivered]``."""
    if len(value) != 3:
        raise CheckpointError(f"corrupt checkpoint: {where} must be [epoch, pos, "
                              f"total], got {len(value)} value(s)")
    epoch = _int(value[0], f"{where} epoch", *epochs)
    pos = _int(value[1], f"{where} position", 0, length)
    total = _int(value[2], f"{where} items delivered", 0,
                 min(MAX_COUNT, (epoch - epochs[0] + 1) * length))
    return (epoch, pos, total)


def _replay_lane(value: list, where: str, plan, lane: int, epochs: tuple) -> tuple:
    """A replay-resume lane entry: ``[epoch, lane chunk at a flush boundary, items since
    that boundary, items delivered, *carry]``."""
    if len(value) < 4:
        raise CheckpointError(f"corrupt checkpoint: {where} must be [epoch, k, since, "
                              f"total, *carry], got {len(value)} value(s)")
    length = plan.lane_length(lane)
    chunk_size = plan.spec.chunk_size
    epoch = _int(value[0], f"{where} epoch", *epochs)
    chunks = -(-length // chunk_size)
    k = _int(value[1], f"{where} lane chunk", 0, max(0, chunks - 1))
    K = plan.flush_every
    if (K and k % K) or (not K and k):
        raise CheckpointError(f"corrupt checkpoint: {where} lane chunk {k} is not a "
                              f"flush boundary (every {K or 'epoch'} chunks)")
    if plan.expands:  # a packer may cut many rows from one sample: no static bound
        segment = total_bound = MAX_COUNT
    else:  # every delivered item consumed at least one sample of the segment
        segment = min(length - k * chunk_size, K * chunk_size) if K else length
        total_bound = min(MAX_COUNT, (epoch - epochs[0] + 1) * length)
    total = _int(value[3], f"{where} items delivered", 1, total_bound)
    since = _int(value[2], f"{where} items since its boundary", 1, min(total, segment))
    carry = value[4:]
    decode_carry(plan.carry_layout, carry, where, carry_bounds(plan, lane, epoch, k,
                                                               epochs[0]))
    return (epoch, k, since, total, *carry)
