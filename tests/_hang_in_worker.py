"""An op whose module hangs when a worker process imports it (a set-up that never
ends: a stuck import, a lock held forever); the test's own process imports it as
usual. A process worker unpickles its stage's program, and so this module, before it
says READY."""

from __future__ import annotations

import multiprocessing
import time

if multiprocessing.parent_process() is not None:
    time.sleep(600)


def plus_one(x):
    return x + 1
