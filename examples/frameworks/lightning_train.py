"""A tiny language model trained with PyTorch Lightning on zephon batches, resumable on
any number of devices.

    python -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1 \\
        --master_port=29512 examples/frameworks/lightning_train.py --out /tmp/lit \\
        --steps 6 --save-at 3
    python -m torch.distributed.run --nproc_per_node=4 ... lightning_train.py \\
        --out /tmp/lit4 --steps 6 --resume /tmp/lit/ckpt/step3.ckpt

The data module (:class:`zephon.torch.lightning.ZephonDataModule`) builds each rank's
pipeline when Lightning knows the rank, and its state rides in Lightning's checkpoint.
Lightning's ``accumulate_grad_batches`` makes the global batch the same on 1, 2 or 4
devices (``--global-batches / world_size`` micro-batches per device and step), so
after a resume every step takes the samples it took in the uninterrupted run. The
command line and the log are described in ``common.py``.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L
import torch
import torch._dynamo  # before the process group exists: see common.shut_down
from common import StepLog, TinyLM, accumulation, build_pipeline, parse, shut_down
from lightning.pytorch.callbacks import ModelCheckpoint

from zephon.torch.lightning import ZephonDataModule


class LitLM(L.LightningModule):
    def __init__(self, args) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model, self.args = TinyLM(), args
        self.steps_log: StepLog | None = None

    def training_step(self, batch, batch_idx):
        if self.steps_log is None:
            self.steps_log = StepLog(self.args.out, self.global_rank)
        self.steps_log.micro(self.global_step, batch)
        return self.model(batch["x"], batch["y"])["loss"]

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # after the callbacks: ModelCheckpoint has written the step's checkpoint
        save_at = self.args.save_at
        if save_at is None or self.global_step != save_at or self.steps_log is None:
            return
        if not os.path.exists(os.path.join(self.args.out, f"saved-{save_at}")):
            self.trainer.strategy.barrier()
            self.steps_log.saved(save_at)
            if self.args.hold_after_save:
                time.sleep(600)  # a test SIGKILLs the run here


def main() -> None:
    args = parse(__doc__.splitlines()[0])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    callbacks = []
    if args.save_at is not None:
        callbacks.append(ModelCheckpoint(
            dirpath=os.path.join(args.out, "ckpt"), filename="step{step:d}",
            auto_insert_metric_name=False, every_n_train_steps=args.save_at, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=world, num_nodes=1,
                        strategy="ddp" if world > 1 else "auto", max_steps=args.steps,
                        accumulate_grad_batches=accumulation(args, world),
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(callbacks), callbacks=callbacks)
    data = ZephonDataModule(lambda world_size, rank: build_pipeline(args, world_size, rank))
    trainer.fit(LitLM(args), datamodule=data, ckpt_path=args.resume)
    print(f"rank {trainer.global_rank}: trained to step {trainer.global_step}")
    shut_down()


if __name__ == "__main__":
    main()
