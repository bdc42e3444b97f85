"""A second Ctrl-C at each point of a pipeline's stop, one run after another (run as a
script by tests/test_pipeline_signals.py).

Each run iterates a pipeline on the threads runner (its consumer waits in the hand-off
from the pump thread); a real SIGINT interrupts ``next()``, and a second
``KeyboardInterrupt`` lands ``k`` signal points later (see
tests/_signal_handoff_storm.py), from the hand-off's ``get()`` through ``__next__``'s
close to the stop, ``k`` swept over the runs. Every run must end with the
``KeyboardInterrupt`` only, the iterator closed and its pump thread gone.

Prints ``RESULT <json>`` (the runs that went wrong); exit status 0 when none did.
Usage: ``python _signal_close_sweep.py FIRST LAST``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _pipeline_fns as F
import _signal_handoff_storm as S

from zephon import Pipeline, RuntimeOptions, sources
from zephon.pipeline import engine, iterator
from zephon.transport import supervisor

S.TARGETS = S.TARGETS + tuple(os.path.abspath(m.__file__)
                              for m in (engine, iterator, supervisor))


def _pumps() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "zephon-pump" and t.is_alive()]


def one_run(k: int) -> str | None:
    """What went wrong with the second interrupt ``k`` points after the first, if any."""
    pipe = (Pipeline(sources.from_sequence([0.02] * 1000), shuffle=False)
            .map(F.slow_identity, parallelism=1)
            .options(RuntimeOptions(runner="threads", max_workers=1)))
    it = iter(pipe)
    next(it)

    def on_sigint(signum, frame):
        if frame is not None and S._ours(frame):
            signal.signal(signal.SIGINT, signal.default_int_handler)
            S._second_after(frame, k)
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    main_id = threading.main_thread().ident
    threading.Timer(0.005, lambda: signal.pthread_kill(main_id, signal.SIGINT)).start()
    wrong = None
    try:
        while True:
            next(it)
    except KeyboardInterrupt:
        pass
    except BaseException as exc:  # noqa: BLE001 - what the test looks for
        wrong = f"next() raised {type(exc).__name__}: {exc}"
    S._disarm(sys._getframe())
    signal.signal(signal.SIGINT, signal.default_int_handler)
    deadline = time.monotonic() + 5
    while _pumps() and time.monotonic() < deadline:
        time.sleep(0.01)
    if wrong is None and not it.closed:
        wrong = "the iterator was left open"
    if wrong is None and _pumps():
        wrong = "the pump thread still runs 5 s after"
    it.close()
    return wrong


def main(first: int, last: int) -> int:
    watchdog = threading.Timer(30, lambda: os._exit(3))  # stuck for good
    watchdog.daemon = True
    watchdog.start()
    wrong = {}
    for k in range(first, last + 1):
        what = one_run(k)
        if what:
            wrong[k] = what
    print("RESULT " + json.dumps(wrong), flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
