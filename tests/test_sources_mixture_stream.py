"""Position-keyed mixture schedules (``schedule_unit="samples"`` / ``"tokens"``): in
every window of 1,000 batches each component's share is within 0.5 point of the
schedule (1 point by tokens), on every runner and world size, and after a restore on
another world size; the same stream whatever runs it; what such a mixture cannot be is
refused by name."""

from __future__ import annotations

import collections

import _mixture_fns as F
import numpy as np
import pytest
from _aggregate_rank import ranks_in_threads
from _resume import assert_resumes
from _streams import sample_ids, take

from zephon import Pipeline, RuntimeOptions, sources
from zephon.errors import ZephonConfigError

C, BATCH, WINDOW = 4, 16, 1000  # canonical lanes, batch size, batches per window
SIZES = {"code": 3_000, "web": 50_000, "books": 7_000}
STEPS = [(0, {"code": 6, "web": 3, "books": 1}),
         (20_000, {"code": 1, "web": 5, "books": 4}),
         (36_000, {"code": 2, "web": 2, "books": 6})]


def mixture(weights=STEPS, **kw):
    return sources.mixture({k: sources.from_callable(n, F.row, name=k)
                            for k, n in SIZES.items()}, weights, schedule_unit="samples", **kw)


def pipe(mix, runner="inline", world=1, rank=0, **opts):
    return Pipeline(mix, seed=3, chunk_size=64, num_epochs=None).batch(BATCH).options(
        RuntimeOptions(runner=runner, max_workers=2, canonical_replicas=C, world_size=world,
                       global_rank=rank, **opts))


def component_of(sid) -> str:
    return sid[0].split("#")[0]


