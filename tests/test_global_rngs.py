"""The global generators seeded per op call (``RuntimeOptions.seed_global_rngs``).

An op drawing from torch's default generator (torchvision's random transforms), NumPy's
legacy ``np.random`` or Python's ``random`` (albumentations-style code) gives the same
stream on every runner and after a restore on another runner; the consumer's own states
are given back; ``auto`` seeds what validation saw an op draw from, ``all`` every map and
filter, ``off`` nothing (a draw is Z002 as before); randomness no seeding reaches is still
refused; ``ctx.rng`` is untouched.
"""

from __future__ import annotations

import random

import _rng_fns as F
import numpy as np
import pytest
from _resume import assert_resumes
from _streams import batch_key, keys_of

from zephon import Pipeline, RuntimeOptions, sources
from zephon.errors import ValidationError
from zephon.pipeline.ops.base import OpContext
from zephon.pipeline.rngs import global_seeds
from zephon.pipeline.validate import validate

# torch's generator is one of the three: the file needs torch (the torch extra)
torch = pytest.importorskip("torch")

N = 16


def _pipe(**opts) -> Pipeline:
    """Every kind of global draw, in two stages (a map after the shuffle is stage 1)."""
    return (Pipeline(sources.from_callable(N, F.make_sample), seed=11, chunk_size=3)
            .map(F.torch_noise).map(F.numpy_noise).map(F.random_noise)
            .map(F.albumentations_like).filter(F.random_keep)
            .batch(2).options(RuntimeOptions(**opts)))


class _Pipes:
    """Pipelines made by a test, closed at its end (their workers are kept after a pass)."""

    def __init__(self) -> None:
        self.made: list[Pipeline] = []

    def __call__(self, make, **opts):
        def factory() -> Pipeline:
            pipe = make(**opts)
            self.made.append(pipe)
            return pipe
        return factory

    def close(self) -> None:
        for pipe in self.made:
            pipe.close()


@pytest.fixture
def pipes():
    made = _Pipes()
    try:
        yield made
    finally:
        made.close()


def _stream(pipes, make=_pipe, **opts) -> list:
    return keys_of(pipes(make, **opts)(), batch_key)


def _set_user_states(n: int) -> None:
    np.random.seed(n)
    random.seed(n + 1)
    torch.manual_seed(n + 2)


def _user_states() -> tuple:
    legacy = np.random.get_state()
    return (legacy[1].tobytes(), legacy[2:], random.getstate(),
            torch.random.get_rng_state().numpy().tobytes())


# -- the seeds ---------------------------------------------------------------------------------


def test_global_seeds_are_a_pure_function_pinned_across_processes():
    # a literal: a seed that depended on the process (hash randomization, a pid) fails here
    s = global_seeds(7, ("callable", 3, 1), 0)
    assert s.torch == 805496629113664950
    assert s.numpy.tolist() == [2638725132, 670491635, 4222024113, 3358673535]
    assert s.random == 273581518172045766115047349429593714428
    others = [global_seeds(8, ("callable", 3, 1), 0), global_seeds(7, ("callable", 4, 1), 0),
              global_seeds(7, ("callable", 3, 2), 0), global_seeds(7, ("callable", 3, 1), 1),
              global_seeds(7, ("other", 3, 1), 0)]
    assert len({o.torch for o in others} | {s.torch}) == 6


def test_a_seeded_call_draws_what_the_identity_seeds():
    out = keys_of(Pipeline(sources.from_callable(4, F.make_sample), seed=7, shuffle=False)
                  .map(F.numpy_noise).map(F.torch_noise))
    for sample in out:
        sid = ("callable", sample["id"], 0)
        np.random.seed(global_seeds(7, sid, 0).numpy)
        assert sample["numpy"].tolist() == np.random.random(3).tolist()
        torch.default_generator.manual_seed(global_seeds(7, sid, 1).torch)  # the 2nd op
        assert sample["torch"].tolist() == torch.rand(3).double().tolist()
    assert len({tuple(s["numpy"]) for s in out}) == 4  # every sample its own numbers


def test_two_ops_drawing_on_one_sample_draw_different_numbers():
    out = keys_of(Pipeline(sources.from_callable(3, F.make_sample), shuffle=False)
                  .map(F.numpy_noise).map(F.numpy_noise_again))
    assert all(s["numpy"].tolist() != s["numpy2"].tolist() for s in out)


