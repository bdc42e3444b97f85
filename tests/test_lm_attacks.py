"""The language-model features attacked as a demanding user would: each test pins a
defect found that way (it failed before its fix) or a promise that held under attack.

Tokenizers are trained here (``_tokenize_fns.train_tokenizer`` and a word-level one):
nothing is downloaded.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

import _tokenize_fns as T  # noqa: E402

from zephon import OpError, Pipeline, sources  # noqa: E402
from zephon.pipeline.training import IGNORE_INDEX, to_training  # noqa: E402


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return T.train_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return tokenizers.Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))


def docs(*lengths, dtype=np.int64, base=100):
    return sources.from_sequence([{"tokens": (np.arange(n) + base * (i + 1)).astype(dtype)}
                                  for i, n in enumerate(lengths)])


# -- to_training --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint8, np.int32])
def test_labels_of_unsigned_tokens_are_ignore_index_not_a_wrapped_value(dtype):
    # tokenize gives uint16 by default: -100 must not wrap to 65436 in the labels
    batch = next(iter(Pipeline(docs(3, 2, dtype=dtype, base=50), shuffle=False)
                      .pack_documents(6, algorithm="first_fit").batch(1)))
    out = to_training(batch)
    assert out["labels"].dtype == np.int64
    assert out["labels"].tolist() == [[51, 52, IGNORE_INDEX, 101, IGNORE_INDEX, IGNORE_INDEX]]
    assert out["num_valid_tokens"] == 3
    custom = to_training(batch, ignore_index=-1)["labels"]
    assert custom.tolist() == [[51, 52, -1, 101, -1, -1]]


# -- pack_documents -----------------------------------------------------------------------

@pytest.mark.parametrize("bad", [None, "hello", np.array([1.5, 2.5]), [b"x"], {"a": 1}])
def test_a_non_integer_token_array_is_an_op_error_naming_the_sample(bad):
    src = sources.from_sequence([{"tokens": np.arange(3)}, {"tokens": bad}])
    with pytest.raises(OpError, match=r"pack_documents.*sample.*'tokens'.*integer"):
        list(Pipeline(src, shuffle=False).pack_documents(4, algorithm="greedy"))


def test_an_empty_list_is_an_empty_document():
    src = sources.from_sequence([{"tokens": []}, {"tokens": np.arange(3) + 1}])
    rows = list(Pipeline(src, shuffle=False).pack_documents(4, algorithm="best_fit"))
    assert [r["tokens"].tolist() for r in rows] == [[1, 2, 3, 0]]


def test_a_non_numeric_aligned_field_is_an_op_error():
    src = sources.from_sequence([{"tokens": np.arange(3), "loss_mask": np.array(["a"] * 3)}])
    with pytest.raises(OpError, match=r"'loss_mask'.*numbers"):
        list(Pipeline(src, shuffle=False).pack_documents(4, aligned=("loss_mask",)))


def test_a_pad_id_the_token_dtype_cannot_hold_is_an_op_error_naming_both():
    pipe = Pipeline(docs(3, dtype=np.uint16), shuffle=False).pack_documents(4, pad_id=70000)
    with pytest.raises(OpError, match=r"pad_id 70000.*uint16"):
        list(pipe)
    full = Pipeline(docs(4, dtype=np.uint16), shuffle=False).pack_documents(4, pad_id=70000)
    assert len(list(full)) == 1  # a row without padding needs no pad_id
