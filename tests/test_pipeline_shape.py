"""The stream's shape: full batches and full packed rows whatever the flush boundaries and
epoch starts, no sample (or token) lost or repeated, and checkpoint/restore at any item
exact on another runner, worker count and world size (the accumulators' carry)."""

from __future__ import annotations

import collections
import random
import threading

import _pipeline_fns as F
import numpy as np
import pytest

from zephon import CheckpointError, Pipeline, RuntimeOptions, sources
from zephon.checkpoint import decode_state, encode_state

# -- chains -----------------------------------------------------------------------------------
# Each: (name, build(pipe, rnd) -> pipe, kind): kind "samples" (the multiset of sample ids per
# epoch is the source's), "kept" (the same after the filter), "tokens" (the multiset of tokens
# delivered is the source's, num_epochs times).


def _shuffle_batch(p, r):
    return p.map(F.jitter).shuffle(r.randint(1, 12)).batch(r.randint(2, 6), r.random() < 0.3)


def _filter_shuffle_batch(p, r):
    return p.filter(F.keep_not_seven).shuffle(r.randint(1, 9)).batch(r.randint(2, 7))


def _pack_batch(p, r):
    return p.pack_tokens(r.randint(3, 11)).batch(r.randint(2, 4))


def _shuffle_pack_batch(p, r):
    return p.shuffle(r.randint(1, 6)).pack_tokens(r.randint(2, 13)).shuffle(3).batch(2)


def _fused_shuffle(p, r):  # read -> map -> batch is fused; the shuffle makes it replay
    return p.map(F.jitter).batch(r.randint(2, 5)).shuffle(r.randint(1, 4))


def _two_batches(p, r):
    return p.batch(r.randint(2, 4)).shuffle(2).batch(r.randint(2, 3))


def _cursor_filter_batch(p, r):  # cursor resume, a serial batch
    return p.filter(F.keep_not_seven).batch(r.randint(2, 6))


def _cursor_fused(p, r):  # cursor resume, the fused batch across epochs
    return p.map(F.jitter).batch(r.randint(2, 9))


CHAINS = [("shuffle_batch", _shuffle_batch, "samples"),
          ("filter_shuffle_batch", _filter_shuffle_batch, "kept"),
          ("pack_batch", _pack_batch, "tokens"),
          ("shuffle_pack_batch", _shuffle_pack_batch, "tokens"),
          ("fused_shuffle", _fused_shuffle, "samples"),
          ("two_batches", _two_batches, "samples"),
          ("cursor_filter_batch", _cursor_filter_batch, "kept"),
          ("cursor_fused", _cursor_fused, "samples")]


