"""Run state in one place: a Pipeline is a definition whose only mutable member is its
Progress (where the next run starts, the live runs, the checkpoint rounds); a run's own
state is its iterator's. Also the iterator's end of life (``next()`` after ``close()``)
and its rank-local ``get_state``/``set_state``."""

from __future__ import annotations

import pickle

import _pipeline_fns as F
import pytest

from zephon import CheckpointError, IteratorClosedError, Pipeline, RuntimeOptions, sources
from zephon.checkpoint import decode_state, encode_state
from zephon.pipeline.engine import Plan
from zephon.pipeline.progress import Progress, RunRecord
from zephon.pipeline.spec import PipelineSpec


def pipeline(n=23, chain="replay", **opts):
    base = Pipeline(sources.from_callable(n, F.make_sample), seed=4, chunk_size=3).map(F.noisy)
    base = base.shuffle(4).batch(2) if chain == "replay" else base.batch(2)
    return base.options(RuntimeOptions(**{"canonical_replicas": 2, **opts}))


def key(b):
    return (b.meta["lane"], b.meta["lane_index"], tuple(b.meta["sample_ids"]))


def keys(items):
    return [key(b) for b in items]


# -- the pipeline is a definition -----------------------------------------------------------
_IMMUTABLE = (int, str, bool, type(None), RuntimeOptions)
_DEFINITION = {"spec": PipelineSpec, "_plan": Plan}  # the frozen definition, its cached plan


def _assert_only_progress_is_mutable(pipe):
    for name, value in vars(pipe).items():
        if name == "_progress":
            assert type(value) is Progress, name
        elif name in _DEFINITION:
            assert isinstance(value, (_DEFINITION[name], type(None))), name
        elif isinstance(value, tuple):
            assert all(not isinstance(v, (list, dict, set)) for v in value), name
        else:
            assert isinstance(value, _IMMUTABLE), f"Pipeline.{name}: {type(value).__name__}"


def _everything_a_user_does(pipe):
    """Iterate, break, checkpoint, restore, set_epoch, close, read stats."""
    for i, _ in enumerate(pipe):
        if i == 2:
            break
    state = pipe.checkpoint()
    it = iter(pipe)
    next(it)
    it.checkpoint(), it.get_state(), pipe.checkpoint(), pipe.stats(), pipe.final_state
    pipe.restore(state)  # the live run restarts
    pipe.set_epoch(3)
    next(it)
    pipe.close()
    pipe.restore(state)  # no run going: the next one starts there
    list(pipe)
    pipe.set_epoch(1)
    return it


def test_running_changes_nothing_on_the_pipeline_but_its_progress():
    pipe = pipeline()
    pipe.plan(), pipe.fingerprint()  # the cached derived values, computed once
    before = dict(vars(pipe))
    progress = pipe._progress
    fresh = (progress.latest, progress.rounds)
    it = _everything_a_user_does(pipe)
    assert vars(pipe).keys() == before.keys(), "an attribute appeared on the Pipeline"
    for name, value in vars(pipe).items():
        assert value is before[name], f"Pipeline.{name} was replaced"
    assert (progress.latest, progress.rounds) != fresh  # the run state went there
    assert it.record is not progress.latest  # set_epoch with no run going placed a start
    _assert_only_progress_is_mutable(pipe)


def test_no_member_of_a_pipeline_is_mutable_but_its_progress():
    pipe = pipeline()
    _assert_only_progress_is_mutable(pipe)
    _everything_a_user_does(pipe)
    _assert_only_progress_is_mutable(pipe)
    derived = pipe.map(F.identity)
    _assert_only_progress_is_mutable(derived)
    assert derived._progress is not pipe._progress


def test_the_check_sees_a_run_state_that_reappears():
    pipe = pipeline()
    pipe._record = RunRecord()  # a run's state held on the definition
    with pytest.raises(AssertionError, match="_record"):
        _assert_only_progress_is_mutable(pipe)
    pipe = pipeline()
    pipe._runs = []
    with pytest.raises(AssertionError, match="_runs"):
        _assert_only_progress_is_mutable(pipe)


def test_a_pickled_pipeline_is_the_definition_without_its_runs():
    pipe = pipeline()
    first = keys(pipe)
    it = iter(pipe)  # a live run (its weak reference does not pickle)
    next(it)
    copy = pickle.loads(pickle.dumps(pipe))
    it.close()
    assert keys(copy) == first  # starts at epoch 0, as a new definition
    assert copy.fingerprint() == pipe.fingerprint()


# -- the shortcuts act on the latest run ----------------------------------------------------
def test_the_shortcuts_act_on_the_latest_run():
    reference = keys(pipeline())
    pipe = pipeline()
    older = iter(pipe)
    assert keys([next(older) for _ in range(3)]) == reference[:3]
    latest = iter(pipe)  # continues after the older one's last item
    assert key(next(latest)) == reference[3]
    assert pipe.checkpoint() == latest.checkpoint()
    start = pipe.checkpoint()
    next(latest)
    pipe.restore(start)  # restarts the latest run, not the older one
    assert keys(latest) == reference[4:]
    assert key(next(older)) == reference[3]
    older.close()


def test_stats_and_final_state_are_the_latest_runs():
    pipe = pipeline(execution_tracking="stages")
    list(pipe)
    assert pipe.stats()["stage0"]["items_in"] == 23 and pipe.final_state is None
    state = pipe.checkpoint()
    pipe.restore(state)  # no run going: a placed start has run nothing yet
    assert pipe.stats() == {}
    it = iter(pipe)
    assert pipe.stats() == it.stats()
    it.close()


