"""Checkpoint state codec and multi-rank aggregation (options layer below it only)."""

from zephon.checkpoint.aggregate import aggregate_through_dir
from zephon.checkpoint.codec import decode_state, encode_state

__all__ = ["aggregate_through_dir", "decode_state", "encode_state"]
