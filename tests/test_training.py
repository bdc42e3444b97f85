"""to_training: labels are the inputs shifted by one, masked at padding, at document
starts and by a loss mask; the layout tensors; the torch layer and the loader option; a
tiny LM's loss equals a hand computation and ignores padding and cross-document pairs."""

from __future__ import annotations

import doctest
import functools
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon import Pipeline, ZephonConfigError, sources
from zephon.pipeline import training
from zephon.pipeline.training import to_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPAN = 1000  # token = document * SPAN + 1 + index (never the pad id 0)


def document(lengths: tuple, i: int) -> dict:
    n = lengths[i]
    return {"tokens": np.arange(n, dtype=np.int64) + SPAN * i + 1,
            "loss_mask": (np.arange(n) % 3 != 0).astype(np.int8)}


def batches(lengths, seq_len, algorithm, size=3, **kw):
    src = sources.from_callable(len(lengths), functools.partial(document, tuple(lengths)))
    return list(Pipeline(src, seed=2, chunk_size=4).pack_documents(
        seq_len, algorithm=algorithm, open_bins=3, **kw).batch(size))


def expected_labels(row_tokens, used, mask=None):
    """Labels by the rule, from the tokens alone: the next slot's token when it is a token
    of the same document that continues this one (index + 1)."""
    out = []
    for t in range(len(row_tokens)):
        nxt = t + 1
        ok = nxt < used and row_tokens[nxt] == row_tokens[t] + 1 and \
            (row_tokens[nxt] - 1) // SPAN == (row_tokens[t] - 1) // SPAN
        if ok and mask is not None:
            ok = mask[nxt] != 0
        out.append(int(row_tokens[nxt]) if ok else -100)
    return out


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=30), st.integers(2, 12),
       st.sampled_from(["greedy", "first_fit", "best_fit"]), st.booleans())
def test_labels_are_the_inputs_shifted_and_masked_at_padding_and_document_starts(
        lengths, seq_len, algorithm, masked):
    for batch in batches(lengths, seq_len, algorithm, aligned=("loss_mask",) if masked else ()):
        out = to_training(batch) if masked else to_training(batch, loss_mask="absent")
        tokens, cu = batch["tokens"], batch["cu_seqlens"]
        for b in range(tokens.shape[0]):
            used = int(cu[b].max())
            mask = batch["loss_mask"][b] if masked else None
            assert out["labels"][b].tolist() == expected_labels(tokens[b], used, mask)
            assert out["attention_mask"][b].tolist() == [1] * used + [0] * (seq_len - used)
        assert out["input_ids"].dtype == out["labels"].dtype == np.int64
        assert np.array_equal(out["position_ids"], batch["positions"])
        assert np.array_equal(out["loss_mask"], out["labels"] != -100)
        assert out["num_valid_tokens"] == int((out["labels"] != -100).sum())
        flat = out["cu_seqlens"]
        assert flat.dtype == np.int32 and flat[0] == 0 and flat[-1] == tokens.size
        assert out["max_seqlen"] == int(np.diff(flat).max())
        for b in range(tokens.shape[0]):  # each row's offsets, then its padding
            row = cu[b][cu[b] >= 0] + b * seq_len
            assert set(row.tolist()) <= set(flat.tolist())
        assert len(flat) - 1 == sum(int((cu[b] >= 0).sum()) - 1 + (int(cu[b].max()) < seq_len)
                                    for b in range(tokens.shape[0]))


def test_pack_tokens_rows_are_one_document_each():
    src = sources.from_sequence([{"tokens": np.arange(5) + 1}] * 2)
    batch = next(iter(Pipeline(src, shuffle=False).pack_tokens(4, drop_remainder=True).batch(2)))
    out = to_training(batch, ignore_index=-1)
    assert out["labels"].tolist() == [[2, 3, 4, -1], [1, 2, 3, -1]]  # rows 1234, 5123
    assert out["cu_seqlens"].tolist() == [0, 4, 8] and out["position_ids"][1].tolist() == \
        [0, 1, 2, 3]


def test_bad_batches_and_options_are_refused_by_name():
    with pytest.raises(ZephonConfigError, match="2-D token column 'ids'"):
        to_training({"tokens": np.zeros((2, 3))}, field="ids")
    with pytest.raises(ZephonConfigError, match="'cu_seqlens' has shape"):
        to_training({"tokens": np.zeros((2, 3)), "cu_seqlens": np.zeros((2, 3))})
    with pytest.raises(ZephonConfigError, match="to_training must be"):
        training.check_options({"ignore": 1})


def test_module_examples_run():
    assert doctest.testmod(training, extraglobs={"np": np, "Pipeline": Pipeline,
                                                 "sources": sources}).failed == 0


# -- torch ---------------------------------------------------------------------------------

torch = pytest.importorskip("torch")


@pytest.mark.filterwarnings("ignore:zephon.torch. pin_memory=True but no accelerator")
def test_torch_to_training_and_the_loader_option_give_the_same_tensors():
    import zephon.torch as zt

    lengths = (5, 3, 9, 2, 7, 4, 1, 6)
    src = sources.from_callable(len(lengths), functools.partial(document, lengths))
    def make():  # a new definition: each run starts at epoch 0
        return Pipeline(src, shuffle=False).pack_documents(8, algorithm="best_fit").batch(2)

    pipe = make()
    want = [zt.to_training(b, ignore_index=-7) for b in make()]
    for pin in (False, True):
        got = list(zt.loader(make(), to_training={"ignore_index": -7}, pin_memory=pin))
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert a.keys() == b.keys() and a.meta == b.meta
            assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else
                       a[k] == b[k] for k in a)
    assert want[0]["labels"].dtype == torch.int64 and want[0]["cu_seqlens"].dtype == torch.int32
    with pytest.raises(ZephonConfigError, match="to_training"):
        zt.loader(pipe, to_training="yes")


def _example():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import train_tiny_lm
    finally:
        sys.path.pop(0)
    return train_tiny_lm


def test_tiny_lm_loss_equals_a_hand_computation_over_the_valid_labels():
    import zephon.torch as zt

    ex = _example()
    torch.manual_seed(1)
    model = ex.TinyLM()
    raw = next(iter(ex.make_pipeline(documents=40)))
    batch = zt.to_training(raw)
    with torch.no_grad():
        loss = float(ex.loss_of(model, batch))
        logits = model(batch["input_ids"], batch["position_ids"]).double()
    tokens, cu = raw["tokens"], raw["cu_seqlens"]
    terms = []
    for b in range(tokens.shape[0]):
        starts = set(cu[b][cu[b] >= 0].tolist())
        used = int(cu[b].max())
        for t in range(used - 1):
            if t + 1 in starts:  # the next slot starts another document
                continue
            row = logits[b, t]
            log_z = math.log(sum(math.exp(float(v)) for v in row))
            terms.append(log_z - float(row[int(tokens[b, t + 1])]))
    assert batch["num_valid_tokens"] == len(terms)
    assert loss == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    # counting padding and cross-document pairs too would give another loss
    naive = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        batch["input_ids"][:, 1:].reshape(-1))
    assert float(naive) != pytest.approx(loss, rel=1e-3)


def test_the_example_trains_to_a_loss_only_within_document_labels_allow():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_tiny_lm.py"),
                          "--steps", "40"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    last = float(out.stdout.strip().splitlines()[-1].split()[-1])
    # each document's first token is random: a loss that counted the pairs across
    # documents could not fall below ~log(63) times their share (over 0.2 here)
    assert last < 0.1, out.stdout