def assert_windows_hold(mix, batches, tolerance=0.005, start=0):
    """Each window of WINDOW batches holds each component's scheduled share, the schedule's
    mean over the window's stream positions."""
    names = mix.names
    for w in range(len(batches) // WINDOW):
        ids = sample_ids(batches[w * WINDOW:(w + 1) * WINDOW])
        counts = collections.Counter(component_of(s) for s in ids)
        lo, hi = start + w * WINDOW * BATCH, start + (w + 1) * WINDOW * BATCH
        want = np.diff(mix.stream.expected(np.array([lo, hi])), axis=0)[0] / (hi - lo)
        for k, name in enumerate(names):
            got = counts[name] / len(ids)
            assert abs(got - want[k]) <= tolerance, (w, name, got, want[k])


@pytest.mark.parametrize("interpolate", ["step", "linear"])
@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_every_window_of_a_thousand_batches_holds_the_schedule(runner, interpolate):
    mix = mixture(interpolate=interpolate)
    batches = take(pipe(mix, runner), 3 * WINDOW)
    assert_windows_hold(mix, batches)
    if runner != "inline":  # one stream whatever runs it
        assert sample_ids(batches) == sample_ids(take(pipe(mix), 3 * WINDOW))


def test_a_module_level_function_is_a_schedule_and_runs_in_workers():
    mix = mixture(F.code_then_web)
    batches = take(pipe(mix, "process"), 2 * WINDOW)
    assert_windows_hold(mix, batches)
    assert sample_ids(batches) == sample_ids(take(pipe(mix), 2 * WINDOW))


def lane_keyed(batches) -> dict:
    return {(b.meta["lane"], b.meta["lane_index"]): b.meta["sample_ids"] for b in batches}


@pytest.mark.parametrize("world", [2, 4])
def test_the_ranks_make_the_one_rank_stream_and_each_holds_the_schedule(world):
    mix = mixture()
    one = lane_keyed(take(pipe(mix), 2 * WINDOW))
    for rank in range(world):
        batches = take(pipe(mix, world=world, rank=rank), 2 * WINDOW // world)
        for key, ids in lane_keyed(batches).items():
            assert one[key] == ids
        counts = collections.Counter(component_of(s) for s in sample_ids(batches))
        whole = collections.Counter(component_of(s) for s in sample_ids(
            take(pipe(mix), 2 * WINDOW)))
        for name in mix.names:  # a rank's share is the whole stream's
            assert abs(counts[name] / sum(counts.values())
                       - whole[name] / sum(whole.values())) <= 0.01


def test_a_restore_on_the_process_runner_resumes_exactly():
    mix = mixture()
    rest = assert_resumes(lambda: pipe(mix, "process"), 1_237, key=lambda b: b.meta["sample_ids"],
                          limit=2 * WINDOW, reference=[b.meta["sample_ids"] for b in
                                                       take(pipe(mix), 2 * WINDOW)]).rest
    assert len(rest) == 2 * WINDOW - 1_237


@pytest.mark.parametrize("saved, restored", [(2, 1), (1, 4), (4, 2)])
def test_a_restore_on_another_world_size_continues_the_stream(tmp_path, saved, restored):
    mix = mixture()
    cut = int(np.random.default_rng(saved * 10 + restored).integers(200, 1_800))
    cut -= cut % 4  # a step of every rank

    def save(r):
        it = iter(pipe(mix, world=saved, rank=r, aggregate_dir=str(tmp_path / "agg"),
                       run_id="stream", aggregate_timeout_s=60))
        for _ in range(cut // saved):
            next(it)
        state = it.checkpoint()
        it.close()
        return state

    states = ranks_in_threads(saved, save)
    one = take(pipe(mix), 3 * WINDOW)
    want = lane_keyed(one[cut:])
    got: dict = {}
    for r in range(restored):
        p = pipe(mix, world=restored, rank=r)
        p.restore(states[0])
        got.update(lane_keyed(take(p, (3 * WINDOW - cut) // restored - 8)))
    for key, ids in got.items():
        assert want[key] == ids
    assert len(got) >= 3 * WINDOW - cut - 8 * restored - C
    # the stream from the cut on holds the schedule too
    assert_windows_hold(mix, one[cut:cut + WINDOW], start=cut * BATCH, tolerance=0.006)


def test_token_keyed_steps_hold_the_token_shares_within_a_point():
    comps = {"short": sources.from_callable(5_000, F.tokens_of_length(10), name="short"),
             "long": sources.from_callable(5_000, F.tokens_of_length(40), name="long")}
    steps = [(0, {"short": 0.8, "long": 0.2}), (300_000, {"short": 0.3, "long": 0.7})]
    mix = sources.mixture(comps, steps, schedule_unit="tokens", by="tokens",
                          tokens_per_sample={"short": 10, "long": 40})
    batches = take(Pipeline(mix, seed=1, num_epochs=None).batch(BATCH), 3 * WINDOW)
    lengths = {"short": 10, "long": 40}
    tokens_seen, windows = 0, []
    for w in range(3):
        counts = collections.Counter(component_of(s) for s in
                                     sample_ids(batches[w * WINDOW:(w + 1) * WINDOW]))
        tokens = {k: counts[k] * n for k, n in lengths.items()}
        total = sum(tokens.values())
        windows.append((tokens_seen, tokens_seen + total, tokens["long"] / total))
        tokens_seen += total
    for lo, hi, long_share in windows:
        if hi <= 300_000:
            assert abs(long_share - 0.2) <= 0.01
        elif lo >= 300_000:
            assert abs(long_share - 0.7) <= 0.01
        else:  # the window of the step: its token-weighted mean
            want = (0.2 * (300_000 - lo) + 0.7 * (hi - 300_000)) / (hi - lo)
            assert abs(long_share - want) <= 0.01


@pytest.mark.parametrize("kw, match", [
    ({"exhausted": "stop"}, "exhausted='repeat'"),
    ({"max_repeats": 2}, "no max_repeats"),
    ({"schedule_unit": "steps"}, "schedule_unit must be one of"),
    ({"interpolate": "cubic"}, "interpolate must be one of"),
])
def test_what_a_position_keyed_schedule_cannot_be_is_refused(kw, match):
    comps = {k: sources.from_callable(n, F.row, name=k) for k, n in SIZES.items()}
    kw = {"schedule_unit": "samples", **kw}
    with pytest.raises(ZephonConfigError, match=match):
        sources.mixture(comps, STEPS, **kw)


def test_a_nested_mixture_and_a_shard_shuffle_are_refused():
    inner = sources.mixture({"x": sources.from_callable(10, F.row, name="x"),
                             "y": sources.from_callable(10, F.row, name="y")})
    with pytest.raises(ZephonConfigError, match="flatten it"):
        sources.mixture({"inner": inner, "z": sources.from_callable(5, F.row, name="z")},
                        {"inner": 1, "z": 1}, schedule_unit="samples")
    with pytest.raises(ZephonConfigError, match="orders itself"):
        Pipeline(mixture(), shuffle="shards")
    many = {f"c{k}": sources.from_callable(1, F.row, name=f"c{k}") for k in range(257)}
    with pytest.raises(ZephonConfigError, match="at most 256 components"):
        sources.mixture(many, {k: 1 for k in many}, schedule_unit="samples")


def test_the_schedule_and_the_shuffle_flag_are_part_of_the_fingerprint():
    base = Pipeline(mixture(), seed=1).fingerprint()
    assert Pipeline(mixture(interpolate="linear"), seed=1).fingerprint() != base
    assert Pipeline(mixture(), seed=1, shuffle=False).fingerprint() != base
    assert Pipeline(mixture(), seed=1).fingerprint() == base


def test_far_positions_cost_what_near_ones_do_and_build_nothing_of_their_size():
    mix = mixture()
    far = mix.stream.locate(np.arange(10**12, 10**12 + 4096), 0)
    near = mix.stream.locate(np.arange(4096), 0)
    assert far[0].shape == near[0].shape == (4096,)
    last = mix.stream.share(np.array([10**12]))[0]  # the last step's rates
    counts = np.bincount(far[0], minlength=3) / 4096
    assert np.abs(counts - last).max() < 0.02


def two(size_a=1_000, size_b=1_000):
    return {"a": sources.from_callable(size_a, F.row, name="a"),
            "b": sources.from_callable(size_b, F.row, name="b")}


def names_at(mix, n, shuffle=False):
    """The component names of the stream's first ``n`` positions, epoch after epoch."""
    ordered, out = mix.ordered(shuffle), []
    for epoch in range(-(-n // len(mix))):
        count = min(len(mix), n - len(out))
        view = ordered.view(np.arange(count), epoch)
        out += [view.identity(i)[0] for i in range(count)]
    return out


def test_a_token_keyed_schedule_of_sample_weights_keeps_them_sample_weights():
    mix = sources.mixture(two(), [(0, {"a": 1, "b": 1}), (10**6, {"a": 1, "b": 3})],
                          schedule_unit="tokens", tokens_per_sample={"a": 1, "b": 100})
    assert mix.stream.share(np.array([0.0]))[0].tolist() == [0.5, 0.5]
    assert len(mix) == 2_000  # an epoch: each component's size once


def test_a_pass_is_read_whole_before_the_next_and_in_order_unshuffled():
    got = names_at(sources.mixture(two(), {"a": 1, "b": 1}, schedule_unit="samples"), 4_000)
    a = [n for n in got if n.split("#")[0] == "a"]
    assert a.index("a#1") == 1_000 and a[1_000:].count("a") == 0
    mix = sources.mixture(two(), {"a": 1, "b": 1}, schedule_unit="samples")
    view = mix.ordered(False).view(np.arange(600), 0)
    first = [view.identity(i)[1] for i in range(600) if view.identity(i)[0] == "a"]
    assert first == list(range(len(first)))  # as_is: the component's own order


def test_a_component_switched_off_holds_no_position_between_its_steps():
    mix = sources.mixture(two(), [(0, {"a": 1, "b": 1}), (1_000, {"a": 1, "b": 0}),
                                  (5_000, {"a": 1, "b": 1})], schedule_unit="samples")
    got = names_at(mix, 6_000, shuffle=True)
    # the steps land on the nearest multiples of 256: 1024 and 5120
    assert not any(n.startswith("b") for n in got[1_024:5_120])
    assert sum(n.startswith("b") for n in got[:1_024]) == 512


def test_tiny_weights_make_no_epoch_too_long_and_far_positions_are_refused_by_name():
    mix = sources.mixture(two(10**7, 10**7), {"a": 1, "b": 1e-9}, schedule_unit="samples")
    assert len(mix) == 2 * 10**7
    with pytest.raises(ZephonConfigError, match="2\\*\\*48"):
        mix.stream.locate(np.array([2**49]), 0)


def test_a_function_schedule_far_out_is_cheap_pickles_small_and_is_thread_safe():
    import pickle
    import threading

    mix = mixture(F.code_then_web)
    fresh = pickle.loads(pickle.dumps(mix))
    small = len(pickle.dumps(mix))
    far = mix.stream.locate(np.arange(10**9, 10**9 + 4096), 5)
    assert len(pickle.dumps(mix)) < small + 4096  # the grown breakpoints stay behind
    results = {}

    def run(name, start):
        results[name] = mix.stream.locate(np.arange(start, start + 4096), 5)

    threads = [threading.Thread(target=run, args=(n, s))
               for n, s in (("far", 3 * 10**9), ("near", 3_000_000))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, start in (("far", 3 * 10**9), ("near", 3_000_000)):
        want = fresh.stream.locate(np.arange(start, start + 4096), 5)
        assert all(np.array_equal(a, b) for a, b in zip(results[name], want, strict=True))
    assert np.array_equal(far[0], fresh.stream.locate(np.arange(10**9, 10**9 + 4096), 5)[0])


def test_ensure_mixture_and_a_position_keyed_mixture_inside_another_are_refused():
    with pytest.raises(ZephonConfigError, match="drop ensure_mixture"):
        Pipeline(mixture()).ensure_mixture()
    with pytest.raises(ZephonConfigError, match="flatten it into one mixture"):
        sources.mixture({"s": mixture(), "z": sources.from_callable(5, F.row, name="z")},
                        {"s": 1, "z": 1})