def _source(r, mixture: bool, n: int):
    if not mixture:
        return sources.from_callable(n, F.ragged_tokens, name="ragged")
    return sources.mixture({"a": sources.from_callable(n // 2, F.ragged_tokens, name="a"),
                            "b": sources.from_callable(n - n // 2, F.ragged_tokens, name="b")})


class Case:
    """One drawn scenario: a chain over a source with its chunking, flush cadence, lanes and
    epochs; ``make(opts)`` builds a fresh pipeline (every run from its start)."""

    def __init__(self, seed: int, chain: int | None = None) -> None:
        r = random.Random(seed)
        self.name, self.build, self.kind = CHAINS[r.randrange(len(CHAINS))
                                                  if chain is None else chain]
        self.mixture = r.random() < 0.25
        self.n = r.randint(20, 90)
        self.chunk = r.choice([1, 2, 3, 5, 8])
        self.flush = r.choice([None, 1, 2, 3])
        self.lanes = r.choice([1, 2, 4])
        self.epochs = r.choice([1, 1, 2, 3])
        self.seed = seed
        self.rnd_state = r.getstate()

    def make(self, **opts) -> Pipeline:
        r = random.Random()
        r.setstate(self.rnd_state)
        base = Pipeline(_source(r, self.mixture, self.n), seed=self.seed % 97,
                        chunk_size=self.chunk, num_epochs=self.epochs)
        opts.setdefault("canonical_replicas", self.lanes)
        if self.flush is not None:
            opts.setdefault("flush_every_k_chunks", self.flush)
        return self.build(base, r).options(RuntimeOptions(**opts))

    def __repr__(self) -> str:
        return (f"Case({self.seed}: {self.name}, mixture={self.mixture}, n={self.n}, "
                f"chunk={self.chunk}, K={self.flush}, C={self.lanes}, epochs={self.epochs})")


def _plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in sorted(value.items())}
    return value


def key(batch) -> tuple:
    return (batch.meta["lane"], batch.meta["lane_index"], repr(_plain(dict(batch))),
            tuple(batch.meta["sample_ids"]))


def _sizes(batch) -> int:
    return len(batch["tokens"]) if "id" not in batch else len(batch["id"])


def _short_rows(batch, seq_len: int) -> bool:
    return any(np.asarray(row).size < seq_len for row in batch["tokens"])


def check_shape(case: Case, batches: list) -> None:
    """Every batch of a lane is full except the lane's last (and, after a packer, its
    short row, a batch of its own after it); every packed row has seq_len tokens except
    the lane's last; the samples or tokens are the source's."""
    pipe = case.make()
    ops = pipe.ops
    size = ops[-1].size if ops[-1].kind == "batch" else ops[-2].size
    drop_last = ops[-1].drop_last if ops[-1].kind == "batch" else False
    by_lane = collections.defaultdict(list)
    for b in batches:
        by_lane[b.meta["lane"]].append(b)
    packs = [op for op in ops if op.kind == "pack_tokens"]
    for lane, items in by_lane.items():
        sizes = [_sizes(b) for b in items]
        if packs and ops[-1].kind == "batch" and _short_rows(items[-1], packs[0].seq_len):
            # the packer's short row never stacks with full rows: a batch of its own, last
            assert sizes[-1] == 1 and not drop_last, (case, lane, sizes)
            sizes = sizes[:-1] or [size]
        if ops[-1].kind == "shuffle":  # it may move the lane's last batch: one short at most
            assert sum(s != size for s in sizes) <= 1, (case, sizes)
        else:
            assert all(s == size for s in sizes[:-1]), (case, lane, sizes)
        assert 0 < min(sizes) and (not drop_last or min(sizes) == size), (case, sizes)
        assert [b.meta["lane_index"] for b in items] == list(range(len(items)))
        _check_rows(case, ops, items)
    if drop_last:
        return
    src = pipe.plan().spec.source
    if case.kind == "tokens":
        got = sorted(t for b in batches for row in b["tokens"] for t in np.asarray(row).tolist())
        # each epoch's samples (a mixture's depend on the epoch: its repeats run on)
        views = [src.view(np.arange(len(src)), e) for e in range(case.epochs)]
        want = sorted(t for v in views for i in range(len(src))
                      for t in v.get(i)["tokens"].tolist())
        assert got == want, case
        return
    got = collections.Counter(tuple(s) for b in batches for s in b.meta["sample_ids"])
    want = collections.Counter()
    for e in range(case.epochs):
        view = src.view(np.arange(len(src)), e)
        for i in range(len(src)):
            if case.kind == "kept" and not F.keep_not_seven(view.get(i)):
                continue
            name, idx = view.identity(i)
            want[(name, idx, e)] += 1
    assert got == want, case


def _check_rows(case: Case, ops: list, items: list) -> None:
    packs = [op for op in ops if op.kind == "pack_tokens"]
    if not packs:
        return
    rows = [np.asarray(row) for b in items for row in b["tokens"]]
    # one short row at most: the packer's last (a shuffle after it may move it)
    assert sum(r.size != packs[0].seq_len for r in rows) <= 1, case
    assert all(0 < r.size <= packs[0].seq_len for r in rows), case
    if ops[-2].kind == "pack_tokens":
        assert all(r.size == packs[0].seq_len for r in rows[:-1]), case


def run(pipe, take: int | None = None):
    """``take`` items (all: None) of a run, the iterator's checkpoint after them."""
    it = iter(pipe)
    try:
        out = [b for _, b in zip(range(take), it, strict=False)] if take is not None else list(it)
        return out, it.checkpoint()
    finally:
        it.close()


def restored(case: Case, state: bytes, **opts) -> list:
    pipe = case.make(**opts)
    pipe.restore(state)
    return [key(b) for b in pipe]


def per_lane(keys: list) -> dict:
    out = collections.defaultdict(list)
    for k in keys:
        out[k[0]].append(k)
    return dict(out)


def restored_on_ranks(case: Case, state: bytes, world: int, **opts) -> dict:
    """The lanes of every rank of ``world`` after ``state``, merged by lane."""
    lanes: dict = {}
    for rank in range(world):
        got = per_lane(restored(case, state, world_size=world, global_rank=rank, **opts))
        assert not set(got) & set(lanes)
        lanes.update(got)
    return lanes


def next_pass(case: Case) -> list:
    pipe = case.make()
    pipe.set_epoch(case.epochs)
    return [key(b) for b in pipe]


def fuzz(seeds, cuts_per_case: int, runners=("inline", "threads")) -> None:
    for seed in seeds:
        case = Case(seed)
        full, _ = run(case.make())
        check_shape(case, full)
        keys = [key(b) for b in full]
        r = random.Random(seed)
        cuts = sorted({0, len(keys), *(r.randint(0, len(keys)) for _ in range(cuts_per_case))})
        for cut in cuts:
            where = r.choice(runners)
            head, state = run(case.make(runner=where, max_workers=2), cut)
            assert [key(b) for b in head] == keys[:cut], (case, cut)
            other = r.choice([x for x in runners if x != where] or runners)
            # after the pass's last item, a run goes on with the next pass
            want = keys[cut:] if cut < len(keys) else next_pass(case)
            assert restored(case, state, runner=other, max_workers=3) == want, \
                (case, cut, where, other)
            # on several ranks too, also when some ranks' lanes had all ended (they
            # deliver nothing more of the pass) or every lane had (the next pass)
            if case.lanes > 1:
                world = r.choice([w for w in (2, 4) if w <= case.lanes])
                want = keys[cut:] if cut < len(keys) else next_pass(case)
                assert restored_on_ranks(case, state, world) == per_lane(want), \
                    (case, cut, world)


# -- the examples of the brief ------------------------------------------------------------------

def readme_pipeline(**opts):
    return (Pipeline(sources.from_callable(2_000, F.readme_load), seed=42, chunk_size=64)
            .map(F.readme_augment, parallelism=2).filter(F.readme_keep).shuffle(256).batch(8)
            .options(RuntimeOptions(**opts)))


def test_readme_first_example_yields_only_full_batches():
    batches, _ = run(readme_pipeline(runner="threads", max_workers=2))
    sizes = collections.Counter(len(b["label"]) for b in batches)
    assert sizes == {8: 1800 // 8}  # 1,800 samples kept: 225 full batches, nothing else
    ids = [tuple(s) for b in batches for s in b.meta["sample_ids"]]
    assert len(ids) == len(set(ids)) == 1800


@pytest.mark.parametrize("lanes", [1, 3])
def test_shuffle_then_batch_is_full_mid_epoch(lanes):
    pipe = Pipeline(sources.from_callable(2_000, F.readme_load), seed=42, chunk_size=64) \
        .shuffle(256).batch(7).options(RuntimeOptions(canonical_replicas=lanes))
    batches, _ = run(pipe)
    by_lane = per_lane([(b.meta["lane"], len(b["label"])) for b in batches])
    for lane, sizes in by_lane.items():
        assert {s for _, s in sizes[:-1]} == {7}, lane
    assert sum(len(b["label"]) for b in batches) == 2_000


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_pack_then_batch_delivers_every_token_in_full_rows(drop_remainder):
    src = sources.from_callable(500, F.ragged_tokens)
    pipe = Pipeline(src, seed=1, chunk_size=16).pack_tokens(64, drop_remainder=drop_remainder) \
        .batch(8).options(RuntimeOptions(flush_every_k_chunks=1))
    batches, _ = run(pipe)
    rows = [np.asarray(r) for b in batches for r in b["tokens"]]
    assert all(r.size == 64 for r in rows[:-1])
    total = sum(src.get(i)["tokens"].size for i in range(500))
    delivered = sum(r.size for r in rows)
    if drop_remainder:
        assert rows[-1].size == 64 and delivered == total - total % 64
    else:
        assert delivered == total
        got = sorted(t for r in rows for t in r.tolist())
        assert got == sorted(t for i in range(500) for t in src.get(i)["tokens"].tolist())


def test_drop_last_drops_only_the_last_batch_of_each_lane():
    pipe = Pipeline(sources.from_callable(203, F.make_sample), seed=3, chunk_size=4,
                    num_epochs=2).shuffle(5).batch(6, drop_last=True) \
        .options(RuntimeOptions(canonical_replicas=2, flush_every_k_chunks=1))
    batches, _ = run(pipe)
    assert {len(b["id"]) for b in batches} == {6}
    lengths = [pipe.plan().lane_length(lane) * 2 for lane in range(2)]  # two epochs
    assert len(batches) == sum(n // 6 for n in lengths)


def test_fused_batch_spans_an_epoch_start():
    # read -> batch (fused): 10 samples per epoch, batches of 4: one batch has samples of
    # epochs 0 and 1, and only the stream's last batch is short
    pipe = Pipeline(sources.from_callable(10, F.make_sample), seed=0, chunk_size=5,
                    num_epochs=2).batch(4)
    assert pipe.plan().fused_batch is not None
    batches, _ = run(pipe)
    assert [len(b["id"]) for b in batches] == [4, 4, 4, 4, 4]
    assert {e for _, _, e in batches[2].meta["sample_ids"]} == {0, 1}


# -- the fuzz -----------------------------------------------------------------------------------

def test_fuzz_shape_and_resume_small():
    fuzz(range(14), cuts_per_case=3)


@pytest.mark.parametrize("chain", range(len(CHAINS)))
def test_every_chain_keeps_its_shape_and_resumes(chain):
    case = Case(1000 + chain, chain)
    full, _ = run(case.make())
    check_shape(case, full)
    keys = [key(b) for b in full]
    for cut in (1, len(keys) // 2, len(keys) - 1):
        _, state = run(case.make(), cut)
        assert restored(case, state, runner="threads", max_workers=2) == keys[cut:], case


def test_process_runner_restores_a_threads_checkpoint_with_a_carry():
    case = Case(7, 3)  # shuffle -> pack -> shuffle -> batch
    keys = [key(b) for b in run(case.make())[0]]
    cut = len(keys) // 2 + 1
    _, state = run(case.make(runner="threads", max_workers=2), cut)
    assert any(len(entry) > 4 for entry in decode_state(state)["lanes"].values())
    assert restored(case, state, runner="process", max_workers=2) == keys[cut:]


@pytest.mark.slow
def test_fuzz_shape_and_resume_large():
    fuzz(range(100, 300), cuts_per_case=8)


@pytest.mark.slow
@pytest.mark.ci
def test_fuzz_shape_and_resume_ci():
    fuzz(range(300, 340), cuts_per_case=5)


@pytest.mark.slow
@pytest.mark.ci
def test_fuzz_process_runner():
    fuzz(range(400, 404), cuts_per_case=2, runners=("process", "threads"))


# -- two ranks -> one -> four -------------------------------------------------------------------

def _ranks_checkpoint(case: Case, world: int, take: int, agg: str) -> list:
    """Run ``world`` ranks in threads, ``take`` items each, then the collective checkpoint."""
    out: list = [None] * world
    errors: list = []

    def rank(r: int) -> None:
        try:
            pipe = case.make(world_size=world, global_rank=r, aggregate_dir=agg,
                             run_id="job", aggregate_timeout_s=60)
            it = iter(pipe)
            items = [key(b) for _, b in zip(range(take), it, strict=False)]
            out[r] = (items, it.checkpoint())
            it.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return out


@pytest.mark.parametrize("chain", [0, 2, 4])
def test_two_ranks_to_one_to_four_with_a_carry(tmp_path, chain):
    case = Case(50 + chain, chain)
    case.lanes, case.flush = 4, 1
    full = per_lane([key(b) for b in run(case.make())[0]])
    done = _ranks_checkpoint(case, 2, 5, str(tmp_path / "agg"))
    state = done[0][1]
    assert done[1][1] == state
    delivered: dict = collections.defaultdict(int)
    for items, _ in done:
        for k in items:
            delivered[k[0]] += 1
    rest = {lane: items[delivered[lane]:] for lane, items in full.items()}
    rest = {lane: items for lane, items in rest.items() if items}
    assert per_lane(restored(case, state)) == rest  # on one rank
    four = restored_on_ranks(case, state, 4)
    assert four == rest
    # ... and a checkpoint taken on one rank mid-way restores on four
    one = case.make()
    one.restore(state)
    it = iter(one)
    [next(it) for _ in range(3)]
    again = it.checkpoint()
    it.close()
    after = restored(case, again)
    assert restored_on_ranks(case, again, 4) == per_lane(after)


# -- what a state may hold ----------------------------------------------------------------------

def _replay_state():
    case = Case(3, 1)  # filter -> shuffle -> batch
    case.flush, case.lanes = 1, 2
    keys = [key(b) for b in run(case.make())[0]]
    for cut in range(1, len(keys)):
        _, state = run(case.make(), cut)
        decoded = decode_state(state)
        if any(len(v) > 5 for v in decoded["lanes"].values()):
            return case, decoded, keys[cut:]
    raise AssertionError("no state with a carry")


def test_a_state_with_a_carry_round_trips():
    case, decoded, rest = _replay_state()
    assert restored(case, encode_state(decoded)) == rest


@pytest.mark.parametrize("tamper", ["count", "position", "epoch", "extra", "missing", "type"])
def test_a_tampered_carry_is_refused(tamper):
    case, decoded, _ = _replay_state()
    lane = next(k for k, v in decoded["lanes"].items() if len(v) > 5)
    entry = decoded["lanes"][lane]
    if tamper == "count":
        entry[4] = case.make().ops[-1].size  # a remainder as large as a whole batch
    elif tamper == "position":
        entry[6] = case.make().plan().lane_length(int(lane)) + 3
    elif tamper == "epoch":
        entry[5] = case.epochs + 5
    elif tamper == "extra":
        entry.append(0)
    elif tamper == "missing":
        entry.pop()
    else:
        entry[6] = float(entry[6])
    pipe = case.make()
    with pytest.raises(CheckpointError, match="corrupt checkpoint"):
        pipe.restore(encode_state(decoded))


def test_a_carried_position_after_its_boundary_is_refused():
    case, decoded, _ = _replay_state()
    lane = next(k for k, v in decoded["lanes"].items() if len(v) > 5)
    entry = decoded["lanes"][lane]
    entry[5], entry[6] = entry[0], entry[1] * case.chunk  # the boundary's own position
    with pytest.raises(CheckpointError, match="not before its boundary"):
        case.make().restore(encode_state(decoded))


def test_a_state_of_the_previous_stream_definition_is_refused_by_name():
    case, decoded, _ = _replay_state()
    data = bytearray(encode_state(decoded))
    data[8] = 2  # format version 2: the previous stream definition
    with pytest.raises(CheckpointError, match="previous stream definition"):
        case.make().restore(bytes(data))
