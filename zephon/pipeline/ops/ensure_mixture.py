"""``ensure_mixture(weights, by, field, max_buffer, leftover)``: a reorder buffer that
holds the running share of each mixture component at its target (serial, holds a queue).

What it owns
------------
A filter after a mixture drops more of one component than of another, and a mixture
by samples is not the same mixture by tokens: the shares the pipeline delivers drift
from the ones asked for. This op puts them back *in order*: it keeps, per lane, one
FIFO queue per component and emits, one record at a time, from the component whose
running share is furthest below its target.

- **Component** of a record: the source name of its first sample id, which a mixture
  sets to the component's name (``"<name>#<r>"`` for a repeat within the epoch: the
  suffix is read past); in a nested mixture it is the innermost component's name,
  which the mixture's own weights count for the nested mixture (its ``aliases``).
  Explicit weights must name exactly the names the mixture's records carry
  (:meth:`EnsureMixtureOp.check_components`, when the op is built on a mixture: a
  ZephonConfigError naming the ones left out and the unknown ones); a record of a
  component the weights do not name (a source that is no mixture) is an
  :class:`~zephon.errors.OpError`. The op reorders samples: it goes before ``batch``
  and the packers (the builder refuses it after them).
- **Target** (``weights``): the mixture's own weights by default (under a weight
  schedule, the weights of the epoch), else the given ``{component: weight}``;
  shares in the unit of ``by``: ``"samples"`` (each record weighs 1) or ``"tokens"``
  (a record weighs the length of its flattened ``field``).
- **Rule** (deterministic): with ``e_k`` the weight emitted of component ``k`` and
  ``E = sum e_k``, both counted since the lane's last boundary, the *ideal* component
  is the one with the largest deficit ``w_k * E - e_k`` among those with a positive
  weight (ties: the first in the weights' order). After each record read, the op
  emits the head of the ideal component's queue while it is not empty; when it is
  empty, it waits, unless the lane holds more than ``max_buffer`` records: then it
  emits from the non-empty queue with the largest deficit until it holds
  ``max_buffer``. So a lane never holds more than ``max_buffer`` records between
  two records read (its memory bound), and the output is a function of the lane's
  record sequence alone, whatever the units are and on every runner.
- **A component that runs dry** (none of it queued: a filter dropped it, the mixture
  dealt none yet, or it is used up for the epoch) is waited for while the buffer has
  room; when the buffer is full the others flow by their deficits and the dry one's
  deficit grows, so that when it comes back each of its records is emitted as it
  arrives. The realized share is the target's as long as the buffer can absorb the
  other components' surplus; beyond that the output follows the input's shares.
- **Epoch end**: at the lane's first boundary of a new epoch, and at the end of the
  lane, it *flushes* what it holds: ``leftover="emit"`` (default) emits it all by the
  same rule (the queues emptied by largest deficit), so the multiset of an epoch's
  output is its input's: a reorder cannot make an epoch whose input holds too few of
  a component hold more, and the surplus of the others comes out at the epoch's end;
  ``leftover="drop"`` discards it instead (a filter of its own: the epoch then holds
  the target's shares, as far as the buffer held the surplus; what a full buffer
  forced out before the epoch's end was delivered).

Statistics (``execution_tracking="nodes"``): the op's node counts ``forced`` (records
emitted off the rule because the buffer was full: a buffer too small for the
surplus, or a component that ran dry), ``flushed`` (emitted at an epoch's end) and
``dropped`` (``leftover="drop"``).

State and resume
----------------
The queues stay across a mid-epoch flush boundary: they are the boundary's carry (a
``("queue", max_buffer, inner)`` slot, :mod:`zephon.pipeline.carry`): the lineage of
every held record, component by component in queue order, rebuilt on a restore
through the ops before it. The counters ``e_k`` start again from 0 at every boundary
(in a run and in a restore alike: they are not part of the carry), so a restore from
any boundary, on any rank layout (the carry is per lane, as a batch's or a
packer's), replays the same stream. The op does not preserve cursor order (replay
resume) and may give more records in a segment than the segment reads (``expands``:
what it held at the boundary leaves in it).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Mapping

import numpy as np

from zephon.errors import OpError, ZephonConfigError
from zephon.options._spec import check_positive
from zephon.pipeline.ops.base import (
    CarryingAccumulator,
    HoldsQueue,
    check_int,
    pos_lineage,
)
from zephon.pipeline.records import Boundary, Record
from zephon.pipeline.shares import weight_shares

__all__ = ["LEFTOVER_POLICIES", "MAX_BUFFER", "EnsureMixtureOp"]

LEFTOVER_POLICIES = ("emit", "drop")
#: the largest ``max_buffer``: the most records one entry of a carry may list
#: (:data:`zephon.pipeline.carry.MAX_ITEMS`)
MAX_BUFFER = 1 << 20
_BY = ("samples", "tokens")


def _target_weights(weights: Any) -> dict[str, float]:
    """Explicit ``{component: weight}``, checked: positive finite weights, named by
    non-empty strings."""
    if not isinstance(weights, Mapping) or not weights:
        raise ZephonConfigError(f"ensure_mixture: weights must be a non-empty mapping "
                                f"{{component: weight}} (or None for the mixture's own), "
                                f"got {weights!r:.80}")
    out = {}
    for name, w in weights.items():
        if not isinstance(name, str) or not name:
            raise ZephonConfigError(f"ensure_mixture: a component name must be a non-empty "
                                    f"string, got {name!r:.40}")
        out[name] = check_positive("ensure_mixture", f"the weight of {name!r}", w)
    return out


class EnsureMixtureOp(HoldsQueue):
    """``ensure_mixture``: per lane, one queue per component, emitted by largest deficit
    (see the module docstring).

    ``weights``: ``{component: weight}``, or a mixture's
    :class:`~zephon.pipeline.sources.mixture.WeightSchedule` (its weights per epoch)."""

    kind = "ensure_mixture"
    preserves_cursor_order = False
    expands = True  # what it held at a boundary leaves after it: more records than read

    def __init__(self, weights: Any, by: str = "samples", field: str = "tokens",
                 max_buffer: int = 4096, leftover: str = "emit") -> None:
        if by not in _BY:
            raise ZephonConfigError(f"ensure_mixture: by must be one of {_BY}, got {by!r:.40}")
        if not isinstance(field, str) or not field:
            raise ZephonConfigError(f"ensure_mixture: field must be a non-empty string, got "
                                    f"{field!r:.40}")
        if leftover not in LEFTOVER_POLICIES:
            raise ZephonConfigError(f"ensure_mixture: leftover must be one of "
                                    f"{LEFTOVER_POLICIES}, got {leftover!r:.40}")
        self.max_buffer = check_int("ensure_mixture", "max_buffer", max_buffer, 1)
        if self.max_buffer > MAX_BUFFER:
            raise ZephonConfigError(f"ensure_mixture: max_buffer must be at most {MAX_BUFFER} "
                                    f"(what a checkpoint's carry may list), got {max_buffer}")
        self.by, self.field, self.leftover = by, field, leftover
        #: names a record may carry for a target component: a nested mixture's
        self.aliases: dict[str, str] = {}
        if hasattr(weights, "at") and hasattr(weights, "names"):  # a mixture's schedule
            self.schedule, self.names = weights, list(weights.names)
            self.aliases = dict(getattr(weights, "aliases", {}))
            self.fixed = None
        else:
            fixed = _target_weights(weights)
            self.schedule, self.names = None, list(fixed)
            self.fixed = np.array([fixed[n] for n in self.names])

    def check_components(self, carried: list[str]) -> None:
        """Refuse explicit weights that do not name exactly the component names the
        mixture's records carry (``carried``:
        :meth:`~zephon.pipeline.sources.mixture.MixtureSource.record_names`, the innermost
        names of a nested mixture): a record of a component the weights leave out would
        stop the run when it arrives, and a named component no record carries would be
        waited for in vain."""
        if self.schedule is not None:
            return  # the mixture's own weights, its nested names in aliases
        missing = [n for n in carried if n not in self.names]
        unknown = [n for n in self.names if n not in carried]
        if not (missing or unknown):
            return
        wrong = " and ".join(([f"name unknown component(s) {unknown}"] if unknown else [])
                             + ([f"leave out the component(s) {missing}"] if missing else []))
        raise ZephonConfigError(
            f"ensure_mixture: weights {wrong}: the mixture's samples carry {carried} (a "
            f"nested mixture's own components, not its name); give each of them a weight, "
            f"or weights=None for the mixture's own", field="ensure_mixture.weights")

    @property
    def carried_records(self) -> int:
        return self.max_buffer

    def target(self, epoch: int) -> list[float]:
        """The target shares of ``epoch``, in the components' order (sum to 1)."""
        if self.schedule is None:
            assert self.fixed is not None
            w = self.fixed
        else:
            w = np.asarray(self.schedule.at(epoch), dtype=np.float64)
        return weight_shares(w).tolist()

    def describe(self) -> str:
        if self.schedule is None:
            assert self.fixed is not None
            target = str(dict(zip(self.names, self.fixed.tolist(), strict=True)))
        else:
            target = f"mixture {self.names} {self.schedule.describe()}"
        field = f", field={self.field!r}" if self.by == "tokens" else ""
        return (f"ensure_mixture({target}, by={self.by!r}{field}, "
                f"max_buffer={self.max_buffer}, leftover={self.leftover!r})")

    def start(self, seed: int, lane: int, boundary: Boundary) -> _EnsureState:
        return _EnsureState(self, boundary.epoch)

    def weight_of(self, record: Record) -> float:
        """What ``record`` counts for: 1, or its tokens (``by="tokens"``)."""
        if self.by == "samples":
            return 1.0
        try:
            return float(np.asarray(record.value[self.field]).size)
        except (KeyError, TypeError, IndexError) as exc:
            raise OpError(f"op ensure_mixture failed on sample {record.ids[0]}: no token "
                          f"field {self.field!r} ({exc})", op="ensure_mixture",
                          sample_id=record.ids[0]) from exc


