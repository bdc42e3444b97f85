"""A tiny language model trained with accelerate on zephon batches, resumable on any
number of processes.

    python -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1 \\
        --master_port=29514 examples/frameworks/accelerate_train.py --out /tmp/acc \\
        --steps 6 --save-at 3
    python -m torch.distributed.run --nproc_per_node=4 ... accelerate_train.py \\
        --out /tmp/acc4 --steps 6 --resume /tmp/acc/ckpt/step-3

The model and optimizer go through ``accelerator.prepare``; the zephon loader does not
(it already reads each process's lanes): :func:`zephon.torch.hf.register` registers it
for ``save_state``/``load_state``, and ``loader.steps()`` runs the fixed number of
steps from wherever the restored stream is. The command line and the log are
described in ``common.py``.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch._dynamo  # before the process group exists: see common.shut_down
from accelerate import Accelerator
from common import StepLog, TinyLM, accumulation, build_pipeline, parse, shut_down

import zephon.torch as zt
from zephon.torch.hf import register


def main() -> None:
    args = parse(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    world, rank = accelerator.num_processes, accelerator.process_index
    accumulate = accumulation(args, world)
    torch.manual_seed(0)
    model = TinyLM()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optim = accelerator.prepare(model, optim)
    loader = register(accelerator, zt.loader(build_pipeline(args, world, rank)))
    if args.resume:
        accelerator.load_state(args.resume)
    steps_log = StepLog(args.out, rank)
    for step, batches in loader.steps(args.steps, micro_batches=accumulate):
        optim.zero_grad(set_to_none=True)
        for j, batch in enumerate(batches):
            steps_log.micro(step, batch)
            loss = model(batch["x"], batch["y"])["loss"] / accumulate
            if j < accumulate - 1:
                with accelerator.no_sync(model):
                    accelerator.backward(loss)
            else:
                accelerator.backward(loss)
        optim.step()
        if args.save_at is not None and step + 1 == args.save_at:
            accelerator.save_state(os.path.join(args.out, "ckpt", f"step-{step + 1}"))
            accelerator.wait_for_everyone()
            steps_log.saved(step + 1)
            if args.hold_after_save:
                time.sleep(600)  # a test SIGKILLs the run here
    print(f"rank {rank}: trained to step {args.steps}")
    loader.close()
    accelerator.end_training()
    shut_down()


if __name__ == "__main__":
    main()
