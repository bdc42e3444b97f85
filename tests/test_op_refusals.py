"""Ops that lost data or misnamed a problem silently (issue 40, findings 9, 11, 12).

- A packer after ``tokenize_chat`` carries its token-aligned ``loss_mask`` (the plan
  knows the chat op made it aligned with the tokens), and one that cannot know whether a
  ``map`` in between kept it is refused at construction, naming the field and the fix.
- A map that draws from a global RNG (numpy's, random's, torch's) fails validation with a
  message that names the op, the cause, how to draw from ``ctx.rng`` and the
  ``auto_validation`` option.
- A map returning an object array is not called "not deterministic"; a map (or
  map_batch) returning None is an error naming the op and the fix, on every runner.
"""

from __future__ import annotations

import _pipeline_fns as F
import numpy as np
import pytest
from _resume import END, assert_resumes_at, passes

from zephon import OpError, Pipeline, RuntimeOptions, ValidationError, ZephonConfigError, sources
from zephon.pipeline.training import to_training

# -- finding 9: a packer never drops the chat op's loss mask silently -----------------------

CHATS = [{"messages": [{"role": "user", "content": f"question {i} " * (1 + i % 3)},
                       {"role": "assistant", "content": f"answer {i} " * (2 + i % 4)}]}
         for i in range(12)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    import _tokenize_fns as T

    return T.train_tokenizer(str(tmp_path_factory.mktemp("tok")))


def chat_pipe(tok_dir, **opts):
    src = sources.from_sequence(CHATS)
    return Pipeline(src, shuffle=False, chunk_size=3, **opts).tokenize_chat(tok_dir)


def concatenated(tok_dir):
    """The chat op's tokens and masks of the whole epoch, concatenated in order."""
    docs = list(chat_pipe(tok_dir))
    return (np.concatenate([d["tokens"] for d in docs]),
            np.concatenate([d["loss_mask"] for d in docs]))


def test_pack_tokens_after_tokenize_chat_carries_the_loss_mask(tok_dir):
    tokens, mask = concatenated(tok_dir)
    rows = list(chat_pipe(tok_dir).pack_tokens(16))
    assert all(set(r) == {"tokens", "loss_mask"} for r in rows)
    assert np.concatenate([r["tokens"] for r in rows]).tolist() == tokens.tolist()
    assert np.concatenate([r["loss_mask"] for r in rows]).tolist() == mask.tolist()
    assert mask.any() and not mask.all()  # prompts 0, answers 1: something to lose
    batches = list(chat_pipe(tok_dir).pack_tokens(16).batch(2, drop_last=True))
    assert all(b["loss_mask"].shape == b["tokens"].shape == (2, 16) for b in batches)
    # the SFT step trains on the assistant's tokens only: a target with mask 0 is ignored
    for b in batches:
        t = to_training(b)
        assert t["num_valid_tokens"] == int(b["loss_mask"][:, 1:].sum())


def test_pack_documents_after_tokenize_chat_carries_the_loss_mask_by_default(tok_dir):
    tokens, mask = concatenated(tok_dir)
    rows = list(chat_pipe(tok_dir).pack_documents(16))
    assert all("loss_mask" in r for r in rows)
    used = [int(r["cu_seqlens"].max()) for r in rows]
    for name, want in (("tokens", tokens), ("loss_mask", mask)):
        got = np.concatenate([r[name][:n] for r, n in zip(rows, used, strict=True)])
        assert got.tolist() == want.tolist(), name
    assert "aligned=['loss_mask']" in chat_pipe(tok_dir).pack_documents(16).ops[-1].describe()


def test_transparent_ops_between_keep_the_mask_carried(tok_dir):
    pipe = chat_pipe(tok_dir).filter(F.keep_all).shuffle(4).pack_tokens(16)
    assert all("loss_mask" in r for r in pipe)
    # a map before the chat op does not matter: the chat op makes the tokens and the mask
    src = sources.from_sequence(CHATS)
    before = Pipeline(src, shuffle=False).map(F.identity).tokenize_chat(tok_dir)
    assert all("loss_mask" in r for r in before.pack_documents(16, algorithm="best_fit"))


def test_a_map_between_chat_and_packer_is_refused_naming_the_field_and_the_fix(tok_dir):
    mapped = chat_pipe(tok_dir).map(F.identity)
    for pack in (lambda p: p.pack_tokens(16), lambda p: p.pack_documents(16)):
        with pytest.raises(ZephonConfigError) as info:
            pack(mapped)
        text = str(info.value)
        assert "'loss_mask'" in text and "tokenize_chat" in text and "map(identity)" in text
        assert "aligned=('loss_mask',)" in text and "aligned=()" in text
    # either way out works
    kept = list(mapped.pack_tokens(16, aligned=("loss_mask",)))
    assert all(set(r) == {"tokens", "loss_mask"} for r in kept)
    dropped = list(mapped.pack_documents(16, aligned=()))
    assert all("loss_mask" not in r for r in dropped)


def test_pack_tokens_aligned_survives_a_restore_at_every_item(tok_dir):
    def make():
        return chat_pipe(tok_dir).pack_tokens(8).options(
            RuntimeOptions(flush_every_k_chunks=1))

    def row(r) -> tuple:
        return r["tokens"].tolist(), r["loss_mask"].tolist()

    reference, following = passes(make, 2, row)
    assert_resumes_at(make, [*range(0, len(reference), 3), END], key=row,
                      reference=reference, following=following)


def test_pack_tokens_refuses_an_aligned_field_of_another_length():
    src = sources.from_sequence([{"tokens": np.arange(5), "loss_mask": np.ones(4, np.uint8)}])
    with pytest.raises(OpError, match=r"pack_tokens.*sample.*'loss_mask'.*4 value.*5 token"):
        list(Pipeline(src).pack_tokens(3, aligned=("loss_mask",)))


def test_a_plain_source_packs_as_before():
    src = sources.from_sequence([{"tokens": np.arange(5), "loss_mask": np.ones(5, np.uint8)}])
    rows = list(Pipeline(src, shuffle=False).pack_tokens(4))
    assert [set(r) for r in rows] == [{"tokens"}, {"tokens"}]  # nothing declared: unchanged


# -- finding 11: a global RNG in a map: a message that says what to do ----------------------


#: a draw from a global RNG is refused only where they are not seeded per call (the default,
#: "auto", seeds them: tests/test_global_rngs.py)
UNSEEDED = RuntimeOptions(seed_global_rngs="off")


def z002_message(fn) -> str:
    src = sources.from_callable(4, F.make_sample)
    with pytest.raises(ValidationError) as info:
        iter(Pipeline(src).map(fn).options(UNSEEDED))
    (issue,) = [i for i in info.value.issues if i.code == "Z002"]
    return str(issue)


def check_ways_out(text: str) -> None:
    assert "seed_global_rngs='auto'" in text
    assert "ctx.rng" in text and "auto_validation" in text
    assert "torch.Generator().manual_seed(int(ctx.rng.integers(2**63)))" in text
    assert "random.Random(int(ctx.rng.integers(2**63)))" in text
    assert "auto_validation='off'" in text or 'auto_validation="off"' in text


def test_numpy_global_rng_in_a_map_is_named_with_the_ways_out():
    text = z002_message(F.np_global_noise)
    assert "map(np_global_noise)" in text and "changed between two runs" in text
    assert "numpy's global RNG (np.random)" in text
    check_ways_out(text)


def test_nan_scalars_in_an_output_are_deterministic():
    # float('nan') != float('nan'): a pure op returning a missing value was refused as
    # "not deterministic" (and a NaN in the input as "mutates its input").
    src = sources.from_callable(4, F.make_sample)
    out = list(Pipeline(src, shuffle=False).map(F.nan_feature))
    assert len(out) == 4 and all(np.isnan(o["score"]) for o in out)
    rows = [{"x": 1, "score": float("nan")}, {"x": 2, "score": 0.5}]
    assert len(list(Pipeline(sources.from_sequence(rows), shuffle=False)
                    .map(F.nan_feature))) == 2


def test_a_global_rng_draw_is_refused_even_when_both_probes_agree():
    # A draw that happens to give the same output twice (p=0.5 in a real filter) still
    # changes the stream from one run to the next.
    src = sources.from_callable(4, F.make_sample)
    with pytest.raises(ValidationError) as info:
        iter(Pipeline(src).filter(F.coin_filter).options(UNSEEDED))
    (issue,) = [i for i in info.value.issues if i.code == "Z002"]
    text = str(issue)
    assert "the random module's global RNG" in text and "happened to match" in text
    check_ways_out(text)


def test_random_module_rng_in_a_map_is_named_with_the_ways_out():
    text = z002_message(F.random_global_noise)
    assert "map(random_global_noise)" in text and "the random module's global RNG" in text
    check_ways_out(text)


def test_torch_global_rng_in_a_map_is_named_with_the_ways_out():
    pytest.importorskip("torch")
    text = z002_message(F.torch_global_noise)
    assert "map(torch_global_noise)" in text and "torch's global RNG" in text
    check_ways_out(text)


# -- finding 12: what a map returns ----------------------------------------------------------


def test_a_map_returning_an_object_array_is_not_called_nondeterministic():
    src = sources.from_callable(4, F.make_sample)
    got = list(Pipeline(src, shuffle=False).map(F.object_array).batch(2))
    assert [b["obj"][:, 1].tolist() for b in got] == [[{"id": 0}, {"id": 1}],
                                                      [{"id": 2}, {"id": 3}]]
    # an object array that really changes is still caught (np.random left unseeded)
    with pytest.raises(ValidationError, match="Z002"):
        iter(Pipeline(src).map(F.object_array_random).options(UNSEEDED))


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_a_map_returning_none_is_an_error_naming_the_op_and_the_fix(runner):
    src = sources.from_callable(6, F.make_sample)
    opts = RuntimeOptions(runner=runner, max_workers=2)
    pipe = Pipeline(src, shuffle=False).map(F.none_at_3).batch(2).options(opts)
    with pytest.raises(OpError) as info:
        list(pipe)
    text = str(info.value)
    assert "map(none_at_3)" in text and "returned None" in text and ".filter(" in text
    assert info.value.sample_id == ("callable", 3, 0)


def test_a_map_batch_returning_none_is_an_error_naming_the_op():
    src = sources.from_callable(4, F.make_sample)
    with pytest.raises(OpError, match=r"map_batch\(return_none\).*returned None"):
        list(Pipeline(src, shuffle=False).batch(2).map_batch(F.return_none))

