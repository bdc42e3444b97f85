"""``PipelineDataset``: a pipeline as a ``torch.utils.data.IterableDataset``.

For training code that must hand a Dataset to ``DataLoader``. zephon already
batches, parallelises (its own worker processes) and checkpoints, so the only
correct DataLoader around it is ``DataLoader(ds, batch_size=None,
num_workers=0)``. In a DataLoader worker process every worker would run the
whole pipeline and the batches would repeat, so iterating there raises a
:class:`~zephon.errors.ZephonConfigError` that says what to use instead.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.utils.data

from zephon.errors import ZephonConfigError
from zephon.torch._loader import TorchLoader

__all__ = ["PipelineDataset"]


class PipelineDataset(torch.utils.data.IterableDataset):
    """Iterates the pipeline's batches as tensors, for code that needs a Dataset.

    Build it with :func:`zephon.torch.dataset` and hand it to
    ``DataLoader(ds, batch_size=None, num_workers=0)``.

    Args:
        pipe: the zephon Pipeline, options included.
        pin_memory: pin numeric columns on a background thread.
        keep_dtypes: as in :func:`zephon.torch.loader`.

    Examples:
        >>> ds = zephon.torch.dataset(Pipeline(sources.from_sequence([1, 2]), shuffle=False))
        >>> list(ds)
        [1, 2]
    """

    def __init__(self, pipe, *, pin_memory: bool = False, keep_dtypes: bool = False) -> None:
        super().__init__()
        self.loader = TorchLoader(pipe, pin_memory=pin_memory, keep_dtypes=keep_dtypes)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is not None:
            raise ZephonConfigError(
                f"zephon.torch.dataset: DataLoader(num_workers={info.num_workers}) would run "
                "the whole pipeline in every DataLoader worker and repeat each batch; use "
                "DataLoader(ds, batch_size=None, num_workers=0) and give zephon the workers: "
                "RuntimeOptions(runner='process', max_workers=N)")
        resharder = _resharding_caller()
        if resharder is not None and self.loader.pipe.plan().opts.world_size > 1:
            raise ZephonConfigError(
                f"zephon.torch.dataset: {resharder} is iterating this dataset to share its "
                "batches out among the ranks again, but every rank's pipeline already reads "
                "only that rank's lanes (the other ranks' lanes would never be read); do not "
                "pass it to accelerator.prepare(): iterate zephon.torch.loader(pipe) on every "
                "rank and register it with zephon.torch.hf.register(accelerator, loader)")
        return iter(self.loader)

    def state_dict(self) -> dict:
        """The position after the last batch handed out, as :meth:`TorchLoader.state_dict`.

        Returns:
            ``{"zephon_checkpoint": bytes}``.

        Examples:
            >>> ds = zephon.torch.dataset(Pipeline(sources.from_sequence([1, 2])))
            >>> list(ds.state_dict())
            ['zephon_checkpoint']
        """
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue after the batches recorded in ``state_dict``, as
        :meth:`TorchLoader.load_state_dict`.

        Args:
            state_dict: the dict :meth:`state_dict` returned.

        Raises:
            CheckpointError: not such a dict, or a checkpoint that does not fit.

        Examples:
            >>> ds = zephon.torch.dataset(Pipeline(sources.from_sequence([1, 2]), shuffle=False))
            >>> state = ds.state_dict()
            >>> ds.load_state_dict(state)
            >>> list(ds)
            [1, 2]
        """
        self.loader.load_state_dict(state_dict)


#: the wrappers that deal a dataset's batches out among ranks (accelerate's prepare())
_RESHARDERS = ("accelerate.",)


def _resharding_caller() -> str | None:
    """The class of the caller, a few frames up, that re-shards a dataset among ranks
    (accelerate's DataLoaderDispatcher or IterableDatasetShard), if any."""
    frame: Any = inspect.currentframe()
    frame = frame.f_back.f_back if frame is not None else None
    for _ in range(8):
        if frame is None:
            return None
        module = frame.f_globals.get("__name__", "")
        if module.startswith(_RESHARDERS):
            owner = frame.f_locals.get("self")
            return f"{module}.{type(owner).__name__}" if owner is not None else module
        frame = frame.f_back
    return None
