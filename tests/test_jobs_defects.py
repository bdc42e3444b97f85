"""Defects known in a comparable tool, each pinned by a test; the store's guarantees;
Ctrl-C with a real SIGINT; progress output."""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from _procs import alive

import _job_fns as J
from zephon import SerializationError, ZephonConfigError
from zephon.errors import CheckpointError
from zephon.jobs import CheckpointStore, JobSetupError, RunPolicy, run
from zephon.jobs.progress import Progress

TESTS = os.path.dirname(os.path.abspath(__file__))
FAST = dict(graceful_shutdown_sec=2.0, subject_spawn_timeout_sec=30.0)


def stored_keys(store_dir) -> tuple[list[str], list[str]]:
    """The keys of the successes and of the failures the store at ``store_dir`` holds."""
    with CheckpointStore(store_dir, None) as store:
        return store.keys(0), store.keys(1)


def subjects(tmp_path, n, action="ok", arg=None):
    d = tmp_path / "log"
    d.mkdir(parents=True, exist_ok=True)
    return [{"subject_id": f"S{i:03d}", "dir": str(d), "action": action, "arg": arg}
            for i in range(n)]




def test_unpicklable_callable_is_an_immediate_clear_error(tmp_path):
    with pytest.raises(SerializationError, match="cannot be pickled"):
        list(run(lambda s: s, ["S1"], RunPolicy(workers=2, resume=False, **FAST),
                 progress=False))


def test_a_result_that_cannot_be_pickled_names_the_subject_the_part_and_the_way_out(
        tmp_path):
    subs = subjects(tmp_path, 2)
    subs[1]["action"] = "lock_in_result"
    out = list(run(J.work, subs, RunPolicy(workers=1, backend="process", resume=False,
                                           auto_retry_rounds=0, **FAST), progress=False))
    assert out[0].ok and not out[1].ok
    error, text = out[1].error, str(out[1].error)
    assert isinstance(error, SerializationError), repr(error)
    assert "'S001'" in text  # the subject
    assert "_thread.lock" in text and "['model'][1]" in text  # what, and where in it
    assert error.path is not None and error.path.endswith("['model'][1]")
    assert "return plain data" in text.lower() and "picklable" in text  # the way out


def test_callable_the_worker_cannot_import_fails_within_the_spawn_timeout():
    with pytest.raises(JobSetupError, match="vanished_module") as info:
        list(run(J.Unloadable(), ["S1", "S2"], RunPolicy(workers=2, resume=False, **FAST),
                 progress=False))
    assert isinstance(info.value.__cause__, ImportError)


def test_a_setup_that_exits_fails_the_run_not_the_callers_process():
    # The worker's SystemExit is its set-up failure: a JobSetupError here, whose cause is
    # that SystemExit; re-raised as it came, it ended the user's own process.
    with pytest.raises(JobSetupError, match="no GPU on this worker") as info:
        list(run(J.ExitsInSetup(), ["S1"], RunPolicy(backend="process", resume=False, **FAST),
                 progress=False))
    assert type(info.value.__cause__) is SystemExit


def test_recycled_worker_never_loses_its_last_result(tmp_path):
    out = list(run(J.work, subjects(tmp_path, 30, "pid"),
                   RunPolicy(workers=2, persistent_worker_recycle_after_tasks=1, resume=False,
                             auto_retry_rounds=0, **FAST), progress=False))
    assert all(x.ok for x in out) and len({x.value for x in out}) == 30


def test_oom_backoff_persists_across_retry_rounds(tmp_path):
    # Two subjects die by SIGKILL in round 0: 4 -> 3 -> 2 workers. In the retry round they
    # die again (2 -> 1), and the retry round must start from 2, never from 4 again.
    subs = subjects(tmp_path, 2, "kill_self") + [
        {**s, "subject_id": "Z" + s["subject_id"]} for s in subjects(tmp_path, 6, "sleep", 0.3)]
    r = run(J.work, subs, RunPolicy(workers=4, auto_retry_rounds=2, resume=False, **FAST),
            progress=False)
    out = list(r)
    assert r.backend.concurrency == 1 and r.summary["oom_backoffs"] == 3
    assert all(x.attempts == 3 for x in out[:2])


def test_force_rerun_subjects_string_is_a_config_error():
    with pytest.raises(ZephonConfigError, match="not a single string"):
        RunPolicy(force_rerun_subjects="S01")


def test_stored_none_is_a_hit(tmp_path):
    store = str(tmp_path / "ckpt")
    subs = subjects(tmp_path, 1, "none")
    first = list(run(J.work, subs, RunPolicy(checkpoint_dir=store, **FAST), progress=False))
    assert first[0].ok and first[0].value is None
    again = list(run(J.work, [{**subs[0], "action": "raise"}],
                     RunPolicy(checkpoint_dir=store, **FAST), progress=False))
    assert again[0].ok and again[0].from_cache and again[0].value is None


