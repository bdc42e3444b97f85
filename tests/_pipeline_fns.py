"""Pipeline op functions for the tests (module level: process workers import them)."""

from __future__ import annotations

import os
import signal

import numpy as np


def make_sample(i):
    return {"id": i, "x": np.full(4, i, dtype=np.int64), "tokens": np.arange(i % 7 + 1) + i}


def double(s):
    return {**s, "x": s["x"] * 2}


def double_with(s, pad=None):
    """``double``, with a keyword that lets a test make the op as large as it likes."""
    return double(s)


def noisy(s, ctx):
    return {**s, "noise": float(ctx.rng.random())}


def keep_most(s):
    return s["id"] % 5 != 3


def total(batch):
    return {**batch, "total": np.asarray(batch["x"]).sum(axis=-1)}


def boom(s):
    if s["id"] == 13:
        raise ValueError("thirteen is unlucky")
    return s


def mutate(s):
    s["x"] += 1
    return s


_calls = {"n": 0}


def nondeterministic(s):
    _calls["n"] += 1
    return {**s, "n": _calls["n"]}


def kill_once(s):
    """SIGKILL this worker the first time sample 7 is seen (marker file in $ZEPHON_TEST_DIR)."""
    if s["id"] == 7:
        marker = os.path.join(os.environ["ZEPHON_TEST_DIR"], "killed-7")
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    return s


def kill_always(s):
    if s["id"] == 7:
        os.kill(os.getpid(), signal.SIGKILL)
    return s


