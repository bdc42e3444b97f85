"""Resumes that prove themselves (zephon.pipeline.proof): a checkpoint records what the
fingerprint does not cover (the source's files, the identities of the samples each lane
reads next, the lane mapping) and a restore that would deliver another stream raises a
ResumeMismatchError naming every difference, unless resume_accept lets it through with a
warning. Honest restores (another runner, another world size) never raise."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
from _aggregate_rank import ranks_in_threads

from zephon import Pipeline, RuntimeOptions, sources
from zephon.checkpoint import codec, decode_state, encode_state
from zephon.errors import CheckpointError, ResumeMismatchError
from zephon.pipeline.proof import ResumeMismatchWarning


def write_tokens(path, seed: int, n: int = 4096) -> None:
    np.random.default_rng(seed).integers(0, 500, n, dtype=np.uint16).tofile(path)


def token_pipe(path, **opts) -> Pipeline:
    return Pipeline(sources.token_windows(str(path), 16, "uint16"), seed=3,
                    chunk_size=8).batch(4).options(RuntimeOptions(**opts))


def take(pipe, n):
    it = iter(pipe)
    out = [next(it)["tokens"].copy() for _ in range(n)]
    return it, out


def test_a_token_file_rewritten_in_place_with_its_size_is_refused_naming_it(tmp_path):
    path = tmp_path / "train.bin"
    write_tokens(path, 0)
    it, _ = take(token_pipe(path), 3)
    state = it.checkpoint()
    it.close()
    before = os.stat(path)
    write_tokens(path, 1)  # the same name and size, other tokens
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    assert os.stat(path).st_size == before.st_size
    again = token_pipe(path)
    assert again.fingerprint() == decode_state(state)["fingerprint"]  # the fingerprint can't see it
    with pytest.raises(ResumeMismatchError) as err:
        again.restore(state)
    text = str(err.value)
    assert "changed: train.bin" in text and "modified" in text
    assert err.value.kinds == ("files",)
    assert "resume_accept=('files',)" in text
    # told to accept it: a warning that names it, and the restore goes on
    accepting = token_pipe(path, resume_accept=("files",))
    with pytest.warns(ResumeMismatchWarning, match="train.bin"):
        accepting.restore(state)
    assert len(list(accepting)) > 0


def test_an_unchanged_file_restores_silently_on_another_runner(tmp_path):
    path = tmp_path / "train.bin"
    write_tokens(path, 0)
    it, _ = take(token_pipe(path), 3)
    state = it.checkpoint()
    rest = [b["tokens"].copy() for b in it]
    it.close()
    other = token_pipe(path, runner="threads", max_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeMismatchWarning)
        other.restore(state)
        got = [b["tokens"].copy() for b in other]
    assert len(got) == len(rest) and all(np.array_equal(a, b) for a, b in zip(got, rest, strict=True))


def test_a_source_added_to_a_mixture_names_the_part_that_differs():
    def mix(names):
        return Pipeline(sources.mixture({n: sources.from_sequence(list(range(40)), name=n)
                                         for n in names}), seed=1, chunk_size=4).batch(2)

    it = iter(mix(["web", "code"]))
    next(it)
    state = it.checkpoint()
    it.close()
    with pytest.raises(CheckpointError) as err:
        mix(["web", "code", "math"]).restore(state)
    text = str(err.value)
    assert "source: " in text and "at the checkpoint, now" in text and "math" in text


def test_an_op_added_names_the_op():
    def pipe():
        return Pipeline(sources.from_sequence(list(range(20))), seed=0).map(abs)

    state = pipe().checkpoint()
    with pytest.raises(CheckpointError, match=r"1 op\(s\) at the checkpoint, 2 now"):
        pipe().map(abs).restore(state)


class Renumbered(sources.Source):
    """A custom source whose description does not change when what an index means does."""

    def __init__(self, stride: int) -> None:
        self.name, self.stride = "items", stride

    def __len__(self) -> int:
        return 64

    def get(self, i: int):
        return i * self.stride

    def identity(self, i: int):
        return self.name, i * self.stride

    def describe(self) -> str:
        return "Renumbered(items)"


def test_lanes_that_would_read_other_samples_are_refused_naming_the_lanes():
    def pipe(stride):
        return Pipeline(Renumbered(stride), seed=5, chunk_size=4).options(
            RuntimeOptions(canonical_replicas=4))

    it = iter(pipe(1))
    for _ in range(6):
        next(it)
    state = it.checkpoint()
    it.close()
    with pytest.raises(ResumeMismatchError) as err:
        pipe(3).restore(state)
    assert err.value.kinds == ("samples",)
    assert "lane 0 (epoch 0" in str(err.value) and "items[" in str(err.value)
    pipe(1).restore(state)  # the same source: no complaint


def ranks_state(tmp_path, mapping: str, world: int = 2, take_n: int = 4) -> bytes:
    """A merged checkpoint of ``world`` ranks (threads exchanging through a directory)."""
    def rank(r):
        pipe = Pipeline(sources.from_sequence(list(range(64))), seed=2, chunk_size=4) \
            .batch(2).options(RuntimeOptions(
                world_size=world, global_rank=r, canonical_replicas=4,
                mapping_strategy=mapping, aggregate_dir=str(tmp_path / f"agg-{mapping}"),
                run_id=f"proof-{mapping}", aggregate_timeout_s=60))
        it = iter(pipe)
        for _ in range(take_n):
            next(it)
        state = it.checkpoint()
        it.close()
        return state

    out = ranks_in_threads(world, rank)
    assert out[0] == out[1]
    return out[0]


def restore_on(state: bytes, world: int, rank: int, mapping: str, **extra):
    pipe = Pipeline(sources.from_sequence(list(range(64))), seed=2, chunk_size=4).batch(2) \
        .options(RuntimeOptions(world_size=world, global_rank=rank, canonical_replicas=4,
                                mapping_strategy=mapping, **extra))
    pipe.restore(state)
    return pipe


def test_another_mapping_on_several_ranks_is_refused_and_any_world_size_is_not(tmp_path):
    state = ranks_state(tmp_path, "interleaved")
    proof = decode_state(state)["proof"]
    assert sorted(proof["next"], key=int) == ["0", "1", "2", "3"]  # every rank's lanes
    assert proof["mapping"] == "interleaved" and proof["dp_degree"] == 2
    with pytest.raises(ResumeMismatchError, match="mapping_strategy='interleaved'") as err:
        restore_on(state, 2, 0, "contiguous")
    assert err.value.kinds == ("mapping",)
    with pytest.warns(ResumeMismatchWarning):
        restore_on(state, 2, 0, "contiguous", resume_accept=("mapping",))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeMismatchWarning)
        for world in (1, 4):  # an honest restore on another world size
            for r in range(world):
                restore_on(state, world, r, "interleaved")
        restore_on(state, 1, 0, "contiguous")  # one rank: the mapping decides nothing


def test_a_state_of_format_version_4_restores_without_a_proof(monkeypatch):
    pipe = Pipeline(sources.from_sequence(list(range(30))), seed=4, chunk_size=3)
    it = iter(pipe)
    for _ in range(5):
        next(it)
    state = decode_state(it.checkpoint())
    rest = list(it)
    it.close()
    del state["proof"]
    monkeypatch.setattr(codec, "VERSION", 4)
    old = encode_state(state)
    monkeypatch.undo()
    assert old[8] == 4
    again = Pipeline(sources.from_sequence(list(range(30))), seed=4, chunk_size=3)
    again.restore(old)
    assert list(again) == rest


def test_a_tampered_proof_is_a_corrupt_checkpoint():
    pipe = Pipeline(sources.from_sequence(list(range(30))), seed=4)
    state = decode_state(pipe.checkpoint())
    state["proof"]["next"] = ["not", "a", "mapping"]
    with pytest.raises(CheckpointError, match="proof next"):
        pipe.restore(encode_state(state))


@pytest.mark.parametrize("order", [False, True, "shards"])
@pytest.mark.parametrize("mixed", [False, True])
def test_lanes_computed_together_digest_as_each_alone(order, mixed):
    """The proof's fast path (all lanes of an epoch at once) gives every lane the digest of
    its identities read one by one through the source's view."""
    from zephon.pipeline.lanes import epoch_positions, epoch_slice, lane_length, lane_lengths
    from zephon.pipeline.proof import _digest_of, lane_digests, next_identities

    items = list(range(300))
    if mixed:
        source = sources.mixture({"a": sources.from_sequence(items, name="a"),
                                  "b": sources.from_sequence(items[:120], name="b")})
    else:
        source = sources.from_sequence(items, name="s")
    kwargs = {"shuffle": "shards", "shuffle_window": 2} if order == "shards" else \
        {"shuffle": order}
    plan = Pipeline(source, seed=11, chunk_size=5, **kwargs).options(
        RuntimeOptions(canonical_replicas=7)).plan()
    spec = plan.spec
    n = len(spec.source)
    assert list(lane_lengths(n, 5, 7)) == [lane_length(n, 5, 7, lane) for lane in range(7)]
    positions = np.arange(0, n, 3)
    assert np.array_equal(epoch_positions(n, 11, 2, spec.permute, positions),
                          epoch_slice(n, 11, 2, spec.permute, 0, n)[positions])
    states = {0: (0, 4, 1), 1: (1, 0, 3), 3: (0, plan.lane_length(3) - 2, 5)}
    found = lane_digests(plan, range(7), states, 0, 8, detail=True)
    for lane, (digest, (epoch, pos), first) in found.items():
        ids = next_identities(plan, lane, epoch, pos, 8)
        assert digest == _digest_of(ids), lane
        assert first == ids[:4]



