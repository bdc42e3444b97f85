"""Adding an op is one file plus its registration: the op contracts are all the engine,
the plan, the dispatch and the checkpoint need.

``_op_fns`` defines two ops outside zephon (a stateless op and a serial op that holds
records across boundaries) through :mod:`zephon.pipeline.ops.base` and
:func:`~zephon.pipeline.ops.register` only; here they run on every runner, resume
from a checkpoint whose carry holds the serial op's remainder, and the registry
refuses classes that do not fulfil a contract.
"""

from __future__ import annotations

import _op_fns as O
import _pipeline_fns as F
import numpy as np
import pytest
from _resume import END, assert_resumes_at, keys_of, passes

from zephon import Pipeline, RuntimeOptions, ZephonConfigError, sources
from zephon.pipeline.ops import REGISTRY, Accumulator, SerialOp, StatelessOp, register
from zephon.pipeline.ops.base import CarryingAccumulator

N = 90


def _pipe(**opts):
    base = Pipeline(sources.from_callable(N, F.make_sample), seed=5, chunk_size=4)
    pipe = O.with_op(base, O.OffsetOp(10, parallelism=2)).shuffle(6)
    return O.with_op(pipe, O.WindowOp(4)).options(RuntimeOptions(**opts))


def _row(item) -> tuple:
    return item["ids"].tolist(), item["total"]


def _rows(items) -> list:
    return keys_of(items, _row)


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_an_op_defined_outside_zephon_runs_on_every_runner(runner):
    reference = _rows(_pipe(runner="inline"))
    got = _rows(_pipe(runner=runner, max_workers=2))
    assert got == reference
    ids = sorted(i for row, _ in got for i in row)
    assert ids == list(range(N))  # every sample once
    for row, total in got:  # each sample's x is four times (id + 10) after the offset
        assert total == sum(4 * (i + 10) for i in row)
    assert [len(row) for row, _ in got[:-1]] == [4] * (len(got) - 1)


def test_the_plan_and_explain_see_the_new_ops_by_their_contracts():
    pipe = _pipe()
    plan = pipe.plan()
    text = pipe.explain()
    assert "stage 0: read, test_offset[parallelism=2]" in text
    assert "serial 2: test_window(4) (preserves_cursor_order=True)" in text
    assert plan.carry_layout == ((2, ("records", 4, ("sample",))),)
    assert "test_window(4)" in "".join(op.describe() for op in pipe.ops)


@pytest.mark.parametrize("runner", ["threads", "process"])
def test_a_new_serial_op_resumes_from_the_carry_it_held(runner):
    def inline():
        return _pipe(runner="inline", flush_every_k_chunks=2)

    reference, following = passes(inline, 2, _row)
    assert_resumes_at(lambda: _pipe(runner=runner, max_workers=2, flush_every_k_chunks=2),
                      (3, 11, END), again=inline, key=_row, reference=reference,
                      following=following)


def test_a_one_to_one_op_lets_a_batch_fuse_into_the_stage_that_reads():
    base = Pipeline(sources.from_callable(N, F.make_sample), seed=5, chunk_size=4)
    pipe = O.with_op(base, O.OffsetOp(1)).batch(8)
    assert pipe.plan().fused_batch is pipe.ops[1]
    batches = list(pipe)
    assert all((b["x"] == b["id"][:, None] * 1 + 1).all() for b in batches)
    assert sorted(np.concatenate([b["id"] for b in batches]).tolist()) == list(range(N))


def test_registration_checks_the_contract():
    class Neither:
        kind = "test_neither"

    with pytest.raises(ZephonConfigError, match="exactly one of StatelessOp and SerialOp"):
        register(Neither)  # type: ignore[arg-type]

    class NoApply(StatelessOp):
        kind = "test_no_apply"

    with pytest.raises(ZephonConfigError, match="does not implement apply_one"):
        register(NoApply)

    class SameKind(StatelessOp):
        kind = "map"

        def apply_one(self, r, seed):
            return r

    with pytest.raises(ZephonConfigError, match="'map' .* already registered by "
                       "zephon.pipeline.ops.map.MapOp"):
        register(SameKind)

    class InheritedKind(O.OffsetOp):
        pass

    with pytest.raises(ZephonConfigError, match="must set its own kind"):
        register(InheritedKind)
    assert register(O.OffsetOp) is O.OffsetOp  # again: a no-op
    assert REGISTRY["test_offset"] is O.OffsetOp and "test_neither" not in REGISTRY


class _Drains(Accumulator):
    def push(self, records):
        return records

    def boundary(self, marker):
        return []

    def drain(self):
        return []


class _Holds(_Drains, CarryingAccumulator):
    def carry(self):
        return []

    def load(self, held):
        pass


def test_an_op_whose_accumulator_contradicts_what_it_says_it_holds_fails_clearly():
    @register
    class Liar(SerialOp):
        """Says it holds nothing across a boundary, yet starts a carrying accumulator."""

        kind = "test_liar"

        def start(self, seed, lane, boundary):
            return _Holds()

    try:
        pipe = Pipeline(sources.from_sequence(list(range(4))))._with(Liar())
        with pytest.raises(TypeError, match="holds=None, but its start.. gave a _Holds"):
            list(pipe)
    finally:
        del REGISTRY["test_liar"]