def test_ctx_rng_is_unchanged_by_the_feature():
    # values the code gave before the global generators were seeded
    rng = OpContext(("callable", 3, 1), 7).rng
    assert rng.integers(0, 2**32, size=3).tolist() == [3330598038, 2829382497, 3497543459]
    assert rng.random() == 0.7302877830544827
    outs = []
    for mode in ("off", "all"):
        pipe = Pipeline(sources.from_callable(4, F.make_sample), seed=7, shuffle=False) \
            .map(F.ctx_noise).map(F.numpy_noise).options(RuntimeOptions(
                seed_global_rngs=mode, auto_validation="off"))
        outs.append([s["ctx"].tolist() for s in pipe])
    expected = [OpContext(("callable", i, 0), 7).rng.random(2).tolist() for i in range(4)]
    assert outs == [expected, expected]


# -- one stream on every runner ------------------------------------------------------------------


@pytest.mark.parametrize("opts", [
    dict(runner="threads", max_workers=1),
    dict(runner="threads", max_workers=3),
    dict(runner="process", max_workers=1),
    dict(runner="process", max_workers=3),
    dict(mtp_mode=True),
    dict(worker_allocation="autotune", max_workers=2),
], ids=["threads1", "threads3", "process1", "process3", "mtp", "adaptive"])
def test_the_stream_is_the_same_on_every_runner(pipes, opts):
    _set_user_states(1)
    reference = _stream(pipes, runner="inline")
    _set_user_states(2)  # what the consumer's generators hold does not matter
    assert _stream(pipes, **opts) == reference
    assert len(reference) >= 4 and len({repr(k[3]) for k in reference}) == len(reference)


def test_a_restore_mid_epoch_on_another_runner_gives_the_rest(pipes):
    assert_resumes(pipes(_pipe, runner="inline"), 2, key=batch_key,
                   again=pipes(_pipe, runner="threads", max_workers=3))
    assert_resumes(pipes(_pipe, runner="threads", max_workers=2), 3, key=batch_key,
                   again=pipes(_pipe, runner="process", max_workers=2), next_pass=False)


def _replay_pipe(**opts) -> Pipeline:
    """A batch after a shuffle: a restore replays from a boundary and rebuilds what the
    batch held by running its samples through the seeded ops again."""
    return Pipeline(sources.from_callable(N, F.make_sample), seed=3, chunk_size=2) \
        .map(F.numpy_noise).shuffle(3).map(F.random_noise).batch(3) \
        .options(RuntimeOptions(seed_global_rngs="all", flush_every_k_chunks=1, **opts))


@pytest.mark.parametrize("k", [1, 3])
def test_a_replayed_restore_rebuilds_seeded_records_exactly(pipes, k):
    assert_resumes(pipes(_replay_pipe, runner="inline"), k, key=batch_key,
                   again=pipes(_replay_pipe, runner="threads", max_workers=2))


def test_seeded_calls_on_threads_run_one_at_a_time(pipes):
    F.overlap_peak(reset=True)
    out = _stream(pipes, lambda **o: Pipeline(sources.from_callable(24, F.make_sample))
                  .map(F.numpy_noise_counting_overlap).batch(4)
                  .options(RuntimeOptions(**o)), runner="threads", max_workers=3)
    assert len(out) == 6 and F.overlap_peak() == 1


# -- the consumer's own states ---------------------------------------------------------------


@pytest.mark.parametrize("opts", [dict(runner="inline"), dict(runner="threads", max_workers=3),
                                  dict(runner="process", max_workers=2)],
                         ids=["inline", "threads", "process"])
def test_the_consumers_states_are_unchanged_after_iteration(pipes, opts):
    _set_user_states(5)
    before = _user_states()
    assert _stream(pipes, **opts)
    assert _user_states() == before


def test_a_consumer_drawing_between_batches_gets_its_own_sequence(pipes):
    np.random.seed(3)
    alone = [np.random.random() for _ in range(8)]
    np.random.seed(3)
    drawn = []
    for _ in pipes(_pipe, runner="inline")():
        drawn.append(np.random.random())
    assert len(drawn) >= 4 and drawn == alone[:len(drawn)]


# -- auto, all, off --------------------------------------------------------------------------


def test_auto_seeds_the_generators_each_op_was_seen_drawing_from():
    pipe = Pipeline(sources.from_callable(4, F.make_sample)).map(F.torch_noise) \
        .map(F.numpy_noise).map(F.albumentations_like).filter(F.random_keep).map(F.ctx_noise)
    keys_of(pipe)
    # an op seen drawing from any of them is seeded for all three (torch is imported
    # here): its draws on other samples may go to another generator
    everything = {"torch", "numpy", "random"}
    assert [set(which) for which in validate(pipe.plan(), "pickle")] == [
        everything, everything, everything, everything, set()]


def _some(mode: str, consumer_seed: int, validation: str = "strict") -> list:
    np.random.seed(consumer_seed)
    pipe = Pipeline(sources.from_callable(6, F.make_sample), shuffle=False) \
        .map(F.numpy_on_some).options(RuntimeOptions(seed_global_rngs=mode,
                                                     auto_validation=validation))
    return [s["some"] for s in pipe]


