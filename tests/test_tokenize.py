"""tokenize: equal to the tokenizer called sample by sample, on every runner.

The tokenizer is a tiny byte-level BPE trained here (``_tokenize_fns.train_tokenizer``,
seconds): nothing is downloaded.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

import _tokenize_fns as T  # noqa: E402
from _resume import END, assert_resumes_at, passes  # noqa: E402

from zephon import OpError, Pipeline, RuntimeOptions, ZephonConfigError, sources  # noqa: E402
from zephon.pipeline.text import tokenizer as tokenizer_mod  # noqa: E402

N = 120


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return T.train_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return tokenizers.Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))


def direct(tok, i, bos=None, eos=None, limit=None, special=False):
    """Sample ``i`` through the tokenizer alone, as a user would call it."""
    ids = tok.encode(T.text_sample(i)["text"], add_special_tokens=special).ids
    if limit is not None:
        ids = ids[:limit]
    return ([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])


def by_id(pipe):
    return {s["id"]: s["tokens"] for s in pipe}


@pytest.mark.parametrize("runner,workers", [("inline", 1), ("threads", 2), ("process", 2)])
def test_equal_to_direct_calls_on_every_runner(tok_dir, tok, runner, workers):
    pipe = Pipeline(sources.from_callable(N, T.text_sample), seed=4, chunk_size=8) \
        .map(T.upper).tokenize(tok_dir, add_bos=True, add_eos=True, keep_fields=True,
                               parallelism=workers) \
        .options(RuntimeOptions(runner=runner, max_workers=workers))
    out = list(pipe)
    assert sorted(s["id"] for s in out) == list(range(N))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    for s in out:
        expected = tok.encode(T.text_sample(s["id"])["text"].upper(),
                              add_special_tokens=False).ids
        assert s["tokens"].dtype == np.uint16
        assert s["tokens"].tolist() == [bos] + expected + [eos]
        assert s["text"] == T.text_sample(s["id"])["text"].upper()  # keep_fields
    inline = pipe.options(RuntimeOptions(runner="inline"))
    assert [s["id"] for s in out] == [s["id"] for s in inline]


def test_a_part_is_encoded_in_slices_of_encode_slice_texts(tok_dir, tok):
    """The stage program hands the op a whole part; it is encoded in order, in calls of
    ENCODE_SLICE texts (a whole part of a process worker in one call outgrew the CPU
    cache), each text once."""
    from zephon.pipeline.lanes import ReadUnit
    from zephon.pipeline.program import StageProgram
    from zephon.pipeline.text.tokenize import ENCODE_SLICE, TokenizeOp

    assert ENCODE_SLICE == 32

    op = TokenizeOp(tok_dir)
    real = op.tokenizer.get()
    calls = []

    class Counting:
        def encode_batch_fast(self, texts, **kw):
            calls.append(len(texts))
            return real.encode_batch_fast(texts, **kw)

    tokenizer_mod._LOADED[op.tokenizer.identity] = Counting()
    try:
        program = StageProgram(sources.from_callable(N, T.text_sample), [[op]], seed=0)
        out = program((0, ReadUnit(0, 0, np.arange(70, dtype=np.int64))))
    finally:
        tokenizer_mod._LOADED[op.tokenizer.identity] = real
    assert calls == [32, 32, 6]
    assert [r.value["tokens"].tolist() for r in out] == [direct(tok, i) for i in range(70)]


def test_truncation_keeps_bos_and_eos_within_max_length(tok_dir, tok):
    src = sources.from_callable(N, T.text_sample)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    cut = list(Pipeline(src, shuffle=False).tokenize(tok_dir, add_bos=True, add_eos=True,
                                                     max_length=16))
    whole = list(Pipeline(src, shuffle=False).tokenize(tok_dir, add_bos=True, add_eos=True,
                                                       max_length=16, overflow="keep"))
    assert max(len(s["tokens"]) for s in whole) > 16  # some documents are longer
    for i, (c, w) in enumerate(zip(cut, whole, strict=True)):
        assert c["tokens"].tolist() == direct(tok, i, bos, eos, limit=14)
        assert w["tokens"].tolist() == direct(tok, i, bos, eos)
        assert len(c["tokens"]) <= 16


def test_special_tokens_given_declared_or_refused(tok_dir, tok):
    src = sources.from_sequence([{"text": "the fox"}])
    declared = next(iter(Pipeline(src).tokenize(tok_dir, add_bos=True, add_eos=True)))
    given = next(iter(Pipeline(src).tokenize(tok, add_bos=True, bos="<|im_start|>",
                                             add_eos=True, eos=tok.token_to_id("<unk>"))))
    ids = tok.encode("the fox").ids
    assert declared["tokens"].tolist() == [tok.token_to_id("<s>")] + ids + \
        [tok.token_to_id("</s>")]
    assert given["tokens"].tolist() == [tok.token_to_id("<|im_start|>")] + ids + \
        [tok.token_to_id("<unk>")]
    # a bare tokenizers.Tokenizer declares no BOS/EOS: asking for one needs an id
    with pytest.raises(ZephonConfigError, match="declares no EOS"):
        Pipeline(src).tokenize(tok, add_eos=True)
    with pytest.raises(ZephonConfigError, match="not in the tokenizer's vocabulary"):
        Pipeline(src).tokenize(tok, add_eos=True, eos="<nope>")
    with pytest.raises(ZephonConfigError, match="outside the vocabulary"):
        Pipeline(src).tokenize(tok, add_bos=True, bos=10**6)
    with pytest.raises(ZephonConfigError, match="max_length"):
        Pipeline(src).tokenize(tok_dir, add_bos=True, add_eos=True, max_length=2)


def test_the_tokenizers_own_special_tokens_are_added_when_asked(tmp_path):
    from tokenizers import processors

    d = T.train_tokenizer(str(tmp_path / "t"), config=False)
    tok = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    src = sources.from_callable(10, T.text_sample)
    out = list(Pipeline(src, shuffle=False).tokenize(tok, add_special_tokens=True))
    assert [s["tokens"].tolist() for s in out] == \
        [direct(tok, i, special=True) for i in range(10)]
    assert all(s["tokens"][0] == 1 and s["tokens"][-1] == 2 for s in out)


def test_dtype_fits_the_vocabulary():
    big = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    big.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    src = sources.from_sequence([{"text": "w1 w69999"}])
    assert next(iter(Pipeline(src).tokenize(big)))["tokens"].dtype == np.int32
    assert next(iter(Pipeline(src).tokenize(big, dtype="int64")))["tokens"].tolist() == \
        [1, 69999]
    with pytest.raises(ZephonConfigError, match="cannot hold"):
        Pipeline(src).tokenize(big, dtype=np.uint16)
    with pytest.raises(ZephonConfigError, match="integer dtype"):
        Pipeline(src).tokenize(big, dtype=np.float32)


@pytest.mark.parametrize("name", ["gpt2", "meta-llama/Llama-3.1-8B", "hf://org/tok",
                                  "https://example.com/tokenizer.json"])
def test_a_hub_name_is_refused_never_downloaded(name):
    with pytest.raises(ZephonConfigError, match="never downloads"):
        Pipeline(sources.from_sequence([{"text": "x"}])).tokenize(name)


def test_a_directory_without_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(ZephonConfigError, match="no tokenizer.json"):
        Pipeline(sources.from_sequence([{"text": "x"}])).tokenize(str(tmp_path))


def test_an_unpicklable_tokenizer_travels_as_its_json(tok_dir, tok):
    fast = T.LockedFastTokenizer(tok_dir)
    with pytest.raises(TypeError):
        pickle.dumps(fast)
    pipe = Pipeline(sources.from_callable(40, T.text_sample), seed=1, chunk_size=4) \
        .tokenize(fast, add_bos=True, add_eos=True, parallelism=2) \
        .options(RuntimeOptions(runner="process", max_workers=2))
    bos, eos = fast.bos_token_id, fast.eos_token_id
    assert {i: t.tolist() for i, t in by_id(_with_ids(pipe)).items()} == \
        {i: direct(tok, i, bos, eos) for i in range(40)}


def _with_ids(pipe):
    """tokenize drops the other fields: pair outputs with their sample ids."""
    return [{"id": s.meta["sample_ids"][0][1], "tokens": s["tokens"][0]}
            for s in pipe.batch(1)]


def test_fingerprint_is_the_tokenizers_json_not_its_object(tok_dir, tok, tmp_path):
    src = sources.from_sequence([{"text": "x"}])
    by_path = Pipeline(src).tokenize(tok_dir).fingerprint()
    by_file = Pipeline(src).tokenize(os.path.join(tok_dir, "tokenizer.json")).fingerprint()
    by_instance = Pipeline(src).tokenize(tok).fingerprint()
    by_copy = Pipeline(src).tokenize(tokenizers.Tokenizer.from_str(tok.to_str())).fingerprint()
    assert by_path == by_file == by_instance == by_copy
    other = T.train_tokenizer(str(tmp_path / "other"), vocab_size=280)
    assert Pipeline(src).tokenize(other).fingerprint() != by_path
    assert Pipeline(src).tokenize(tok_dir, max_length=9).fingerprint() != by_path
    assert "0x" not in Pipeline(src).tokenize(tok).ops[-1].describe()


def test_a_changed_tokenizer_file_is_refused_in_a_new_process(tok_dir, tmp_path):
    d = T.train_tokenizer(str(tmp_path / "t"))
    op = Pipeline(sources.from_sequence([{"text": "x"}])).tokenize(d).ops[-1]
    blob = pickle.dumps(op)
    T.train_tokenizer(d, vocab_size=280)  # the file changes under the pipeline
    code = ("import pickle, sys; op = pickle.loads(sys.stdin.buffer.read()); "
            "op.tokenizer.get()")
    done = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode != 0 and b"changed since the pipeline was built" in done.stderr


def test_a_bad_sample_fails_first_in_sample_order_after_the_samples_before_it(tok_dir):
    """Sample 3 has no text (tokenize fails on it); a map after it fails on sample 7: the
    error is tokenize's, on sample 3, after samples 0-2."""
    pipe = Pipeline(sources.from_callable(20, T.text_or_missing), shuffle=False,
                    chunk_size=20).map(T.fail_on_seven).tokenize(tok_dir, keep_fields=True)
    got = []
    with pytest.raises(OpError, match=r"op tokenize failed on sample .*3.*no text field"):
        for s in pipe:
            got.append(s["id"])
    assert got == [0, 1, 2]
    later = Pipeline(sources.from_callable(20, T.text_sample), shuffle=False, chunk_size=20) \
        .tokenize(tok_dir, keep_fields=True).map(T.fail_on_seven)
    got = []
    with pytest.raises(OpError, match="seven"):
        for s in later:
            got.append(s["id"])
    assert got == list(range(7))


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_a_bad_sample_past_the_first_slice_fails_after_every_sample_before_it(
        tok_dir, tok, runner):
    """Sample 40 has no text: the 40 samples before it (a whole encode slice and part of
    the next) come out tokenized, then its error."""
    pipe = Pipeline(sources.from_callable(70, T.text_or_missing_at_40), shuffle=False,
                    chunk_size=70).tokenize(tok_dir, keep_fields=True, parallelism=2) \
        .options(RuntimeOptions(runner=runner, max_workers=2))
    got = []
    with pytest.raises(OpError, match=r"op tokenize failed on sample .*40.*no text field"):
        for s in pipe:
            got.append((s["id"], s["tokens"].tolist()))
    assert got == [(i, direct(tok, i)) for i in range(40)]


