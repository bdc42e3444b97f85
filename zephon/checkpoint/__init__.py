"""Checkpoint state codec and multi-rank aggregation (options layer below it only)."""

from zephon.checkpoint.aggregate import aggregate_through_dir
from zephon.checkpoint.codec import decode_state, encode_state

__all__ = ["aggregate_through_dir", "decode_state", "encode_state", "exchange_state"]


def exchange_state(local: dict, opts, round_no: int) -> bytes:
    """The checkpoint bytes of ``local`` (one rank's state); with several ranks, the state
    merged through ``aggregate_dir`` (every rank returns the same bytes)."""
    from zephon.errors import ZephonConfigError
    from zephon.options import resolve_aggregate_timeout_s

    if opts.world_size == 1:
        return encode_state(local, opts.aggregate_serializer, opts.aggregate_compressor)
    if opts.aggregate_store is not None:
        raise NotImplementedError(
            f"aggregate_store={opts.aggregate_store!r}: exchanging states through torch's "
            "TCPStore is not available yet; use aggregate_dir (a directory every rank "
            "can reach)")
    if opts.aggregate_dir is None:
        raise ZephonConfigError(
            "checkpoint() with world_size > 1 needs aggregate_dir (a directory every rank "
            "can reach) so that the ranks can merge their states")
    return aggregate_through_dir(
        local, directory=opts.aggregate_dir, run_id=opts.run_id, round_no=round_no,
        rank=opts.global_rank, world=opts.world_size,
        timeout_s=resolve_aggregate_timeout_s(opts),
        serializer=opts.aggregate_serializer, compressor=opts.aggregate_compressor)