SERIAL_INTERRUPT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    from zephon.jobs import RunPolicy, run

    def fn(subject):
        if subject == "S1":
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the subject runs
            time.sleep(5)
        return subject

    if __name__ == "__main__":
        try:
            list(run(fn, ["S0", "S1", "S2"], RunPolicy(subject_timeout_sec=None,
                                                       checkpoint_dir={store!r}),
                     progress=False))
        except KeyboardInterrupt:
            print("interrupted")
""")


def test_ctrl_c_in_the_serial_backend_stops_the_run(tmp_path):
    store = str(tmp_path / "ckpt")
    out = subprocess.run([sys.executable, "-c", SERIAL_INTERRUPT.format(tests=TESTS,
                                                                        store=store)],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "interrupted", out.stderr
    ok, failed = stored_keys(store)
    assert len(ok) == 1 and "S0" in ok[0]  # S0 finished and was stored
    assert failed == []  # S1 is not a failure
    assert not [f for f in os.listdir(store) if f.startswith(".tmp")]


PROCESS_INTERRUPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    import _job_fns as J
    from zephon.jobs import RunPolicy, run

    if __name__ == "__main__":
        subs = [{{"subject_id": f"S{{i}}", "dir": {log!r}, "action": "sleep", "arg": 600}}
                for i in range(3)]
        subs[0]["arg"] = 0.01
        print("ready", flush=True)
        try:
            for r in run(J.work, subs, RunPolicy(workers=3, graceful_shutdown_sec=2.0,
                                                 checkpoint_dir={store!r}), progress=False):
                print("stored", r.subject_id, flush=True)  # yielded once recorded
        except KeyboardInterrupt:
            print("interrupted", flush=True)
""")


def test_ctrl_c_in_the_process_backend_stops_workers_and_keeps_the_store(tmp_path):
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    store = str(tmp_path / "ckpt")
    code = PROCESS_INTERRUPT.format(tests=TESTS, log=str(log_dir), store=store)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        # S0 (10 ms) has finished and been recorded in the store (the run yields it only
        # then), and all three started (waited for, not assumed after a fixed sleep)
        assert proc.stdout.readline().strip() == "stored S0", proc.stderr.read()
        while len([f for f in os.listdir(log_dir) if f.endswith(".start")]) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=2.0 + 1.0 + 10.0)  # grace + 1 s, with slack
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "interrupted" in out, err
    pids = {int(f.split(".")[1]) for f in os.listdir(log_dir) if f.endswith(".start")}
    assert not any(alive(p) for p in pids)
    ok, failed = stored_keys(store)
    assert len(ok) == 1 and "S0" in ok[0] and failed == []


def test_a_second_concurrent_run_on_the_same_store_fails_clearly(tmp_path):
    store = str(tmp_path / "ckpt")
    held = CheckpointStore(store, "v1")
    try:
        with pytest.raises(CheckpointError, match=f"in use by another run \\(pid {os.getpid()}"):
            list(run(J.work, subjects(tmp_path, 1), RunPolicy(checkpoint_dir=store, **FAST),
                     progress=False))
    finally:
        held.close()
    list(run(J.work, subjects(tmp_path, 1), RunPolicy(checkpoint_dir=store, **FAST),
             progress=False))  # free again


def test_store_round_trips_values_natively_and_refuses_pickle_unless_allowed(tmp_path):
    store = CheckpointStore(str(tmp_path / "s"), "fp")
    value = {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "t": (1, "x", None),
             "big": 1 << 100, "f": np.float32(1.5), "n": None, "b": b"\x00\x01"}
    store.save_success("k1", "S1", value, 1, 0.5)
    got = store.load("k1").value
    assert np.array_equal(got["a"], value["a"]) and got["a"].dtype == np.int16
    assert got["t"] == (1, "x", None) and got["big"] == 1 << 100 and got["b"] == b"\x00\x01"
    assert got["f"] == np.float32(1.5) and got["n"] is None
    with pytest.raises(SerializationError, match="allow_pickle=True"):
        store.save_success("k2", "S2", {1, 2}, 1, 0.1)
    store.close()
    pickling = CheckpointStore(str(tmp_path / "s"), "fp", allow_pickle=True)
    pickling.save_success("k2", "S2", {1, 2}, 1, 0.1)
    assert pickling.load("k2").value == {1, 2}
    pickling.close()
    strict = CheckpointStore(str(tmp_path / "s"), "fp")
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        strict.load("k2")
    strict.close()
    assert sorted(stored_keys(str(tmp_path / "s"))[0]) == ["k1", "k2"]
    assert not [e for e in os.listdir(tmp_path / "s") if e.startswith(".tmp")]
    assert oct(os.stat(tmp_path / "s").st_mode & 0o777) == "0o700"


