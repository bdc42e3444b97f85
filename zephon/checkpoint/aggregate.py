"""Merging the checkpoint state of all ranks through a shared directory.

Round ``n`` of ``run_id`` lives in ``<aggregate_dir>/<run_id>/round-<n>/``.
Every rank writes ``rank-<r>`` (atomically) with its encoded local state and a
per-rank nonce. Rank 0 waits until every rank's file is there, checks that
ranks of one data-parallel group agree on the lanes they share (if not, they
did not reach the checkpoint at the same point: a missing barrier), merges the
lanes, and writes ``merged`` listing the nonces it merged. The other ranks wait
for a ``merged`` whose nonce list contains their own (a stale file of an
earlier job never satisfies them). Every rank returns the same merged bytes.
``aggregate_timeout_s`` bounds the whole exchange; a missing rank is an
:class:`~zephon.errors.AggregationTimeoutError` naming it.
"""

from __future__ import annotations

import os
import time

from zephon.checkpoint.codec import decode_state, encode_state
from zephon.errors import AggregationTimeoutError, CheckpointError

__all__ = ["aggregate_through_dir"]


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def aggregate_through_dir(local: dict, *, directory: str, run_id: str, round_no: int,
                          rank: int, world: int, timeout_s: float,
                          serializer: str, compressor: str) -> bytes:
    """Exchange ``local`` (``{"lanes": {...}, "group": g, ...}``) and return the merged
    checkpoint bytes."""
    folder = os.path.join(directory, run_id, f"round-{round_no}")
    os.makedirs(folder, exist_ok=True)
    nonce = os.urandom(8).hex()
    mine = dict(local, nonce=nonce, rank=rank)
    _atomic_write(os.path.join(folder, f"rank-{rank}"), encode_state(mine, serializer,
                                                                     compressor))
    deadline = time.monotonic() + timeout_s
    merged_path = os.path.join(folder, "merged")
    if rank == 0:
        states = {}
        while len(states) < world:
            for r in range(world):
                if r not in states:
                    blob = _read(os.path.join(folder, f"rank-{r}"))
                    if blob is not None:
                        states[r] = decode_state(blob)
            if len(states) < world:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world)) - set(states))
                    raise AggregationTimeoutError(
                        f"checkpoint round {round_no}: rank(s) {missing} did not write their "
                        f"state to {folder} within {timeout_s} s", missing=missing)
                time.sleep(0.02)
        lanes: dict = {}
        first_of_group: dict = {}
        for r in range(world):
            group = states[r].get("group")
            peer = first_of_group.setdefault(group, r)
            mine = {k: tuple(v) for k, v in states[r]["lanes"].items()}
            theirs = {k: tuple(v) for k, v in states[peer]["lanes"].items()}
            if mine != theirs:
                diff = sorted(set(theirs.items()) ^ set(mine.items()), key=str)[:1]
                lane = diff[0][0] if diff else "?"
                raise CheckpointError(
                    f"ranks {peer} and {r} of dp group {group} disagree on lane {lane} "
                    f"({states[peer]['lanes'].get(lane)} vs {states[r]['lanes'].get(lane)}); "
                    "every rank must take the checkpoint after the same number of batches "
                    "(a missing barrier?)")
            lanes.update(states[r]["lanes"])
        merged = dict(states[0], lanes=lanes, nonces=sorted(s["nonce"] for s in states.values()),
                      world=world)
        merged.pop("nonce", None)
        merged.pop("rank", None)
        blob = encode_state(merged, serializer, compressor)
        _atomic_write(merged_path, blob)
        return blob
    while True:
        blob = _read(merged_path)
        if blob is not None:
            state = decode_state(blob)
            if nonce in state.get("nonces", ()):
                return blob
        if time.monotonic() > deadline:
            raise AggregationTimeoutError(
                f"checkpoint round {round_no}: rank 0 did not publish the merged state in "
                f"{folder} within {timeout_s} s", missing=[0])
        time.sleep(0.02)