def write_jsonl(path, tag: str) -> None:
    with open(path, "w") as fh:
        for i in range(40):
            fh.write(json.dumps({"x": i, "t": tag}) + "\n")


def jsonl_pipe(path) -> Pipeline:
    return Pipeline(sources.jsonl(str(path)), seed=1, chunk_size=4).batch(2)


def test_files_are_compared_as_they_are_at_the_restore_on_the_same_pipeline(tmp_path):
    path = tmp_path / "a.jsonl"
    write_jsonl(path, "a")
    pipe = jsonl_pipe(path)
    it = iter(pipe)
    for _ in range(3):
        next(it)
    state = it.checkpoint()
    it.close()
    before = os.stat(path)
    write_jsonl(path, "b")  # same size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    with pytest.raises(ResumeMismatchError, match=r"changed: a\.jsonl"):
        pipe.restore(state)  # the same object: its files are looked at again


def test_a_file_rewritten_before_the_first_checkpoint_is_recorded_as_it_was_built(tmp_path):
    path = tmp_path / "a.jsonl"
    write_jsonl(path, "a")
    it = iter(jsonl_pipe(path))
    for _ in range(3):
        next(it)
    before = os.stat(path)
    write_jsonl(path, "b")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    state = it.checkpoint()  # the stream so far came from the file as it was built
    it.close()
    with pytest.raises(ResumeMismatchError, match=r"changed: a\.jsonl"):
        jsonl_pipe(path).restore(state)


