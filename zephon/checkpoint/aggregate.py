"""Merging the checkpoint state of all ranks into one state every rank returns.

What it owns: the exchange protocol (one checkpoint round), the merge and the
consistency check of a merged state. Where the bytes travel is a *medium*
(:mod:`zephon.checkpoint.media`: a local directory, an fsspec URL, torch's
TCPStore); the protocol is the same over all of them.

One launch, one round: a round's keys live under a *scope*, a hash of the
pipeline's fingerprint and of what names the launch to all of its ranks and to
no other launch running at the same time (:func:`launch_identity`): a launch id
rank 0 draws and publishes in the initialized default process group's store;
else torchrun's description of the launch; else an explicit ``run_id``, which
is in the medium's path; nothing more when the medium is the process group's
store itself, which only this launch reaches. A rank reads and writes only
under its own launch's scope, so it never submits to a round that another
running launch opened. With none of these (the default ``run_id`` outside
torchrun and without a process group) no rank could tell two launches started
at once apart, so every rank refuses with a
:class:`~zephon.errors.ZephonConfigError` before it writes anything. Launches
with one identity can only follow each other (a resumed job, a torchrun
restart); what an earlier one left is handled as below.

A round (``round_no`` counts the calls of ``checkpoint()`` in this launch):

1. Rank 0 draws a fresh random token and publishes ``round-<n>/open`` naming it.
   An ``open`` already there was left by an earlier launch: rank 0 first writes
   a redirect to its token into that round's ``merged`` key, where ranks that
   read the old token wait.
2. Every other rank waits for ``open`` and submits its state once under
   ``round-<n>/<token>/`` (:meth:`submit` of the medium), unless a ``merged``
   record is there already. A merged state is an earlier launch's (it would hold
   this rank's), and so is a failure unless it is this launch's own: rank 0 gave
   up on this late rank (:meth:`_Round.own_failure`: the scope is private to the
   launch; or ``open`` names, as ``after``, the token of round ``n - 1`` that this
   rank took part in; or rank 0 wrote the failure, ``at``, more than
   :data:`CLOCK_MARGIN_S` after this process started and after its last round on
   this scope ended, which no earlier launch can have done). The rank raises its
   own launch's failure at once; for an earlier launch's record it waits for
   rank 0 to reopen the round.
3. Rank 0 gathers the submissions under the token it drew a moment ago, so a
   record of an earlier launch or round can never be merged, checks that
   nobody reopened the round, checks the states (:func:`merge_states`) and
   publishes ``round-<n>/<token>/merged``: the merged state, or the error that
   stopped it.
4. Every rank reads ``merged`` once and returns its state (or raises its
   error), then tells the medium it is done (``tidy``): the last one removes
   the round. A medium that cannot count its readers leaves the round to
   rank 0, which removes round ``n - 1`` after merging round ``n`` (every rank
   has submitted to ``n``, so all are done with ``n - 1``).

Cost: every wait blocks on the medium (a store) or backs off (a directory), and a
rank makes a constant number of medium operations a round whatever the world size
(see :mod:`zephon.checkpoint.media`); every rank reads the merged record, the
compressed merged state and nothing per rank, once.

Invariants: every rank returns the same bytes or raises; a merged state has
passed :func:`check_merged` (every lane in range, each lane owned by exactly
the dp group that reported it, replicas of a group agreeing); nothing is
merged from another launch (launches that run at once have distinct scopes;
two that share an explicit ``run_id`` against that rule are refused by rank 0
when it sees the other's ``open``, at best effort).

Time: ``aggregate_timeout_s`` bounds the whole exchange. ``checkpoint()`` is
collective: every rank must call it at the same step. Rank 0 waits for the
other ranks at most :func:`arrival_grace_s` (a sixth of the budget, at most
30 s) before it names the ranks that never called it; a rank that comes
after that raises rank 0's error naming it (step 2); a rank waiting for
rank 0 (which may be saving a model first) waits the whole budget. Either
way the error says that every rank must call ``checkpoint()``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import sys
import time
from typing import Callable, NoReturn

from zephon.checkpoint.codec import decode_state, encode_state
from zephon.checkpoint.media import backoff
from zephon.errors import AggregationTimeoutError, CheckpointError, ZephonConfigError
from zephon.options import (
    resolve_aggregate_timeout_s,
    resolve_canonical_replicas,
    resolve_dp_degree,
    resolve_dp_group_id,
    resolve_mapping_strategy,
)
from zephon.options.runtime import DEFAULT_RUN_ID

__all__ = [
    "aggregate_through_dir",
    "arrival_grace_s",
    "check_merged",
    "exchange",
    "exchange_scope",
    "exchange_state",
    "launch_identity",
    "merge_states",
    "owned_lanes",
]

log = logging.getLogger("zephon.checkpoint")

_LOCAL_KEYS = ("nonce", "rank", "group", "world", "dp_degree", "mapping")
MAX_ARRIVAL_GRACE_S = 30.0


def arrival_grace_s(timeout_s: float) -> float:
    """How long rank 0 waits for a rank that has not called ``checkpoint()`` at all:
    ``min(timeout_s / 6, 30 s)``. Ranks of a data-parallel job reach the checkpoint
    at the same step, so a rank that is later than that is not calling it."""
    return min(timeout_s / 6.0, MAX_ARRIVAL_GRACE_S)


def owned_lanes(lanes: int, groups: int, group: int, strategy: str) -> list[int]:
    """The canonical lanes dp group ``group`` of ``groups`` reads (the same rule as the
    pipeline's work source; a test pins the two together)."""
    if strategy == "interleaved":
        return [lane for lane in range(lanes) if lane % groups == group]
    base, extra = divmod(lanes, groups)
    start = group * base + min(group, extra)
    return list(range(start, start + base + (1 if group < extra else 0)))


def _lane_entries(state: dict, who: str) -> dict:
    lanes = state.get("lanes")
    if not isinstance(lanes, dict):
        raise CheckpointError(f"{who}: 'lanes' is {type(lanes).__name__}, not a mapping")
    out = {}
    for lane, value in lanes.items():
        try:
            lane_no = int(lane)
            entry = tuple(int(v) for v in value)
        except (TypeError, ValueError):
            raise CheckpointError(f"{who}: corrupt lane entry {lane!r}: {value!r}") from None
        if not entry or min(entry) < 0:  # the pipeline checks the fields it restores
            raise CheckpointError(f"{who}: corrupt lane entry {lane!r}: {value!r}")
        out[lane_no] = entry
    return out


def check_merged(state: dict, *, groups: int | None = None, strategy: str | None = None,
                 owners: dict | None = None) -> None:
    """Refuse a merged state that cannot be right.

    Checks that ``lanes_total`` is a positive int, every lane is in
    ``[0, lanes_total)`` with a position of non-negative ints, and (when ``owners`` maps
    dp group -> the lanes it reported) that each group reported only lanes it owns
    under ``groups``/``strategy``, so no lane comes from two groups.

    Args:
        state: the merged state (``lanes_total``, ``lanes``: lane id as a string ->
            position list).
        groups: the number of dp groups (needed with ``owners``).
        strategy: the lane mapping, ``"contiguous"`` or ``"interleaved"`` (needed with
            ``owners``).
        owners: dp group -> the lane ids it reported; None skips the ownership check.

    Raises:
        CheckpointError: naming the lane and what is wrong with it.

    Examples:
        >>> check_merged({"lanes_total": 2, "lanes": {"1": [0, 4, 4]}})
        >>> check_merged({"lanes_total": 2, "lanes": {"3": [0, 1, 1]}})
        Traceback (most recent call last):
        ...
        zephon.errors.CheckpointError: merged state: lane 3 is out of range [0, 2) ...
    """
    total = state.get("lanes_total")
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise CheckpointError(f"merged state: lanes_total is {total!r}, expected an int >= 1")
    for lane in _lane_entries(state, "merged state"):
        if not 0 <= lane < total:
            raise CheckpointError(f"merged state: lane {lane} is out of range "
                                  f"[0, {total}) (canonical_replicas={total})")
    if owners is None:
        return
    if groups is None or strategy is None:
        raise TypeError("check_merged: owners needs groups and strategy to check against")
    seen: dict[int, int] = {}
    for group, lanes in sorted(owners.items()):
        allowed = set(owned_lanes(total, groups, group, strategy))
        for lane in lanes:
            if lane not in allowed:
                raise CheckpointError(
                    f"merged state: dp group {group} reported lane {lane}, which it does not "
                    f"own ({strategy} mapping of {total} lanes over {groups} groups gives it "
                    f"{sorted(allowed)})")
            if lane in seen:
                raise CheckpointError(f"merged state: lane {lane} reported by dp groups "
                                      f"{seen[lane]} and {group}")
            seen[lane] = group


def merge_states(states: dict) -> dict:
    """Merge ``{rank: submitted state}`` (all ranks of one round) into one state.

    Every submission carries the local pipeline state (``fingerprint``,
    ``lanes_total``, ``lanes``) plus ``group``, ``world``, ``dp_degree`` and
    ``mapping``. Refused with :class:`CheckpointError`: ranks that disagree on the
    pipeline, the topology or C; a dp group with no rank; two ranks of one dp group
    that disagree on a lane (they did not take the checkpoint at the same step); a
    lane out of range or reported by a group that does not own it.

    Args:
        states: rank -> that rank's submission, for ranks ``0 .. world - 1``.

    Returns:
        The merged state: the pipeline fields of rank 0, the union of the lanes,
        ``world``.

    Raises:
        CheckpointError: as above, naming the ranks, groups or lane concerned.

    Examples:
        >>> def submission(rank):
        ...     return {"fingerprint": "f", "lanes_total": 2, "resume": "cursor",
        ...             "lanes": {str(rank): [0, 4, 4]}, "group": rank, "world": 2,
        ...             "dp_degree": 2, "mapping": "contiguous"}
        >>> merge_states({0: submission(0), 1: submission(1)})["lanes"]
        {'0': [0, 4, 4], '1': [0, 4, 4]}
    """
    world = len(states)
    if sorted(states) != list(range(world)):
        raise CheckpointError(f"merge: expected ranks 0..{world - 1}, got {sorted(states)}")
    first = states[0]
    for key in ("fingerprint", "lanes_total", "world", "dp_degree", "mapping", "mixture"):
        for r in range(1, world):
            if states[r].get(key) != first.get(key):
                raise CheckpointError(
                    f"ranks 0 and {r} disagree on {key} ({first.get(key)!r} vs "
                    f"{states[r].get(key)!r}): they do not run the same pipeline and topology")
    if first.get("world") != world:
        raise CheckpointError(f"merge: {world} ranks submitted a state but they report "
                              f"world_size={first.get('world')}")
    groups, strategy = first["dp_degree"], first["mapping"]
    first_of_group: dict[int, int] = {}
    owners: dict[int, set] = {}
    lanes: dict[int, tuple] = {}
    for r in range(world):
        group = states[r].get("group")
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < groups:
            raise CheckpointError(f"rank {r} reports dp group {group!r}; expected 0 <= group "
                                  f"< dp_degree ({groups})")
        peer = first_of_group.setdefault(group, r)
        mine = _lane_entries(states[r], f"rank {r}")
        theirs = _lane_entries(states[peer], f"rank {peer}")
        if mine != theirs:
            lane = sorted(set(mine.items()) ^ set(theirs.items()))[0][0]
            raise CheckpointError(
                f"ranks {peer} and {r} of dp group {group} disagree on lane {lane} "
                f"({theirs.get(lane)} vs {mine.get(lane)}); every rank must take the "
                "checkpoint after the same number of batches (a missing barrier?)")
        owners.setdefault(group, set()).update(mine)
        lanes.update(mine)
    missing_groups = sorted(set(range(groups)) - set(first_of_group))
    if missing_groups:
        raise CheckpointError(f"merge: no rank of dp group(s) {missing_groups} submitted a "
                              "state")
    merged = {k: v for k, v in first.items() if k not in _LOCAL_KEYS}
    merged["lanes"] = {str(lane): list(lanes[lane]) for lane in sorted(lanes)}
    if isinstance(first.get("proof"), dict):  # rank 0's files and parts, every rank's lanes
        merged["proof"] = _merged_proof(states, world)
    merged["world"] = world
    check_merged(merged, groups=groups, strategy=strategy, owners=owners)
    return merged


def _merged_proof(states: dict, world: int) -> dict:
    """Rank 0's proof with the ``next`` digests of every rank's lanes (each rank records
    the lanes it owns: :mod:`zephon.pipeline.proof`)."""
    proof = dict(states[0]["proof"])
    nxt: dict = {}
    for r in range(world):
        theirs = states[r].get("proof")
        if not isinstance(theirs, dict) or not isinstance(theirs.get("next"), dict):
            raise CheckpointError(f"rank {r} submitted no resume proof while rank 0 did: "
                                  "the ranks run different zephon versions")
        nxt.update(theirs["next"])
    proof["next"] = {lane: nxt[lane] for lane in sorted(nxt, key=lambda x: (len(x), x))}
    return proof


def _submission(local: dict, opts) -> dict:
    return dict(local, group=resolve_dp_group_id(opts), world=opts.world_size,
                dp_degree=resolve_dp_degree(opts), mapping=resolve_mapping_strategy(opts))


def _raise_recorded(record: dict, address: str) -> NoReturn:
    kind, message = record.get("kind"), str(record.get("error"))
    if kind == "timeout":
        raise AggregationTimeoutError(message, missing=record.get("missing") or ())
    raise CheckpointError(f"rank 0 refused the checkpoint round ({address}): {message}")


def exchange(medium, submission: dict, *, round_no: int, rank: int, world: int,
             timeout_s: float, serializer: str, compressor: str,
             grace_s: float | None = None, scope: str = "",
             private_scope: bool = False) -> bytes:
    """Run one checkpoint round over ``medium`` (see the module docstring).

    Args:
        medium: a :mod:`zephon.checkpoint.media` medium.
        submission: this rank's local state plus ``group``/``world``/``dp_degree``/
            ``mapping``.
        round_no: the round (the n-th ``checkpoint()`` of this launch, from 1).
        grace_s: how long rank 0 waits for ranks that never arrive; default
            :func:`arrival_grace_s` of ``timeout_s``.
        scope: a key prefix that keeps apart exchanges sharing one medium (the launch
            and the pipeline, see :func:`exchange_scope`).
        private_scope: no other launch, earlier or concurrent, ever uses ``scope`` (it
            names a launch id drawn in the process group's store), so every record
            under it is this launch's.

    Returns:
        The merged checkpoint bytes (the same on every rank).

    Raises:
        AggregationTimeoutError: a rank did not take part in time (named).
        CheckpointError: the states are inconsistent, or the medium failed.
    """
    rnd = _Round(medium, round_no, timeout_s, grace_s, scope, private_scope)
    merged_token = None
    try:
        if rank == 0:
            data = _lead(rnd, submission, world, serializer, compressor)
        else:
            data = _follow(rnd, submission, rank, world, serializer, compressor)
        merged_token = rnd.token
        return data
    finally:
        _ROUNDS_SEEN[rnd.history_key(rank)] = (round_no, merged_token, time.time())


class _Round:
    """One exchange round's keys and clock: where its records live on the medium, when
    rank 0 stops waiting for arrivals (``grace``) and when everyone gives up."""

    def __init__(self, medium, round_no: int, timeout_s: float, grace_s: float | None,
                 scope: str, private_scope: bool = False) -> None:
        self.medium, self.round_no, self.timeout_s = medium, round_no, timeout_s
        self.private_scope = private_scope
        self.token: str | None = None  # the token of the round this rank took part in
        self.start = time.monotonic()
        self.deadline = self.start + timeout_s
        self.grace = arrival_grace_s(timeout_s) if grace_s is None else min(grace_s, timeout_s)
        self.prefix = f"{scope}/" if scope else ""
        self.base = f"{self.prefix}round-{round_no}"
        self.where = f"{medium.address} ({self.base})"

    def history_key(self, rank: int) -> tuple[str, str, int]:
        return (self.medium.address, self.prefix, rank)

    def previous_token(self, rank: int) -> str | None:
        """The token of round ``round_no - 1`` when this process took part in it as
        ``rank`` and it was merged (so it belongs to this launch), else None."""
        seen = _ROUNDS_SEEN.get(self.history_key(rank))
        return seen[1] if seen is not None and seen[0] == self.round_no - 1 else None

    def own_failure(self, rank: int, opened: dict, record: dict) -> bool:
        """Whether ``record``, a failure rank 0 published in the round ``opened`` names
        before this rank submitted, is this launch's (rank 0 gave up on this rank),
        not one an earlier launch with the same scope left (step 2 of the module
        docstring: a private scope, the token chain, then the clock)."""
        if "error" not in record:
            return False
        if self.private_scope:
            return True
        before = self.previous_token(rank)
        if before is not None and opened.get("after") == before:
            return True  # rank 0 opened it right after this launch's previous round
        seen = _ROUNDS_SEEN.get(self.history_key(rank))
        since = max(_process_started(), seen[2] if seen is not None else 0.0)
        at = record.get("at")
        return isinstance(at, float) and at > since + CLOCK_MARGIN_S


def _record(fields: dict) -> bytes:
    return encode_state(fields, "msgpack", "none")


def _token_of(record: dict | None, field: str = "token") -> str | None:
    token = record.get(field) if record is not None else None
    return token if isinstance(token, str) and _TOKEN.fullmatch(token) else None


def _lead(rnd: _Round, submission: dict, world: int, serializer: str,
          compressor: str) -> bytes:
    """Rank 0: open the round, collect every rank's state, merge, publish the merged
    state (or the failure, which every rank then raises), tidy the round."""
    medium, base = rnd.medium, rnd.base
    token = os.urandom(8).hex()
    # An open record already there was left by an earlier launch: ranks that read it
    # wait on its merged key, so a redirect there sends them to this round.
    previous = _token_of(_read_record(medium, f"{base}/open"))
    if previous is not None:
        medium.put(f"{base}/{previous}/merged", _record({"reopened": token}))
    opened = {"token": token, "world": world}
    after = rnd.previous_token(0)
    if after is not None:  # tells this launch's late ranks that the round is its own
        opened["after"] = after
    medium.put(f"{base}/open", _record(opened))
    tokens = [token] if previous is None else [token, previous]
    states = {0: dict(submission, rank=0)}

    def fail(record: dict, exc: BaseException, tidy: bool = False) -> NoReturn:
        try:
            medium.put(f"{base}/{token}/merged", _record(dict(record, at=time.time())))
            if tidy:  # every rank arrived and reads the failure: the round ends as usual
                medium.tidy(base, tokens, 0, world, rnd.deadline)
        except Exception:  # best effort: the ranks then time out instead
            log.debug("could not publish the failure of %s", rnd.where, exc_info=True)
        raise exc

    _collect(rnd, token, states, world, fail)
    try:
        merged = merge_states(states)
        state = encode_state(merged, serializer, compressor)
    except CheckpointError as exc:
        fail({"kind": "error", "error": str(exc)}, exc, tidy=True)
    medium.put(f"{base}/{token}/merged", _record({"state": state}))
    rnd.token = token
    medium.tidy(base, tokens, 0, world, rnd.deadline)
    if rnd.round_no > 1:
        # every rank has submitted to this round, so every rank is done with the last one
        # (a medium that cannot count its readers leaves each round to the next)
        try:
            medium.remove(f"{rnd.prefix}round-{rnd.round_no - 1}")
        except Exception:  # a leftover round is harmless: keep the checkpoint
            log.debug("could not remove round %d at %s", rnd.round_no - 1, medium.address,
                      exc_info=True)
    return state


def _collect(rnd: _Round, token: str, states: dict, world: int,
             fail: Callable[..., NoReturn]) -> None:
    """Rank 0: wait (at most the arrival grace) until every rank has submitted, read the
    submissions in one go; ``fail`` on a foreign opener, an unreadable record or ranks
    that do not arrive in time."""
    medium, base = rnd.medium, rnd.base
    until = min(rnd.start + rnd.grace, rnd.deadline)
    try:
        blobs = medium.gather(f"{base}/{token}", world, until) if world > 1 else {}
    except CheckpointError as exc:
        fail({"kind": "error", "error": str(exc)}, exc)
    if _token_of(_read_record(medium, f"{base}/open")) != token:
        message = (f"checkpoint round {rnd.round_no}: another launch with the same "
                   f"run_id opened this round at {rnd.where} while this one was "
                   "collecting: give launches that run at the same time on one "
                   "aggregate_dir distinct run_ids (under torchrun or with an "
                   "initialized process group each launch is kept apart automatically)")
        fail({"kind": "error", "error": message}, CheckpointError(message))
    for r, blob in sorted(blobs.items()):
        try:
            states[r] = decode_state(blob)
        except CheckpointError as exc:
            fail({"kind": "error", "error": f"rank {r}'s record: {exc}"}, exc)
    missing = sorted(set(range(world)) - set(states))
    if missing:
        waited = min(rnd.grace, rnd.timeout_s)
        message = (
            f"checkpoint round {rnd.round_no}: rank(s) {missing} did not call "
            f"checkpoint() within {waited:.1f} s of rank 0 ({rnd.where}); checkpoint() "
            "is collective: every rank must call it at the same step, not only rank 0")
        fail({"kind": "timeout", "error": message, "missing": missing},
             AggregationTimeoutError(message, missing=missing))


def _follow(rnd: _Round, submission: dict, rank: int, world: int, serializer: str,
            compressor: str) -> bytes:
    """A rank other than 0: submit to the round rank 0 opened (again if it reopens it),
    then wait for the merged state published after this rank submitted."""
    medium, base = rnd.medium, rnd.base
    mine = encode_state(dict(submission, rank=rank), serializer, compressor)
    opened = _await_open(rnd, None)
    while True:
        token = opened["token"]
        merged = f"{base}/{token}/merged"
        record = _read_record(medium, merged)
        if record is None:  # the round is open and not merged yet: take part in it
            medium.submit(f"{base}/{token}", rank, world, mine,
                          until=min(rnd.start + rnd.grace, rnd.deadline))
            record = _decoded(medium, merged, medium.wait(merged, rnd.deadline))
            if record is None and time.monotonic() >= rnd.deadline:
                _rank_0_late(rnd)
            if record is not None and "reopened" not in record:
                medium.tidy(base, [token], rank, world, rnd.deadline)
                if "error" in record:
                    _raise_recorded(record, rnd.where)
                rnd.token = token
                return record["state"]
        elif rnd.own_failure(rank, opened, record):
            # rank 0 of this launch gave up on this rank before it came: its error
            # (naming this rank) is this rank's at once
            _raise_recorded(record, rnd.where)
        redirect = _token_of(record, "reopened")
        # a redirect names the round rank 0 opened; any other merged record there before
        # this rank submitted is an earlier launch's, and rank 0 of this one reopens the
        # round
        opened = {"token": redirect} if redirect is not None else _await_open(rnd, token)


def _await_open(rnd: _Round, stale: str | None) -> dict:
    """The open record of the round once its token is not ``stale`` (a blocking wait for
    the open record, then a bounded backoff while only a stale one is there)."""
    key = f"{rnd.base}/open"
    record = _decoded(rnd.medium, key, rnd.medium.wait(key, rnd.deadline))
    for _ in backoff(rnd.deadline, first_s=0.01, cap_s=0.5):
        token = _token_of(record)
        if record is not None and token is not None and token != stale:
            return record
        record = _read_record(rnd.medium, key)
    _rank_0_late(rnd)


def _rank_0_late(rnd: _Round) -> NoReturn:
    raise AggregationTimeoutError(
        f"checkpoint round {rnd.round_no}: rank 0 did not publish the merged state "
        f"within {rnd.timeout_s} s ({rnd.where}); checkpoint() is collective: every "
        "rank, rank 0 included, must call it at the same step", missing=[0])


_TOKEN = re.compile(r"[0-9a-f]{16}")

#: (medium address, scope, rank) -> (round_no, token of that round once it was merged
#: with this rank's state, else None; wall time it ended) of the last round a rank of
#: this process ran there: how a late rank tells its own launch's failed round from an
#: earlier launch's leftover (:meth:`_Round.own_failure`)
_ROUNDS_SEEN: dict[tuple[str, str, int], tuple[int, str | None, float]] = {}

#: how much later than the start of this process (or the end of its last round on the
#: same scope) rank 0 must have written a failure for a late rank to take it as its own
#: launch's: covers the clocks of two hosts disagreeing, and /proc's tick granularity
CLOCK_MARGIN_S = 2.0


def _process_started() -> float:
    """This process's start as a wall time (Linux /proc); +inf where it is unknown, so
    that no failure is judged by the clock there."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return float("inf")


def _read_record(medium, key: str) -> dict | None:
    """A small record of the protocol, or None when it is absent or unreadable."""
    return _decoded(medium, key, medium.get(key))


def _decoded(medium, key: str, blob: bytes | None) -> dict | None:
    if blob is None:
        return None
    try:
        record = decode_state(blob)
    except CheckpointError:
        # A torn or foreign leftover in a reused directory counts as not there yet:
        # rank 0 of this launch writes its own.
        log.warning("checkpoint exchange: ignoring an unreadable %s at %s", key,
                    medium.address)
        return None
    return record if isinstance(record, dict) else None


def exchange_scope(local: dict, launch: str) -> str:
    """The key prefix of one pipeline's exchanges in one launch.

    ``launch`` is what names the launch to all of its ranks and to no other launch
    (:func:`launch_identity`), so concurrent launches on one aggregate_dir never share a
    key; the pipeline's fingerprint keeps two pipelines of one job (train and
    validation) apart when they share an aggregate_dir."""
    fingerprint = str(local.get("fingerprint", ""))
    digest = hashlib.sha256(f"{launch}\n{fingerprint}".encode()).hexdigest()[:16]
    return f"p-{digest}"


LAUNCH_ID_KEY = "zephon/launch-id"
_LOOPBACK = ("localhost", "ip6-localhost", "::1", "")


def launch_identity(opts, timeout_s: float) -> str:
    """What every rank of this launch shares and no concurrent launch can have.

    In order: an initialized default process group (rank 0 draws a random launch id
    and publishes it in the group's store, the others read it there: a store belongs
    to one launch); a torchrun launch (``TORCHELASTIC_RUN_ID``, ``MASTER_ADDR``,
    ``MASTER_PORT``, whose store holds that port while the launch runs, plus this
    host's name when the master is a loopback address, since another machine's
    single-node launch uses the same address); an explicit ``run_id`` (the keys live
    under it; launches that run at the same time must use distinct ones). Returns ""
    for the last, whose name is already in the medium's path.

    Raises:
        ZephonConfigError: none of these: the default ``run_id`` outside torchrun,
            where two launches started at once could merge each other's states.
        AggregationTimeoutError: rank 0 did not publish the launch id in time.
        CheckpointError: the process group's store failed.
    """
    store = _process_group_store()
    if store is not None:
        return "pg|" + _agreed_launch_id(store, opts.global_rank, timeout_s)
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run:
        addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
        host = socket.gethostname() if addr in _LOOPBACK or addr.startswith("127.") else ""
        return "|".join(("torchrun", run, addr, port, host))
    if opts.run_id != DEFAULT_RUN_ID:
        return ""
    where = opts.aggregate_dir if opts.aggregate_dir is not None else opts.aggregate_store
    raise ZephonConfigError(
        f"checkpoint() of rank {opts.global_rank} of {opts.world_size}: nothing tells this "
        f"launch's ranks from another launch's on {where!r} (run_id is the default "
        f"{DEFAULT_RUN_ID!r}, there is no torchrun launch and no initialized "
        "torch.distributed process group), so two launches started at once could merge "
        "each other's states; give every launch its own run_id, the same on all of its "
        "ranks (RuntimeOptions(run_id=...)), or launch it with torchrun",
        field="RuntimeOptions.run_id")


def _process_group_store():
    """The default process group's store when torch.distributed is loaded and the group
    is initialized (torch is never imported here), else None."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # a group without a store: no identity from it
        log.debug("checkpoint exchange: no store in the default process group", exc_info=True)
        return None