class _EnsureState(CarryingAccumulator):
    """One lane's queues and counters (see the module docstring)."""

    def __init__(self, op: EnsureMixtureOp, epoch: int) -> None:
        super().__init__()
        self.op, self.limit = op, op.max_buffer
        k = len(op.names)
        self.queues: list[deque] = [deque() for _ in range(k)]
        self.index: dict[str, int] = {n: i for i, n in enumerate(op.names)}
        self.index.update({inner: self.index[n] for inner, n in op.aliases.items()
                           if inner not in self.index})
        self.held = 0
        self.stats: Any = None
        self.node = ""
        self._epoch(epoch)

    def count_into(self, stats, node: str) -> None:
        """Count forced, flushed and dropped records in ``stats`` under ``node``."""
        self.stats, self.node = stats, node

    def _epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.w = self.op.target(epoch)
        self.live = [i for i, w in enumerate(self.w) if w > 0]
        self._reset()

    def _reset(self) -> None:
        self.e = [0.0] * len(self.w)
        self.total = 0.0

    def component(self, record: Record) -> int:
        name = record.ids[0][0] if record.ids else None
        k = self.index.get(name) if isinstance(name, str) else None
        if k is not None:
            return k
        if isinstance(name, str):
            stem, sep, r = name.rpartition("#")
            if sep and r.isdigit() and stem in self.index:
                k = self.index[name] = self.index[stem]  # a repeat's name, cached
                return k
        sid = record.ids[0] if record.ids else None
        raise OpError(f"op ensure_mixture failed on sample {sid}: its component {name!r} is "
                      f"not one of the target's {self.op.names}", op="ensure_mixture",
                      sample_id=sid)

    def _hold(self, record: Record) -> None:
        self.queues[self.component(record)].append((record, self.op.weight_of(record)))
        self.held += 1

    def _take(self, k: int, out: list) -> None:
        record, weight = self.queues[k].popleft()
        self.held -= 1
        self.e[k] += weight
        self.total += weight
        out.append(record)

    def _emit(self, limit: int, out: list) -> None:
        """Emit by the rule until the ideal component's queue is empty and the lane holds
        at most ``limit`` records."""
        queues, w, e = self.queues, self.w, self.e
        while self.held:
            total = self.total
            ideal, best = -1, -math.inf
            for k in self.live:
                d = w[k] * total - e[k]
                if d > best:
                    ideal, best = k, d
            if ideal >= 0 and queues[ideal]:
                self._take(ideal, out)
                continue
            if self.held <= limit:
                return
            pick, best = -1, -math.inf
            for k, q in enumerate(queues):
                if q:
                    d = w[k] * total - e[k]
                    if d > best:
                        pick, best = k, d
            self._take(pick, out)
            if limit and self.stats is not None:
                self.stats.add(self.node, forced=1)

    def push(self, records: list) -> list:
        out: list = []
        for r in records:
            self._hold(r)
            self._emit(self.limit, out)
        return out

    def _flush(self) -> list:
        out: list = []
        held = self.held
        if self.op.leftover == "drop":
            for q in self.queues:
                q.clear()
            self.held = 0
        else:
            self._emit(0, out)
        if held and self.stats is not None:
            self.stats.add(self.node, **{"dropped" if self.op.leftover == "drop"
                                         else "flushed": held})
        return out

    def boundary(self, marker: Boundary) -> list:
        out = self._flush() if marker.epoch != self.epoch else []
        if marker.epoch != self.epoch:
            self._epoch(marker.epoch)
        else:
            self._reset()
        return out

    def carry(self) -> list:
        if self.lineage is pos_lineage:  # sample records: thousands at each boundary
            return [r.pos for q in self.queues for r, _ in q]
        return [self.lineage(r) for q in self.queues for r, _ in q]

    def load(self, held: list) -> None:
        """Put back the rebuilt records a restore's boundary held, in queue order."""
        for r in held:
            self._hold(r)

    def drain(self) -> list:
        return self._flush()