def test_a_state_at_the_end_of_a_pass_proves_the_next_pass():
    def pipe(stride):
        return Pipeline(Renumbered(stride), seed=3, chunk_size=4)

    it = iter(pipe(1))
    assert sum(1 for _ in it) == 64
    state = it.checkpoint()
    it.close()
    assert len(decode_state(state)["proof"]["next"]) == 1  # the next pass's first samples
    pipe(1).restore(state)
    with pytest.raises(ResumeMismatchError, match="samples"):
        pipe(3).restore(state)


@pytest.mark.parametrize("field,value", [
    ("stamps", 5), ("stamps", [[]]), ("stamps", [["a.jsonl"]]), ("stamps", [[["x"], 1, "s"]]),
    ("count", 10**30), ("block", 0), ("names", [1]), ("digests", ["0", "1"]),
])
def test_tampered_files_in_a_proof_are_a_corrupt_checkpoint(tmp_path, field, value):
    path = tmp_path / "a.jsonl"
    write_jsonl(path, "a")
    state = decode_state(jsonl_pipe(path).checkpoint())
    state["proof"]["files"][field] = value
    with pytest.raises(CheckpointError, match="corrupt checkpoint: proof files"):
        jsonl_pipe(path).restore(encode_state(state))


@pytest.mark.parametrize("field,value", [
    ("next", {"abc": "0123456789abcdef"}), ("next", {"99": "0123456789abcdef"}),
    ("next", {"0": "xyz"}), ("dp_degree", 2**62), ("extra", 1), ("parts", "source"),
    ("digest", "blake2b"), ("k", 10**9),
])
def test_tampered_fields_of_a_proof_are_a_corrupt_checkpoint(field, value):
    pipe = Pipeline(sources.from_sequence(list(range(30))), seed=4)
    state = decode_state(pipe.checkpoint())
    state["proof"][field] = value
    with pytest.raises(CheckpointError, match="corrupt checkpoint: proof"):
        pipe.restore(encode_state(state))