def test_all_seeds_an_op_that_draws_only_on_some_samples_and_auto_does_not():
    # validation probes sample 0, where the op does not draw: auto leaves it unseeded
    assert _some("auto", 1) != _some("auto", 2)
    assert _some("all", 1) == _some("all", 2)


def test_auto_with_validation_off_seeds_nothing_and_all_still_seeds():
    def run(mode: str, consumer_seed: int) -> list:
        np.random.seed(consumer_seed)
        pipe = Pipeline(sources.from_callable(4, F.make_sample), shuffle=False) \
            .map(F.numpy_noise).options(RuntimeOptions(seed_global_rngs=mode,
                                                       auto_validation="off"))
        return [s["numpy"].tolist() for s in pipe]
    assert run("auto", 1) != run("auto", 2)
    assert run("all", 1) == run("all", 2)


def test_all_seeds_a_map_after_a_serial_op_on_every_runner(pipes):
    def make(**opts):
        return Pipeline(sources.from_callable(12, F.make_sample), seed=4, chunk_size=4) \
            .shuffle(4).map(F.random_noise).batch(3) \
            .options(RuntimeOptions(seed_global_rngs="all", **opts))
    reference = _stream(pipes, make, runner="inline")
    assert _stream(pipes, make, runner="process", max_workers=2) == reference


@pytest.mark.parametrize("fn, label", [
    (F.numpy_noise, "numpy's global RNG (np.random)"),
    (F.random_noise, "the random module's global RNG"),
    (F.torch_noise, "torch's global RNG"),
])
def test_off_refuses_a_global_draw_as_before(fn, label):
    pipe = Pipeline(sources.from_callable(4, F.make_sample)).map(fn) \
        .options(RuntimeOptions(seed_global_rngs="off"))
    with pytest.raises(ValidationError) as info:
        iter(pipe)
    (issue,) = [i for i in info.value.issues if i.code == "Z002"]
    assert label in str(issue) and "seed_global_rngs='auto'" in str(issue)
    assert "ctx.rng" in str(issue)


@pytest.mark.parametrize("fn", [F.unseeded_generator, F.kept_generator, F.urandom])
@pytest.mark.parametrize("mode", ["auto", "all"])
def test_randomness_no_seeding_reaches_is_still_refused(fn, mode):
    pipe = Pipeline(sources.from_callable(4, F.make_sample)).map(fn) \
        .options(RuntimeOptions(seed_global_rngs=mode))
    with pytest.raises(ValidationError) as info:
        iter(pipe)
    (issue,) = [i for i in info.value.issues if i.code == "Z002"]
    text = str(issue)
    assert "changed between two runs" in text and "ctx.rng" in text
    assert "made without a seed" in text and "auto_validation='off'" in text
    if mode == "all":
        assert "seeded from the sample's identity" in text


def test_a_seeded_op_that_also_draws_from_its_own_generator_is_refused():
    pipe = Pipeline(sources.from_callable(4, F.make_sample)).map(F.torch_and_unseeded)
    with pytest.raises(ValidationError) as info:
        iter(pipe)
    (issue,) = [i for i in info.value.issues if i.code == "Z002"]
    text = str(issue)
    assert "torch's global RNG" in text and "seeded from the sample's identity" in text
    assert "cannot be seeded per call" in text


def test_an_op_iterating_a_seeded_threads_pipeline_of_its_own_does_not_hang():
    """The outer op draws nothing, so it is not seeded and its probes run its code
    without the seeded calls' lock: the inner pipeline's seeded calls on its threads run
    (they used to wait for ever on the probe's lock), and the probe's plants by another
    thread are told apart from draws by making the call again."""
    pipe = Pipeline(sources.from_callable(3, F.make_sample), shuffle=False) \
        .map(F.inner_numpy_pipeline)
    first, second = list(pipe), list(pipe)
    assert len(first) == 3 and [s["inner"] for s in first] == [s["inner"] for s in second]


