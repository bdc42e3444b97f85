"""zephon under Hugging Face: ``transformers.Trainer`` and ``accelerate``, resuming
exactly on any number of processes.

    from zephon.torch.hf import ZephonTrainer
    trainer = ZephonTrainer(model=model, args=TrainingArguments(
        output_dir=out, max_steps=1000, save_steps=100,
        gradient_accumulation_steps=GLOBAL // world_size),
        train_loader=zephon.torch.loader(pipe))
    trainer.train(resume_from_checkpoint=True)   # the latest checkpoint-N, data included

    from zephon.torch.hf import register
    model, optim = accelerator.prepare(model, optim)
    loader = register(accelerator, zephon.torch.loader(pipe))   # saved by save_state()
    accelerator.load_state(folder)                               # ... and restored here
    for step, batches in loader.steps(total, micro_batches=accumulate): ...

What it owns: the loader's state in each framework's checkpoint, and keeping the
frameworks away from what zephon already does.

- **Trainer** (:class:`ZephonTrainer`): ``get_train_dataloader`` hands out the zephon
  loader as it is (the Trainer prepares only the DataLoaders it builds itself, so
  nothing re-shards it or wraps it in a sampler); every checkpoint folder
  ``checkpoint-N`` gets :data:`DATA_FILE`, the loader's state after the batches of
  step N (the Trainer takes exactly ``gradient_accumulation_steps`` batches per step,
  so nothing is taken ahead); ``train(resume_from_checkpoint=...)`` restores it before
  the first batch, and the Trainer's skipping of the batches already trained on
  (``get_resumed_dataloader``) is turned off: the loader continues after them itself,
  on any number of processes. A checkpoint folder without the data file is refused
  (training would silently start the stream again).
- **accelerate** (:func:`register`): ``prepare`` passes any object that is not a
  ``torch.utils.data.DataLoader`` through untouched, so the loader is never re-sharded;
  :func:`register` checks that and registers it for checkpointing (``save_state``
  stores the main process's copy, ``load_state`` gives it to every process).

In both the state is the merged state of every rank (``state_dict`` is collective:
each framework calls it on every process when it saves), so it restores on any world
size, and a restore proves itself (:mod:`zephon.pipeline.proof`).
"""

from __future__ import annotations

import os
from typing import Any

from zephon.errors import CheckpointError, ZephonConfigError

try:
    import torch
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import get_last_checkpoint
except ImportError:  # pragma: no cover - the message names the extra
    raise ImportError('zephon.torch.hf needs transformers: python -m pip install -e '
                      '".[transformers]" (in the zephon checkout)') from None

__all__ = ["DATA_FILE", "ZephonTrainer", "register"]

#: the file in each ``checkpoint-N`` folder that holds the loader's state
DATA_FILE = "zephon_data.pt"


def _require_loader(loader: Any, who: str) -> None:
    from zephon.torch import TorchLoader

    if not isinstance(loader, TorchLoader):
        raise ZephonConfigError(
            f"{who} takes a zephon.torch.loader(pipe), got {type(loader).__name__}: a "
            "DataLoader, prepared by accelerate or not, shares batches out among the ranks "
            "again, while every rank's pipeline already reads only its own lanes")


class _SaveData(TrainerCallback):
    """Writes the loader's state into every checkpoint folder the Trainer saves."""

    def __init__(self, trainer: "ZephonTrainer") -> None:
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        data = self.trainer.train_loader.state_dict()  # collective: every process calls it
        if args.process_index == 0:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            tmp = os.path.join(folder, DATA_FILE + ".tmp")
            torch.save(data, tmp)
            os.replace(tmp, os.path.join(folder, DATA_FILE))
        return control