def test_unstorable_value_fails_the_subject_with_a_clear_error(tmp_path):
    out = list(run(J.work, subjects(tmp_path, 1, "object"),
                   RunPolicy(checkpoint_dir=str(tmp_path / "c"), auto_retry_rounds=0, **FAST),
                   progress=False))
    assert isinstance(out[0].error, SerializationError)
    ok = list(run(J.work, subjects(tmp_path / "p", 1, "object"),
                  RunPolicy(checkpoint_dir=str(tmp_path / "c2"), **FAST), progress=False,
                  allow_pickle=True))
    assert ok[0].ok and ok[0].value == {1, 2}


def test_custom_cache_key_separates_entries(tmp_path):
    store = str(tmp_path / "ckpt")
    subs = subjects(tmp_path, 1, "ok", arg=1)
    list(run(J.KeyedWork(), subs, RunPolicy(checkpoint_dir=store, **FAST), progress=False))
    changed = [{**subs[0], "arg": 2}]
    out = list(run(J.KeyedWork(), changed, RunPolicy(checkpoint_dir=store, **FAST),
                   progress=False))
    assert not out[0].from_cache  # the key includes arg


def test_subject_ids_are_validated(tmp_path):
    with pytest.raises(ZephonConfigError, match="duplicate subject ids"):
        run(J.work, ["S1", "S1"])
    with pytest.raises(ZephonConfigError, match="subject 1 .*has no id"):
        run(J.work, ["S1", 5])


def test_progress_bar_on_a_tty_and_log_lines_otherwise(caplog):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    bar = Progress(4, True, stream=stream)
    for ok in (True, True, False, True):
        bar.update(ok=ok, cached=False)
    bar.close({"done": 3, "failed": 1})
    text = stream.getvalue()
    assert "[" + "#" * 30 + "] 4/4 subjects" in text and "done 3, failed 1" in text
    with caplog.at_level(logging.INFO, logger="zephon.jobs"):
        quiet = Progress(2, True, stream=io.StringIO(), log_every_s=0.0)
        quiet.update(ok=True, cached=True)
        quiet.close({"done": 1})
    assert "progress: 1/2 subjects (1 cached, 0 failed)" in caplog.text
    assert "job run summary: done 1" in caplog.text


def test_run_summary_counts(tmp_path):
    subs = subjects(tmp_path, 3)
    subs[2]["action"] = "raise"
    r = run(J.work, subs, RunPolicy(resume=False, auto_retry_rounds=1, **FAST), progress=False)
    list(r)
    assert {k: r.summary[k] for k in ("done", "cached", "failed", "retried", "timeouts",
                                      "oom_backoffs")} == {
        "done": 2, "cached": 0, "failed": 1, "retried": 1, "timeouts": 0, "oom_backoffs": 0}


@pytest.mark.parametrize("backend", ["process", "serial"])
@pytest.mark.parametrize("action, exc_type", [("sys_exit", SystemExit),
                                              ("raise_interrupt", KeyboardInterrupt)])
def test_a_subject_that_exits_or_interrupts_itself_fails_alone(tmp_path, backend, action,
                                                               exc_type):
    # SystemExit / KeyboardInterrupt raised by a subject's own code are that subject's
    # failure on every backend (job workers ignore Ctrl-C: it is never the caller's):
    # recorded with the exception itself (type and code kept), the worker and its setup()
    # kept, the run going on. The process backend reported a crash and replaced the
    # worker (setup() again); the serial backend ended the whole run
    fn = J.WithSetup(str(tmp_path))
    subs = [{"subject_id": "S0", "dir": str(tmp_path), "action": "ok"},
            {"subject_id": "S1", "dir": str(tmp_path), "action": action, "arg": 5},
            {"subject_id": "S2", "dir": str(tmp_path), "action": "ok"}]
    policy = RunPolicy(backend=backend, workers=1, resume=False, auto_retry_rounds=0,
                       subject_timeout_sec=None if backend == "serial" else 60.0, **FAST)
    try:
        results = list(run(fn, subs, policy, progress=False))
    except (SystemExit, KeyboardInterrupt) as exc:  # (never let it end the test session)
        pytest.fail(f"the subject's own {exc!r} ended the whole run")
    assert [(r.subject_id, r.ok) for r in results] == [("S0", True), ("S1", False),
                                                       ("S2", True)]
    error = results[1].error
    assert type(error) is exc_type, repr(error)
    if exc_type is SystemExit:
        assert error.code == 5
    else:
        assert "S1 gave up" in str(error)
    setups = [f for f in os.listdir(tmp_path) if f.startswith("setup.")]
    assert len(setups) == 1, setups  # one worker (or this process) set up once
