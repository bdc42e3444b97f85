"""Checkpoint state codec and multi-rank aggregation (options layer below it only).

``exchange_state(local, opts, round_no)`` is what ``Pipeline.checkpoint()`` calls:
it encodes a one-rank state, or runs one round of the exchange between ranks
through ``aggregate_dir`` (a path or fsspec URL) or ``aggregate_store``
(torch's TCPStore) and returns the merged bytes every rank shares.
"""

from zephon.checkpoint.aggregate import (
    aggregate_through_dir,
    check_merged,
    exchange_state,
    merge_states,
)
from zephon.checkpoint.codec import decode_state, encode_state

__all__ = ["aggregate_through_dir", "check_merged", "decode_state", "encode_state",
           "exchange_state", "merge_states"]
