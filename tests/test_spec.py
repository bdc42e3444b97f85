"""The frozen ``PipelineSpec``: a pipeline's definition, held and fingerprinted once by its
plan.

A checkpoint restores only into a pipeline with the same fingerprint, so the values in
``BASE_FINGERPRINTS`` must never change: they were computed by the code before the spec
existed (``Pipeline.fingerprint()`` hashing the pipeline's own attributes), running
``python -c "import test_spec; test_spec.print_fingerprints()"`` with that code first on
``PYTHONPATH``. The cases use only the public API, so that the same builders ran there.
"""

from __future__ import annotations

import dataclasses
import functools

import _pipeline_fns as F
import pytest

from zephon import MixtureReadConfig, Pipeline, RuntimeOptions, sources


def _base():
    return Pipeline(sources.from_callable(40, F.make_sample), seed=3, chunk_size=5)


def _mix(config=None):
    a = sources.from_sequence([{"id": i} for i in range(20)], name="a")
    b = sources.from_sequence([{"id": 100 + i} for i in range(20)], name="b")
    return sources.mixture({"a": a, "b": b}, {"a": 0.25, "b": 0.75}, config=config)


_RANDOM = MixtureReadConfig(mode="weighted_random", seed=9)

CASES = {
    "plain": lambda: _base(),
    "endless_in_order": lambda: Pipeline(sources.from_sequence(list(range(9))),
                                         shuffle=False, num_epochs=None, chunk_size=2),
    "shards": lambda: Pipeline(sources.from_callable(50, F.make_sample), seed=7,
                               shuffle="shards", shuffle_window=3),
    "map_filter_batch": lambda: _base().map(F.double).filter(F.keep_most).batch(4),
    "fused": lambda: _base().map(F.double, parallelism=2).batch(4, drop_last=True),
    "collate_fn": lambda: _base().batch(3, collate_fn=F.total),
    "lambda_partial": lambda: _base().map(lambda s: s).map(
        functools.partial(F.double_with, pad=2)),
    "shuffle_pack": lambda: _base().map(F.noisy).shuffle(8).pack_tokens(6).batch(2)
    .map_batch(F.total),
    "pack_documents": lambda: Pipeline(sources.from_callable(30, F.ragged_tokens), seed=1)
    .pack_documents(12, open_bins=4),
    "flush_2": lambda: _base().shuffle(3).options(RuntimeOptions(flush_every_k_chunks=2)),
    "flush_auto_cursor": lambda: _base().batch(2).options(
        RuntimeOptions(canonical_replicas=3, runner="threads", max_workers=2)),
    "mixture_refined": lambda: Pipeline(_mix(), shuffle=False).options(
        RuntimeOptions(mixture_config=_RANDOM)),
    "mixture_own_config": lambda: Pipeline(_mix(MixtureReadConfig(seed=1)), shuffle=False)
    .options(RuntimeOptions(mixture_config=_RANDOM)),
    "ensure_mixture": lambda: Pipeline(_mix(), seed=2).ensure_mixture(max_buffer=16),
}

#: computed by the code before the spec (see the module docstring)
BASE_FINGERPRINTS = {
    'collate_fn': '77b876042bdc667c1dd1da4133d0503dcfb8b71b355bf2b3445783036de30678',
    'endless_in_order': '6d9a645f96ed61b184ad71b781249793230614fd7c44ba135a1e610f86057e1a',
    'ensure_mixture': '526073a98097c9ad58595d3cbe057ada800b75442d0940bc5c57535cf0cdb7c4',
    'flush_2': 'ea0f561d61fb5f420b5dc77596dae945427aa094a8ee78d05abee1dde9ac867a',
    'flush_auto_cursor': '82763ccef6fe0d836189da301738f358666075fbdb19e28b08244913e28dd973',
    'fused': '96e926e7e64785324ffdd4a9eb26de1096b215bf33c8531874dc7539a068175c',
    'lambda_partial': '8f9a0805abf00f70e832f0bbfe6a3e5a26d4ee5bed88239319bdd7417f0b250c',
    'map_filter_batch': '8145caf6eefe72dc4071f78e799138c838b7c7c4dea599d1eae8c1763569a8d4',
    'mixture_own_config': 'e54f32b4f78e5f256bf09b75c3e67b7b2d60c8c7f2e72a91bcd8af72879df16e',
    'mixture_refined': '5fd21d4bb72a8c3c87b958789f4388d9487ef20c901732a9fefc6287bc7ad55c',
    'pack_documents': '8c68941468d87d25d8a5fb8d9cfef6ebd70af36db5ff474998e23eeb3e57d93e',
    'plain': '0e775b18ddfaeb36bb8acf2560b146152e3630bb623415454348842fe3a7d81a',
    'shards': '109d2c24f8fddefee6cbd8bcd39727e3ae648c74b3f465902440a258a69ea043',
    'shuffle_pack': 'd7156b792581f5b3554733261b8c4563333afa71434bca35e3e3867884899773',
}


