"""What the framework examples share: the data (a tiny language-model stream), the
model, the command line, and the log each rank writes.

Every example trains ``--steps`` optimizer steps, each over a global batch of
``--global-batches`` micro-batches split over the ranks (``global_batches //
world_size`` per rank and step, gradient accumulation), with
``mapping_strategy="interleaved"`` so that a step takes the same samples on any
number of ranks. Each rank writes ``<out>/rank-<r>.jsonl``: one line per micro-batch
(``step``, ``rank``, the sample ids). With ``--save-at K`` the run checkpoints after
step K and writes ``<out>/saved-K``; with ``--hold-after-save`` it then waits (so a test
can SIGKILL it there). ``--resume PATH`` continues from a checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import numpy as np
import torch

from zephon import Pipeline, RuntimeOptions, sources

VOCAB, SEQ = 64, 16


def make_window(i: int) -> dict:
    """Sample ``i``: a window of SEQ + 1 tokens, a pure function of ``i``."""
    tokens = np.random.default_rng([1234, i]).integers(0, VOCAB, SEQ + 1, dtype=np.int64)
    return {"id": i, "x": tokens[:-1], "y": tokens[1:]}


def build_pipeline(args, world_size: int, rank: int) -> Pipeline:
    """One rank's pipeline: every rank reads the lanes it owns; the checkpoint exchange
    goes through torchrun's store."""
    opts = RuntimeOptions(world_size=world_size, global_rank=rank, canonical_replicas=8,
                          mapping_strategy="interleaved", aggregate_store="torch://")
    return Pipeline(sources.from_callable(args.samples, make_window), seed=args.seed,
                    chunk_size=2, num_epochs=None).batch(2).options(opts)


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x, y=None, **_):
        logits = self.head(torch.tanh(self.embed(x)))
        if y is None:
            return logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        return {"loss": loss, "logits": logits}


def parse(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--hold-after-save", action="store_true")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--global-batches", type=int, default=4)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--seed", type=int, default=7)
    return parser.parse_args()


def accumulation(args, world_size: int) -> int:
    if args.global_batches % world_size:
        raise SystemExit(f"--global-batches {args.global_batches} is not a multiple of the "
                         f"world size {world_size}")
    return args.global_batches // world_size


class StepLog:
    """``<out>/rank-<r>.jsonl``: one line per micro-batch a rank trained on."""

    def __init__(self, out: str, rank: int) -> None:
        os.makedirs(out, exist_ok=True)
        self.out, self.rank = out, rank
        self.fh = open(os.path.join(out, f"rank-{rank}.jsonl"), "a")

    def micro(self, step: int, batch) -> None:
        ids = batch["id"].tolist()
        self.fh.write(json.dumps({"step": step, "rank": self.rank, "ids": ids}) + "\n")
        self.fh.flush()

    def saved(self, step: int) -> None:
        """Mark the checkpoint of ``step`` as written (rank 0, after every rank saved)."""
        if self.rank == 0:
            with open(os.path.join(self.out, f"saved-{step}"), "w") as fh:
                fh.write("ok\n")

    def close(self) -> None:
        self.fh.close()


def shut_down() -> None:
    """Destroy the process group while the interpreter is alive.

    gloo's worker threads drop their last references to finished collectives late; if
    that happens while the interpreter finalizes, a rank hangs or aborts at exit. The
    group's destructor joins those threads, so the last reference to it goes here (and
    ``torch._dynamo``, which keeps references to a group that exists when it is first
    imported, is imported before the group: see each example's imports).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()
