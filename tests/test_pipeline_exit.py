"""Leaving a pipeline loop early, in every way a training script does, ends promptly,
quietly and without leftovers (real scripts in real subprocesses, real signals)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from _procs import alive, wait_gone

TESTS = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    import _pipeline_fns as F
    from zephon import Pipeline, RuntimeOptions, sources

    def main():
        pipe = (Pipeline(sources.from_callable(100_000, F.make_sample), chunk_size=4)
                .map(F.double, parallelism=2).batch(4)
                .options(RuntimeOptions({opts})))
        for i, batch in enumerate(pipe):
            if i == 3:
                pids = [p.pid for p in __import__("multiprocessing").active_children()]
                print("PIDS", *pids, flush=True)
                {leave}

    if __name__ == "__main__":
        main()
""")

LEAVE = {
    "break": "break",
    "raise": "raise RuntimeError('consumer failed')",
    "sys.exit": "sys.exit(0)",
    "kept": "global kept; kept = pipe; break",  # the pipeline outlives the loop
    "sigint": "print('READY', flush=True); time.sleep(60)",
}

RUNNERS = {"process": "runner='process', max_workers=2",
           "mtp": "mtp_mode=True, runner='process', max_workers=2"}


def run_script(tmp_path, runner: str, leave: str, timeout: float = 60.0):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(tests=TESTS, opts=RUNNERS[runner], leave=LEAVE[leave]))
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        if leave == "sigint":
            line = ""
            deadline = time.monotonic() + timeout
            while "READY" not in line and time.monotonic() < deadline:
                line = proc.stdout.readline()
                if line.startswith("PIDS"):
                    pids_line = line
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
            out, err = proc.communicate(timeout=timeout)
            out = pids_line + out
        else:
            out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the script did not exit within {timeout} s ({runner}, {leave})")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    pids = [int(p) for line in out.splitlines() if line.startswith("PIDS")
            for p in line.split()[1:]]
    return proc.returncode, out, err, pids


@pytest.mark.parametrize("runner", sorted(RUNNERS))
@pytest.mark.parametrize("leave", ["break", "raise", "sys.exit", "kept"])
def test_leaving_the_loop_exits_promptly_and_leaves_no_process(tmp_path, runner, leave):
    code, out, err, pids = run_script(tmp_path, runner, leave)
    assert pids, err
    assert code == (1 if leave == "raise" else 0), err
    assert not wait_gone(pids, 10)
    # zephon stopped its own workers: that is not a crash, and says nothing at ERROR
    assert "ERROR" not in err and "re-dispatching" not in err, err
    if leave == "raise":
        assert err.count("Traceback") == 1 and "consumer failed" in err


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_ctrl_c_gives_one_keyboard_interrupt_and_no_worker_traceback(tmp_path, runner):
    code, out, err, pids = run_script(tmp_path, runner, "sigint")
    assert code != 0 and "KeyboardInterrupt" in err
    assert err.count("Traceback") == 1, err
    assert not wait_gone(pids, 10)


UNGUARDED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import _pipeline_fns as F
    from zephon import Pipeline, RuntimeOptions, sources

    pipe = (Pipeline(sources.from_callable(40, F.make_sample))
            .map(F.double, parallelism=2).batch(4)
            .options(RuntimeOptions(runner="process", max_workers=2)))
    print(len(list(pipe)))
""")


#: a stage program far larger than a pipe holds (its map carries 8 MiB): spawn's
#: preparation data once carried it, and the parent blocked for ever writing it to a child
#: that had died re-running the script
BIG_PROGRAM = ("import functools, numpy as np\n"
               "F.double = functools.partial(F.double_with, pad=np.zeros(1 << 20))\n")


@pytest.mark.parametrize("program", ["small", "large"])
def test_a_script_without_the_main_guard_is_told_how_to_fix_it(tmp_path, program):
    path = tmp_path / "unguarded.py"
    text = UNGUARDED.format(tests=TESTS)
    if program == "large":
        text = text.replace("from zephon import", BIG_PROGRAM + "from zephon import")
    path.write_text(text)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "re-ran" in last and 'if __name__ == "__main__":' in last, proc.stderr
    assert proc.stderr.count("if __name__") == 1  # said once, by the parent


# -- leaving while an op is in flight --------------------------------------------------
# Sample 2's op sleeps 30 s (tests/_exit_fns.py); the script leaves the loop once that op
# is in its sleep (a file barrier) and reports how long getting back took, measured around
# that one action, and which of the op's processes (worker, the op's own child) and the
# run's children are still alive at that moment.

STALL_SCRIPT = textwrap.dedent("""
    import json, multiprocessing, os, sys, time
    sys.path.insert(0, {tests!r})
    import _exit_fns as X
    from _procs import alive
    from zephon import Pipeline, RuntimeOptions, sources
    import _pipeline_fns as F

    def report(t0, pids, **extra):
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds.append(os.readlink(f"/proc/self/fd/{{fd}}"))
            except OSError:
                pass
        print(json.dumps(dict(extra, back=time.monotonic() - t0, pids=pids,
                              left=[p for p in pids if alive(p)],
                              memfds=[f for f in fds if "memfd:" in f],
                              finished=X.stall_finished())), flush=True)

    def main():
        os.environ["ZEPHON_MAIN_PID"] = str(os.getpid())
        pipe = (Pipeline(sources.from_callable(1000, F.make_sample), chunk_size=1,
                         shuffle=False)
                .map(X.stall).options(RuntimeOptions({opts})))
        it = iter(pipe) if {loop!r} == "it" else None
        pids, t0 = [], None
        try:
            for item in {loop}:
                pids = X.wait_for_stall() + [p.pid for p in multiprocessing.active_children()]
                t0 = time.monotonic()
                {leave}
        except (RuntimeError, KeyboardInterrupt) as exc:
            report(t0, pids, raised=type(exc).__name__)
            return
        report(t0, pids)

    if __name__ == "__main__":
        main()
