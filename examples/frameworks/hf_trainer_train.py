"""A tiny language model trained with transformers' Trainer on zephon batches,
resumable on any number of processes.

    python -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1 \\
        --master_port=29513 examples/frameworks/hf_trainer_train.py --out /tmp/hf \\
        --steps 6 --save-at 3
    python -m torch.distributed.run --nproc_per_node=4 ... hf_trainer_train.py \\
        --out /tmp/hf4 --steps 6 --resume /tmp/hf/checkpoint-3

:class:`zephon.torch.hf.ZephonTrainer` hands the Trainer the zephon loader and
writes its state into every ``checkpoint-N`` folder; ``gradient_accumulation_steps``
keeps the global batch the same on 1, 2 or 4 processes. The command line and the log
are described in ``common.py``.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch._dynamo  # before the process group exists: see common.shut_down
from common import StepLog, TinyLM, accumulation, build_pipeline, parse, shut_down
from transformers import TrainerCallback, TrainingArguments

import zephon.torch as zt
from zephon.torch.hf import ZephonTrainer


class Logged(ZephonTrainer):
    """Logs the sample ids of every micro-batch the Trainer trains on."""

    def __init__(self, *args, steps_log: StepLog, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps_log = steps_log

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.steps_log.micro(self.state.global_step, inputs)
        return super().training_step(model, inputs, num_items_in_batch)


class MarkSaved(TrainerCallback):
    """After the checkpoint of ``--save-at`` is written: the marker, then the hold."""

    def __init__(self, args, steps_log: StepLog) -> None:
        self.args, self.steps_log = args, steps_log

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.args.save_at:
            torch.distributed.barrier() if torch.distributed.is_initialized() else None
            self.steps_log.saved(state.global_step)
            if self.args.hold_after_save:
                time.sleep(600)  # a test SIGKILLs the run here
        return control


def main() -> None:
    args = parse(__doc__.splitlines()[0])
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    training = TrainingArguments(
        output_dir=os.path.join(args.out, "ckpt"), use_cpu=True, ddp_backend="gloo",
        max_steps=args.steps, gradient_accumulation_steps=accumulation(args, world),
        save_strategy="steps" if args.save_at else "no", save_steps=args.save_at or 1,
        learning_rate=1e-2, report_to="none", logging_steps=1000, disable_tqdm=True,
        remove_unused_columns=False)
    steps_log = StepLog(args.out, rank)
    trainer = Logged(model=TinyLM(), args=training, steps_log=steps_log,
                     train_loader=zt.loader(build_pipeline(args, world, rank)),
                     callbacks=[MarkSaved(args, steps_log)])
    trainer.train(resume_from_checkpoint=args.resume)
    print(f"rank {rank}: trained to step {trainer.state.global_step}")
    trainer.train_loader.close()
    shut_down()


if __name__ == "__main__":
    main()
