"""zephon for PyTorch training loops: tensors, pinned memory, the Stateful protocol.

    import zephon.torch as zt
    loader = zt.loader(pipe, pin_memory=True)   # batches of torch tensors
    for batch in loader:
        ...
    ckpt = {"model": model.state_dict(), "data": loader.state_dict()}
    loader.load_state_dict(ckpt["data"])        # continues after the last delivered batch
    ds = zt.dataset(pipe)                        # for DataLoader(ds, batch_size=None, num_workers=0)

What it owns: turning zephon batches into tensors (:func:`to_torch`), the
loader wrapper (:class:`TorchLoader`: optional pinning on a background thread,
``state_dict()`` / ``load_state_dict()``) and the ``IterableDataset`` adapter
(:func:`dataset`). torch is imported when one of these is used, never by
importing ``zephon`` itself; without torch they raise an ImportError naming
``pip install "zephon[torch]"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily at run time (it needs torch)
    from zephon.torch._loader import TorchLoader

__all__ = ["STATE_KEY", "TorchLoader", "dataset", "loader", "to_torch"]

STATE_KEY = "zephon_checkpoint"


def _require_torch():
    try:
        import torch
    except ImportError:
        raise ImportError('zephon.torch needs torch: pip install "zephon[torch]"') from None
    return torch


def loader(pipe, *, pin_memory: bool = False, prefetch: int = 2) -> "TorchLoader":
    """Wrap ``pipe`` (a zephon Pipeline) so that it yields batches of torch tensors.

    Args:
        pipe: the pipeline, options included (``.options(RuntimeOptions(...))``).
        pin_memory: pin numeric columns in page-locked memory on a background thread
            (only where an accelerator is available; otherwise a warning, and the
            batches are returned unpinned).
        prefetch: batches the pinning thread may prepare ahead (``pin_memory`` only).

    Returns:
        A :class:`TorchLoader`; iterate it, and checkpoint it with ``state_dict()``.

    Example:
        >>> for batch in zephon.torch.loader(pipe):
        ...     loss = model(batch["tokens"])
    """
    from zephon.torch._loader import TorchLoader

    return TorchLoader(pipe, pin_memory=pin_memory, prefetch=prefetch)


def dataset(pipe, *, pin_memory: bool = False):
    """A ``torch.utils.data.IterableDataset`` over ``pipe`` for code that needs a Dataset.

    Use it with ``DataLoader(ds, batch_size=None, num_workers=0)``: zephon batches
    already, and runs its own workers (``RuntimeOptions(runner="process",
    max_workers=N)``); ``num_workers > 0`` raises a ZephonConfigError saying so.
    The dataset has ``state_dict()`` / ``load_state_dict()`` like :class:`TorchLoader`.
    """
    from zephon.torch._dataset import PipelineDataset

    return PipelineDataset(pipe, pin_memory=pin_memory)


def to_torch(batch):
    """A zephon Batch with every numeric numpy column as a tensor sharing its memory
    (``torch.from_numpy``: the arena region stays leased while the tensor lives); other
    columns untouched; ``.meta`` kept."""
    from zephon.torch._convert import to_torch as convert

    return convert(batch)


def __getattr__(name):
    if name == "TorchLoader":
        from zephon.torch._loader import TorchLoader

        return TorchLoader
    raise AttributeError(f"module 'zephon.torch' has no attribute {name!r}")
