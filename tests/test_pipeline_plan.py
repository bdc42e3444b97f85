"""The plan: typed, frozen steps built once from the ops and options; stable output.

The fingerprints and the ``explain()`` text are pinned: a checkpoint restores only into a
pipeline with the same fingerprint, so these values must not change by accident (more
fingerprints are pinned in test_spec.py).
"""

from __future__ import annotations

import dataclasses
import json

import _pipeline_fns as F
import pytest

from zephon import Pipeline, RuntimeOptions, StoreOptions, ZephonConfigError, sources
from zephon.pipeline.engine import Plan as EnginePlan
from zephon.pipeline.ops import BatchOp, MapOp, ShuffleOp
from zephon.pipeline.plan import Plan, SerialStep, Stage, StageStep, cut_steps


def _base():
    return Pipeline(sources.from_callable(40, F.make_sample), seed=3, chunk_size=5)


PINNED_FINGERPRINTS = {
    "plain": (lambda: _base(),
              "0e775b18ddfaeb36bb8acf2560b146152e3630bb623415454348842fe3a7d81a"),
    "map_filter_batch": (lambda: _base().map(F.double).filter(F.keep_most).batch(4),
                         "8145caf6eefe72dc4071f78e799138c838b7c7c4dea599d1eae8c1763569a8d4"),
    "fused": (lambda: _base().map(F.double).batch(4, drop_last=True),
              "96e926e7e64785324ffdd4a9eb26de1096b215bf33c8531874dc7539a068175c"),
    "shuffle_pack": (lambda: _base().map(F.noisy).shuffle(8).pack_tokens(6).batch(2)
                     .map_batch(F.total),
                     "d7156b792581f5b3554733261b8c4563333afa71434bca35e3e3867884899773"),
    "flush": (lambda: _base().shuffle(3).options(RuntimeOptions(flush_every_k_chunks=2)),
              "ea0f561d61fb5f420b5dc77596dae945427aa094a8ee78d05abee1dde9ac867a"),
}

PINNED_EXPLAIN = """\
pipeline 470f055096ac: source CallableSource(callable, n=40, fn=_pipeline_fns.make_sample)
  work: seed=3, shuffle=True (a seeded permutation per epoch), chunk_size=5, num_epochs=1
  lanes: 1 canonical lane(s) (canonical_replicas: chunk j goes to lane j mod 1), \
dp_degree=1; this rank (global_rank 0 of 1) is dp group 0 and owns lane(s) [0] (contiguous)
  order: deterministic (sequence order in every stage); tail: strict lane round robin
  resume: replay from the last flush boundary (an op carries history across samples; \
what batch and pack_tokens held there is rebuilt from its lineage)
  flush: every 8 chunks of a lane and at each epoch start (resume points: batches stay \
full across them)
  tail prefetch: 8 item(s)
  compute threads: 1 per process worker (torch, BLAS/OpenMP; threads stages share the \
consumer's)
  stage 0: read, map(noisy)[parallelism=1]: runner=inline, workers=1 (inline: the \
consumer's thread), depth=1 units/lane (+1 per worker in flight), op_queue=8 items/lane, \
latency_flush=off
  serial 1: shuffle(8) (preserves_cursor_order=False)
  serial 2: pack_tokens(6, 'tokens') (preserves_cursor_order=False)
  serial 3: batch(2, drop_last=False) (preserves_cursor_order=True)
  stage 1: map_batch(total)[parallelism=1], map(double)[parallelism=1]: runner=threads, \
workers=2 (fit_to_ops: sum of op parallelism 2), depth=8 units/lane (+1 per worker in \
flight), op_queue=8 items/lane, latency_flush=off"""


@pytest.mark.parametrize("name", sorted(PINNED_FINGERPRINTS))
def test_fingerprints_are_pinned(name):
    build, want = PINNED_FINGERPRINTS[name]
    assert build().fingerprint() == want


def test_explain_is_pinned():
    opts = RuntimeOptions(runner="threads", max_workers=2, per_stage_runner={0: "inline"})
    pipe = _base().map(F.noisy).shuffle(8).pack_tokens(6).batch(2).map_batch(F.total) \
        .map(F.double).options(opts)
    assert pipe.explain() == PINNED_EXPLAIN


def test_steps_are_typed_and_say_which_stage_or_op_they_run():
    pipe = _base().map(F.double).filter(F.keep_most).shuffle(4).map(F.noisy).batch(2).batch(3)
    plan = pipe.plan()
    shuffle, batch2, batch3 = pipe.ops[2], pipe.ops[4], pipe.ops[5]
    assert plan.steps == (StageStep(0), SerialStep(shuffle), StageStep(1), SerialStep(batch2),
                          SerialStep(batch3))
    assert [s.ops for s in plan.stages] == [tuple(pipe.ops[:2]), (pipe.ops[3],)]
    assert plan.fused_batch is None and plan.carry_layout == (
        (3, ("records", 2, ("sample",))), (4, ("records", 3, ("records", 2, ("sample",)))))


def test_a_batch_after_read_and_maps_is_fused_into_stage_0_and_is_no_step():
    pipe = _base().map(F.double).batch(4).shuffle(2)
    plan = pipe.plan()
    assert plan.fused_batch is pipe.ops[1]
    assert plan.steps == (StageStep(0), SerialStep(pipe.ops[2]))
    assert plan.stages[0].collates and not plan.stages[0].split
    # a filter makes it unknowable which samples form a batch before they are read
    assert _base().filter(F.keep_most).batch(4).plan().fused_batch is None
    assert _base().map(F.double).batch(4).options(
        RuntimeOptions(deterministic=False)).plan().fused_batch is None


def test_a_plan_never_changes_once_built():
    plan = _base().map(F.double).shuffle(4).plan()
    with pytest.raises(AttributeError, match="cannot set 'steps'"):
        plan.steps = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.stages[0].workers = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.steps[1].op = None  # type: ignore[misc]
    assert isinstance(plan.stages, tuple) and isinstance(plan.steps, tuple)
    assert isinstance(plan.owned, tuple)


def test_building_a_plan_leaves_the_pipeline_it_is_given_unchanged(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps({"i": i}) for i in range(5)))
    src = sources.jsonl(str(path))
    opts = RuntimeOptions(io_options=StoreOptions(download_retry=7))
    spec = Pipeline(src).options(opts).spec
    before = dict(vars(spec))
    plan = Plan(spec, opts)
    assert spec.source is src and vars(spec) == before
    assert plan.spec.source is not src  # the refined source is the plan's own copy
    assert plan.spec.source.describe() == src.describe()
    assert sorted(x["i"] for x in Pipeline(src).options(opts)) == list(range(5))


def test_cut_steps_is_a_pure_function_of_the_ops():
    ops = (MapOp(F.double), ShuffleOp(3), BatchOp(2), MapOp(F.noisy))
    first, again = cut_steps(ops), cut_steps(ops)
    assert first == again
    groups, steps = first
    assert groups == [(ops[0],), (ops[3],)]
    assert steps == [StageStep(0), SerialStep(ops[1]), SerialStep(ops[2]), StageStep(1)]
    assert cut_steps(()) == ([()], [StageStep(0)])  # stage 0 always reads


def test_plan_is_importable_where_it_was():
    assert EnginePlan is Plan
    assert isinstance(_base().plan().stages[0], Stage)


def test_an_op_of_an_unregistered_class_is_refused_by_the_plan():
    class Unregistered(MapOp):
        pass

    pipe = _base()._with(Unregistered(F.double))
    with pytest.raises(ZephonConfigError, match="not a registered op"):
        pipe.plan()