def test_final_state_is_the_latest_runs_and_a_placed_start_has_none():
    pipe = pipeline(n=9, mtp_mode=True, mtp_prefetch=0)  # mtp_auto_checkpoint: on
    list(pipe)
    final = pipe.final_state
    assert final is not None and decode_state(final) == decode_state(pipe.checkpoint())
    pipe.restore(final)
    assert pipe.final_state is None


# -- next() after close() -------------------------------------------------------------------
@pytest.mark.parametrize("runner", ["inline", "threads"])
def test_next_after_close_raises_naming_close(runner):
    pipe = pipeline(runner=runner, max_workers=2)
    it = iter(pipe)
    for _ in it:
        break  # leaving the loop keeps the iterator (we hold it)
    it.close()
    for _ in range(2):  # and keeps raising
        with pytest.raises(IteratorClosedError, match=r"closed PipelineIterator.*close\(\)"):
            next(it)
    assert not isinstance(IteratorClosedError("x"), StopIteration)


@pytest.mark.parametrize("runner", ["inline", "threads"])
def test_an_exhausted_iterator_keeps_raising_stop_iteration_even_once_closed(runner):
    it = iter(pipeline(runner=runner, max_workers=2))
    assert len(list(it)) > 0 and it.closed
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)
    it.close()
    assert list(it) == []


def test_after_its_runs_error_next_names_the_error():
    pipe = Pipeline(sources.from_callable(20, F.make_sample), shuffle=False).map(F.boom)
    it = iter(pipe)
    with pytest.raises(Exception, match="thirteen") as raised:
        list(it)
    with pytest.raises(IteratorClosedError, match=type(raised.value).__name__):
        next(it)


@pytest.mark.parametrize("again", ["restore", "set_state"])
def test_a_closed_iterator_restarts_from_a_state(again):
    reference = keys(pipeline())
    it = iter(pipeline())
    head = keys([next(it) for _ in range(4)])
    state = it.checkpoint() if again == "restore" else it.get_state()
    it.close()
    getattr(it, again)(state)
    assert head + keys(it) == reference


# -- get_state / set_state ------------------------------------------------------------------
@pytest.mark.parametrize("chain", ["replay", "cursor"])
def test_get_state_restores_exactly_without_an_exchange_round(chain):
    reference = keys(pipeline(chain=chain))
    pipe = pipeline(chain=chain)
    it = iter(pipe)
    head = keys([next(it) for _ in range(5)])
    rounds = pipe._progress.rounds
    state = it.get_state()
    assert pipe._progress.rounds == rounds  # local: no multi-rank round was used
    assert keys([next(it)]) == reference[5:6]
    it.set_state(state)
    assert head + keys(it) == reference
    elsewhere = pipeline(chain=chain, runner="threads", max_workers=2)
    elsewhere.restore(state)  # one rank: the same bytes restore through the shortcut
    assert head + keys(elsewhere) == reference


def _rank(rank, world=2, **opts):
    return pipeline(world_size=world, global_rank=rank, canonical_replicas=4, **opts)


def test_a_ranks_own_state_is_its_lanes_and_layout():
    it = iter(_rank(1))
    next(it)
    state = decode_state(it.get_state())
    plan = it.plan
    assert (state["group"], state["dp_degree"], state["mapping"]) == (1, 2, plan.mapping)
    assert {int(lane) for lane in state["lanes"]} <= set(plan.owned)
    assert "world" not in state
    it.close()


def test_a_ranks_own_state_restores_only_on_its_layout():
    it = iter(_rank(0))
    head = keys([next(it) for _ in range(3)])
    state = it.get_state()
    rest = keys(it)
    same = iter(_rank(0))
    same.set_state(state)
    assert keys(same) == rest and head
    mapping = {"contiguous": "interleaved", "interleaved": "contiguous"}[_rank(0).plan().mapping]
    for other in (_rank(1), _rank(0, world=1), _rank(0, world=4),
                  _rank(0, mapping_strategy=mapping)):
        with pytest.raises(CheckpointError, match="one rank's own state"):
            other.restore(state)


def test_a_rank_layout_without_its_group_is_refused():
    it = iter(pipeline())
    next(it)
    state = decode_state(it.get_state())
    it.close()
    del state["group"]
    with pytest.raises(CheckpointError, match="without its group"):
        pipeline().restore(encode_state(state))


# -- progress and the iterator ----------------------------------------------------------------
class _Run:
    """A run as Progress sees it: a record, ``closed``, ``close()``; and its restart."""

    def __init__(self):
        self.record, self.closed, self.starts = RunRecord(), False, []

    def close(self):
        self.closed = True

    def restart(self, start):
        self.starts.append(start)


def test_progress_restarts_a_live_run_through_the_callback_it_was_handed():
    from zephon.pipeline.state import RunStart

    progress, run = Progress(), _Run()
    progress.begin(run, run.restart)
    assert progress.latest is run.record and progress.current() is run
    progress.move_to(RunStart({}, 2))
    assert run.starts == [RunStart({}, 2)] and progress.latest is run.record
    run.close()  # no run going: the next one starts there
    progress.move_to(RunStart({}, 3))
    assert run.starts == [RunStart({}, 2)] and progress.latest.start_epoch == 3
    progress.close_runs()


def test_a_dropped_run_is_not_held_by_its_progress():
    import gc
    import weakref

    progress, run = Progress(), _Run()
    progress.begin(run, run.restart)
    gone = weakref.ref(run)
    del run
    gc.collect()
    assert gone() is None and progress.current() is None
