"""The language-model features attacked as a demanding user would: each test pins a
defect found that way (it failed before its fix) or a promise that held under attack.

Tokenizers are trained here (``_tokenize_fns.train_tokenizer`` and a word-level one):
nothing is downloaded.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

import _tokenize_fns as T  # noqa: E402

from zephon import OpError, Pipeline, sources  # noqa: E402
from zephon.pipeline.text.chat import CHATML  # noqa: E402
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


# -- tokenize_chat ------------------------------------------------------------------------

def chat_row(tok, messages, template):
    src = sources.from_sequence([{"messages": messages}])
    (row,) = Pipeline(src, shuffle=False).tokenize_chat(tok, template=template)
    return row


def learned(tok, row) -> str:
    """The text of the masked tokens."""
    ids = [int(t) for t, m in zip(row["tokens"], row["loss_mask"], strict=True) if m]
    return tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("reply", ["a", "s", "assistant", "\n", "user", "im_start", "t"])
def test_a_jinja_mask_starts_at_the_content_even_when_the_header_contains_it(tok, reply):
    # the content was searched for in the message's segment: "a" was found in
    # "<|im_start|>" and the whole header was learned
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": reply},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": ""},
                {"role": "user", "content": "once more"},
                {"role": "assistant", "content": reply}]
    builtin, jinja = chat_row(tok, messages, "chatml"), chat_row(tok, messages, CHATML)
    assert jinja["tokens"].tolist() == builtin["tokens"].tolist()
    assert jinja["loss_mask"].tolist() == builtin["loss_mask"].tolist()
    assert learned(tok, jinja) == f"{reply}<|im_end|>\n" * 2


def test_a_template_whose_own_text_repeats_the_reply_masks_the_reply(tok):
    template = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
                " [/INST]{% else %}<assistant> {{ m['content'] }}</s>{% endif %}"
                "{% endfor %}")
    messages = [{"role": "user", "content": "say assist"},
                {"role": "assistant", "content": "assist"}]
    row = chat_row(tok, messages, template)
    assert learned(tok, row).strip() == "assist</s>"


#: Qwen2.5's chat template, shortened (no tools): it reads messages[0] unguarded, so it
#: cannot render an empty conversation
QWEN_LIKE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role != "system" or not loop.first %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def test_a_template_that_cannot_render_no_messages_still_works(tok):
    # every prefix was rendered from messages[:0], which this template cannot render
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello there"}]
    row = chat_row(tok, messages, QWEN_LIKE)
    text = tok.decode(row["tokens"].tolist(), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert learned(tok, row) == "hello there<|im_end|>\n"


def test_pack_documents_after_batch_is_refused_not_one_merged_document():
    # a batch's [B, n] tokens were flattened into one document: B documents attending
    # to each other
    src = sources.from_sequence([{"tokens": np.arange(3) + 10 * i} for i in range(4)])
    with pytest.raises(OpError, match=r"a batch of 2 samples.*before batch"):
        list(Pipeline(src, shuffle=False).batch(2).pack_documents(8, algorithm="best_fit"))


def test_packing_packed_rows_again_is_refused_not_their_padding_taken_for_tokens():
    src = docs(3, 2)
    with pytest.raises(OpError, match=r"already packed"):
        list(Pipeline(src, shuffle=False).pack_documents(8).pack_documents(8))


def test_a_token_array_of_several_rows_is_refused_and_one_row_is_read_as_it():
    two = sources.from_sequence([{"tokens": np.arange(6).reshape(2, 3)}])
    with pytest.raises(OpError, match=r"shape \(2, 3\).*1-D"):
        list(Pipeline(two, shuffle=False).pack_documents(8))
    one = sources.from_sequence([{"tokens": np.arange(3).reshape(1, 3) + 1}])
    (row,) = Pipeline(one, shuffle=False).pack_documents(4)
    assert row["tokens"].tolist() == [1, 2, 3, 0]


# -- elastic resume -----------------------------------------------------------------------

LENGTHS = [(5 * i) % 11 for i in range(23)]


def length_doc(i: int) -> dict:
    return {"tokens": np.arange(LENGTHS[i]) + 100 * i}


def lane_rows(world=1, rank=0, state=None) -> dict:
    from zephon import RuntimeOptions

    pipe = (Pipeline(sources.from_callable(len(LENGTHS), length_doc), seed=1, chunk_size=2,
                     num_epochs=3)
            .pack_documents(6, algorithm="best_fit", open_bins=1).batch(2)
            .options(RuntimeOptions(canonical_replicas=4, flush_every_k_chunks=1,
                                    world_size=world, global_rank=rank)))
    if state is not None:
        pipe.restore(state)
    out: dict = {}
    for b in pipe:
        out.setdefault(b.meta["lane"], []).append(b["tokens"].tolist())
    return out


def test_a_rank_whose_lanes_had_finished_delivers_nothing_more_of_the_pass():
    from zephon import RuntimeOptions

    full = lane_rows()

    pipe = (Pipeline(sources.from_callable(len(LENGTHS), length_doc), seed=1, chunk_size=2,
                     num_epochs=3)
            .pack_documents(6, algorithm="best_fit", open_bins=1).batch(2)
            .options(RuntimeOptions(canonical_replicas=4, flush_every_k_chunks=1)))
    delivered: dict = {lane: 0 for lane in full}
    it = iter(pipe)
    while any(delivered[lane] < len(full[lane]) for lane in (2, 3)):  # lanes 2, 3 finish
        delivered[next(it).meta["lane"]] += 1
    state = pipe.checkpoint()
    pipe.close()
    assert delivered[1] < len(full[1])  # lane 1 (rank 0 on two ranks) has more
    rest = {}
    for rank in range(2):
        rest.update(lane_rows(2, rank, state))
    expected = {lane: rows[delivered[lane]:] for lane, rows in full.items()
                if rows[delivered[lane]:]}
    assert rest == expected


# -- the whole chain, as a chat fine-tune reads it ----------------------------------------

def chat_sample(i: int) -> dict:
    words = T.corpus(3, seed=i)
    return {"messages": [{"role": "system", "content": "answer"},
                         {"role": "user", "content": " ".join(words[0].split()[:4])},
                         {"role": "assistant", "content": words[1]},
                         {"role": "user", "content": "more"},
                         {"role": "assistant", "content": words[2] if i % 3 else ""}]}


def test_chat_rows_through_the_loader_learn_exactly_the_kept_assistant_tokens(tok_dir, tok):
    torch = pytest.importorskip("torch")
    import zephon.torch as zt

    pipe = (Pipeline(sources.from_callable(12, chat_sample), shuffle=False, chunk_size=4)
            .tokenize_chat(tok_dir, add_eos=True, max_length=90)
            .pack_documents(64, algorithm="greedy", aligned=("loss_mask",)).batch(3))
    expected = []  # (row, slot) -> label, from the packed rows themselves
    for b in pipe:
        for tokens, mask, cu in zip(b["tokens"], b["loss_mask"], b["cu_seqlens"],
                                    strict=True):
            offs = cu[cu >= 0].tolist()
            labels = [IGNORE_INDEX] * tokens.size
            for a, e in itertools.pairwise(offs):
                for t in range(a, e - 1):
                    if mask[t + 1]:
                        labels[t] = int(tokens[t + 1])
            expected.append(labels)
    assert b["tokens"].dtype == np.uint16  # what tokenize gives by default
    got = [row for out in zt.loader(pipe, to_training=True) for row in out["labels"].tolist()]
    assert got == expected
    assert sum(v != IGNORE_INDEX for row in got for v in row) > 100
    assert torch.tensor(got).min().item() == IGNORE_INDEX  # never a wrapped 65436


@pytest.mark.parametrize("algorithm", ["greedy", "first_fit", "best_fit"])
@pytest.mark.parametrize("seq_len", [2, 3, 5])
def test_edge_lengths_give_varlen_offsets_and_labels_within_documents(algorithm, seq_len):
    # held: documents of 0, 1, seq_len, seq_len + 1 and 2 * seq_len + 1 tokens, one open
    # bin, a pad_id that is also a real token
    lengths = [seq_len, seq_len + 1, 1, 2 * seq_len, 0, seq_len - 1, 2 * seq_len + 1, 1]
    pipe = Pipeline(docs(*lengths, base=5), shuffle=False).pack_documents(
        seq_len, algorithm=algorithm, open_bins=1, pad_id=5).batch(len(lengths) * 3)
    (batch,) = pipe
    out = to_training(batch)
    rows = batch["tokens"].shape[0]
    cu = out["cu_seqlens"]
    assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == rows * seq_len
    assert (np.diff(cu) > 0).all() and out["max_seqlen"] == int(np.diff(cu).max())
    for r in range(rows):
        offs = batch["cu_seqlens"][r][batch["cu_seqlens"][r] >= 0].tolist()
        want = [IGNORE_INDEX] * seq_len
        for a, e in itertools.pairwise(offs):
            want[a:e - 1] = batch["tokens"][r][a + 1:e].tolist()
        assert out["labels"][r].tolist() == want
        assert out["attention_mask"][r].tolist() == [int(t < offs[-1]) for t in range(seq_len)]
    assert out["num_valid_tokens"] == int((out["labels"] != IGNORE_INDEX).sum())
