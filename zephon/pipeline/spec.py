"""``PipelineSpec``: what a pipeline's definition is, frozen and typed.

A :class:`~zephon.pipeline.Pipeline` makes one spec when it is built (each
builder method makes the new pipeline's): the source, the ops in order, the
seed, the epoch order, the chunk size and the number of epochs. It is the part
of a pipeline that defines the stream; the runtime options say how the stream is
produced, and three of them also define it (the number of canonical lanes, the
flush cadence, ``deterministic``): the plan (:mod:`zephon.pipeline.plan`) resolves
those.

Invariants: a spec never changes (setting a field raises); :meth:`configured`
gives a spec whose source the options refine (a copy when they change it, never
a mutation), and is idempotent: a configured spec configured again under the
same options is itself. The fingerprint of a spec (with its flush cadence) is
:func:`~zephon.pipeline.fingerprint.pipeline_fingerprint`'s, computed once by
the plan that holds it. A spec pickles with its source and ops (what the MTP
subprocess rebuilds its plan from).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from zephon.pipeline.ops import Op
    from zephon.pipeline.shards import ShardShuffle
    from zephon.pipeline.sources import Source

__all__ = ["PipelineSpec"]


@dataclass(frozen=True)
class PipelineSpec:
    """A pipeline's definition: its source, ops, seed, epoch order, chunking and epochs.

    Attributes:
        source: the source the samples are read from.
        ops: the ops in chain order.
        seed: the seed of the epoch orders and of every op's randomness.
        permute: the epoch order: True (a seeded permutation), False (source order), or
            the source's :class:`~zephon.pipeline.shards.ShardShuffle`.
        chunk_size: samples per chunk (chunk ``j`` goes to lane ``j mod C``).
        num_epochs: epochs in a pass (None: one endless pass).
    """

    source: Source
    ops: tuple[Op, ...]
    seed: int
    permute: Union[bool, ShardShuffle]
    chunk_size: int
    num_epochs: int | None

    def with_op(self, op: Op) -> "PipelineSpec":
        """This spec with ``op`` appended to its ops."""
        return replace(self, ops=(*self.ops, op))

    def configured(self, opts) -> "PipelineSpec":
        """This spec with its source as the runtime options ``opts`` refine it
        (:meth:`~zephon.pipeline.sources.Source.configured`): ``self`` when they change
        nothing, else a copy."""
        source = self.source.configured(opts)
        return self if source is self.source else replace(self, source=source)

    @property
    def preserves_cursor_order(self) -> bool:
        """Whether every op preserves cursor order (a restore then reads on after the
        last delivered sample; otherwise it replays from a flush boundary)."""
        return all(op.preserves_cursor_order for op in self.ops)
