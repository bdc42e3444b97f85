"""Which lane mapping gives every optimizer step the same samples across world sizes.

A step consumes G micro-batches in total: G / W per rank (gradient accumulation).
With ``interleaved`` (rank r owns the lanes l % W == r) micro-step j of rank r is
position s * G + j * W + r of the one-rank stream, so a step is the same window of
that stream on any W. With ``contiguous`` blocks it is not. (No torch needed.)"""

from __future__ import annotations

import pytest

import _pipeline_fns as F
from zephon import Pipeline, RuntimeOptions, sources

LANES, G, STEPS = 8, 4, 3


def step_samples(world: int, mapping: str) -> list:
    per_rank = []
    for rank in range(world):
        pipe = Pipeline(sources.from_callable(64, F.make_sample), seed=7, chunk_size=2) \
            .batch(2).options(RuntimeOptions(world_size=world, global_rank=rank,
                                             canonical_replicas=LANES,
                                             mapping_strategy=mapping))
        it = iter(pipe)
        per_rank.append([tuple(next(it)["id"].tolist()) for _ in range(STEPS * G // world)])
        pipe.close()
    accumulate = G // world
    return [sorted(batch for rank in range(world)
                   for batch in per_rank[rank][s * accumulate:(s + 1) * accumulate])
            for s in range(STEPS)]


def test_interleaved_steps_are_identical_across_world_sizes():
    one = step_samples(1, "interleaved")
    assert step_samples(2, "interleaved") == one
    assert step_samples(4, "interleaved") == one


@pytest.mark.parametrize("world", [2, 4])
def test_contiguous_steps_differ_across_world_sizes(world):
    assert step_samples(world, "contiguous") != step_samples(1, "contiguous")