def print_fingerprints() -> None:
    """Print ``BASE_FINGERPRINTS`` as the running code computes it."""
    for name in sorted(CASES):
        print(f"    {name!r}: {CASES[name]().fingerprint()!r},")


@pytest.mark.parametrize("name", sorted(CASES))
def test_fingerprints_are_those_of_the_code_before_the_spec(name):
    assert CASES[name]().fingerprint() == BASE_FINGERPRINTS[name]


def test_every_case_is_pinned():
    assert sorted(BASE_FINGERPRINTS) == sorted(CASES)
    assert len(set(BASE_FINGERPRINTS.values())) == len(CASES)  # all differ


def test_a_pipeline_makes_its_spec_once_and_builders_make_new_ones():
    from zephon.pipeline.spec import PipelineSpec

    pipe = _base()
    spec = pipe.spec
    assert isinstance(spec, PipelineSpec) and spec.ops == ()
    assert (spec.seed, spec.chunk_size, spec.num_epochs, spec.permute) == (3, 5, 1, True)
    mapped = pipe.map(F.double)
    assert pipe.spec is spec and mapped.spec is not spec  # the original is unchanged
    assert mapped.spec.ops == mapped.ops and len(mapped.ops) == 1
    assert mapped.spec.source is spec.source
    assert pipe.options(RuntimeOptions(runner="threads")).spec is spec  # options: same spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 4  # type: ignore[misc]


def test_the_plan_holds_the_spec_and_its_fingerprint_computed_once(monkeypatch):
    from zephon.pipeline import fingerprint as fp_module
    from zephon.pipeline import plan as plan_module

    calls = []
    real = fp_module.pipeline_fingerprint

    def counting(spec, flush_every):
        calls.append(spec)
        return real(spec, flush_every)

    monkeypatch.setattr(plan_module, "pipeline_fingerprint", counting)
    pipe = _base().shuffle(4)
    plan = pipe.plan()
    assert plan.spec.ops == pipe.spec.ops and plan.spec.seed == 3
    first = pipe.fingerprint()
    assert plan.fingerprint == first and pipe.fingerprint() == first
    pipe.explain()
    state = pipe.checkpoint()
    pipe.restore(state)
    assert calls == [plan.spec]  # once, from the plan's spec


def test_the_plans_spec_is_the_one_the_options_refine():
    pipe = Pipeline(_mix(), shuffle=False).options(RuntimeOptions(mixture_config=_RANDOM))
    plan = pipe.plan()
    assert plan.spec.source is not pipe.spec.source
    assert plan.spec.source.config == _RANDOM and pipe.spec.source.config != _RANDOM
    assert plan.spec.configured(pipe.runtime) is plan.spec  # configuring it again: itself
    plain = _base()
    assert plain.plan().spec is plain.spec  # options that change nothing: the same spec


def test_the_plan_never_reaches_up_to_the_pipeline():
    import ast
    import pathlib

    import zephon.pipeline.plan as plan_module

    tree = ast.parse(pathlib.Path(plan_module.__file__).read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.startswith("zephon.pipeline.pipeline")}
    assert "fingerprint()" not in pathlib.Path(plan_module.__file__).read_text()


def test_a_pickled_spec_plans_to_the_same_fingerprint():
    import pickle

    from zephon.pipeline.plan import Plan

    pipe = _base().map(F.double).shuffle(4).batch(2)
    copy = pickle.loads(pickle.dumps(pipe.plan().spec))
    assert Plan(copy, pipe.runtime).fingerprint == pipe.fingerprint()
