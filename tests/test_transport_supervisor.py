"""The supervisor with real child processes: handshake, stop/terminate/kill/reap, process
groups, the parent-death watch, crash reports and the shutdown policy."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
from _procs import alive, wait_gone
from _supervisor_children import (
    exits_at_once,
    fails_setup,
    forks_grandchild,
    ignores_sigterm,
    never_ready,
    obeys_stop,
)

from zephon.errors import TransportError, WorkerCrashedError
from zephon.transport.spawn_guard import EXIT_UNGUARDED_MAIN
from zephon.transport.supervisor import (
    Child,
    MsgKind,
    ShutdownPolicy,
    await_ready,
    crash_error,
    exit_text,
    stop_children,
    sweep_groups,
)

SPAWN = multiprocessing.get_context("spawn")
QUICK = ShutdownPolicy(grace_s=0.3, terminate_wait_s=0.3, kill_wait_s=10.0)


@pytest.fixture
def spawn():
    """Start children through the supervisor; every one is killed and reaped at teardown,
    with whatever it started (``extra`` pids)."""
    children: list[Child] = []
    extra: list[int] = []

    def start(target, *args, group: bool = False) -> Child:
        child = Child.spawn(SPAWN, target, args, name="zephon-test-child", group=group)
        children.append(child)
        return child

    start.extra = extra  # type: ignore[attr-defined]
    yield start
    for child in children:
        if child.exitcode is None:
            child.signal(signal.SIGKILL)
        child.reap(10.0)
        child.close_channel()
    for pid in extra:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_child_that_never_handshakes_times_out_and_is_killed(spawn):
    child = spawn(never_ready)
    with pytest.raises(TransportError, match=r"worker\(s\) \[0\] of test pool did not start"):
        await_ready({0: child}, 0.5, "test pool")
    stop_children([child], QUICK)  # it reads no STOP: SIGTERM at the end of the grace
    assert child.exitcode == -signal.SIGTERM
    assert child.stopped


def test_a_child_that_dies_while_starting_is_named_with_its_exit_status(spawn):
    child = spawn(exits_at_once, 3)
    with pytest.raises(TransportError, match=r"worker 7 of test pool died while starting "
                                             r"\(exit code 3\)"):
        await_ready({7: child}, 60.0, "test pool")


def test_a_child_that_reran_an_unguarded_main_says_so(spawn):
    child = spawn(exits_at_once, EXIT_UNGUARDED_MAIN)
    with pytest.raises(TransportError, match="__name__"):
        await_ready({0: child}, 60.0, "test pool")


def test_a_failed_setup_raises_the_childs_own_exception(spawn):
    child = spawn(fails_setup)
    with pytest.raises(LookupError, match="no such model"):
        await_ready({0: child}, 60.0, "test pool")


def test_stop_lets_an_obedient_child_exit_by_itself(spawn):
    children = [spawn(obeys_stop) for _ in range(2)]
    await_ready(dict(enumerate(children)), 60.0, "test pool")
    stop_children(children, ShutdownPolicy.for_shutdown_mode("graceful"))
    assert [c.exitcode for c in children] == [0, 0]


def test_a_child_that_ignores_sigterm_is_killed_and_reaped(spawn):
    child = spawn(ignores_sigterm)
    await_ready({0: child}, 60.0, "test pool")
    stop_children([child], QUICK)
    assert child.exitcode == -signal.SIGKILL
    assert not alive(child.pid)


def test_the_group_of_a_child_that_forked_a_grandchild_is_swept(spawn):
    child = spawn(forks_grandchild, group=True)
    deadline = time.monotonic() + 60.0
    header, _, _ = child.channel.recv()
    assert header["k"] == MsgKind.READY
    grandchild = header["grandchild"]
    spawn.extra.append(grandchild)
    assert alive(grandchild)
    grace_end = stop_children([child], QUICK)
    assert child.exitcode == 0
    assert alive(grandchild)  # the child left it behind: the group sweep's job
    assert sweep_groups([child.pid], grace_end, QUICK) == []
    assert not wait_gone([grandchild], max(1.0, deadline - time.monotonic()))


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_child_exits_when_its_parent_dies(tmp_path, method):
    # Under forkserver the child's parent is multiprocessing's fork server, which exits
    # when the zephon parent does: the child goes then, and not before (see the test
    # below: comparing with the zephon parent's pid read every such child as orphaned).
    pid_file = tmp_path / "child.pid"
    here = os.path.dirname(__file__)
    parent = subprocess.Popen([sys.executable, os.path.join(here, "_supervisor_children.py"),
                               str(pid_file), method], cwd=here)
    child_pid = None
    try:
        assert parent.wait(120) == 0
        child_pid = int(pid_file.read_text())
        assert wait_gone([child_pid], 30.0) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child_pid is not None and alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def test_a_crash_report_keeps_its_fields_through_pickle():
    error = crash_error("worker 2 (pid 4321) of pool 'p' died by signal SIGKILL",
                        worker=2, pid=4321, exitcode=-signal.SIGKILL, tasks=[5, 6], seq=5,
                        op="p")
    back = pickle.loads(pickle.dumps(error))
    assert isinstance(back, WorkerCrashedError)
    assert (back.worker, back.pid, back.signal, back.tasks, back.seq, back.op) == \
        (2, 4321, signal.SIGKILL, [5, 6], 5, "p")
    assert str(back) == str(error)


def test_a_crash_by_exit_code_has_no_signal():
    error = crash_error("died", worker=0, pid=1, exitcode=3)
    assert error.signal is None and error.tasks == []


def test_the_public_shutdown_options_map_onto_one_policy():
    hard = ShutdownPolicy.for_shutdown_mode("hard")
    graceful = ShutdownPolicy.for_shutdown_mode("graceful")
    exiting = ShutdownPolicy.for_shutdown_mode("graceful", exiting=True)
    assert hard.grace_s < exiting.grace_s < graceful.grace_s
    assert ShutdownPolicy.for_grace(3.0).grace_s == 3.0


def test_exit_statuses_are_named():
    assert exit_text(-signal.SIGTERM) == "signal SIGTERM"
    assert exit_text(2) == "exit code 2"
    assert exit_text(None) == "an unknown cause"


def test_a_pipeline_runs_its_workers_under_forkserver():
    # RuntimeOptions(mp_context=forkserver) killed every worker at its first idle half
    # second: the worker compared its parent (the fork server) with the zephon parent's
    # pid, took itself for orphaned and killed its own process group, so no op longer
    # than PARENT_POLL_S ever finished. Each sample here spans a poll.
    import _pipeline_fns as F

    from zephon import Pipeline, RuntimeOptions, sources
    from zephon.transport.supervisor import PARENT_POLL_S

    values = [1.2 * PARENT_POLL_S] * 4
    pipe = (Pipeline(sources.from_sequence(values), seed=0, shuffle=False)
            .map(F.slow_identity, parallelism=2)
            .options(RuntimeOptions(runner="process", max_workers=2, max_worker_retries=0,
                                    mp_context=multiprocessing.get_context("forkserver"))))
    try:
        assert list(pipe) == values
    finally:
        pipe.close()
