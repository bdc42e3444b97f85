"""Refusals at construction (issue 40): mixture weights whose ratio makes an epoch too long to
hold, ``ensure_mixture`` weights that leave out a component, a token share estimated from a
probe (a warning with the probe's size and the estimate's uncertainty; exact where the
source knows its token counts), a misspelled token dtype, a generator given to
``from_sequence``, and a token file read with a dtype its vocabulary says is wrong.

Every refusal is a ZephonConfigError raised when the source or the op is built, whose
message names the cause, the value and the fix."""

from __future__ import annotations

import re
import warnings

import _mixture_fns as F
import numpy as np
import pytest

from zephon import MixtureReadConfig, Pipeline, sources
from zephon.errors import SourceError, ZephonConfigError
from zephon.pipeline.sources.mixture import LONG_EPOCH, MAX_EPOCH


def two(n_a=100, n_b=51):
    return {"a": sources.from_sequence(list(range(n_a)), name="a"),
            "b": sources.from_sequence(list(range(n_b)), name="b")}


# -- mixture: an epoch too long to hold --------------------------------------------------------

@pytest.mark.parametrize("tiny", [1e-18, 5e-324])
def test_a_weight_ratio_beyond_the_longest_epoch_is_refused_naming_the_weights(tiny):
    # before: 1e-18 built a source of negative length (counts [-2**63, 51]) that failed in
    # len(); 5e-324 raised a bare OverflowError from inside the counts
    with pytest.raises(ZephonConfigError) as err:
        sources.mixture(two(), {"a": 1.0, "b": tiny})
    text = str(err.value)
    assert "'b'" in text and repr(tiny) in text  # the weights, by name and value
    assert "2**53" in text  # the limit
    assert "max_repeats" in text and "stop" in text  # the ways out


def test_a_long_epoch_warns_and_still_holds_exact_counts():
    with pytest.warns(UserWarning, match=r"mixture 'mixture': the weights .*'b': 1e-09.* make "
                                         r"an epoch of 51000000051 positions"):
        mix = sources.mixture(two(), {"a": 1.0, "b": 1e-9})
    assert MAX_EPOCH > len(mix) > LONG_EPOCH
    assert mix.counts.tolist() == [51_000_000_000, 51]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an ordinary epoch says nothing
        sources.mixture(two(), {"a": 1.0, "b": 1e-3})


def test_the_longest_epoch_is_the_limit_itself():
    # a weight ratio just inside the limit builds; the next step past it is refused
    with pytest.warns(UserWarning, match="more than 4294967296"):
        ok = sources.mixture(two(1, 1), {"a": 1.0, "b": 2.0 ** -52})
    assert len(ok) == 2 ** 52 + 1
    with pytest.raises(ZephonConfigError, match=r"more than the 2\*\*53"):
        sources.mixture(two(1, 4), {"a": 1.0, "b": 2.0 ** -52})


# -- ensure_mixture: weights that leave a component out ----------------------------------------

def test_ensure_mixture_weights_missing_a_component_are_refused_when_built():
    comps = {"a": sources.from_callable(60, F.doc_a, name="a"),
             "b": sources.from_callable(60, F.doc_b, name="b"),
             "c": sources.from_callable(60, F.doc_b, name="c")}
    mix = sources.mixture(comps, {"a": 0.5, "b": 0.3, "c": 0.2})
    # before: accepted, then an OpError mid-stream at the first sample of "c"
    with pytest.raises(ZephonConfigError, match=r"ensure_mixture: weights leave out the "
                                                r"component\(s\) \['c'\]: the mixture's "
                                                r"samples carry \['a', 'b', 'c'\].*"
                                                r"weights=None"):
        Pipeline(mix).ensure_mixture({"a": 0.6, "b": 0.4})


def test_ensure_mixture_weights_must_name_the_innermost_components_of_a_nested_mixture():
    inner = sources.mixture({"x": sources.from_callable(30, F.doc_a, name="x"),
                             "y": sources.from_callable(30, F.doc_b, name="y")})
    outer = sources.mixture({"inner": inner, "z": sources.from_callable(30, F.doc_b,
                                                                         name="z")})
    # the records carry "x", "y" and "z": the name of the nested mixture is never seen
    with pytest.raises(ZephonConfigError, match=r"unknown component\(s\) \['inner'\].*"
                                                r"\['x', 'y', 'z'\]"):
        Pipeline(outer).ensure_mixture({"inner": 0.5, "z": 0.5})
    pipe = Pipeline(outer, shuffle=False).ensure_mixture({"x": 1, "y": 1, "z": 2})
    assert sum(1 for _ in pipe) == len(outer)


