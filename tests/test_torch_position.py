"""The loader says where it is: position() after a restore on any number of ranks, and
steps() runs a fixed number of optimizer steps across epochs from the restored step."""

from __future__ import annotations

import pytest
from _aggregate_rank import ranks_in_threads

from zephon import Pipeline, RuntimeOptions, sources
from zephon.errors import ZephonConfigError

torch = pytest.importorskip("torch")
import zephon.torch as zt  # noqa: E402

pytestmark = pytest.mark.torch


def pipe(num_epochs=1, **opts):
    return Pipeline(sources.from_sequence(list(range(40))), seed=9, chunk_size=2,
                    num_epochs=num_epochs).batch(2).options(RuntimeOptions(**opts))


def ids(batches):
    return [tuple(b.tolist()) for b in batches]


def test_steps_cross_epochs_and_a_restore_goes_on_at_its_step():
    whole = zt.loader(pipe())
    ref = [(step, ids(b)) for step, b in whole.steps(25, micro_batches=2)]
    whole.close()
    assert [s for s, _ in ref] == list(range(25))  # 50 batches: two and a half epochs of 20
    first_epoch = {i for _, b in ref[:10] for batch in b for i in batch}
    assert first_epoch == set(range(40))

    loader = zt.loader(pipe())
    got = []
    for step, b in loader.steps(7, micro_batches=2):
        got.append((step, ids(b)))
    state = loader.state_dict()
    loader.close()
    resumed = zt.loader(pipe())
    resumed.load_state_dict(state)
    assert resumed.position().batches == 14 and resumed.position().samples == 28
    got += [(step, ids(b)) for step, b in resumed.steps(10, micro_batches=2)]
    resumed.close()
    assert got == ref[:10]


def test_a_later_pass_needs_the_trainers_step():
    loader = zt.loader(pipe())
    list(loader.steps(12, micro_batches=2))  # into the second epoch (pass)
    state = loader.state_dict()
    loader.close()
    again = zt.loader(pipe())
    again.load_state_dict(state)
    with pytest.raises(ZephonConfigError, match="give start="):
        again.steps(20, micro_batches=2)
    assert [s for s, _ in again.steps(14, micro_batches=2, start=12)] == [12, 13]
    again.close()


def test_a_position_mid_step_is_refused():
    loader = zt.loader(pipe(num_epochs=None))
    it = iter(loader)
    for _ in range(3):
        next(it)
    with pytest.raises(ZephonConfigError, match="3 batches were delivered"):
        loader.steps(10, micro_batches=2)
    loader.close()


def test_position_after_a_restore_on_one_rank_counts_every_ranks_batches(tmp_path):
    def rank(r):
        loader = zt.loader(pipe(num_epochs=None, world_size=2, global_rank=r,
                                canonical_replicas=4, mapping_strategy="interleaved",
                                aggregate_dir=str(tmp_path / "agg"), run_id="steps"))
        for _ in loader.steps(3, micro_batches=2):
            pass
        assert loader.position().rank_batches == 6
        state = loader.state_dict()
        loader.close()
        return state

    states = ranks_in_threads(2, rank)
    assert states[0] == states[1]
    one = zt.loader(pipe(num_epochs=None, canonical_replicas=4, mapping_strategy="interleaved"))
    one.load_state_dict(states[0])
    pos = one.position()
    assert (pos.batches, pos.rank_batches, pos.samples) == (12, 12, 24)
    # a global batch of 4 micro-batches on one rank: the restored run is at step 3
    assert [s for s, _ in one.steps(5, micro_batches=4)] == [3, 4]
    one.close()
