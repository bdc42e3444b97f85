"""A tiny causal language model trained on CPU on documents packed by zephon.

    python examples/train_tiny_lm.py --steps 40

What it shows:

- ``pack_documents(seq_len, algorithm="best_fit")`` keeps every document whole
  in rows of ``seq_len`` slots, with ``positions`` restarting at each document
  and ``cu_seqlens`` marking where each one starts;
- ``zephon.torch.loader(pipe, to_training=True)`` hands out the training
  tensors: ``labels`` are the inputs shifted by one with -100 on padding and
  at the last token of every document (it does not predict the next
  document's first), ``num_valid_tokens`` counts the rest;
- the loss is ``cross_entropy(..., ignore_index=-100, reduction="sum") /
  num_valid_tokens``: padding and cross-document pairs never count.

The model is an embedding of the token plus one of its position in its
document, then a linear layer: it learns the corpus' rule (each document counts
up by one from a random start) and that a document's first tokens are random.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import zephon.torch as zt
from zephon import Pipeline, RuntimeOptions, sources

VOCAB = 64
SEQ_LEN = 24


def document(i: int, ctx) -> dict:
    """Document ``i``: 3 to 16 tokens counting up (mod VOCAB, avoiding 0, the padding)."""
    n = int(ctx.rng.integers(3, 17))
    start = int(ctx.rng.integers(1, VOCAB))
    return {"tokens": (start + np.arange(n)) % (VOCAB - 1) + 1}


def make_pipeline(documents: int = 2000, batch_size: int = 8, seed: int = 0) -> Pipeline:
    src = sources.from_callable(documents, lambda i: i)
    return (Pipeline(src, seed=seed)
            .map(document)
            .pack_documents(SEQ_LEN, algorithm="best_fit", open_bins=16)
            .batch(batch_size, drop_last=True)
            .options(RuntimeOptions(runner="inline")))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = VOCAB, width: int = 32, seq_len: int = SEQ_LEN) -> None:
        super().__init__()
        self.token = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Embedding(seq_len, width)
        self.out = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.token(input_ids) + self.position(position_ids)))


def loss_of(model: TinyLM, batch: dict) -> torch.Tensor:
    """Mean next-token loss over the batch's valid labels (``to_training`` tensors)."""
    logits = model(batch["input_ids"], batch["position_ids"])
    total = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
        ignore_index=-100, reduction="sum")
    return total / batch["num_valid_tokens"]


def train(steps: int = 40, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    model = TinyLM()
    optim = torch.optim.Adam(model.parameters(), lr=3e-2)
    losses: list[float] = []
    loader = zt.loader(make_pipeline(seed=seed), to_training=True)
    for batch in loader:
        loss = loss_of(model, batch)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
        if len(losses) == steps:
            break
    loader.close()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    losses = train(args.steps)
    for step in (0, len(losses) // 2, len(losses) - 1):
        print(f"step {step}: loss {losses[step]:.3f}")


if __name__ == "__main__":
    main()