def big_sample(i):
    return {"tokens": np.full((4 << 20) // 8, i, dtype=np.int64), "seq": i}


def add_one(s):
    return {"tokens": s["tokens"] + 1, "seq": s["seq"]}


import threading as _threading
import time as _time

_conc = {"now": 0, "peak": 0}
_conc_lock = _threading.Lock()


def reset_concurrency():
    with _conc_lock:
        _conc["now"] = _conc["peak"] = 0


def peak_concurrency():
    return _conc["peak"]


def track_concurrency(s):
    """Records how many calls overlap (threads runner: one process, shared counters)."""
    with _conc_lock:
        _conc["now"] += 1
        _conc["peak"] = max(_conc["peak"], _conc["now"])
    _time.sleep(0.02)
    with _conc_lock:
        _conc["now"] -= 1
    return s


def slow_first(s):
    """Sample 0 takes a while, every other sample is instant: a head-of-line unit."""
    if s["id"] == 0:
        _time.sleep(0.5)
    return s


_reads = {"n": 0}


def counted_sample(i):
    """make_sample that counts its calls (inline runner: one process, one counter)."""
    _reads["n"] += 1
    return make_sample(i)


def reset_reads():
    _reads["n"] = 0


def reads():
    return _reads["n"]


def keep_all(s):
    """A filter that keeps every sample (it still changes the plan: filters are not 1:1)."""
    return True


def identity(s):
    """A map that changes nothing (it still makes every sample go through an op)."""
    return s


def fail_always(batch):
    raise ValueError("this op always fails")


def slow_identity(s):
    """Sleep ``s`` seconds (the sample is a number), then return it."""
    _time.sleep(s)
    return s


def fail_from_3_late_first(s):
    """Samples 0-2 pass; 3 and later fail, 3 only after the later failures are done (so a
    worker finishes a later failing sample first)."""
    if s >= 3:
        if s == 3:
            _time.sleep(1.0)
        raise ValueError(f"sample {s} fails")
    return s


class SlowFrom:
    """``add_one`` that, from sample ``slow_from`` on, marks the sample as started (a file
    in ``folder``) and then takes ``sleep`` seconds."""

    def __init__(self, folder, slow_from, sleep):
        self.folder, self.slow_from, self.sleep = str(folder), slow_from, sleep

    def __call__(self, s):
        if s["seq"] >= self.slow_from:
            open(os.path.join(self.folder, f"started-{s['seq']}"), "w").close()
            _time.sleep(self.sleep)
        return add_one(s)


class LookupFailed(Exception):
    """An op's own exception type, raised from the KeyError that caused it."""


def lookup_7(s):
    """Sample 7 is not in the table: a KeyError, re-raised as the op's own error."""
    table = {i: i * 10 for i in range(20) if i != 7}
    try:
        return table[s]
    except KeyError as err:
        raise LookupFailed(f"no entry for {s}") from err


class _PidBound(Exception):
    """Pickles anywhere, rebuilds only in the process that made it (an error holding a
    process-local handle)."""

    def __init__(self, message, pid):
        super().__init__(message, pid)

    def __reduce__(self):
        return _rebuild_pid_bound, self.args


def _rebuild_pid_bound(message, pid):
    if os.getpid() != pid:
        raise RuntimeError(f"a handle of process {pid} cannot be rebuilt in {os.getpid()}")
    return _PidBound(message, pid)


class _StrRaises(Exception):
    """Does not pickle (a lock) and its str() raises."""

    def __init__(self):
        super().__init__("x")
        self.lock = _threading.Lock()

    def __str__(self):
        raise RuntimeError("no str")


def cause_pid_bound_at_3(s):
    if s == 3:
        raise ValueError("sample 3 lost its connection") from _PidBound("conn", os.getpid())
    return s


def cause_str_raises_at_3(s):
    if s == 3:
        raise ValueError("sample 3 failed oddly") from _StrRaises()
    return s


def unreadable_from_5(i):
    """A source function: sample ``i`` is ``i``, and reading sample 5 or later fails."""
    if i >= 5:
        raise OSError(f"sample {i} is unreadable")
    return i


def map_fails_at_4(s):
    if s == 4:
        raise ValueError("sample 4 fails in the map")
    return s


def input_address(s):
    """``add_one``, also giving the address of the input array (where the worker's heap
    put the sample that ``load`` made)."""
    return {"tokens": s["tokens"] + 1, "seq": s["seq"], "pid": os.getpid(),
            "input_at": s["tokens"].__array_interface__["data"][0]}


def _sharded_source():
    from zephon.pipeline.sources import Source

    class Sharded(Source):
        """A source whose ``identity`` finds the sample's shard with ``next(...)``: index
        5 is in no shard, so it raises ``StopIteration`` (a bug in the user's table)."""

        name = "sharded"
        shards = ((0, 5), (6, 12))

        def __len__(self):
            return 12

        def identity(self, i):
            start, _ = next(s for s in self.shards if s[0] <= i < s[1])
            return (f"shard{start}", i)

        def get(self, i):
            return i

    return Sharded


Sharded = _sharded_source()
Sharded.__module__, Sharded.__qualname__ = __name__, "Sharded"


def unreadable_from_9(i):
    if i >= 9:
        raise OSError(f"sample {i} is unreadable")
    return {"id": i}


def batch_fails_at_4(batch):
    if 4 in np.asarray(batch["id"]).tolist():
        raise ValueError("the batch with sample 4 fails")
    return batch


def slow_0_kill_1(s):
    """Sample 0 takes 4 s; sample 1 kills its worker (SIGKILL) every time it is run."""
    if s == 0:
        _time.sleep(4.0)
    elif s == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return s


def ragged_tokens(i):
    """A sample of 1..9 tokens (a pure function of ``i``), for packing."""
    n = 1 + (i * 7) % 9
    return {"id": i, "tokens": np.arange(n, dtype=np.int64) + 1000 * i}


def keep_not_seven(s):
    return s["id"] % 7 != 3


def jitter(s, ctx):
    """Adds a draw of ``ctx.rng`` (seeded by the sample's identity, epoch included)."""
    return {**s, "draw": int(ctx.rng.integers(0, 1 << 30))}


def readme_load(i):
    return {"tokens": np.arange(64, dtype=np.int64) + i, "label": i % 10}


def readme_augment(sample, ctx):
    noise = ctx.rng.integers(0, 2, size=sample["tokens"].shape)
    return {"tokens": sample["tokens"] + noise, "label": sample["label"]}


def readme_keep(sample):
    return sample["label"] != 3


def some_empty_tokens(i):
    """Token arrays of 0, 1 or 2 tokens: every third sample has none."""
    return {"tokens": np.arange(i % 3, dtype=np.int64) + 10 * i}


def square_unit(x):
    """An executor's program in the executor tests: a number in, its square out."""
    return x * x


def np_global_noise(s):
    """A map that draws from numpy's global RNG (not ctx.rng): not deterministic."""
    return {**s, "noise": float(np.random.random())}


def random_global_noise(s):
    """A map that draws from the random module's global RNG."""
    import random

    return {**s, "noise": random.random()}


def torch_global_noise(s):
    """A map that draws from torch's global RNG (as torchvision's random transforms do)."""
    import torch

    return {**s, "noise": torch.rand(3)}


def object_array(s):
    """A map returning an object array (deterministic: the same objects every call)."""
    return {"obj": np.array(["id", {"id": s["id"]}], dtype=object)}


def object_array_random(s):
    """A map returning an object array whose contents change every call."""
    return {"obj": np.array(["id", {"noise": float(np.random.random())}], dtype=object)}


def none_at_3(s):
    """A map that returns None for sample 3 (a forgotten ``return``)."""
    return None if s["id"] == 3 else s


def return_none(value):
    """A map_batch that forgets to return."""
    return None


def nan_feature(s):
    """Deterministic, with NaN scalars in its output (a missing value)."""
    return {"x": s["x"], "score": float("nan"), "np_score": np.float32("nan"),
            "scores": [float("nan"), 1.0]}


def coin_filter(s):
    """Keeps a sample on a global-RNG coin flip: both probes agree half of the time."""
    import random

    return random.random() < 2.0  # always True: the draw alone must be caught