def test_a_mapping_that_gives_every_rank_the_same_lanes_is_no_difference(tmp_path):
    def rank(r):
        it = iter(Pipeline(sources.from_sequence(list(range(64))), seed=2, chunk_size=4)
                  .batch(2).options(RuntimeOptions(
                      world_size=2, global_rank=r, canonical_replicas=2,
                      mapping_strategy="contiguous", aggregate_dir=str(tmp_path / "agg"),
                      run_id="same-lanes", aggregate_timeout_s=60)))
        for _ in range(3):
            next(it)
        state = it.checkpoint()
        it.close()
        return state

    out = ranks_in_threads(2, rank)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeMismatchWarning)
        pipe = Pipeline(sources.from_sequence(list(range(64))), seed=2, chunk_size=4) \
            .batch(2).options(RuntimeOptions(world_size=2, global_rank=0, canonical_replicas=2,
                                             mapping_strategy="interleaved"))
        pipe.restore(out[0])  # C = 2 on 2 ranks: one lane each, whatever the mapping


def test_a_long_source_description_is_recorded_by_its_digest_and_still_named(tmp_path):
    paths = []
    for k in range(120):
        path = tmp_path / f"shard-with-a-long-name-{k:05d}.jsonl"
        write_jsonl(path, "a")
        paths.append(str(path))
    pipe = Pipeline(sources.jsonl(paths), seed=1, chunk_size=4).batch(2)
    state = pipe.checkpoint()
    parts = decode_state(state)["proof"]["parts"]
    assert len(parts[0]) < 1100 and "sha256" in parts[0]
    other = Pipeline(sources.jsonl(paths[:-1]), seed=1, chunk_size=4).batch(2)
    with pytest.raises(CheckpointError, match="source: "):
        other.restore(state)


def test_the_digest_is_the_same_computed_in_numpy_or_in_python_ints():
    from zephon.pipeline.proof import _digests, _digests_small

    rng = np.random.default_rng(0)
    indices = rng.integers(0, 2**40, (12, 8)).astype(np.int64)  # 96 > 16: the NumPy path
    keys = rng.integers(0, 2**63, (12, 8)).astype(np.uint64)
    epochs = rng.integers(0, 100, (12, 8)).astype(np.int64)
    assert _digests(keys, indices, epochs) == _digests_small(keys, indices, epochs)
    assert _digests(np.uint64(7), indices, 3) == _digests_small(np.uint64(7), indices, 3)


class Sized(sources.Source):
    """A source with the default identity whose description leaves its length out."""

    def __init__(self, n: int) -> None:
        self.name, self.n = "sized", n

    def __len__(self) -> int:
        return self.n

    def get(self, i: int):
        return i

    def describe(self) -> str:
        return "Sized(sized)"


def test_a_plain_source_whose_length_changed_under_the_same_description_is_refused():
    def pipe(n):
        return Pipeline(Sized(n), seed=5, chunk_size=4)

    it = iter(pipe(64))
    for _ in range(6):
        next(it)
    state = it.checkpoint()
    it.close()
    pipe(64).restore(state)  # the same length: nothing is recomputed, nothing differs
    with pytest.raises(ResumeMismatchError) as err:
        pipe(80).restore(state)
    assert err.value.kinds == ("samples",)


def test_an_accepted_difference_is_said_once_through_the_torch_loader(tmp_path):
    zt = pytest.importorskip("zephon.torch")
    pytest.importorskip("torch")
    path = tmp_path / "train.bin"
    write_tokens(path, 0)
    loader = zt.loader(token_pipe(path))
    next(iter(loader))
    state = loader.state_dict()
    loader.close()
    before = os.stat(path)
    write_tokens(path, 1)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    again = zt.loader(token_pipe(path, resume_accept=("files",)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.load_state_dict(state)
    assert [w.category for w in caught] == [ResumeMismatchWarning]
    with pytest.raises(ResumeMismatchError):
        zt.loader(token_pipe(path)).load_state_dict(state)
    again.close()
