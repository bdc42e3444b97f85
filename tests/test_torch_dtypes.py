"""zephon.torch hands training dtypes: uint16 token windows reach nn.Embedding as int64.

Unsigned ``uint16``/``uint32`` arrays become ``int64`` tensors unless ``keep_dtypes``;
``uint8`` stays ``uint8``; tuple batches (``BatchList``) convert item by item with
their ``meta``.
"""

from __future__ import annotations

import _collate_fns as F
import numpy as np
import pytest

from zephon import Pipeline, sources
from zephon.pipeline.records import BatchList

torch = pytest.importorskip("torch")
import zephon.torch as zt  # noqa: E402


def test_uint16_token_windows_reach_nn_embedding_as_int64(tmp_path):
    path = tmp_path / "train.bin"
    (np.arange(4 * 64) % 1000).astype(np.uint16).tofile(path)
    pipe = Pipeline(sources.token_windows(str(path), seq_len=16), shuffle=False).batch(4)
    embedding, head = torch.nn.Embedding(1000, 8), torch.nn.Linear(8, 1000)
    batches = list(zt.loader(pipe))
    assert len(batches) == 4
    for k, batch in enumerate(batches):
        tokens = batch["tokens"]
        assert tokens.dtype == torch.int64 and tokens.shape == (4, 16)
        assert tokens.flatten().tolist() == [t % 1000 for t in range(64 * k, 64 * (k + 1))]
        logits = head(embedding(tokens))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 1000), tokens.reshape(-1))
        assert logits.shape == (4, 16, 1000) and torch.isfinite(loss)
    kept = next(iter(zt.loader(pipe, keep_dtypes=True)))
    assert kept["tokens"].dtype == torch.uint16


def test_to_torch_converts_tuple_batches_and_keeps_uint8_and_meta():
    pipe = Pipeline(sources.from_callable(4, F.image_label), shuffle=False).batch(2)
    batch = next(iter(pipe))
    out = zt.to_torch(batch)
    assert type(out) is BatchList and out.meta["sample_ids"] == batch.meta["sample_ids"]
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.int64
    images = zt.to_torch((np.zeros((2, 2), np.uint8), np.arange(2, dtype=np.uint32)))
    assert images[0].dtype == torch.uint8 and images[1].dtype == torch.int64


def test_map_leaves_walks_tuple_batches_keeping_meta():
    from zephon.torch._convert import map_leaves

    batch = BatchList([torch.ones(2), {"a": (torch.zeros(1), "s")}], meta={"lane": 3})
    out = map_leaves(batch, lambda v: v * 2 if isinstance(v, torch.Tensor) else v)
    assert type(out) is BatchList and out.meta == {"lane": 3}
    assert out[0].tolist() == [2.0, 2.0] and out[1]["a"][1] == "s"
    assert out[1]["a"][0].tolist() == [0.0]