def test_ensure_mixture_counts_a_nested_mixtures_samples_for_it_under_its_own_weights():
    inner = sources.mixture({"x": sources.from_callable(30, F.doc_a, name="x"),
                             "y": sources.from_callable(30, F.doc_b, name="y")})
    outer = sources.mixture({"inner": inner, "z": sources.from_callable(30, F.doc_b,
                                                                         name="z")})
    # before: an OpError at the first sample, "its component 'x' is not one of the
    # target's ['inner', 'z']"
    own = Pipeline(outer, shuffle=False).ensure_mixture(max_buffer=8)
    assert sorted(s["id"] for s in own) == sorted(s["id"] for s in Pipeline(outer))


# -- by="tokens": an estimate from a probe says so ---------------------------------------------

def heavy_tail(i):
    """Token lengths with a heavy tail: mostly 8, one sample in 97 of 4000."""
    return {"tokens": np.zeros(4000 if i % 97 == 0 else 8, dtype=np.int32)}


def test_token_shares_estimated_from_a_probe_warn_with_the_probe_and_its_uncertainty():
    comps = {"a": sources.from_callable(20_000, heavy_tail, name="a"),
             "b": sources.from_callable(20_000, F.tokens_of_length(50), name="b")}
    # before: the estimate from a 64-sample probe was silent
    with pytest.warns(UserWarning, match=r"mixture\(by='tokens'\): tokens per sample "
                                         r"estimated from a probe of 64 samples per "
                                         r"component.*'a': [0-9.]+ ± [0-9.]+.*token share "
                                         r"of 'a' 0\.700 ± 0\.[0-9]+.*tokens_per_sample="):
        sources.mixture(comps, {"a": 0.7, "b": 0.3}, by="tokens")


