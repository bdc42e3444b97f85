"""A storm of SIGINTs aimed at the consumer's side of a :class:`Handoff` (run as a script
by tests/test_pipeline_signals.py).

A pump thread puts numbered items into a small hand-off; the main thread takes them while
another thread sends it SIGINTs (``signal.pthread_kill``, real signals), in pairs a few
microseconds apart. The SIGINT handler raises ``KeyboardInterrupt`` as Python's own does,
but only where the main thread is inside the hand-off or the ``threading`` module (where
the interrupt can break a lock), so that the script's own bookkeeping is never cut. Every
``KeyboardInterrupt`` out of ``get()`` is caught and the loop goes on.

Prints one line ``RESULT <json>``: how many items were taken and interrupts caught,
whether the items came in order, and what went wrong (an exception other than
``KeyboardInterrupt``, ``get()`` or ``close()`` stuck). Exit status 0 when nothing did.
Usage: ``python _signal_handoff_storm.py SECONDS``.
"""

from __future__ import annotations

import dis
import json
import os
import random
import signal
import sys
import threading
import time

from zephon.pipeline import iterator as it_mod
from zephon.pipeline.iterator import Handoff, HandoffClosed

TARGETS = (os.path.abspath(it_mod.__file__), os.path.abspath(threading.__file__))


#: set while the main thread takes items (not while it starts or joins threads)
ARMED: list[bool] = []
#: how many opcodes after the first interrupt the second lands (swept, one pair after
#: another, over the whole unwinding path)
SWEEP = 40
PAIRS = [0]


def _ours(frame) -> bool:
    return os.path.abspath(frame.f_code.co_filename) in TARGETS


def _disarm(frame) -> None:
    sys.settrace(None)
    while frame is not None:
        frame.f_trace = None
        frame = frame.f_back


def _checks_before(fr, prev: dict) -> bool:
    """Whether the interpreter looks at pending signals right before the instruction
    ``fr`` is at: after a call returned (CPython checks at the end of its call
    instructions), at a backward jump; a function's start is the ``call`` event."""
    op = dis.opname[fr.f_code.co_code[fr.f_lasti]]
    before, prev[fr] = prev.get(fr, ""), op
    return before.startswith("CALL") or "JUMP_BACKWARD" in op


def _second_after(frame, points: int) -> None:
    """Raise KeyboardInterrupt at the ``points``-th point from now where the interpreter
    would look at a pending SIGINT while the main thread runs the hand-off or
    ``threading``: a second Ctrl-C landing exactly there."""
    left, prev = [points], {}

    def tracer(fr, event, arg):
        fr.f_trace_opcodes = True
        if _ours(fr) and (event == "call" or (event == "opcode" and _checks_before(fr, prev))):
            if left[0] <= 0:
                _disarm(fr)
                raise KeyboardInterrupt
            left[0] -= 1
        return tracer

    sys.settrace(tracer)
    while frame is not None:
        frame.f_trace, frame.f_trace_opcodes = tracer, True
        frame = frame.f_back


def on_sigint(signum, frame):
    if ARMED and frame is not None and _ours(frame):
        PAIRS[0] += 1
        _second_after(frame, PAIRS[0] % SWEEP)
        raise KeyboardInterrupt


def _take(h: Handoff, seconds: float, problems: list[str]) -> dict:
    """Take items for ``seconds`` while the SIGINTs come; what was seen."""
    seen = dict(taken=0, interrupts=0, ordered=True, last=-1)
    end = time.monotonic() + seconds
    ARMED.append(True)
    while time.monotonic() < end:
        try:
            item = h.get()
        except KeyboardInterrupt:
            _disarm(sys._getframe())  # the second one may not have come: not now
            seen["interrupts"] += 1
            continue
        except BaseException as exc:  # noqa: BLE001 - what the test looks for
            problems.append(f"get() raised {type(exc).__name__}: {exc}")
            break
        seen["ordered"] = seen["ordered"] and item > seen["last"]
        seen["last"] = item
        seen["taken"] += 1
    ARMED.clear()
    return seen


def _check_after(h: Handoff, pumper: threading.Thread, seen: dict,
                 problems: list[str]) -> None:
    """The hand-off still works after the storm, and close() ends the pump."""
    for _ in range(3):
        try:
            item = h.get()
        except BaseException as exc:  # noqa: BLE001 - what the test looks for
            problems.append(f"get() after the storm raised {type(exc).__name__}: {exc}")
            return
        seen["ordered"] = seen["ordered"] and item > seen["last"]
        seen["last"] = item
    closer = threading.Thread(target=h.close, daemon=True)
    closer.start()
    closer.join(10)
    if closer.is_alive():
        problems.append("close() stuck")
    pumper.join(10)
    if pumper.is_alive():
        problems.append("the pump stuck in put() after close()")
    try:
        h.get()
        problems.append("get() after close() returned an item")
    except HandoffClosed:
        pass
    except BaseException as exc:  # noqa: BLE001 - what the test looks for
        problems.append(f"get() after close() raised {type(exc).__name__}: {exc}")


def main(seconds: float) -> int:
    signal.signal(signal.SIGINT, on_sigint)
    h = Handoff(depth=4)
    main_id = threading.main_thread().ident
    done: list[bool] = []  # not an Event: its set() is in the threading module
    problems: list[str] = []

    def pump() -> None:
        i = 0
        while h.put(i):
            i += 1
            if i % 2:
                time.sleep(0.0001)  # the consumer waits in get() most of the time

    def kick() -> None:
        rng = random.Random(1)
        while not done:
            signal.pthread_kill(main_id, signal.SIGINT)  # the handler arms the second
            time.sleep(0.001 + rng.random() * 0.002)

    pumper = threading.Thread(target=pump, daemon=True)
    kicker = threading.Thread(target=kick, daemon=True)
    pumper.start()
    kicker.start()
    watchdog = threading.Timer(seconds + 8, lambda: os._exit(3))  # get() stuck for good
    watchdog.daemon = True
    watchdog.start()
    seen = _take(h, seconds, problems)
    done.append(True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # late SIGINTs in flight: ignore
    kicker.join()
    time.sleep(0.05)
    if not problems:
        _check_after(h, pumper, seen, problems)
    seen.pop("last")
    print("RESULT " + json.dumps(dict(seen, problems=problems)), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(float(sys.argv[1]) if len(sys.argv) > 1 else 3.0))
