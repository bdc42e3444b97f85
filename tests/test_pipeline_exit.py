"""Leaving a pipeline loop early, in every way a training script does, ends promptly,
quietly and without leftovers (real scripts in real subprocesses, real signals)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from _procs import alive

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
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]
    # zephon stopped its own workers: that is not a crash, and says nothing at ERROR
    assert "ERROR" not in err and "re-dispatching" not in err, err
    if leave == "raise":
        assert err.count("Traceback") == 1 and "consumer failed" in err


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_ctrl_c_gives_one_keyboard_interrupt_and_no_worker_traceback(tmp_path, runner):
    code, out, err, pids = run_script(tmp_path, runner, "sigint")
    assert code != 0 and "KeyboardInterrupt" in err
    assert err.count("Traceback") == 1, err
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]


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


def test_a_script_without_the_main_guard_is_told_how_to_fix_it(tmp_path):
    path = tmp_path / "unguarded.py"
    path.write_text(UNGUARDED.format(tests=TESTS))
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "re-ran" in last and 'if __name__ == "__main__":' in last, proc.stderr
    assert proc.stderr.count("if __name__") == 1  # said once, by the parent