def test_two_pipelines_checked_at_once_on_two_threads_see_no_draw_of_each_other():
    """Validation under seed_global_rngs="auto" plants all three generators before an
    op's first probe call: unlocked, a pipeline checked on another thread at that moment
    saw the plants as its own op's draws (a false Z002 that failed a CI run of two ranks
    in threads). Pipeline A's op, seen drawing nothing, is inside its second probe when
    B's first probe plants; B's op waits until A's check is over. A's probe sees that
    the generators changed under it and calls the op again."""
    import threading

    F.HOLD.update(entered=threading.Event(), release=threading.Event(), calls=0,
                  b_entered=threading.Event(), a_done=threading.Event(), b_calls=0)
    errors: list[BaseException] = []

    def first_of(pipe):
        try:
            it = iter(pipe)
            next(it)
            it.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    def pipe(fn):
        return Pipeline(sources.from_callable(4, F.make_sample), shuffle=False) \
            .map(fn).options(RuntimeOptions(runner="inline"))

    a = threading.Thread(target=first_of, args=(pipe(F.held_once),), daemon=True)
    b = threading.Thread(target=first_of, args=(pipe(F.waits_for_a),), daemon=True)
    a.start()
    assert F.HOLD["entered"].wait(30)
    b.start()
    F.HOLD["b_entered"].wait(1.0)  # B planted (unlocked) or waits for A's probe to end
    F.HOLD["release"].set()
    a.join(60)
    F.HOLD["a_done"].set()
    b.join(60)
    assert not a.is_alive() and not b.is_alive()
    assert not errors, errors


def _nested(name: str, mode: str, consumer: int) -> dict:
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, os.path.join(here, "_nested_rng_run.py"), name,
                           mode, str(consumer)], capture_output=True, text=True, timeout=120,
                          cwd=here)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(lines[-1])


@pytest.mark.parametrize("name", ["draws_then_inner_inline", "inner_on_a_helper_thread"])
def test_ops_running_pipelines_of_their_own_are_seeded_and_do_not_hang(name):
    """An op that iterates a pipeline of its own (inline, on its thread or on a helper
    thread) runs, its own draws are seeded, and the stream does not depend on the
    consumer's generators."""
    first, second = _nested(name, "auto", 1), _nested(name, "auto", 2)
    assert "stream" in first, first
    assert first == second


@pytest.mark.parametrize("name, mode", [("draws_then_inner_threads", "auto"),
                                        ("draws_then_inner_threads", "all")])
def test_a_seeded_op_starting_a_seeded_threads_pipeline_is_an_error_not_a_hang(name, mode):
    """The seeded op's call holds the lock the inner pipeline's threads would wait for:
    the inner run is refused with the ways out (it used to hang for ever)."""
    got = _nested(name, mode, 1)
    assert "error" in got, got
    assert "runner='inline' or runner='process'" in got["text"], got


# -- how draws are seen ----------------------------------------------------------------------


@pytest.mark.parametrize("fn", [F.numpy_noise, F.no_draw],
                         ids=["numpy-drawing op", "op drawing nothing"])
@pytest.mark.parametrize("runner", ["inline", "threads"])
def test_a_cached_normal_of_the_consumer_is_given_back_too(fn, runner):
    # np.random's legacy generator keeps the second normal of a pair (has_gauss): a draw
    # check that reads only the raw key and position must not lose it, since the probes
    # seed np.random and the consumer's next randn() would then differ
    np.random.seed(11)
    np.random.randn()  # one of a pair: the other is cached now
    before = np.random.get_state(legacy=False)
    pipe = Pipeline(sources.from_callable(4, F.make_sample), shuffle=False).map(fn) \
        .options(RuntimeOptions(runner=runner, max_workers=2))
    assert len(list(pipe)) == 4
    after = np.random.get_state(legacy=False)
    assert after["has_gauss"] == before["has_gauss"] == 1 and after["gauss"] == before["gauss"]
    assert after["state"]["pos"] == before["state"]["pos"]
    assert np.array_equal(after["state"]["key"], before["state"]["key"])


def test_draws_are_seen_whatever_np_random_s_bit_generator():
    # the quick read of np.random's state is for numpy's MT19937; another global bit
    # generator falls back to get_state, and draws are seen all the same
    original = np.random.get_bit_generator()
    np.random.set_bit_generator(np.random.PCG64(5))
    try:
        def run(mode: str, consumer_seed: int) -> list:
            np.random.set_bit_generator(np.random.PCG64(consumer_seed))
            pipe = Pipeline(sources.from_callable(4, F.make_sample), shuffle=False) \
                .map(F.numpy_noise).options(RuntimeOptions(seed_global_rngs=mode))
            return [s["numpy"].tolist() for s in pipe]
        assert run("auto", 1) == run("auto", 2)  # seen drawing: seeded
        with pytest.raises(ValidationError):
            run("off", 1)

        def normals(consumer_cached: bool) -> list:
            # np.random.seed drops legacy's cached second normal only under MT19937:
            # here each seeded call took the normal the call before (or the consumer)
            # had left, and validation called the op not deterministic
            np.random.set_bit_generator(np.random.PCG64(1))
            if consumer_cached:
                np.random.standard_normal()
            pipe = Pipeline(sources.from_callable(4, F.make_sample), shuffle=False) \
                .map(F.numpy_normal)
            return [float(s["normal"]) for s in pipe]
        assert normals(False) == normals(True)
    finally:
        np.random.set_bit_generator(original)