""")

STALL_LEAVE = {
    "break": ("iter(pipe)", "break"),  # the loop's iterator is dropped: garbage collected
    # the exception leaves the loop: the loop's iterator goes with it
    "raise": ("iter(pipe)", "raise RuntimeError('consumer failed')"),
    "close": ("it", "it.close(); break"),
    "sigint": ("iter(pipe)", "print('READY', flush=True); time.sleep(60)"),
}

STALL_RUNNERS = {
    "process": "runner='process', max_workers=2",
    "threads": "runner='threads', max_workers=2",
    "mtp": "mtp_mode=True, runner='process', max_workers=2",
}

#: "back in under 1 s": the bound the exit promise makes, measured around the one action.
BACK_S = 1.0


def run_stall(tmp_path, runner: str, leave: str, *, opts: str = "", stall_s: float = 30.0):
    """Run the stalling script; returns (its report, stderr, seconds from SIGINT to the
    report for ``leave="sigint"``)."""
    path = tmp_path / "train.py"
    loop, body = STALL_LEAVE[leave]
    options = ", ".join(x for x in (STALL_RUNNERS[runner], opts) if x)
    path.write_text(STALL_SCRIPT.format(tests=TESTS, opts=options, loop=loop, leave=body))
    env = dict(os.environ, ZEPHON_TEST_DIR=str(tmp_path), ZEPHON_STALL_S=str(stall_s),
               PYTHONFAULTHANDLER="1")  # a crash of the script says where
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    report, since_signal, line, err = None, None, "", ""
    try:
        line = proc.stdout.readline()
        if leave == "sigint" and line.startswith("READY"):
            t0 = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
            line = proc.stdout.readline()
            since_signal = time.monotonic() - t0
        if line.startswith("{"):
            report = json.loads(line)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for pid in (report or {}).get("pids", []):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert report is not None, (f"exit status {proc.returncode}, first line {line!r}, "
                                f"stderr: {err}")
    return report, err, since_signal


@pytest.mark.parametrize("runner", sorted(STALL_RUNNERS))
@pytest.mark.parametrize("leave", ["break", "raise", "close"])
def test_leaving_during_a_30s_op_is_back_within_a_second(tmp_path, runner, leave):
    report, err, _ = run_stall(tmp_path, runner, leave)
    assert report["back"] < BACK_S, (report, err)
    assert report["raised"] == "RuntimeError" if leave == "raise" else "raised" not in report
    assert not report["finished"]  # the op was abandoned, not waited for
    if runner != "threads":  # a thread's op cannot be stopped; a worker's is, with its tree
        assert len(report["pids"]) >= 3, report  # worker, the op's child, the run's children
        assert report["left"] == [], report
    assert report["memfds"] == [], report
    assert "Traceback" not in err or leave == "raise", err


@pytest.mark.parametrize("runner", sorted(STALL_RUNNERS))
def test_ctrl_c_during_a_30s_op_is_back_within_a_second(tmp_path, runner):
    report, err, since_signal = run_stall(tmp_path, runner, "sigint")
    assert report["raised"] == "KeyboardInterrupt", (report, err)
    assert since_signal < BACK_S, (since_signal, report, err)
    if runner != "threads":
        assert report["left"] == [], report
    assert report["memfds"] == [], report


@pytest.mark.parametrize("runner", ["process", "mtp"])
def test_sys_exit_during_a_30s_op_leaves_within_a_second(tmp_path, runner):
    path = tmp_path / "train.py"
    path.write_text(STALL_SCRIPT.format(
        tests=TESTS, opts=STALL_RUNNERS[runner], loop="it",
        leave="print(json.dumps(dict(t=time.time(), pids=pids)), flush=True); sys.exit(0)"))
    env = dict(os.environ, ZEPHON_TEST_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    pids: list[int] = []
    try:
        line = proc.stdout.readline()
        proc.wait(timeout=120)
        gone_at = time.time()
        report = json.loads(line)
        pids = report["pids"]
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert gone_at - report["t"] < BACK_S, (gone_at - report["t"], err)
    assert len(pids) >= 3 and not [p for p in pids if alive(p)], pids


@pytest.mark.parametrize("runner", ["process", "mtp"])
def test_the_graceful_mode_still_waits_for_the_op_in_flight(tmp_path, runner):
    report, err, _ = run_stall(tmp_path, runner, "close", opts="shutdown_mode='graceful'",
                               stall_s=2.0)
    assert report["finished"], (report, err)  # close() let the op finish
    assert report["left"] == [], report


@pytest.mark.parametrize("runner", ["inline", "threads", "process"])
def test_an_op_may_run_a_multiprocessing_pool_on_every_runner(runner, tmp_path, monkeypatch):
    import _exit_fns as X
    from zephon import Pipeline, RuntimeOptions, sources
    import _pipeline_fns as F

    monkeypatch.setenv("ZEPHON_TEST_DIR", str(tmp_path))  # before the workers start
    pipe = (Pipeline(sources.from_callable(3, F.make_sample), shuffle=False)
            .map(X.with_mp_pool).options(RuntimeOptions(runner=runner, max_workers=1)))
    out = list(pipe)
    assert [o["squares"] for o in out] == [[0], [0, 1], [0, 1, 4]]
    pids = [p for i in range(3) for p in json.loads((tmp_path / f"mp-{i}.json").read_text())]
    assert len(pids) == 6 and not [p for p in pids if alive(p)]