@pytest.mark.parametrize("runner", ["process", "threads"])
def test_restore_mid_epoch_is_exact(tok_dir, runner):
    base = Pipeline(sources.from_callable(N, T.text_sample), seed=2, chunk_size=6) \
        .tokenize(tok_dir, add_eos=True, parallelism=2).pack_tokens(64).batch(4)
    rows = lambda b: [np.asarray(r).tolist() for r in b["tokens"]]  # noqa: E731
    inline = lambda: base.options(RuntimeOptions(runner="inline"))  # noqa: E731
    reference, following = passes(inline, 2, rows)
    assert len(reference) > 10
    assert_resumes_at(lambda: base.options(RuntimeOptions(runner=runner, max_workers=2)),
                      (len(reference) // 2, END), again=inline, key=rows,
                      reference=reference, following=following)


def test_without_tokenizers_the_error_names_the_extra():
    code = ("import sys; sys.modules['tokenizers'] = None\n"
            "from zephon import Pipeline, sources\n"
            "Pipeline(sources.from_sequence(['x'])).tokenize('tok.json')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode != 0
    assert b'ImportError' in done.stderr and b'.[text]' in done.stderr


def test_process_workers_size_the_tokenizers_thread_pool_like_the_others(tok_dir):
    """worker_compute_threads limits the tokenizers' Rust pool (RAYON_NUM_THREADS) in a
    process worker: N workers x the machine's cores would oversubscribe it."""
    pipe = Pipeline(sources.from_callable(8, T.text_sample), chunk_size=4) \
        .tokenize(tok_dir, keep_fields=True, parallelism=2).map(T.rayon_threads) \
        .options(RuntimeOptions(runner="process", max_workers=2, worker_compute_threads=1))
    assert {s["rayon"] for s in pipe} == {"1"}
