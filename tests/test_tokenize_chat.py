"""tokenize_chat: templates, tokens of the rendered conversation, assistant-only masks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

import _tokenize_fns as T  # noqa: E402
from zephon import OpError, Pipeline, RuntimeOptions, ZephonConfigError, sources  # noqa: E402
from zephon.pipeline.text.chat import CHATML  # noqa: E402

CHAT = {"messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "the fox"},
                     {"role": "assistant", "content": "jumps over"},
                     {"role": "user", "content": "why"},
                     {"role": "assistant", "content": "nobody asks"}]}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return T.train_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return tokenizers.Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))


def one(tokenizer, sample=CHAT, **kw):
    return next(iter(Pipeline(sources.from_sequence([sample])).tokenize_chat(tokenizer, **kw)))


def masked_text(tok, row) -> list[str]:
    """The decoded runs of tokens with mask 1."""
    runs, cur = [], []
    for t, m in zip(row["tokens"].tolist(), row["loss_mask"].tolist(), strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def test_chatml_mask_covers_the_assistant_turns_exactly(tok):
    row = one(tok)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                   for m in CHAT["messages"])
    assert row["tokens"].tolist() == tok.encode(text, add_special_tokens=False).ids
    assert row["loss_mask"].dtype == np.uint8 and row["tokens"].dtype == np.uint16
    assert masked_text(tok, row) == ["jumps over<|im_end|>\n", "nobody asks<|im_end|>\n"]
    # hand check of the first turns: nothing before the first assistant content is masked
    ids = row["tokens"].tolist()
    first = ids.index(tok.token_to_id("<|im_start|>"),
                      [i for i, t in enumerate(ids) if t == tok.token_to_id("<|im_start|>")][2])
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
    assert ids[first:first + len(header)] == header
    assert row["loss_mask"][:first + len(header)].sum() == 0
    assert row["loss_mask"][first + len(header)] == 1


def test_a_jinja_template_gives_what_the_builtin_gives(tok):
    builtin = one(tok)
    jinja = one(tok, template=CHATML)
    assert jinja["tokens"].tolist() == builtin["tokens"].tolist()
    assert jinja["loss_mask"].tolist() == builtin["loss_mask"].tolist()


def test_the_tokenizers_own_template_is_used_and_sees_its_special_tokens(tok_dir, tmp_path):
    d = T.train_tokenizer(str(tmp_path / "t"))
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}"
                "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
                "{% endfor %}")  # (trim_blocks eats a newline right after a block tag)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}, f)
    tok = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    row = one(d)
    text = "<s>" + "".join(f"[{m['role']}]: {m['content']}" +
                           ("</s>" if m["role"] == "assistant" else "") + "\n"
                           for m in CHAT["messages"])
    assert row["tokens"].tolist() == tok.encode(text, add_special_tokens=False).ids
    # byte-level BPE joins the space before a turn to its first word: " ju" is the
    # assistant's (it has characters of the content)
    assert masked_text(tok, row) == [" jumps over</s>\n", " nobody asks</s>\n"]
    fast = T.LockedFastTokenizer(d, chat_template=template)  # a transformers-shaped one
    assert one(fast)["loss_mask"].tolist() == row["loss_mask"].tolist()


def test_bos_eos_and_truncation_keep_tokens_and_mask_aligned(tok_dir, tok):
    full = one(tok_dir)
    row = one(tok_dir, add_bos=True, add_eos=True)
    assert row["tokens"].tolist() == [tok.token_to_id("<s>")] + full["tokens"].tolist() + \
        [tok.token_to_id("</s>")]
    assert row["loss_mask"].tolist() == [0] + full["loss_mask"].tolist() + [0]
    cut = one(tok_dir, add_bos=True, add_eos=True, max_length=30)
    assert cut["tokens"].tolist() == [tok.token_to_id("<s>")] + \
        full["tokens"].tolist()[:28] + [tok.token_to_id("</s>")]
    assert cut["loss_mask"].tolist() == [0] + full["loss_mask"].tolist()[:28] + [0]


def test_templates_that_hide_the_assistant_are_refused(tok, tmp_path):
    not_prefix_stable = "{% for m in messages|reverse %}{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(OpError, match="not prefix-stable"):
        one(tok, template=not_prefix_stable)
    changes_content = "{% for m in messages %}{{ m['content']|upper }}\n{% endfor %}"
    with pytest.raises(OpError, match="changes the content of message 2"):
        one(tok, template=changes_content)
    with pytest.raises(ZephonConfigError, match="does not compile"):
        one(tok, template="{% for m in messages %}")
    named = T.LockedFastTokenizer(T.train_tokenizer(str(tmp_path / "t")),
                                  chat_template={"default": CHATML})  # several, by name
    with pytest.raises(ZephonConfigError, match="pass template="):
        one(named)
    assert one(named, template="chatml")["tokens"].tolist() == one(tok)["tokens"].tolist()


def test_bad_messages_name_the_sample(tok):
    with pytest.raises(OpError, match="no list of messages"):
        one(tok, sample={"text": "x"})
    with pytest.raises(OpError, match="message 0 is not a dict"):
        one(tok, sample={"messages": [{"role": "user", "content": ["parts"]}]})


@pytest.mark.parametrize("runner", ["threads", "process"])
def test_chat_rows_are_the_same_on_every_runner(tok_dir, runner):
    def chat(i):
        return {"messages": [{"role": "user", "content": T.corpus(1, seed=i)[0]},
                             {"role": "assistant", "content": T.corpus(1, seed=i + 500)[0]}]}

    samples = [chat(i) for i in range(30)]
    base = Pipeline(sources.from_sequence(samples), seed=5, chunk_size=4) \
        .tokenize_chat(tok_dir, parallelism=2, add_eos=True)
    reference = [(s["tokens"].tolist(), s["loss_mask"].tolist())
                 for s in base.options(RuntimeOptions(runner="inline"))]
    got = [(s["tokens"].tolist(), s["loss_mask"].tolist())
           for s in base.options(RuntimeOptions(runner=runner, max_workers=2))]
    assert got == reference and len(got) == 30
    assert all(0 < sum(m) < len(m) for _, m in got)