def test_token_shares_are_exact_where_the_source_knows_its_token_counts(tmp_path):
    np.arange(40_000, dtype=np.uint16).tofile(tmp_path / "a.bin")
    np.arange(40_000, dtype=np.uint16).tofile(tmp_path / "b.bin")
    comps = {"a": sources.token_windows(str(tmp_path / "a.bin"), seq_len=16, name="a"),
             "b": sources.token_windows(str(tmp_path / "b.bin"), seq_len=400, name="b"),
             "c": sources.from_callable(10, F.tokens_of_length(7), name="c")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # token files, and a component probed whole: exact
        mix = sources.mixture(comps, {"a": 0.5, "b": 0.3, "c": 0.2}, by="tokens",
                              config=MixtureReadConfig(seed=1))
    assert mix.tokens_per_sample.tolist() == [16.0, 400.0, 7.0]


# -- token_windows: dtypes and vocabularies ----------------------------------------------------

def test_a_misspelled_token_dtype_is_a_config_error(tmp_path):
    np.arange(64, dtype=np.uint16).tofile(tmp_path / "t.bin")
    # before: NumPy's TypeError "data type 'float16x' not understood"
    with pytest.raises(ZephonConfigError, match=r"token_windows: dtype must be one of "
                                                r"\('uint16', .*got 'float16x'"):
        sources.token_windows(str(tmp_path / "t.bin"), seq_len=4, dtype="float16x")


def test_a_uint16_file_read_as_uint32_is_refused_by_its_vocabulary(tmp_path):
    path = tmp_path / "t.bin"
    (np.arange(50_000) % 50_257).astype(np.uint16).tofile(path)  # an even count: 4-byte rows
    # before: no vocab_size=, and the windows read as uint32 were garbage
    with pytest.raises(ZephonConfigError, match=r"token_windows: .*t\.bin holds token "
                                                r"[0-9]+ read as uint32, outside vocab_size="
                                                r"50257.*dtype='uint16'"):
        sources.token_windows(str(path), seq_len=8, dtype="uint32", vocab_size=50_257)
    src = sources.token_windows(str(path), seq_len=8, dtype="uint16", vocab_size=50_257)
    assert src.get(1)["tokens"].tolist() == list(range(8, 16))
    with pytest.raises(ZephonConfigError, match=r"vocab_size must be an int >= 1"):
        sources.token_windows(str(path), seq_len=8, vocab_size=0)


def test_a_token_file_of_the_wrong_size_names_the_dtypes_that_fit(tmp_path):
    np.arange(101, dtype=np.uint16).tofile(tmp_path / "t.bin")  # 202 bytes
    with pytest.raises(SourceError, match=r"t\.bin: 202 bytes of tokens is not a multiple of "
                                          r"4 \(uint32\).*dtype='uint16'"):
        sources.token_windows(str(tmp_path / "t.bin"), seq_len=4, dtype="uint32")


# -- from_sequence: something without a length -------------------------------------------------

def test_a_generator_given_to_from_sequence_is_refused_with_the_fix():
    # before: built, then "object of type 'generator' has no len()" from inside the library
    with pytest.raises(ZephonConfigError, match=r"from_sequence: items must be a sequence .*"
                                                r"got a generator.*list\(items\).*"
                                                r"from_callable"):
        sources.from_sequence(i * i for i in range(10))
    with pytest.raises(ZephonConfigError, match=r"got a set"):
        sources.from_sequence({1, 2, 3})
    assert sources.from_sequence(range(3)).get(2) == 2
    assert sources.from_sequence(np.arange(3)).get(1) == 1


# -- adversarial findings (issue 41) -----------------------------------------------------------

def ten_twenty():
    return {"a": sources.from_sequence(list(range(10)), name="a"),
            "b": sources.from_sequence(list(range(1000, 1020)), name="b")}


def epoch_values(mix, epoch):
    view = mix.view(np.arange(len(mix)), epoch)
    return sorted(view.get(n) for n in range(len(mix)))


def test_huge_equal_weights_are_equal_weights():
    # before: weights.sum() overflowed to inf: len 1, counts [1, 0]
    mix = sources.mixture(ten_twenty(), {"a": 1e308, "b": 1e308})
    assert len(mix) == 40 and mix.counts.tolist() == [20, 20]
    assert mix.counts.tolist() == sources.mixture(ten_twenty(), None).counts.tolist()
    # a list schedule's step: before, refused with "cannot fill an epoch of 40 positions"
    steps = sources.mixture(ten_twenty(), [(0, {"a": 1, "b": 1}),
                                           (1, {"a": 1e308, "b": 1e308})])
    assert steps.epoch_plan(1)[0].tolist() == [20, 20]
    # a callable schedule: before, that error mid-stream at epoch 2
    fn = sources.mixture(ten_twenty(), F.huge_from_2)
    assert fn.epoch_plan(2)[0].tolist() == [20, 20]
    assert epoch_values(fn, 2) == sorted(2 * list(range(10)) + list(range(1000, 1020)))
    pipe = Pipeline(fn, seed=0)
    for _ in range(3):  # epochs 0, 1, 2 of a pipeline
        assert sum(1 for _ in pipe) == 40


def test_ensure_mixture_targets_of_huge_weights_are_their_shares():
    comps = {"a": sources.from_sequence(list(range(20)), name="a"),
             "b": sources.from_sequence(list(range(1000, 1020)), name="b")}
    mix = sources.mixture(comps, {"a": 1, "b": 1})

    def out(weights):
        pipe = Pipeline(mix, shuffle=False).ensure_mixture(weights, max_buffer=64,
                                                            leftover="drop")
        return [int(v) for v in pipe]

    # before: the target's sum overflowed, every share was 0 and "drop" dropped all 40
    want = out({"a": 1, "b": 3})
    assert len(want) == 27 and out({"a": 5e307, "b": 1.5e308}) == want
    huge = sources.mixture(comps, {"a": 1e308, "b": 1e308})  # its own weights as the target
    assert sum(1 for _ in Pipeline(huge, shuffle=False).ensure_mixture(leftover="drop")) == 40


@pytest.mark.parametrize("weights, tps", [
    ({"a": 1, "b": 1}, {"a": 1e-300, "b": 1e300}),    # before: counts [10, 0]
    ({"a": 1e-200, "b": 1}, {"a": 1e200, "b": 1}),     # before: counts [0, 20]
    ({"a": 1, "b": 1}, {"a": 1e-320, "b": 1}),         # before: len 1, NumPy warnings
    ({"a": 1, "b": 1}, {"a": 1e-12, "b": 1e12}),       # a ratio 1e24: past 2**53
])
def test_token_rates_past_what_an_epoch_holds_are_refused_naming_the_tokens(weights, tps):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NumPy overflow warning on the way
        with pytest.raises(ZephonConfigError) as err:
            sources.mixture(ten_twenty(), weights, by="tokens", tokens_per_sample=tps)
    text = str(err.value)
    assert "tokens_per_sample" in text and repr(tps["a"]) in text and repr(tps["b"]) in text


def test_token_rates_of_ordinary_extremes_still_build():
    mix = sources.mixture(ten_twenty(), {"a": 1, "b": 1}, by="tokens",
                          tokens_per_sample={"a": 1e-320, "b": 1e-320})  # equal: a ratio 1
    assert mix.counts.tolist() == [20, 20]


def test_a_nested_component_name_clashing_with_an_outer_one_is_refused():
    def seq(n, name):
        return sources.from_sequence(list(range(n)), name=name)

    inner = sources.mixture({"a": seq(40, "B"), "c": seq(40, "C")}, name="inner")
    # before: built; record names ['a', 'a', 'c'], 1600 identities of which 1200 distinct
    with pytest.raises(ZephonConfigError, match=r"mixture: the name 'a' .*component 'a' "
                                                r"and .*nested mixture 'inner'.*rename"):
        sources.mixture({"a": seq(40, "A"), "inner": inner})
    deeper = sources.mixture({"x": inner, "y": seq(5, "Y")})
    with pytest.raises(ZephonConfigError, match=r"the name 'a' .*'inner' and .*'x'"):
        sources.mixture({"inner": inner, "x": deeper})
    ok = sources.mixture({"z": seq(40, "A"), "inner": inner})
    assert ok.record_names() == ["z", "a", "c"]


def test_a_component_name_that_is_another_ones_repeat_name_is_refused():
    def seq(n, name):
        return sources.from_sequence(list(range(n)), name=name)

    # before: built; 100 positions, 95 distinct identities ('a#1', i) twice
    with pytest.raises(ZephonConfigError, match=r"'a#1'.*repeat of 'a'.*rename"):
        sources.mixture({"a#1": seq(50, "s1"), "a": seq(5, "s2")})
    with pytest.raises(ZephonConfigError, match=r"'x#12'.*'x'"):
        sources.mixture({"x": seq(5, "s2"),
                         "n": sources.mixture({"x#12": seq(5, "s1"), "y": seq(5, "s3")})})
    # names with '#' that no repeat can take are fine: '#0', a leading 0, no such stem
    mix = sources.mixture({"a#0": seq(50, "s1"), "a#01": seq(5, "s2"), "a": seq(5, "s3"),
                           "b#1": seq(5, "s4")})
    ids = [mix.identity(i) for i in range(len(mix))]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("bad", [1, None, ("a",), ""])
def test_component_names_must_be_non_empty_strings(bad):
    comps = {bad: sources.from_sequence([1, 2], name="x"),
             "b": sources.from_sequence([3], name="b")}
    # before: 1 built, then ensure_mixture failed mid-stream on "its component '1#1'"
    with pytest.raises(ZephonConfigError, match=r"mixture: component names must be non-empty "
                                                r"strings.*got " + re.escape(repr(bad))):
        sources.mixture(comps)


@pytest.mark.parametrize("kwargs", [
    {"weights": {"a": 1, 3: 1}},
    {"weights": {"a": 1, "b": 1}, "by": "tokens", "tokens_per_sample": {"a": 1, 3: 1}},
    {"weights": [(0, {"a": 1, "b": 1}), (2, {"a": 1, 3: 1})]},
    {"weights": None, "max_repeats": {"a": 1, 3: 1, "zz": 1}},
])
def test_weights_keyed_by_mixed_types_are_a_config_error(kwargs):
    # before: TypeError "'<' not supported between instances of 'int' and 'str'"
    with pytest.raises(ZephonConfigError, match=r"\b3\b"):
        sources.mixture(ten_twenty(), **kwargs)


class _ByLabel:
    """A mapping-like table: a length, and indexing by label (a DataFrame's columns)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, key):
        if not isinstance(key, str):
            raise KeyError(key)
        return [r[key] for r in self.rows]


def test_from_sequence_refuses_a_table_indexed_by_label():
    # before: built, then "reading sample ('sequence', 0, 0) failed: KeyError: 0"
    with pytest.raises(ZephonConfigError, match=r"from_sequence: items\[0\] raised KeyError.*"
                                                r"_ByLabel.*list\(.*from_callable"):
        sources.from_sequence(_ByLabel([{"a": 1}, {"a": 2}]))

    class Short(list):  # a length past the last item: items[len - 1] fails
        def __len__(self):
            return super().__len__() + 1

    with pytest.raises(ZephonConfigError, match=r"items\[3\] raised IndexError"):
        sources.from_sequence(Short([1, 2, 3]))
    assert len(sources.from_sequence([])) == 0

    class Bad(list):  # a sample that fails to read is the read's business (error policy)
        def __getitem__(self, i):
            raise ValueError(f"sample {i} is damaged")

    src = sources.from_sequence(Bad([1, 2]))
    with pytest.raises(ValueError, match="sample 1 is damaged"):
        src.get(1)


def test_from_sequence_refuses_pandas_objects_with_the_fix():
    pd = pytest.importorskip("pandas")
    with pytest.raises(ZephonConfigError, match=r"DataFrame.*to_dict\(\"records\"\)"):
        sources.from_sequence(pd.DataFrame({"a": [1, 2, 3]}))
    with pytest.raises(ZephonConfigError, match=r"Series.*to_list\(\)"):
        sources.from_sequence(pd.Series([1, 2], index=["x", "y"]))


def test_from_sequence_of_more_items_than_a_length_holds_is_a_config_error():
    # before: a raw OverflowError from len()
    with pytest.raises(ZephonConfigError, match=r"from_sequence: .*range.*more items than "
                                                r"len\(\) holds"):
        sources.from_sequence(range(10 ** 20))


def test_an_epoch_whose_positions_pass_int64_is_refused_at_that_epoch():
    comps = {"a": sources.from_sequence([0], name="a"),
             "b": sources.from_sequence(list(range(20)), name="b")}
    with pytest.warns(UserWarning, match="more than 4294967296"):
        mix = sources.mixture(comps, {"a": 1, "b": 2.0 ** 53 - 3})
    last = np.array([len(mix) - 1])
    view = mix.view(last, 1023)  # the last epoch whose occurrences fit int64
    assert view.identity(0)[0].startswith("b#") and int(view.passes[0]) > 0
    # before: epoch 1024 and later gave negative passes and identities ('b#-9218...', 8)
    with pytest.raises(ZephonConfigError, match=r"epoch 1024 .*2\*\*63.*epochs 0 to 1023"):
        mix.view(last, 1024)


def test_a_renamed_npy_file_is_read_as_npy_not_as_raw_tokens(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.uint16))
    for name in ("T.NPY", "t.bin"):
        (tmp_path / name).write_bytes((tmp_path / "t.npy").read_bytes())
        # before: the header's bytes were read as tokens: [20115, 19797, 22864, 1]
        src = sources.token_windows(str(tmp_path / name), 4, dtype=None, vocab_size=50257)
        assert src.get(0)["tokens"].tolist() == [0, 1, 2, 3] and len(src) == 25
    with pytest.raises(SourceError, match=r"t\.bin holds uint16, dtype='uint32' given"):
        sources.token_windows(str(tmp_path / "t.bin"), 4, dtype="uint32")


def test_token_windows_accepts_numpy_integers_and_refuses_a_seq_len_past_the_file(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    # before: seq_len=np.int64(8) was refused while vocab_size=np.int64(...) was accepted
    src = sources.token_windows(str(tmp_path / "t.bin"), np.int64(8),
                                vocab_size=np.int64(1000))
    assert len(src) == 12 and type(src.seq_len) is int
    # before: a source of 0 windows, silently
    with pytest.raises(ZephonConfigError, match=r"t\.bin holds 100 tokens, fewer than "
                                                r"seq_len=128"):
        sources.token_windows(str(tmp_path / "t.bin"), 128)