def _agreed_launch_id(store, rank: int, timeout_s: float) -> str:
    """Rank 0's launch id in the process group's store: rank 0 sets it once (a later call
    reads the one set first), the others wait for it."""
    import datetime

    try:
        if rank == 0:
            value = store.compare_set(LAUNCH_ID_KEY, "", os.urandom(16).hex())
        else:
            store.wait([LAUNCH_ID_KEY], datetime.timedelta(seconds=timeout_s))
            value = store.get(LAUNCH_ID_KEY)
    except Exception as exc:  # noqa: BLE001 - DistStoreError, DistNetworkError, ...
        first = str(exc).splitlines()[0] if str(exc) else ""
        if rank != 0 and "timeout" in first.lower():
            raise AggregationTimeoutError(
                f"checkpoint(): rank 0 did not publish the launch id in the process group's "
                f"store within {timeout_s} s; checkpoint() is collective: every rank, rank "
                "0 included, must call it at the same step", missing=[0]) from None
        raise CheckpointError(f"checkpoint(): the process group's store failed "
                              f"({type(exc).__name__}: {first}); nothing was merged") from None
    return bytes(value).decode("ascii", "replace")


def exchange_state(local: dict, opts, round_no: int) -> bytes:
    """The checkpoint bytes of a pipeline whose local state is ``local``.

    With one rank the state is checked and encoded. With several, the ranks exchange
    their states through ``opts.aggregate_dir`` (a path or an fsspec URL) or
    ``opts.aggregate_store`` (``torch://``, ``torch://host:port``) and every rank
    returns the same merged bytes. This is what ``checkpoint()`` calls.

    Args:
        local: this rank's ``{"fingerprint", "lanes_total", "lanes", "group"}``.
        opts: the pipeline's :class:`~zephon.RuntimeOptions` (ranks, medium, timeout,
            serializer, compressor).
        round_no: the number of this ``checkpoint()`` call in this launch (1, 2, ...);
            every rank passes the same one.

    Returns:
        The checkpoint bytes (:func:`~zephon.checkpoint.decode_state` reads them).

    Raises:
        ZephonConfigError: several ranks but neither aggregate_dir nor aggregate_store,
            a medium that cannot be used (missing package, no MASTER_ADDR), or nothing
            that names the launch (the default run_id outside torchrun and without a
            process group: :func:`launch_identity`).
        AggregationTimeoutError: a rank did not take part in time (named).
        CheckpointError: inconsistent states, or the medium failed mid-round.

    Examples:
        >>> local = {"fingerprint": "f", "lanes_total": 1, "lanes": {"0": [0, 5, 5]},
        ...          "group": 0}
        >>> decode_state(exchange_state(local, RuntimeOptions(), 1))
        {'fingerprint': 'f', 'lanes_total': 1, 'lanes': {'0': [0, 5, 5]}, 'world': 1}
    """
    serializer, compressor = opts.aggregate_serializer, opts.aggregate_compressor
    if opts.world_size == 1:
        state = {k: v for k, v in local.items() if k != "group"}
        state["world"] = 1
        check_merged(state)
        return encode_state(state, serializer, compressor)
    if opts.aggregate_dir is None and opts.aggregate_store is None:
        raise ZephonConfigError(
            "checkpoint() with world_size > 1 needs aggregate_dir (a directory or fsspec URL "
            "every rank can reach) or aggregate_store='torch://' so that the ranks can merge "
            "their states")
    if resolve_canonical_replicas(opts) != local.get("lanes_total"):
        raise CheckpointError("local state and options disagree on canonical_replicas")
    from zephon.checkpoint.media import open_medium

    timeout_s = resolve_aggregate_timeout_s(opts)
    deadline = time.monotonic() + timeout_s
    medium = open_medium(opts, timeout_s)
    try:
        # nothing is written before the launch is known (launch_identity); a medium
        # only this launch reaches (its process group's store) names it already
        private = getattr(medium, "launch_private", False)
        launch = "" if private else launch_identity(opts, timeout_s)
        scope = exchange_scope(local, launch)
        return exchange(medium, _submission(local, opts), round_no=round_no,
                        rank=opts.global_rank, world=opts.world_size,
                        timeout_s=max(deadline - time.monotonic(), 0.001),
                        serializer=serializer, compressor=compressor, scope=scope,
                        private_scope=private or launch.startswith("pg|"))
    finally:
        medium.close()


