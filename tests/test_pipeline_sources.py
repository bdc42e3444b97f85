"""Sources: identities, reading, errors naming the file and line, mixture schedules."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from zephon import MixtureReadConfig, Pipeline, RuntimeOptions, ZephonConfigError, sources
from zephon.pipeline.sources import SourceError


def test_from_sequence_and_callable():
    seq = sources.from_sequence(["a", "b", "c"], name="letters")
    assert len(seq) == 3 and seq.get(1) == "b" and seq.identity(2) == ("letters", 2)
    fn = sources.from_callable(4, lambda i: i * i)
    assert [fn.get(i) for i in range(4)] == [0, 1, 4, 9]
    with pytest.raises(ZephonConfigError):
        sources.from_callable(-1, abs)
    out = list(Pipeline(seq, shuffle=False, chunk_size=2))
    assert out == ["a", "b", "c"]


def test_token_windows_memmap(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    src = sources.token_windows(str(path), seq_len=64)
    assert len(src) == 15  # the 40-token tail is not a full window
    assert np.array_equal(src.get(2)["tokens"], np.arange(128, 192, dtype=np.uint16))
    rows = list(Pipeline(src, shuffle=False, chunk_size=4).pack_tokens(100).batch(2))
    flat = np.concatenate([np.asarray(r) for b in rows for r in b["tokens"]])
    # every token of the 15 windows, in full rows but the last (960 = 9 * 100 + 60)
    assert flat.dtype == np.uint16 and np.array_equal(flat, np.arange(960))
    assert [len(r) for b in rows for r in b["tokens"]] == [100] * 9 + [60]
    with pytest.raises(SourceError, match="cannot read"):
        sources.token_windows(str(tmp_path / "missing.bin"), 8)


def test_jsonl_globs_and_bad_lines_name_file_and_line(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"i": 0}\n\n{"i": 1}\n')
    (tmp_path / "b.jsonl").write_text('{"i": 2}\n{"i": 3, oops}\n')
    src = sources.jsonl(str(tmp_path / "*.jsonl"))
    assert len(src) == 4 and [src.get(k)["i"] for k in range(3)] == [0, 1, 2]
    with pytest.raises(SourceError, match=r"b\.jsonl, line 2: invalid JSON"):
        src.get(3)
    with pytest.raises(Exception, match=r"b\.jsonl, line 2"):
        list(Pipeline(src, shuffle=False))
    with pytest.raises(SourceError, match="no file matches"):
        sources.jsonl(str(tmp_path / "*.csv"))


@pytest.mark.parametrize("mode", ["weighted_round_robin", "weighted_random"])
def test_mixture_is_deterministic_and_complete(mode):
    web = sources.from_sequence([f"w{i}" for i in range(300)], name="web")
    code = sources.from_sequence([f"c{i}" for i in range(100)], name="code")
    config = MixtureReadConfig(mode=mode, seed=3, within_component="shuffle")
    mix = sources.mixture({"web": web, "code": code}, {"web": 0.75, "code": 0.25},
                          config=config)
    again = sources.mixture({"web": web, "code": code}, {"web": 0.75, "code": 0.25},
                            config=config)
    values = [mix.get(i) for i in range(len(mix))]
    assert values == [again.get(i) for i in range(len(again))]
    assert sorted(values) == sorted([f"w{i}" for i in range(300)] + [f"c{i}" for i in range(100)])
    head = collections.Counter(v[0] for v in values[:200])
    assert 120 <= head["w"] <= 180  # about 3:1 while both components last
    assert mix.identity(0)[0] in ("web", "code")


def test_mixture_rejects_bad_weights():
    a = sources.from_sequence([1])
    with pytest.raises(ZephonConfigError, match="weights"):
        sources.mixture({"a": a}, {"b": 1.0})
    with pytest.raises(ZephonConfigError, match="positive"):
        sources.mixture({"a": a}, {"a": 0.0})


def test_sample_ids_carry_source_index_epoch():
    src = sources.from_callable(6, lambda i: {"v": np.array(i)}, name="nums")
    batches = list(Pipeline(src, seed=0, chunk_size=2, num_epochs=2).batch(3))
    ids = [sid for b in batches for sid in b.meta["sample_ids"]]
    assert sorted(ids) == sorted(("nums", i, e) for i in range(6) for e in range(2))
    assert all(b["v"].tolist() == [sid[1] for sid in b.meta["sample_ids"]] for b in batches)


def test_a_local_file_gone_mid_run_is_an_error_not_retried(tmp_path):
    """A missing local file is a deterministic error: raised at the first attempt however
    patient the retry options, naming the file (a file that comes back 5 s later is never
    seen: the run did not retry for that long)."""
    import shutil
    import threading

    from zephon import StoreOptions

    ready = tmp_path / "ready.jsonl"
    ready.write_text('{"i": 0}\n{"i": 1}\n')
    src = sources.jsonl(str(ready))
    late = tmp_path / "late.jsonl"
    src.files = [str(late)]  # the index was built; the file vanishes
    patient = RuntimeOptions(io_options=StoreOptions(open_retry_attempts=300,
                                                     retry_backoff_initial_s=0.05,
                                                     retry_backoff_max_s=0.2))
    timer = threading.Timer(5.0, lambda: shutil.copy(ready, late))
    timer.start()
    try:
        with pytest.raises(Exception, match="late.jsonl"):
            list(Pipeline(src, shuffle=False).options(patient))
    finally:
        timer.join()


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_a_columnar_read_may_work_on_its_indices_in_place(runner):
    # Indices of a small unit travel inside the pickled task; they must arrive writable
    # like any other array, or get_batch fails and every row is read one by one.
    from _sources_fns import InPlaceIndices

    pipe = Pipeline(InPlaceIndices(100), shuffle=False, chunk_size=8).batch(8) \
        .options(RuntimeOptions(runner=runner, max_workers=1))
    batches = list(pipe)
    assert np.concatenate([b["i"] for b in batches]).tolist() == list(range(100))
    assert all(b["batched"].all() for b in batches), "get_batch fell back to row reads"


def test_a_columnar_read_that_fails_is_said_once_and_rows_are_read_instead():
    class Broken(sources.Source):
        name = "broken"

        def __len__(self):
            return 40

        def get(self, i):
            return {"i": np.int64(i)}

        def get_batch(self, indices):
            raise ValueError("no columnar read today")

    pipe = Pipeline(Broken(), shuffle=False, chunk_size=8).batch(8) \
        .options(RuntimeOptions(runner="inline"))
    with pytest.warns(RuntimeWarning, match="Broken.get_batch raised ValueError") as seen:
        out = list(pipe)
    assert np.concatenate([b["i"] for b in out]).tolist() == list(range(40))
    assert sum("get_batch raised" in str(w.message) for w in seen) == 1
