"""Refusals at construction (issue 40): mixture weights whose ratio makes an epoch too long to
hold, ``ensure_mixture`` weights that leave out a component, a token share estimated from a
probe (a warning with the probe's size and the estimate's uncertainty; exact where the
source knows its token counts), a misspelled token dtype, a generator given to
``from_sequence``, and a token file read with a dtype its vocabulary says is wrong.

Every refusal is a ZephonConfigError raised when the source or the op is built, whose
message names the cause, the value and the fix."""

from __future__ import annotations

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