def aggregate_through_dir(local: dict, *, directory: str, run_id: str, round_no: int,
                          rank: int, world: int, timeout_s: float,
                          serializer: str, compressor: str) -> bytes:
    """Compatibility entry point: one exchange round through a local directory.

    It assumes a contiguous mapping and one dp group per rank; prefer
    :func:`exchange_state`, which takes the topology from the options.

    Args:
        local: this rank's ``{"fingerprint", "lanes_total", "lanes"}`` (``group``
            defaults to ``rank``).
        directory: a directory every rank can reach; the round runs in
            ``directory/run_id``.
        run_id: the name of this launch: launches that run at the same time on
            ``directory`` need distinct ones (nothing else keeps them apart here).
        round_no: the number of this checkpoint in the launch (1, 2, ...).
        rank: this rank, ``0 <= rank < world``.
        world: the number of ranks.
        timeout_s: the budget of the whole round, in seconds.
        serializer: ``"msgpack"`` or ``"json"``.
        compressor: ``"zstd"`` or ``"none"``.

    Returns:
        The merged checkpoint bytes, the same on every rank.

    Raises:
        AggregationTimeoutError: a rank did not take part in time (named).
        CheckpointError: inconsistent states, or the directory failed mid-round.

    Examples:
        >>> local = {"fingerprint": "f", "lanes_total": 1, "lanes": {"0": [0, 5, 5]}}
        >>> data = aggregate_through_dir(local, directory="agg", run_id="r", round_no=1,
        ...                              rank=0, world=1, timeout_s=10.0,
        ...                              serializer="json", compressor="none")
        >>> decode_state(data)["lanes"]
        {'0': [0, 5, 5]}
    """
    from zephon.checkpoint.media import DirMedium

    submission = dict(local, world=world, dp_degree=world, mapping="contiguous")
    submission.setdefault("group", rank)
    medium = DirMedium(os.path.join(directory, run_id))
    return exchange(medium, submission, round_no=round_no, rank=rank, world=world,
                    timeout_s=timeout_s, serializer=serializer, compressor=compressor)
