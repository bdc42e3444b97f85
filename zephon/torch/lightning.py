"""zephon under PyTorch Lightning: a ``LightningDataModule`` whose position goes into
Lightning's checkpoint and restores on any number of devices.

    from zephon.torch.lightning import ZephonDataModule

    def build(world_size, rank):            # the pipeline of one rank
        return Pipeline(source, seed=7).batch(8).options(RuntimeOptions(
            world_size=world_size, global_rank=rank, canonical_replicas=8,
            mapping_strategy="interleaved", aggregate_store="torch://"))

    trainer = L.Trainer(strategy="ddp", devices=2, max_steps=1000,
                        accumulate_grad_batches=GLOBAL // 2)
    trainer.fit(model, datamodule=ZephonDataModule(build), ckpt_path=...)

What it owns: building each rank's pipeline once the trainer knows the world size and
rank (:meth:`ZephonDataModule.setup`), handing Lightning an iterable of tensor batches
(:func:`zephon.torch.loader`), and the data state in Lightning's checkpoint
(``state_dict``/``load_state_dict`` of the data module, which Lightning stores under
the module's class name and gives back before the first batch of a resumed fit).

Invariants:

- **Only batches Lightning trained on count.** Lightning's fetcher takes a batch
  ahead of the step that uses it (for an iterable without ``len``), so the loader's
  own position is one batch ahead when a checkpoint is written. The data module
  records the loader's position with every batch it hands out and takes the one of
  the batch Lightning starts training on (a callback's ``on_train_batch_start``,
  which the data module adds to the trainer in ``setup``; the LightningModule's own
  batch hooks stay the user's): the checkpoint holds exactly the batches the
  optimizer saw.
- **Resharding is zephon's.** The iterable is not a ``torch.utils.data.DataLoader``, so
  Lightning adds no ``DistributedSampler`` and re-wraps nothing; each rank's pipeline
  reads the lanes its rank owns, and the checkpoint is the merged state of every rank
  (``state_dict`` is collective: Lightning calls it on every rank when it saves), so it
  restores on any number of devices. Lightning writes rank 0's copy; every rank's is
  the same.
- **A restore proves itself** (:mod:`zephon.pipeline.proof`): another pipeline, rewritten
  files or another mapping raise before the first batch.

Lifecycle: ``setup("fit")`` builds the pipeline and the loader (a state loaded before
it waits until then); each epoch Lightning calls ``iter()`` and gets the next pass;
``teardown`` closes the loader (its workers are reaped).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

from zephon.errors import ZephonConfigError

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the message names the extra
    raise ImportError('zephon.torch.lightning needs Lightning: python -m pip install -e '
                      '".[lightning]" (in the zephon checkout)') from None

__all__ = ["ZephonDataModule"]


class _Batches:
    """The iterable Lightning gets: the loader's batches, each with its position kept."""

    def __init__(self, module: "ZephonDataModule") -> None:
        self._module = module

    def __iter__(self):
        module = self._module
        loader = module.loader
        assert loader is not None, "setup() builds the loader before Lightning iterates"
        iterator = iter(loader)
        module._handed.clear()
        module._trained = loader.delivered()
        for batch in iterator:
            module._handed.append(loader.delivered())
            yield batch


class _TrainedOn(pl.Callback):
    """Takes the position of each batch as Lightning starts training on it (a callback,
    so that the LightningModule's own batch hooks stay the user's)."""

    def __init__(self, module: "ZephonDataModule") -> None:
        self.module = module

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        handed = self.module._handed
        if handed:
            self.module._trained = handed.popleft()


