"""Ops for the profiling tests (module level: spawn workers import them)."""

from __future__ import annotations

import time

import numpy as np

#: CPU seconds the slow op spends per sample (a spin, not a sleep: it is busy)
SLOW_S = 0.004


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def cheap(x):
    return x + 1


def slow(x):
    spin(SLOW_S)
    return x


def array_sample(i):
    return np.full(131072, i, dtype=np.float32)  # 512 KiB: results go through the arena


def slow_array(a):
    spin(SLOW_S)
    return a * 2


def slow_step(batch):
    """A training step of 15 ms of CPU."""
    spin(0.015)


def square(x):
    return x * x
