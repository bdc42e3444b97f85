"""A script that runs ``zephon.jobs.run`` on 2 process workers whose subjects shrug off
SIGTERM (each writes ``<log>/<id>.term`` when it gets one, then sleeps on), for the
Ctrl-C tests of ``tests/test_jobs_signals.py``.

Usage: ``python _jobs_signal_run.py LOG_DIR STORE_DIR GRACE_S [body] [catch] [twin]``. It
prints ``ready`` before the run starts and ``result <id>`` for each result; with ``body``
the first subject returns as soon as the second has started, and the loop's body then
sleeps (a Ctrl-C lands in the caller's code, not in the run's). A KeyboardInterrupt is
left to reach the interpreter (the exit status then says SIGINT), as in a user's script;
with ``catch`` the loop's ``except KeyboardInterrupt`` first prints ``caught``, then
``unlocked`` if the store's lock is free, and raises it again. With ``twin`` a Ctrl-C
that interrupts the run's wait (the selector's ``poll``) is followed by a second one,
sent by the script to itself the moment the KeyboardInterrupt leaves that call: two
Ctrl-Cs at the same instant that the kernel delivers as two (it merges two that arrive
before the first is delivered), the second landing while the first one's
KeyboardInterrupt unwinds the run.
"""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _job_fns as J

from zephon.jobs import RunPolicy, run

if __name__ == "__main__":
    log_dir, store, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])
    body, catch = "body" in sys.argv[4:], "catch" in sys.argv[4:]
    subs = [{"subject_id": f"S{i}", "dir": log_dir, "action": "ignore_term"}
            for i in range(4)]
    if body:  # S0 returns once S1 has started (on the other worker)
        subs[0].update(action="sleep_once_started", arg=(2, 0.0))
    print("ready", flush=True)
    if "twin" in sys.argv[4:]:
        def second_ctrl_c(frame, event, arg):
            if event == "c_exception" and getattr(arg, "__name__", "") in ("poll", "select"):
                sys.setprofile(None)
                os.kill(os.getpid(), signal.SIGINT)

        sys.setprofile(second_ctrl_c)
    try:
        for r in run(J.work, subs, RunPolicy(workers=2, graceful_shutdown_sec=grace,
                                             subject_spawn_timeout_sec=60.0,
                                             checkpoint_dir=store), progress=False):
            print("result", r.subject_id, flush=True)
            if body:
                time.sleep(600)
    except KeyboardInterrupt:
        if catch:
            print("caught", flush=True)
            with open(os.path.join(store, "LOCK"), "rb") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: still locked
            print("unlocked", flush=True)
        raise
