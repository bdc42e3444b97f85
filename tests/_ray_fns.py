"""Ops and sources for the Ray runner's tests (``test_pipeline_ray.py``) and benchmark:
module level, so Ray actors import them by name (``tests/`` is on their
``PYTHONPATH``, see ``_ray_clusters.py``)."""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np


def item(i: int) -> dict:
    return {"id": i, "x": np.arange(16, dtype=np.int64) + i}


def noisy(sample: dict, ctx) -> dict:
    """A seeded draw per sample: the stream shows any change in what ``ctx.rng`` gives."""
    x = sample["x"]
    return {"id": sample["id"], "x": x + ctx.rng.integers(0, 100, x.shape).astype(x.dtype)}


def not_div7(sample) -> bool:
    return sample["id"] % 7 != 0


def value_sample(i: int) -> dict:
    return {"v": np.full(4, i, dtype=np.float32)}


def plus_one(sample: dict) -> dict:
    return {"v": sample["v"] + 1}


def drop_every_fifth(sample: dict) -> bool:
    return int(sample["v"][0]) % 5 != 0


def jpeg_sample(i: int) -> dict:
    """An encoded JPEG of its own (64x48, natural-ish content) and its id."""
    from _images import jpeg_bytes, make_image

    image = make_image((64, 48), np.random.default_rng(i))
    return {"id": i, "image": jpeg_bytes(image)}


class Logged:
    """A map that appends ``"<id> <pid> <node>\\n"`` to ``path`` for every call (a side
    effect to count; the node is the Ray node id where Ray is connected, else "-") after
    ``sleep`` seconds of "work"."""

    def __init__(self, path: str, sleep: float = 0.0) -> None:
        self.path, self.sleep = path, sleep

    def __call__(self, sample: dict) -> dict:
        if self.sleep:
            time.sleep(self.sleep)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{sample['id']} {os.getpid()} {_node()}\n".encode())
        finally:
            os.close(fd)
        return sample


def _node() -> str:
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return "-"
    return ray.get_runtime_context().get_node_id()


def calls(path: str) -> list[tuple[int, int]]:
    """The ``(id, pid)`` of every call :class:`Logged` recorded in ``path``."""
    return [(i, pid) for i, pid, _ in placed_calls(path)]


def placed_calls(path: str) -> list[tuple[int, int, str]]:
    """The ``(id, pid, node id)`` of every call :class:`Logged` recorded in ``path``."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [(int(a), int(b), c) for a, b, c in (line.split() for line in fh
                                                    if line.strip())]


def fail_at(sample: dict) -> dict:
    if sample["id"] == 123:
        raise ValueError("sample 123 is bad")
    return sample


def wait_10ms(sample: dict) -> dict:
    """An I/O-bound op: waits 10 ms per sample, as a remote read does."""
    time.sleep(0.01)
    return sample


def digest(batches) -> str:
    """One hash of every batch's every column (name, dtype, shape, bytes) and meta."""
    h = hashlib.sha256()
    for batch in batches:
        for name in sorted(batch):
            value = batch[name]
            h.update(name.encode())
            if isinstance(value, np.ndarray):
                h.update(f"{value.dtype.str}{value.shape}".encode())
                h.update(np.ascontiguousarray(value).tobytes())
            else:
                h.update(repr(value).encode())
        h.update(repr(batch.meta.get("sample_ids")).encode())
    return h.hexdigest()


def plus_id(sample: dict) -> dict:
    return {"id": sample["id"], "x": sample["x"] + sample["id"]}


def ranked(runner: str, world: int = 1, rank: int = 0, lanes: int = 4, workers: int = 2):
    """The pipeline the rank tests run: 4 lanes, ``world`` ranks, this one ``rank``."""
    from zephon import Pipeline, RuntimeOptions, sources

    return (Pipeline(sources.from_callable(640, item), seed=3, chunk_size=16)
            .map(noisy).shuffle(32).batch(8)
            .options(RuntimeOptions(runner=runner, max_workers=workers,
                                    worker_allocation="per_stage_fixed",
                                    world_size=world, global_rank=rank,
                                    canonical_replicas=lanes)))


def lane_keys(batches) -> list:
    """``[lane, index in the lane, ids, a digest of x]`` of every batch."""
    return [[int(b.meta["lane"]), int(b.meta["lane_index"]), [int(i) for i in b["id"]],
             hashlib.sha256(np.ascontiguousarray(b["x"]).tobytes()).hexdigest()]
            for b in batches]


def big_item(i: int) -> dict:
    return {"id": i, "x": np.full(1 << 18, i, dtype=np.float32)}  # 1 MiB


def bump_in_place(sample: dict) -> dict:
    """Works in place, as many augmentations do."""
    sample["x"] += 1
    return sample


def lock_at_50(sample: dict) -> dict:
    """Sample 50's value holds a lock: it cannot be pickled."""
    if sample["id"] == 50:
        import threading

        return {**sample, "lock": threading.Lock()}
    return sample
