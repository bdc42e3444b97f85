"""The workload shared by the data-wait benchmark: token windows and a tiny LM step.

A flat uint16 token file (nanoGPT style) is cut into windows of ``SEQ`` tokens;
each sample becomes ``x = tokens[:-1]``, ``y = tokens[1:]`` (int64); batches of
``BATCH`` samples feed one forward/backward/optimizer step of a tiny language
model. zephon reads the windows with ``sources.token_windows`` and maps
:func:`to_xy`; torch's DataLoader reads the same windows through
:class:`WindowDataset` and applies the same function per sample.
"""

from __future__ import annotations

import os

import numpy as np

SEQ, BATCH, VOCAB = 257, 32, 512
TOKENS = 1 << 22  # 4 Mi tokens: 16,320 windows, 510 batches


def write_tokens(path: str) -> str:
    if not os.path.exists(path):
        rng = np.random.default_rng(0)
        rng.integers(0, VOCAB, TOKENS, dtype=np.uint16).tofile(path)
    return path


def to_xy(sample: dict) -> dict:
    tokens = sample["tokens"].astype(np.int64)
    return {"x": tokens[:-1], "y": tokens[1:]}


class WindowDataset:
    """Map-style dataset of the same windows for torch's DataLoader (no torch import)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.n = os.path.getsize(path) // 2 // SEQ
        self._tokens = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        return to_xy({"tokens": np.array(self._tokens[i * SEQ:(i + 1) * SEQ])})


def make_model():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, VOCAB))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(model, optim, batch) -> None:
    import torch

    logits = model(batch["x"])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["y"].reshape(-1))
    optim.zero_grad()
    loss.backward()
    optim.step()
