"""An op whose module hangs when another process than the test's imports it (a
set-up that never ends: a stuck import, a lock held forever): a process worker
unpickles its stage's program, and so this module, before it says READY. The test
names its own process in $ZEPHON_TEST_MAIN_PID before the workers start (they
inherit it)."""

from __future__ import annotations

import os
import time

if os.environ.get("ZEPHON_TEST_MAIN_PID", str(os.getpid())) != str(os.getpid()):
    time.sleep(600)


def plus_one(x):
    return x + 1
