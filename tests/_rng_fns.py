"""Ops that draw from the global generators (torch's, NumPy's legacy ``np.random``,
Python's ``random``) and ops with randomness no seeding reaches, for
``tests/test_global_rngs.py``. Module level, so spawn workers import them."""

from __future__ import annotations

import os
import random
import threading

import numpy as np

#: a generator made once, without a seed, and kept between calls
_KEPT = random.Random()
#: a torch.Generator made on first use and kept between calls
_TORCH_KEPT: dict = {}


def make_sample(i):
    return {"id": i, "x": np.full(3, i, dtype=np.float64)}


def numpy_normal(s):
    """One normal from np.random (legacy caches the pair's second)."""
    return {**s, "normal": np.random.standard_normal()}


def no_draw(s):
    """Draws from nothing."""
    return {**s, "y": s["x"] * 2}


def torch_noise(s):
    """torch's global generator, as torchvision's random transforms draw from it."""
    import torch

    return {**s, "torch": torch.rand(3).numpy().astype(np.float64)}


def numpy_noise(s):
    return {**s, "numpy": np.random.random(3)}


def numpy_noise_again(s):
    return {**s, "numpy2": np.random.random(3)}


def random_noise(s):
    return {**s, "random": random.random()}


def albumentations_like(s):
    """A flip decided by ``random``, a jitter drawn from ``np.random``."""
    flip = random.random() < 0.5
    x = s["x"][::-1] if flip else s["x"]
    return {**s, "x": x + np.random.uniform(-1, 1, size=x.shape), "flip": flip}


def random_keep(s):
    """A filter on a coin of the random module's generator."""
    return random.random() < 0.7


def ctx_noise(s, ctx):
    return {**s, "ctx": ctx.rng.random(2)}


def numpy_on_some(s):
    """Draws only on samples whose id is odd (validation sees sample 0 only)."""
    return {**s, "some": float(np.random.random()) if s["id"] % 2 else 0.0}


def unseeded_generator(s):
    return {**s, "u": np.random.default_rng().random()}


def kept_generator(s):
    return {**s, "u": _KEPT.random()}


def urandom(s):
    return {**s, "u": os.urandom(8)}


def torch_and_unseeded(s):
    """torch's global generator (seeded per call) and a torch.Generator kept between calls
    (as one made at import would be)."""
    import torch

    if "torch" not in _TORCH_KEPT:
        _TORCH_KEPT["torch"] = torch.Generator()
    return {**s, "a": float(torch.rand(1)), "b": float(torch.rand(1, generator=_TORCH_KEPT["torch"]))}


_OVERLAP = {"now": 0, "peak": 0}
_OVERLAP_LOCK = __import__("threading").Lock()


def overlap_peak(reset: bool = False) -> int:
    peak = _OVERLAP["peak"]
    if reset:
        _OVERLAP.update(now=0, peak=0)
    return peak


def numpy_noise_counting_overlap(s):
    """Draws from np.random and records how many calls of it overlap (threads runner)."""
    import time

    with _OVERLAP_LOCK:
        _OVERLAP["now"] += 1
        _OVERLAP["peak"] = max(_OVERLAP["peak"], _OVERLAP["now"])
    value = np.random.random()
    time.sleep(0.005)
    with _OVERLAP_LOCK:
        _OVERLAP["now"] -= 1
    return {**s, "numpy": value}


def inner_numpy_pipeline(s):
    """Draws nothing itself: iterates a pipeline of its own whose op draws from np.random
    on 2 threads (a nested pipeline, as a data-generation op may run)."""
    from zephon import Pipeline, RuntimeOptions, sources

    inner = (Pipeline(sources.from_callable(4, make_sample), shuffle=False)
             .map(numpy_noise).options(RuntimeOptions(runner="threads", max_workers=2)))
    return {**s, "inner": [float(x["numpy"][0]) for x in inner]}


#: set by a test: the second call of :func:`held_once` waits for it (at most 30 s)
HOLD = {"entered": threading.Event(), "release": threading.Event(), "calls": 0,
        "b_entered": threading.Event(), "a_done": threading.Event(), "b_calls": 0}


def held_once(s):
    """Draws nothing; its second call (validation's second probe, which the first
    showed drawing nothing) waits until the test releases it, so another pipeline is
    checked on another thread meanwhile."""
    HOLD["calls"] += 1
    if HOLD["calls"] == 2:
        HOLD["entered"].set()
        HOLD["release"].wait(30)
    return {**s, "held": 1}


def waits_for_a(s):
    """Draws nothing; its first call (validation's first probe, after the seeds are
    planted) waits until the test says :func:`held_once`'s pipeline is checked."""
    HOLD["b_calls"] += 1
    if HOLD["b_calls"] == 1:
        HOLD["b_entered"].set()
        HOLD["a_done"].wait(30)
    return {**s, "waited": 1}


def _inner(runner: str, fn=None, **opts):
    from zephon import Pipeline, RuntimeOptions, sources

    return (Pipeline(sources.from_callable(4, make_sample), shuffle=False)
            .map(fn or numpy_noise).options(RuntimeOptions(runner=runner, max_workers=2,
                                                           **opts)))


def _plain(s):
    return {**s, "plain": 1}


def draws_then_inner_threads(s):
    """Draws, then iterates a seeded threads pipeline of its own."""
    own = np.random.random()
    return {**s, "own": own, "inner": [float(x["numpy"][0]) for x in _inner("threads")]}


def draws_then_inner_inline(s):
    """Draws, then iterates a seeded inline pipeline of its own (same thread)."""
    own = np.random.random()
    return {**s, "own": own, "inner": [float(x["numpy"][0]) for x in _inner("inline")]}


def inner_on_a_helper_thread(s):
    """Draws nothing; iterates a plain inline pipeline on a helper thread."""
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(1) as pool:
        n = pool.submit(lambda: len(list(_inner("inline", _plain)))).result(timeout=60)
    return {**s, "inner": n}
