"""A tiny language model trained with DDP (gloo) on zephon batches, resumable anywhere.

Run it under torchrun, for example on 2 ranks:

    python -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1 \\
        --master_port=29511 examples/train_ddp.py --out /tmp/run --steps 6 --save-at 3

then resume the checkpoint it saved at step 3 on 1, 2 or 4 ranks, with any runner:

    python -m torch.distributed.run --nproc_per_node=4 ... examples/train_ddp.py \\
        --out /tmp/resumed --steps 6 --resume /tmp/run/ckpt-3.pt

What it shows:

- Every optimizer step consumes ``--global-batches`` micro-batches in total,
  split over the ranks (gradient accumulation: ``global_batches / world_size``
  micro-batches per rank and step), so the global batch does not depend on
  the world size.
- ``mapping_strategy="interleaved"`` gives rank ``r`` the lanes ``l % W == r``;
  then micro-step ``j`` of rank ``r`` in step ``s`` is position
  ``s * G + j * W + r`` of the one-rank stream, so every step sees the same
  samples whatever the world size. (With ``"contiguous"`` blocks of lanes per
  rank, a step mixes different lanes on different world sizes.)
- ``--exact`` reduces the per-micro-batch losses and gradients in that
  canonical stream order (an all-gather) instead of DDP's rank-order
  all-reduce, so losses and weights are bit-identical across world sizes.
  Without it, plain DDP accumulation (``no_sync`` then one all-reduce).
- The checkpoint holds model, optimizer and data state
  (``loader.state_dict()``, collective: every rank calls it); the data state is
  exchanged through torchrun's TCPStore (``aggregate_store="torch://"``).

Each rank writes ``<out>/rank-<r>.jsonl``: one line per micro-batch (step,
lane, lane_index, sample ids, loss as a hex float) and, on rank 0, one per step
(``"step_loss"``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import numpy as np
import torch
import torch._dynamo  # noqa: F401 - before the process group exists: see shut_down_gloo
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zephon.torch as zt
from zephon import Pipeline, RuntimeOptions, sources

VOCAB, SEQ = 64, 16


def make_window(i: int) -> dict:
    """Sample ``i``: a window of SEQ + 1 tokens, a pure function of ``i``."""
    rng = np.random.default_rng([1234, i])
    tokens = rng.integers(0, VOCAB, SEQ + 1, dtype=np.int64)
    return {"id": i, "x": tokens[:-1], "y": tokens[1:]}


def build_pipeline(args, world: int, rank: int) -> Pipeline:
    opts = RuntimeOptions(world_size=world, global_rank=rank,
                          canonical_replicas=args.lanes, mapping_strategy=args.mapping,
                          aggregate_store="torch://", runner=args.runner,
                          max_workers=args.workers)
    return Pipeline(sources.from_callable(args.samples, make_window), seed=7,
                    chunk_size=args.micro_batch) \
        .batch(args.micro_batch).options(opts)


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))


def micro_loss(model, batch):
    logits = model(batch["x"])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["y"].reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--global-batches", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--mapping", default="interleaved")
    parser.add_argument("--runner", default="inline")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--exact", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)  # deterministic kernels: same ops, same bits
    dist.init_process_group("gloo")
    try:
        train(args)
    finally:
        shut_down_gloo()


def train(args: argparse.Namespace) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.global_batches % world:
        raise SystemExit(f"--global-batches {args.global_batches} is not a multiple of the "
                         f"world size {world}")
    accumulate = args.global_batches // world

    torch.manual_seed(0)
    model = DDP(TinyLM())
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = zt.loader(build_pipeline(args, world, rank))
    start = 0
    if args.resume:
        ckpt = torch.load(args.resume, weights_only=True)
        model.module.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        loader.load_state_dict(ckpt["data"])
        start = ckpt["step"]

    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, f"rank-{rank}.jsonl"), "w")
    batches = iter(loader)
    params = list(model.parameters())
    for step in range(start, args.steps):
        optim.zero_grad(set_to_none=True)
        mine = []
        for j in range(accumulate):
            batch = next(batches)
            meta = batch.meta
            record = {"step": step, "rank": rank, "micro": j, "lane": meta["lane"],
                      "lane_index": meta["lane_index"], "ids": batch["id"].tolist()}
            if args.exact:
                with model.no_sync():
                    loss = micro_loss(model, batch)
                    grads = torch.autograd.grad(loss, params)
                position = step * args.global_batches + j * world + rank
                mine.append((position, loss.detach(), [g.detach() for g in grads]))
            else:
                loss = micro_loss(model, batch)
                if j < accumulate - 1:
                    with model.no_sync():
                        (loss / accumulate).backward()
                else:
                    (loss / accumulate).backward()  # DDP all-reduces (averages) here
            record["loss"] = float(loss.detach()).hex()
            log.write(json.dumps(record) + "\n")
        if args.exact:
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            ordered = sorted((item for part in gathered for item in part), key=lambda t: t[0])
            step_loss = ordered[0][1].clone()
            for item in ordered[1:]:
                step_loss = step_loss + item[1]
            for k, p in enumerate(params):
                total = ordered[0][2][k].clone()
                for item in ordered[1:]:
                    total = total + item[2][k]
                p.grad = total / len(ordered)
            step_loss = step_loss / len(ordered)
            if rank == 0:
                log.write(json.dumps({"step_loss": step, "loss": float(step_loss).hex()}) + "\n")
        optim.step()
        if args.save_at is not None and step + 1 == args.save_at:
            data = loader.state_dict()  # collective: every rank takes part
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                            "data": data, "step": step + 1},
                           os.path.join(args.out, f"ckpt-{step + 1}.pt"))
            dist.barrier()
    log.close()
    loader.close()


def shut_down_gloo() -> None:
    """Join gloo's worker threads before the interpreter finalizes.

    A gloo worker thread drops its reference to a finished collective (and with
    it the Python objects of the collective's tensors) after the caller has been
    told the collective is done. On a busy machine that drop can come late: if
    it asks for the GIL while the interpreter is finalizing, the thread is torn
    down inside C++ code and the process aborts ("terminate called without an
    active exception"; 2 runs in 8 on 4 ranks and 2 cores). The process group's
    destructor releases the GIL and joins those threads, so the last reference
    to the group is dropped here, while the interpreter is alive: torch's
    registry holds one, the DDP model of ``train`` others (gone with its frame,
    or with the collection below).

    One more holder has to be kept away: importing ``torch._dynamo`` (DDP's
    constructor does) while a process group exists keeps references to it for
    good, and then no destructor ever runs. The import at the top of this file
    comes before ``init_process_group``.
    """
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