class ZephonDataModule(pl.LightningDataModule):
    """A LightningDataModule over a zephon pipeline built per rank.

    Args:
        build: ``build(world_size, global_rank) -> Pipeline``, called in :meth:`setup`
            with the trainer's world size and rank; the pipeline's options must say the
            same (``RuntimeOptions(world_size=, global_rank=)``) and, with several ranks,
            how checkpoints are exchanged (``aggregate_store="torch://"`` under torchrun).
        **loader_options: keyword arguments of :func:`zephon.torch.loader`
            (``pin_memory``, ``to_training``, ``device``, ...).

    Raises:
        ZephonConfigError: ``build`` is not callable, or returns a pipeline whose world
            size or rank differs from the trainer's.

    Examples:
        >>> dm = ZephonDataModule(lambda world, rank: Pipeline(
        ...     sources.from_sequence(list(range(8))), seed=0).batch(4))
        >>> dm.setup("fit")
        >>> [b.shape[0] for b in dm.train_dataloader()]
        [4, 4]
        >>> dm.teardown("fit")
    """

    def __init__(self, build: Callable[[int, int], Any], **loader_options: Any) -> None:
        super().__init__()
        if not callable(build):
            raise ZephonConfigError(f"ZephonDataModule: build must be callable "
                                    f"(world_size, rank) -> Pipeline, got {type(build).__name__}")
        self.build, self.loader_options = build, loader_options
        self.loader: Any = None  # a zephon.torch.TorchLoader once set up
        self._handed: deque = deque()  # positions of batches handed out, not yet trained on
        self._trained: dict | None = None  # position after the last batch trained on
        self._pending: dict | None = None  # a state loaded before setup()
        self._callback = _TrainedOn(self)

    # -- Lightning's hooks ---------------------------------------------------------------
    def setup(self, stage: str) -> None:
        trainer = self.trainer
        callbacks = getattr(trainer, "callbacks", None)  # the trainer's list, set at run time
        if callbacks is not None and self._callback not in callbacks:
            callbacks.append(self._callback)
        if self.loader is not None:
            return
        from zephon.torch import loader

        world, rank = (1, 0) if trainer is None else (trainer.world_size, trainer.global_rank)
        pipe = self.build(world, rank)
        opts = pipe.plan().opts
        if (opts.world_size, opts.global_rank) != (world, rank):
            raise ZephonConfigError(
                f"ZephonDataModule: the pipeline says world_size={opts.world_size}, "
                f"global_rank={opts.global_rank}; the trainer runs rank {rank} of {world}: "
                "build it with RuntimeOptions(world_size=world_size, global_rank=rank)")
        self.loader = loader(pipe, **self.loader_options)
        if self._pending is not None:
            state, self._pending = self._pending, None
            self.loader.load_state_dict(state)

    def train_dataloader(self) -> _Batches:
        if self.loader is None:
            self.setup("fit")
        self._align_progress()
        return _Batches(self)

    def _align_progress(self) -> None:
        """After a resume, make Lightning count this epoch's batches as the restored
        stream does on this rank.

        Lightning restores its batch counter from the checkpoint (the batches each
        device took there) and accumulates gradients on that counter; on another number
        of devices the first step after the resume would then be short. The restored
        stream knows how many batches this rank's lanes delivered in the run (its
        ``position().rank_batches``): the loop's counters are moved to it, so every step
        takes ``accumulate_grad_batches`` batches again. Lightning calls this after its
        loops are restored and before the epoch starts.
        """
        trainer = self.trainer
        if trainer is None or self.loader is None or not trainer.fit_loop.restarting:
            return
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        shift = self.loader.position().rank_batches - progress.ready
        # every counter moves alike: Lightning's own restart logic (a checkpoint written
        # at a batch's end has one batch ready and not yet completed) still holds
        for counter in ("ready", "started", "processed", "completed"):
            setattr(progress, counter, getattr(progress, counter) + shift)

    def state_dict(self) -> dict:
        """The position after the last batch Lightning trained on (collective: every rank
        calls it when Lightning saves)."""
        if self.loader is None:
            return {} if self._pending is None else dict(self._pending)
        return self.loader.state_dict(delivered=self._trained)

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue after the batches the checkpoint's step trained on (checked at once
        when the loader exists, else in :meth:`setup`)."""
        if not state_dict:
            return
        self._handed.clear()
        self._trained = None
        if self.loader is None:
            self._pending = dict(state_dict)
        else:
            self.loader.load_state_dict(state_dict)

    def teardown(self, stage: str) -> None:
        if self.loader is not None:
            self.loader.close()
