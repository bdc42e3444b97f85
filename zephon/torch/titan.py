"""zephon under torchtitan: a data loader torchtitan's trainer builds from its config
and its checkpointer saves with the model, restoring on any data-parallel degree.

    from zephon.torch.titan import ZephonDataLoader

    # in a torchtitan config registry function (what --module/--config name):
    config.dataloader = ZephonDataLoader.Config(pipeline="my_data:build",
                                                dataset_path="/data/tokens.bin")

    # my_data.py
    def build(*, seq_len, local_batch_size, dataset_path, tokenizer, **_):
        return Pipeline(sources.token_windows(dataset_path, seq_len + 1), seed=0,
                        num_epochs=None).batch(local_batch_size)

What it owns: torchtitan's data loader protocol (``BaseDataLoader``: a ``Configurable``
whose ``Config.build(dp_world_size=, dp_rank=, tokenizer=, seq_len=,
local_batch_size=)`` makes it, iterating ``(inputs, labels)`` and ``Stateful``), built
on a pipeline the user's function defines.

- **Topology.** The loader sets the pipeline's ranks itself: ``world_size`` and
  ``global_rank`` from ``torch.distributed``, ``dp_degree``/``dp_group_id`` from
  torchtitan's data-parallel degree and rank (ranks of one dp group, tensor or
  pipeline parallel peers, read the same lanes), and the checkpoint exchange through
  torchrun's store (``aggregate_store="torch://"``) unless the pipeline names one.
- **Batches.** Each batch's ``field`` column (``"tokens"``: ``seq_len + 1`` tokens per
  row) becomes ``({"input": tokens[:, :-1]}, tokens[:, 1:])``, the pair torchtitan's
  training step takes.
- **State.** ``state_dict()`` is ``{"zephon_checkpoint": bytes}``, the merged state of
  every rank (collective: torchtitan's checkpointer calls it on every rank), the same
  bytes on every rank: DCP stores it once and gives it to every rank on load, whatever
  their number. (torchtitan's own ``ParallelAwareDataloader`` keeps one entry per dp
  rank and refuses another dp degree.) A restore proves itself
  (:mod:`zephon.pipeline.proof`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Iterator

from zephon.errors import ZephonConfigError

try:
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
except ImportError:  # pragma: no cover - the message names the extra
    raise ImportError('zephon.torch.titan needs torchtitan: python -m pip install -e '
                      '".[torchtitan]" (in the zephon checkout)') from None

__all__ = ["ZephonDataLoader"]


def _builder(path: str):
    module, _, name = path.partition(":")
    if not module or not name:
        raise ZephonConfigError(f"ZephonDataLoader.Config.pipeline must be 'module:function', "
                                f"got {path!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ZephonConfigError(f"ZephonDataLoader: cannot load the pipeline builder "
                                f"{path!r}: {exc}") from exc
    if not callable(fn):
        raise ZephonConfigError(f"ZephonDataLoader: {path!r} is not callable")
    return fn


class ZephonDataLoader(BaseDataLoader):
    """A torchtitan data loader over a zephon pipeline.

    Args:
        config: its :class:`ZephonDataLoader.Config` (``pipeline``: ``"module:function"``
            of the builder, called with the keyword arguments ``dp_world_size``,
            ``dp_rank``, ``seq_len``, ``local_batch_size``, ``tokenizer``,
            ``dataset_path`` and returning a Pipeline whose batches have ``field``;
            ``field``: the token column).
        dp_world_size: torchtitan's data-parallel degree.
        dp_rank: this rank's data-parallel rank.
        tokenizer: torchtitan's tokenizer (handed to the builder).
        seq_len: the training sequence length (handed to the builder).
        local_batch_size: the batch per rank (handed to the builder).
        **kwargs: what else torchtitan passes (``snapshot_every_n_steps``: every batch
            boundary is a resume point here, so it is not needed).

    Raises:
        ZephonConfigError: the builder cannot be loaded or does not return a Pipeline.

    Examples:
        >>> import sys, types
        >>> sys.modules["demo_data"] = demo = types.ModuleType("demo_data")
        >>> demo.build = lambda *, seq_len, local_batch_size, **_: Pipeline(
        ...     sources.from_callable(64, lambda i: {"tokens": np.arange(seq_len + 1) + i}),
        ...     seed=0).batch(local_batch_size)
        >>> loader = ZephonDataLoader.Config(pipeline="demo_data:build").build(
        ...     dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=4, local_batch_size=2)
        >>> inputs, labels = next(iter(loader))
        >>> tuple(inputs["input"].shape), tuple(labels.shape)
        ((2, 4), (2, 4))
        >>> sorted(loader.state_dict())
        ['zephon_checkpoint']
        >>> loader.close()
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        pipeline: str = ""
        """The builder of the pipeline, ``"module:function"``."""

        field: str = "tokens"
        """The batch column of ``seq_len + 1`` tokens per row."""

    def __init__(self, config: "ZephonDataLoader.Config", *, dp_world_size: int,
                 dp_rank: int, tokenizer: Any = None, seq_len: int = 2048,
                 local_batch_size: int = 8, **kwargs: Any) -> None:
        from zephon.pipeline import Pipeline
        from zephon.torch import loader

        self.config = config
        pipe = _builder(config.pipeline)(
            dp_world_size=dp_world_size, dp_rank=dp_rank, seq_len=seq_len,
            local_batch_size=local_batch_size, tokenizer=tokenizer,
            dataset_path=config.dataset_path)
        if not isinstance(pipe, Pipeline):
            raise ZephonConfigError(f"ZephonDataLoader: {config.pipeline!r} returned "
                                    f"{type(pipe).__name__}, not a zephon Pipeline")
        self.loader = loader(pipe.options(self._topology(pipe, dp_world_size, dp_rank)))

    @staticmethod
    def _topology(pipe, dp_world_size: int, dp_rank: int):
        dist = torch.distributed
        on = dist.is_available() and dist.is_initialized()
        world, rank = (dist.get_world_size(), dist.get_rank()) if on else (1, 0)
        opts = pipe.plan().opts
        changes: dict = {"world_size": world, "global_rank": rank, "dp_degree": dp_world_size,
                         "dp_group_id": dp_rank}
        if world > 1 and opts.aggregate_dir is None and opts.aggregate_store is None:
            changes["aggregate_store"] = "torch://"
        return opts.replace(**changes)

    def __iter__(self) -> Iterator[tuple[dict, Any]]:
        field = self.config.field
        for batch in self.loader:
            if field not in batch:
                raise ZephonConfigError(f"ZephonDataLoader: the batch has no {field!r} column "
                                        f"(it has {sorted(batch)}); set Config.field")
            tokens = batch[field]
            yield {"input": tokens[:, :-1]}, tokens[:, 1:]

    def state_dict(self) -> dict:
        """The loader's position (the same bytes on every rank; collective)."""
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue after the batches recorded in ``state_dict``, on any dp degree."""
        if state_dict:
            self.loader.load_state_dict(state_dict)

    def close(self) -> None:
        """Close the pipeline's run (its workers are reaped; idempotent).

        Examples:
            >>> import sys, types
            >>> sys.modules["demo_close"] = demo = types.ModuleType("demo_close")
            >>> demo.build = lambda **_: Pipeline(sources.from_callable(
            ...     4, lambda i: {"tokens": np.arange(3) + i})).batch(2)
            >>> loader = ZephonDataLoader.Config(pipeline="demo_close:build").build(
            ...     dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=2, local_batch_size=2)
            >>> loader.close()
            >>> loader.close()
        """
        self.loader.close()
