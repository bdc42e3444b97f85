"""A tiny language model trained with torchtitan's components on zephon batches: the
data loader built from its config the way torchtitan's trainer builds it, and saved
with the model by torchtitan's CheckpointManager (DCP), resumable on any dp degree.

    python -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1 \\
        --master_port=29515 examples/frameworks/torchtitan_train.py --out /tmp/tt \\
        --steps 6 --save-at 3
    python -m torch.distributed.run --nproc_per_node=4 ... torchtitan_train.py \\
        --out /tmp/tt4 --steps 6 --resume /tmp/tt/ckpt/step-3

torchtitan's ``Trainer`` itself asks for a CUDA device (it sets the device of
``torchtitan.tools.utils.device_type``, "cuda" on a machine without one), so this loop
stands in for it on CPU: ``ZephonDataLoader.Config(...).build(dp_world_size=,
dp_rank=, tokenizer=, seq_len=, local_batch_size=)`` is the trainer's own call, and
``CheckpointManager.Config(...).build(dataloader=...)`` its checkpointer, which saves
the loader's state with the model, optimizer, LR schedulers and the train state. The
command line and the log are described in ``common.py`` (the log names each row by a
hash of its tokens).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import torch
import torch._dynamo  # before the process group exists: see common.shut_down
import torch.distributed as dist
from common import SEQ, VOCAB, StepLog, TinyLM, accumulation, parse, shut_down
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from zephon import Pipeline, RuntimeOptions, sources
from zephon.torch.titan import ZephonDataLoader

SAMPLES = int(os.environ.get("ZEPHON_EXAMPLE_SAMPLES", "96"))
SEED = int(os.environ.get("ZEPHON_EXAMPLE_SEED", "7"))


def window(i: int) -> dict:
    return {"tokens": np.random.default_rng([1234, i]).integers(0, VOCAB, SEQ + 1)}


def build(*, seq_len, local_batch_size, **_) -> Pipeline:
    """The pipeline builder ``ZephonDataLoader.Config.pipeline`` names (the loader sets
    the ranks; the lanes stay 8 on any dp degree)."""
    assert seq_len == SEQ
    return Pipeline(sources.from_callable(SAMPLES, window), seed=SEED, chunk_size=2,
                    num_epochs=None).batch(local_batch_size).options(
        RuntimeOptions(canonical_replicas=8, mapping_strategy="interleaved"))


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state_dict) -> None:
        self.step = int(state_dict["step"])


def row_ids(inputs) -> list:
    return [int.from_bytes(hashlib.blake2b(row.numpy().tobytes(), digest_size=6).digest(),
                           "big") for row in inputs["input"]]


def main() -> None:
    args = parse(__doc__.splitlines()[0])
    os.environ["ZEPHON_EXAMPLE_SAMPLES"], os.environ["ZEPHON_EXAMPLE_SEED"] = \
        str(args.samples), str(args.seed)
    global SAMPLES, SEED
    SAMPLES, SEED = args.samples, args.seed
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    accumulate = accumulation(args, world)
    torch.manual_seed(0)
    model = TinyLM()
    optim_config = default_adamw(lr=1e-2)
    optim_config.implementation = "for-loop"  # "fused" is CUDA's
    optimizers = optim_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(
        optimizers=optimizers, training_steps=args.steps)
    loader = ZephonDataLoader.Config(pipeline="torchtitan_train:build").build(
        dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=SEQ, local_batch_size=2)
    state = TrainState()
    checkpointer = CheckpointManager.Config(
        enable=True, folder="ckpt", interval=args.save_at or 10**9, keep_latest_k=0,
        last_save_model_only=False, async_mode="disabled",
        initial_load_path=os.path.abspath(args.resume) if args.resume else None,
        initial_load_model_only=False,
    ).build(dataloader=loader, model_parts=[model], optimizers=optimizers,
            lr_schedulers=schedulers, states={"train_state": state}, sd_adapter=None,
            base_folder=args.out)
    checkpointer.load(step=-1)
    steps_log = StepLog(args.out, rank)
    batches = iter(loader)
    while state.step < args.steps:
        optimizers.zero_grad()
        for _ in range(accumulate):
            inputs, labels = next(batches)
            steps_log.micro(state.step, {"id": torch.tensor(row_ids(inputs))})
            logits = model(inputs["input"])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                     labels.reshape(-1)) / accumulate
            loss.backward()
        for p in model.parameters():  # data parallel: the ranks' mean gradient
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizers.step()
        schedulers.step()
        state.step += 1
        if checkpointer.save(curr_step=state.step) and state.step == args.save_at:
            dist.barrier()
            steps_log.saved(state.step)
            if args.hold_after_save:
                time.sleep(600)  # a test SIGKILLs the run here
    print(f"rank {rank}: trained to step {state.step}")
    checkpointer.close()
    loader.close()
    shut_down()


if __name__ == "__main__":
    main()
