"""Hypothesis fuzz over every field of every option class.

Two properties:

1. Constructing an option object (constructor, ``from_dict``, ``replace``) from any
   values (wrong types, NaN, infinities, huge and negative ints, nested garbage,
   wrong-typed mapping keys and values, unknown names, positional arguments) either
   succeeds or raises ``ZephonConfigError``; nothing else escapes. Whatever is accepted
   round-trips through ``to_dict``/``from_dict`` and pickle.
2. Every ``RuntimeOptions`` that is accepted runs a tiny real pipeline to completion
   and delivers every sample exactly once (on a single rank). The one exception is a
   rank of a multi-rank job in MTP mode with auto-checkpoint: finishing its iteration
   is a collective checkpoint that waits for the other ranks.

The strategies are derived from the field checks themselves (bounds, choices,
mapping shapes), so a new field is fuzzed without editing this file. The default run
keeps to a few dozen examples and to small worker counts (fields that start processes);
the ``slow`` sweep uses the full ranges and many more examples.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import pickle
import warnings
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import _pipeline_fns
from zephon import (
    MetricsSinkConfig, MixtureReadConfig, Pipeline, RunPolicy, RuntimeOptions, StoreOptions,
    ZephonConfigError, sources,
)
from zephon.options import _spec

CLASSES = [RuntimeOptions, RunPolicy, StoreOptions, MixtureReadConfig, MetricsSinkConfig]


class _FailingRepr:
    def __repr__(self):
        raise RuntimeError("repr failed")


class _FailingMapping(dict):
    def items(self):
        raise RuntimeError("items failed")


# -- garbage: values no option should accept (or accept only by accident) ---------------
_huge = st.one_of(
    st.sampled_from([2**31, 2**32, 2**63, 2**64, 2**70, 10**18, 10**400, -(10**400),
                     -(2**63)]),
    # Too many digits for str(): built lazily, since hypothesis reprs sampled values.
    st.builds(lambda: 10**5000),
)
_special_floats = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324,
                                   -0.0, 1e9, 2.6e6])
_odd_numbers = st.sampled_from([np.int64(-1), np.uint64(2**64 - 1), np.float64("nan"),
                                np.float32(3.0), Fraction(10**400, 3), Decimal("NaN"),
                                Decimal("1e400"), 1 + 2j])
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), _huge, st.floats(), _special_floats,
    _odd_numbers, st.text(max_size=12), st.binary(max_size=6),
    st.builds(_FailingRepr),
)
garbage = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.integers(-3, 2000), st.text(max_size=5), st.none(),
                                  st.booleans(), st.floats(), _huge), inner, max_size=3),
        st.builds(_FailingMapping, st.dictionaries(st.integers(0, 3), inner, max_size=2)),
    ),
    max_leaves=6,
)


# -- plausible values, derived from each field's check ----------------------------------
def _int_values(check, small: bool, valid: bool):
    lo = check.min if check.min is not None else -5
    hi = check.max if check.max is not None else 2**40
    inner = st.integers(lo, min(hi, lo + 4)) if small else st.integers(lo, hi)
    if valid:
        return st.one_of(inner, st.sampled_from([lo, min(hi, lo + 1)] if small else [lo, hi]))
    return st.one_of(st.sampled_from([lo - 1, lo, hi, hi + 1]), inner, st.integers(lo, hi))


def _float_values(check, valid: bool):
    lo = check.min if check.min is not None else -1.0
    hi = check.max if check.max is not None else 1e9
    inside = [math.nextafter(lo, math.inf), hi] + ([] if check.exclusive_min else [lo])
    edges = inside if valid else inside + [lo, math.nextafter(hi, math.inf), lo - 1.0]
    return st.one_of(st.sampled_from(edges),
                     st.floats(lo, hi, exclude_min=check.exclusive_min),
                     st.integers(int(lo) + 1, int(min(hi, 10**6))))


def plausible(check, *, small: bool, nested_as_dict: bool, valid: bool = False):
    """Values a check accepts, plus (unless ``valid``) its edges min-1 and max+1 and
    near misses; ``small`` keeps ints near their minimum (worker counts, depths)."""
    C = _spec
    if isinstance(check, C.Int):
        base = _int_values(check, small, valid)
    elif isinstance(check, C.Float):
        base = _float_values(check, valid)
    elif isinstance(check, C.Bool):
        base = st.booleans()
    elif isinstance(check, C.Str):
        if check.choices:
            base = st.sampled_from(check.choices)
        else:
            good = (st.from_regex(check.pattern, fullmatch=True) if check.pattern
                    else st.text(min_size=1, max_size=12))
            base = good if valid else st.one_of(good, st.text(max_size=12))
    elif isinstance(check, C.PathStr):
        good = st.just("/tmp/zephon-fuzz-unused")
        base = good if valid else st.one_of(st.text(max_size=12), good)
    elif isinstance(check, C.EnumOf):
        base = st.sampled_from([m for m in check.enum_cls] + [m.value for m in check.enum_cls])
    elif isinstance(check, C.MpContext):
        base = st.sampled_from(multiprocessing.get_all_start_methods()
                               + ([] if valid else ["spork"]))
    elif isinstance(check, C.IntKeyMap):
        keys = st.one_of(st.integers(0, 3), st.just(check.max_key))
        if not valid:
            keys = st.one_of(keys, st.sampled_from([-1, check.max_key + 1]))
        if nested_as_dict:
            keys = st.one_of(keys, keys.map(str))
        base = st.dictionaries(keys, plausible(check.value_check, small=small,
                                               nested_as_dict=nested_as_dict, valid=valid),
                               max_size=3)
    elif isinstance(check, C.StrMap):
        base = st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3)
        if check.key_pattern is not None:
            good = st.dictionaries(st.from_regex(check.key_pattern, fullmatch=True),
                                   st.from_regex(check.value_pattern, fullmatch=True),
                                   max_size=3)
            base = good if valid else st.one_of(good, base)
    elif isinstance(check, C.StrTuple):
        base = st.lists(st.text(max_size=5), max_size=3)
    elif isinstance(check, C.Nested):
        form = fields_of(check.cls, small=small, nested_as_dict=nested_as_dict,
                         garbage_share=None if valid else 4, valid=valid)
        if not nested_as_dict:  # an object: built from fuzzed fields (default if refused)
            form = form.map(lambda kw, cls=check.cls: _call(lambda: cls(**kw)) or cls())
        base = form
    else:  # pragma: no cover - a new Check kind: fuzz it with garbage only
        base = garbage
    if check.optional:
        base = st.one_of(st.none(), base)
    return base


def fields_of(cls, *, small: bool, nested_as_dict: bool, garbage_share: int | None = 4,
              exclude: dict | None = None, valid: bool = False):
    """A dict of a few of ``cls``'s fields, each plausible or (1 in garbage_share) garbage
    (never garbage when ``garbage_share`` is None)."""
    exclude = exclude or {}
    fields = list(dataclasses.fields(cls))

    @st.composite
    def draw(draw_):
        names = draw_(st.sets(st.sampled_from([f.name for f in fields]), max_size=6))
        out = {}
        for f in fields:
            if f.name not in names:
                continue
            check = f.metadata["check"]
            good = plausible(check, small=small, nested_as_dict=nested_as_dict, valid=valid)
            value = draw_(good if garbage_share is None else
                          st.one_of(*([good] * (garbage_share - 1)), garbage))
            if isinstance(value, str) and value in exclude.get(f.name, ()):
                continue
            out[f.name] = value
        return out

    return draw()


def _call(fn):
    """Run a constructor-like call: its result, or None when it raised ZephonConfigError."""
    try:
        return fn()
    except ZephonConfigError:
        return None


def _accepted_round_trips(obj):
    assert obj == type(obj).from_dict(obj.to_dict())
    assert pickle.loads(pickle.dumps(obj)) == obj


construction = st.one_of(*[
    st.tuples(st.just(cls), fields_of(cls, small=False, nested_as_dict=nested),
              st.just(nested))
    for cls in CLASSES for nested in (False, True)
])


def _check_construction(cls, kwargs, as_dict):
    if as_dict:
        obj = _call(lambda: cls.from_dict(kwargs))
    else:
        obj = _call(lambda: cls(**kwargs))
        replaced = _call(lambda: cls().replace(**kwargs))
        assert (obj is None) == (replaced is None)
        if obj is not None:
            assert replaced == obj
    event(f"{cls.__name__} {'accepted' if obj is not None else 'refused'}")
    if obj is not None:
        assert type(obj) is cls
        _accepted_round_trips(obj)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(construction)
def test_construction_raises_only_config_errors(case):
    _check_construction(*case)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(cls=st.sampled_from(CLASSES), args=st.lists(garbage, min_size=1, max_size=2),
       extra=st.dictionaries(st.text(max_size=8), garbage, min_size=1, max_size=2))
def test_positional_and_unknown_arguments_are_config_errors(cls, args, extra):
    with pytest.raises(ZephonConfigError):
        cls(*args)
    unknown = {k: v for k, v in extra.items() if k not in cls.field_names()}
    if unknown:
        for call in (lambda: cls(**unknown), lambda: cls.from_dict(unknown),
                     lambda: cls().replace(**unknown)):
            with pytest.raises(ZephonConfigError) as info:
                call()
            assert len(str(info.value)) < 400


@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(construction)
def test_construction_raises_only_config_errors_sweep(case):
    _check_construction(*case)


# -- accepted RuntimeOptions run a pipeline ---------------------------------------------
_RUN_EXCLUDE: dict = {}


def _runtime_options(small: bool):
    """Accepted RuntimeOptions: in-range values of a few fields, the runner always drawn."""
    def build(args):
        runner, mtp, kwargs = args
        kwargs = {"runner": runner, "mtp_mode": mtp, **kwargs}
        try:
            return RuntimeOptions(**kwargs)
        except ZephonConfigError:
            return None

    return st.tuples(
        st.sampled_from([None, "inline", "threads", "process"]), st.booleans(),
        fields_of(RuntimeOptions, small=small, nested_as_dict=False, garbage_share=None,
                  valid=True, exclude=_RUN_EXCLUDE),
    ).map(build).filter(lambda o: o is not None and not _collective_at_end(o))


def _describe(opts: RuntimeOptions) -> None:
    event(f"runner={opts.runner} mtp={opts.mtp_mode} stages={dict(opts.per_stage_runner)}")


def _collective_at_end(opts: RuntimeOptions) -> bool:
    """True when finishing the iteration takes a checkpoint merged across ranks (MTP
    auto-checkpoint with world_size > 1): by design it waits for the other ranks of the
    job, which a single test process cannot stand in for."""
    return opts.mtp_mode and opts.mtp_auto_checkpoint and opts.world_size > 1


def _run_tiny_pipeline(opts: RuntimeOptions):
    pipe = (Pipeline(sources.from_sequence([{"x": i} for i in range(12)]), seed=0,
                     chunk_size=2)
            .map(_pipeline_fns.double).batch(3).options(opts))
    try:
        with warnings.catch_warnings():
            # A kernel clamping a large socket buffer says so in a RuntimeWarning.
            warnings.simplefilter("ignore", RuntimeWarning)
            batches = list(pipe)
    finally:
        pipe.close()
    seen = sorted(int(v) for b in batches for v in np.asarray(b["x"]).ravel())
    if opts.world_size == 1:
        assert seen == [2 * i for i in range(12)], opts
    else:
        assert set(seen) <= {2 * i for i in range(12)} and len(seen) == len(set(seen))


def _on_this_host(opts: RuntimeOptions) -> bool:
    """No stage on the Ray runner: it needs a cluster whose workers import the tests'
    modules (``tests/test_pipeline_ray.py`` runs it on one), and Ray, an extra."""
    return opts.runner != "ray" and "ray" not in opts.per_stage_runner.values()


def _small_workers(opts: RuntimeOptions) -> bool:
    """Default run: at most a few worker processes per example."""
    starts_processes = opts.runner == "process" or opts.mtp_mode or \
        "process" in opts.per_stage_runner.values()
    return not starts_processes or (opts.max_workers or 4) <= 3 or \
        opts.worker_allocation in ("fit_to_ops", "autotune")  # autotune starts at 1


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(_runtime_options(small=True).filter(_small_workers).filter(_on_this_host))
def test_accepted_runtime_options_run_a_pipeline(opts):
    _describe(opts)
    _run_tiny_pipeline(opts)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the budget of the whole sweep (about 1 s per example)
@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(_runtime_options(small=False).filter(_on_this_host))
def test_accepted_runtime_options_run_a_pipeline_sweep(opts):
    _describe(opts)
    _run_tiny_pipeline(opts)


@pytest.mark.slow
@pytest.mark.ci
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(_runtime_options(small=True).filter(_small_workers).filter(_on_this_host))
def test_accepted_runtime_options_run_a_pipeline_ci(opts):
    _describe(opts)
    _run_tiny_pipeline(opts)


# -- the edges, explicitly ----------------------------------------------------------------
EDGES = [
    dict(runner="threads", max_workers=127, worker_allocation="per_stage_fixed"),
    dict(runner="process", prefetch_batches=65536, default_stage_prefetch=65536,
         op_queue_capacity=65536, per_stage_prefetch={0: 65536, 1024: 1}),
    dict(canonical_replicas=4096),
    dict(world_size=2**20, dp_degree=4096, global_rank=2**20 - 1),
    dict(runner="process", ipc_buffer_bytes=2**30),
    dict(mtp_mode=True, mtp_buffer=4096, mtp_buffer_bytes=2**30, mtp_prefetch=4096),
    dict(mtp_mode=True, prefetch_batches=65536),
    dict(runner="process", shm_min_item_bytes=2**40, shm_min_new_allocation_bytes=2**40,
         shm_min_forward_bytes=2**40, shm_compact_min_savings_bytes=2**40,
         shm_max_coalesced_bytes=2**40, shm_compact_above_ratio=1e6),
    dict(flush_every_k_chunks=65536, max_worker_retries=1000, aggregate_timeout_s=2592000.0),
]


@pytest.mark.parametrize("kwargs", EDGES, ids=lambda k: ",".join(k))
def test_every_upper_bound_runs(kwargs):
    _run_tiny_pipeline(RuntimeOptions(**kwargs))


@pytest.mark.slow
def test_largest_process_pool_runs():
    """127 worker processes (the bound: 7 bits of owner in a region token) start, run and
    stop."""
    _run_tiny_pipeline(RuntimeOptions(runner="process", max_workers=127,
                                      worker_allocation="per_stage_fixed"))
