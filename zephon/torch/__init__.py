"""zephon for PyTorch training loops: tensors, pinned memory, the Stateful protocol.

    import zephon.torch as zt
    loader = zt.loader(pipe, pin_memory=True)   # batches of torch tensors
    for batch in loader:
        ...
    ckpt = {"model": model.state_dict(), "data": loader.state_dict()}
    loader.load_state_dict(ckpt["data"])        # continues after the last delivered batch
    ds = zt.dataset(pipe)                        # for DataLoader(ds, batch_size=None, num_workers=0)

    loader = zt.loader(pipe, device="cuda", pin_memory=True,   # uint8 images in,
                       normalize={"image": (mean, std)})       # float NCHW on the GPU out

What it owns: turning zephon batches into tensors (:func:`to_torch`: through
the batch's structure, dict, list, tuple or namedtuple; ``uint16`` and
``uint32`` arrays, token ids, become ``int64`` as ``nn.Embedding`` and
``cross_entropy`` need, unless ``keep_dtypes=True``), the
loader wrapper (:class:`TorchLoader`: optional pinning on a background thread,
the move to a device and the normalisation of image columns there
(:mod:`zephon.torch._device`), ``state_dict()`` / ``load_state_dict()``) and the ``IterableDataset`` adapter
(:func:`dataset`). The training frameworks' integrations are modules of their own, imported only by
their users: :mod:`zephon.torch.lightning` (a ``LightningDataModule``),
:mod:`zephon.torch.hf` (transformers' ``Trainer`` and accelerate) and
:mod:`zephon.torch.titan` (a torchtitan data loader). torch is imported when one of
these is used, never by importing ``zephon`` itself; without torch they raise an ImportError naming
``python -m pip install -e ".[torch]"`` in the zephon checkout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily at run time (it needs torch)
    from zephon.torch._loader import TorchLoader

__all__ = ["STATE_KEY", "TorchLoader", "dataset", "loader", "to_torch", "to_training"]

STATE_KEY = "zephon_checkpoint"


def _require_torch():
    try:
        import torch
    except ImportError:
        raise ImportError('zephon.torch needs torch: python -m pip install -e ".[torch]" (in the zephon checkout)') from None
    return torch


def loader(pipe, *, pin_memory: bool = False, prefetch: int = 2,
           keep_dtypes: bool = False, to_training: bool | dict = False, device=None,
           non_blocking: bool = True, normalize=None, layout: str = "HWC",
           channels_last: bool = False) -> "TorchLoader":
    """Wrap ``pipe`` (a zephon Pipeline) so that it yields batches of torch tensors.

    Image batches are best left ``uint8`` in the pipeline (a quarter of ``float32``'s
    bytes between processes and over the host-to-device link) and converted on the
    device: ``device="cuda"`` moves every tensor of a batch there and ``normalize=``
    turns the named image columns into the float tensors a vision model takes, as
    torchvision's ``ToTensor()`` + ``Normalize(mean, std)`` do, after the copy. With
    ``pin_memory=True`` both run on the loader's background thread, on CUDA on a side
    stream that the training loop's stream waits on when it takes the batch, so they
    overlap the training step.

    Args:
        pipe: the pipeline, options included (``.options(RuntimeOptions(...))``).
        pin_memory: pin numeric columns in page-locked memory on a background thread
            (only where an accelerator is available; otherwise a warning, and the
            batches are returned unpinned).
        prefetch: batches the pinning thread may prepare ahead (an int >= 1;
            ``pin_memory`` only).
        keep_dtypes: keep ``uint16``/``uint32`` arrays in their dtype instead of
            ``int64`` (see :func:`to_torch`).
        to_training: hand out the training tensors of each packed batch
            (:func:`to_training`) instead of its columns: True, or a dict of
            :func:`to_training`'s keyword arguments (``field``, ``ignore_index``,
            ``loss_mask``).
        device: a ``torch.device``, a string (``"cuda"``, ``"cuda:1"``, ``"cpu"``) or a
            device index: every tensor of a batch is moved there
            (``tensor.to(device, non_blocking=non_blocking)``); None (the default): the
            batches stay on the host.
        non_blocking: copy to the device asynchronously (from pinned memory; the loader
            makes the consumer's stream wait for the copy, see above).
        normalize: None, or column -> ``(mean, std)``, each a number or one per channel
            in 0-1 units, torchvision's convention (``{"image": ((0.485, 0.456, 0.406),
            (0.229, 0.224, 0.225))}``): each named column, a ``uint8`` batch of images,
            becomes ``(x / 255 - mean) / std`` as ``(N, C, H, W)`` float32, on the device
            (on the host with ``device=None``).
        layout: the layout of each image of the named columns, as the decode op made it:
            ``"HWC"`` (the default: height, width, channels, what image decoders make) or
            ``"CHW"``; images of shape ``(H, W)`` are one channel.
        channels_last: give the normalised images ``torch.channels_last`` memory format
            (their shape stays ``(N, C, H, W)``; from ``"HWC"`` images it needs no
            transposition); False: contiguous ``(N, C, H, W)``.

    Returns:
        A :class:`TorchLoader`; iterate it, and checkpoint it with ``state_dict()``.

    Raises:
        ImportError: torch is missing (``python -m pip install -e ".[torch]"`` in the zephon checkout).
        ZephonConfigError: ``pipe`` is not a Pipeline, or a bad ``pin_memory``,
            ``prefetch``, ``keep_dtypes`` or ``to_training``; a ``device`` torch does not
            know or this machine does not have; a ``normalize`` that is not a mapping of
            ``(mean, std)`` pairs in 0-1 units; a bad ``layout``, ``non_blocking`` or
            ``channels_last``. When a batch is normalised: a named column that is missing,
            not ``uint8``, or has another number of channels than ``mean`` and ``std``.

    Examples:
        >>> src = sources.from_callable(6, lambda i: {"x": np.full(3, i, dtype=np.float32)})
        >>> loader = zephon.torch.loader(Pipeline(src, shuffle=False).batch(2))
        >>> [type(b["x"]).__name__ for b in loader]
        ['Tensor', 'Tensor', 'Tensor']
        >>> images = sources.from_callable(4, lambda i: {
        ...     "image": np.full((2, 2, 3), 255 * (i % 2), dtype=np.uint8), "label": i})
        >>> loader = zephon.torch.loader(Pipeline(images, shuffle=False).batch(2),
        ...                              device="cpu", normalize={"image": (0.5, 0.5)})
        >>> batch = next(iter(loader))
        >>> batch["image"].shape, batch["image"].dtype, batch["image"][:, 0, 0, 0].tolist()
        (torch.Size([2, 3, 2, 2]), torch.float32, [-1.0, 1.0])
    """
    from zephon.torch._loader import TorchLoader

    return TorchLoader(pipe, pin_memory=pin_memory, prefetch=prefetch,
                       keep_dtypes=keep_dtypes, to_training=to_training, device=device,
                       non_blocking=non_blocking, normalize=normalize, layout=layout,
                       channels_last=channels_last)


def dataset(pipe, *, pin_memory: bool = False, keep_dtypes: bool = False):
    """A ``torch.utils.data.IterableDataset`` over ``pipe`` for code that needs a Dataset.

    Use it with ``DataLoader(ds, batch_size=None, num_workers=0)``: zephon batches
    already, and runs its own workers (``RuntimeOptions(runner="process",
    max_workers=N)``); iterating it in a DataLoader worker (``num_workers > 0``) raises
    a ZephonConfigError saying so. The dataset has ``state_dict()`` /
    ``load_state_dict()`` like :class:`TorchLoader`.

    Args:
        pipe: the pipeline, options included.
        pin_memory: as in :func:`loader`.
        keep_dtypes: as in :func:`loader`.

    Returns:
        A ``PipelineDataset`` (an ``IterableDataset``).

    Raises:
        ImportError: torch is missing (``python -m pip install -e ".[torch]"`` in the zephon checkout).

    Examples:
        >>> import torch
        >>> src = sources.from_callable(4, lambda i: {"x": np.full(2, i)})
        >>> ds = zephon.torch.dataset(Pipeline(src, shuffle=False).batch(2))
        >>> dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
        >>> [b["x"].tolist() for b in dl]
        [[[0, 0], [1, 1]], [[2, 2], [3, 3]]]
    """
    from zephon.torch._dataset import PipelineDataset

    return PipelineDataset(pipe, pin_memory=pin_memory, keep_dtypes=keep_dtypes)


def to_torch(batch, *, keep_dtypes: bool = False):
    """A zephon batch with every numeric NumPy array in it as a tensor sharing its memory.

    ``torch.from_numpy`` makes the tensor, so a shared-memory region stays leased
    while a tensor over it lives. The batch is converted through its structure
    (dict values, list and tuple items, namedtuple fields, recursively); other values
    (strings, object arrays) are left as they are; ``.meta`` is kept. An array torch
    cannot view (negative strides, a non-native byte order) becomes a tensor of a
    copy. ``uint16`` and ``uint32`` arrays (token ids) become ``int64`` tensors (a
    copy), which ``nn.Embedding`` and ``cross_entropy`` take; ``uint8`` (images) and
    the other dtypes stay as stored.

    Args:
        batch: a :class:`~zephon.Batch` or dict of columns, a
            :class:`~zephon.pipeline.records.BatchList`, list, tuple or namedtuple, or a
            single array.
        keep_dtypes: keep every dtype as stored (``uint16`` stays ``uint16``).

    Returns:
        A :class:`~zephon.Batch` (for a dict), a BatchList, list, tuple or namedtuple
        of the converted items, or a tensor (for a numeric array), else ``batch``
        unchanged.

    Raises:
        ImportError: torch is missing (``python -m pip install -e ".[torch]"`` in the zephon checkout).

    Examples:
        >>> out = zephon.torch.to_torch({"x": np.arange(3), "name": ["a", "b", "c"]})
        >>> type(out["x"]).__name__, out["name"]
        ('Tensor', ['a', 'b', 'c'])
        >>> zephon.torch.to_torch(np.arange(3, dtype=np.uint16)).dtype
        torch.int64
    """
    from zephon.torch._convert import to_torch as convert

    return convert(batch, keep_dtypes=keep_dtypes)


def to_training(batch, *, field: str = "tokens", ignore_index: int = -100,
                loss_mask: str = "loss_mask"):
    """The training tensors of a batch of packed rows, as torch tensors.

    :func:`zephon.pipeline.training.to_training` (shifted ``labels`` with
    ``ignore_index`` on padding, at document boundaries and where ``loss_mask`` is 0;
    ``loss_mask``, ``attention_mask``, ``position_ids``, ``cu_seqlens`` (int32, for
    flash-attn's varlen kernels), ``max_seqlen``, ``num_valid_tokens``), converted by
    :func:`to_torch`: ``input_ids``, ``labels`` and ``position_ids`` are int64 tensors,
    ``max_seqlen`` and ``num_valid_tokens`` ints.

    Args:
        batch: a batch of ``pack_documents`` (or ``pack_tokens``) rows.
        field: the token column.
        ignore_index: the label of positions that predict nothing.
        loss_mask: the name of an aligned mask column combined with the labels when the
            batch has it.

    Returns:
        A dict (a :class:`~zephon.Batch` with the input's ``meta`` for a Batch) of tensors.

    Raises:
        ImportError: torch is missing.
        ZephonConfigError: the batch has no 2-D token column, or a layout column of
            another shape.

    Examples:
        >>> src = sources.from_sequence([{"tokens": np.arange(n) + 10 * n} for n in (3, 2)])
        >>> pipe = Pipeline(src, shuffle=False).pack_documents(6, algorithm="first_fit")
        >>> out = zephon.torch.to_training(next(iter(pipe.batch(1))))
        >>> out["labels"].tolist(), out["cu_seqlens"].dtype, out["max_seqlen"]
        ([[31, 32, -100, 21, -100, -100]], torch.int32, 3)
    """
    _require_torch()
    from zephon.pipeline.training import to_training as arrays
    from zephon.torch._convert import to_torch as convert

    return convert(arrays(batch, field=field, ignore_index=ignore_index, loss_mask=loss_mask))


def __getattr__(name):
    if name == "TorchLoader":
        from zephon.torch._loader import TorchLoader

        return TorchLoader
    raise AttributeError(f"module 'zephon.torch' has no attribute {name!r}")
