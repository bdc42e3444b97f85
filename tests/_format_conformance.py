"""What every file-format source must do, checked the same way for each format.

A format's test file builds its corpus with the format's own writer and calls:

- :func:`same_value` to compare a sample zephon read with what the format's library gives
  (arrays by dtype, shape and bytes; bytes, strings, numbers and nested dicts/lists exactly);
- :func:`check_shuffle_modes`: in every shuffle mode (``False``, ``True``, ``"shards"``) one
  epoch delivers each sample exactly once, and the stream is the same on inline and threads;
- :func:`check_restore_on_another_world`: a run checkpointed on ``saved`` ranks and restored
  on ``restored`` ranks delivers, lane by lane, what the uninterrupted one-rank run does.

Ranks run as threads of this process exchanging through a directory (as in
``test_mixture_weights_set.py``), so no process is left behind when a check fails.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from _aggregate_rank import ranks_in_threads
from _streams import take

from zephon import Pipeline, RuntimeOptions

__all__ = ["check_restore_on_another_world", "check_shuffle_modes", "same_value"]

LANES = 4
BATCH = 8


def same_value(got: Any, want: Any) -> bool:
    """Whether two decoded samples are equal: arrays by dtype, shape and values (NaN equal
    to NaN), mappings key by key, sequences item by item, everything else with ``==``."""
    if isinstance(want, np.ndarray) or isinstance(got, np.ndarray):
        a, b = np.asarray(got), np.asarray(want)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(
            same_value(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(
            same_value(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(want, float) and isinstance(got, float) and want != want:
        return got != got
    return bool(got == want) and type(got) is type(want) or (
        isinstance(want, (int, float)) and not isinstance(want, bool)
        and isinstance(got, (int, float, np.number)) and got == want)


def _ids(batch) -> list:
    return [tuple(s) for s in batch.meta["sample_ids"]]


def check_shuffle_modes(source, runners=("inline", "threads")) -> None:
    """One epoch in each shuffle mode holds every sample once; the runners agree."""
    n = len(source)
    for mode in (False, True, "shards"):
        streams = []
        for runner in runners:
            pipe = Pipeline(source, shuffle=mode, seed=7, num_epochs=1,
                            chunk_size=32).batch(BATCH, drop_last=False)
            got = [i for b in pipe.options(RuntimeOptions(runner=runner)) for i in _ids(b)]
            assert sorted(i[1] for i in got) == list(range(n)), (mode, runner)
            streams.append(got)
        assert all(s == streams[0] for s in streams), mode
        if mode is not False:
            assert streams[0] != sorted(streams[0]), f"shuffle={mode!r} left the order as is"


def _pipe(source, world: int = 1, rank: int = 0, **opts):
    return Pipeline(source, shuffle=True, seed=11, chunk_size=16, num_epochs=None).batch(
        BATCH).options(RuntimeOptions(canonical_replicas=LANES, world_size=world,
                                      global_rank=rank, **opts))


def _keyed(batches) -> dict:
    return {(b.meta["lane"], b.meta["lane_index"]): _ids(b) for b in batches}


def check_restore_on_another_world(make_source: Callable[[], Any], tmp_path, saved: int,
                                   restored: int, total: int = 48, cut: int = 20) -> None:
    """``cut`` global steps on ``saved`` ranks, a checkpoint, then the rest up to ``total``
    on ``restored`` ranks (fresh sources in each: as a new launch builds them) equal the
    uninterrupted one-rank run lane by lane. ``cut`` and ``total`` are multiples of both
    world sizes. Pairs such as (2, 4), (4, 2) and (3, 1) compare; (2, 3) and (3, 2) do not:
    on 3 ranks the 4 lanes advance unevenly, so whole global steps cover other
    (lane, index) keys than the one-rank run's first ``total`` batches."""
    assert cut % saved == 0 and cut % restored == 0 and total % restored == 0
    want = _keyed(take(_pipe(make_source()), total))

    def run(world, tag, body):
        return ranks_in_threads(world, lambda r: body(r, _pipe(
            make_source(), world, r, aggregate_dir=str(tmp_path / f"agg-{tag}"), run_id=tag,
            aggregate_timeout_s=60)))

    def first(rank, pipe):
        it = iter(pipe)
        got = [next(it) for _ in range(cut // saved)]
        state = it.checkpoint()
        it.close()
        return got, state

    out = run(saved, f"saved{saved}", first)
    state = out[0][1]
    assert all(o[1] == state for o in out.values())

    def second(rank, pipe):
        pipe.restore(state)
        it = iter(pipe)
        got = [next(it) for _ in range((total - cut) // restored)]
        it.close()
        return got

    got = _keyed([b for o in out.values() for b in o[0]])
    for batches in run(restored, f"restored{restored}", second).values():
        got.update(_keyed(batches))
    assert got == want