class ZephonTrainer(Trainer):
    """A ``transformers.Trainer`` that trains on a zephon loader and saves its position.

    Args:
        *args: the Trainer's arguments.
        train_loader: the loader (:func:`zephon.torch.loader`) of this process's pipeline;
            with several processes its options name the rank and the exchange
            (``RuntimeOptions(world_size=, global_rank=, aggregate_store="torch://")``).
            The Trainer's ``max_steps`` must be set (the stream has no length).
        **kwargs: the Trainer's keyword arguments (no ``train_dataset``: the loader is the
            data).

    Raises:
        ZephonConfigError: ``train_loader`` is not a zephon loader, or a
            ``train_dataset`` is given too.

    Examples:
        >>> import tempfile, torch
        >>> from transformers import TrainingArguments
        >>> class Tiny(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.zeros(1))
        ...     def forward(self, x):
        ...         return {"loss": ((x - self.w) ** 2).mean()}
        >>> pipe = Pipeline(sources.from_sequence([{"x": np.float32(i)} for i in range(8)]),
        ...                 seed=0, num_epochs=None).batch(2)
        >>> out = tempfile.mkdtemp()
        >>> trainer = ZephonTrainer(model=Tiny(), args=TrainingArguments(
        ...     output_dir=out, max_steps=2, save_steps=2, use_cpu=True, report_to="none",
        ...     disable_tqdm=True), train_loader=zephon.torch.loader(pipe))
        >>> trainer.train().global_step
        {...}
        2
        >>> "zephon_data.pt" in os.listdir(f"{out}/checkpoint-2")
        True
        >>> trainer.train_loader.close()
    """

    def __init__(self, *args: Any, train_loader: Any, **kwargs: Any) -> None:
        _require_loader(train_loader, "ZephonTrainer(train_loader=)")
        if kwargs.get("train_dataset") is not None:
            raise ZephonConfigError("ZephonTrainer: give the data as train_loader=, not "
                                    "train_dataset= as well")
        super().__init__(*args, **kwargs)
        self.train_loader = train_loader
        # first of the callbacks: the data file is in the folder before any other
        # callback's on_save hears that the checkpoint was saved
        self.callback_handler.callbacks.insert(0, _SaveData(self))

    def get_train_dataloader(self):
        return self.train_loader

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        # The loader was restored to the checkpoint's position: skipping the batches
        # already trained on would skip as many again.
        return dataloader

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any):
        """The Trainer's ``train``; a checkpoint to resume from restores the loader too
        (from its :data:`DATA_FILE`) before the first batch.

        Raises:
            CheckpointError: the checkpoint folder has no data file (it was not written by
                a ZephonTrainer), or its state does not continue this pipeline.
        """
        folder = resume_from_checkpoint
        if folder is True:
            folder = get_last_checkpoint(self.args.output_dir)
            if folder is None:
                raise CheckpointError(f"resume_from_checkpoint=True: no checkpoint-N folder "
                                      f"in {self.args.output_dir}")
        if folder:
            path = os.path.join(str(folder), DATA_FILE)
            if not os.path.exists(path):
                raise CheckpointError(
                    f"{folder} has no {DATA_FILE}: it was not saved by a ZephonTrainer, and "
                    "resuming without it would start the data stream again")
            self.train_loader.load_state_dict(torch.load(path, weights_only=True))
        return super().train(folder or None, *args, **kwargs)


def register(accelerator: Any, loader: Any) -> Any:
    """Register a zephon loader with ``accelerator`` for ``save_state``/``load_state``.

    Do not pass it to ``accelerator.prepare`` wrapped in a DataLoader: zephon already
    gives each process its lanes. (``prepare(loader)`` returns it untouched.)

    Args:
        accelerator: an ``accelerate.Accelerator``.
        loader: a :func:`zephon.torch.loader`.

    Returns:
        ``loader``.

    Raises:
        ZephonConfigError: ``loader`` is not a zephon loader.

    Examples:
        >>> from accelerate import Accelerator
        >>> accelerator = Accelerator(cpu=True)
        >>> loader = zephon.torch.loader(Pipeline(sources.from_sequence(list(range(4)))))
        >>> register(accelerator, loader) is loader
        True
        >>> loader.close()
    """
    _require_loader(loader, "zephon.torch.hf.register")
    accelerator.register_for_checkpointing(loader)
    return loader
