"""torchvision's random transforms in a map give one stream on every runner.

Their random choices come from torch's global generator; ``seed_global_rngs="auto"`` (the
default) seeds it from each sample's identity before every call of the op. Skipped where
torchvision is not installed (it runs in the vision environment of the benchmarks).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("torchvision")

import _vision_fns as V
import torch
from _resume import assert_resumes
from _streams import batch_key, keys_of

from zephon import Pipeline, RuntimeOptions, sources


def _pipe(**opts) -> Pipeline:
    return Pipeline(sources.from_callable(12, V.make_image), seed=2, chunk_size=2) \
        .map(V.augment).batch(3).options(RuntimeOptions(**opts))


@pytest.fixture
def made():
    """Pipelines made by a test, closed at its end (their workers are kept after a pass)."""
    pipes: list[Pipeline] = []

    def make(**opts):
        def factory() -> Pipeline:
            pipe = _pipe(**opts)
            pipes.append(pipe)
            return pipe
        return factory
    try:
        yield make
    finally:
        for pipe in pipes:
            pipe.close()


def _states() -> tuple:
    legacy = np.random.get_state()
    return (legacy[1].tobytes(), legacy[2:], random.getstate(),
            torch.random.get_rng_state().numpy().tobytes())


def test_torchvision_transforms_give_one_stream_on_every_runner(made):
    torch.manual_seed(1)
    np.random.seed(1)
    before = _states()
    reference = keys_of(made(runner="inline")(), batch_key)
    assert _states() == before  # the consumer's generators are given back
    images = [k[3] for k in reference]
    assert len({repr(i) for i in images}) == len(images) == 4
    for opts in (dict(runner="threads", max_workers=1), dict(runner="threads", max_workers=3),
                 dict(runner="process", max_workers=1), dict(runner="process", max_workers=3)):
        torch.manual_seed(int(opts["max_workers"]) + 10)  # the consumer's state is no input
        before = _states()
        assert keys_of(made(**opts)(), batch_key) == reference, opts
        assert _states() == before, opts


def test_a_restore_mid_epoch_on_another_runner_gives_the_rest(made):
    assert_resumes(made(runner="inline"), 2, key=batch_key,
                   again=made(runner="process", max_workers=2), next_pass=False)
    assert_resumes(made(runner="process", max_workers=3), 1, key=batch_key,
                   again=made(runner="threads", max_workers=2), next_pass=False)
