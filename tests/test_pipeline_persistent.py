"""Persistent workers: a pipeline's process workers serve every epoch, and go when they
should (close, garbage collection, idle timeout, interpreter exit, a run left early).

Which process ran a sample is what the op itself reports (its ``os.getpid()``), so a
respawn is seen as a new pid, never read from zephon's internals.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time

import _pipeline_fns as F
import numpy as np
import pytest
from _procs import HANG_S, alive, wait_gone
from conftest import zephon_shm_entries

from zephon import Pipeline, RuntimeOptions, sources

TESTS = os.path.dirname(os.path.abspath(__file__))


def pid_of(s):
    return {**s, "pid": os.getpid()}


def make(mtp: bool = False, n: int = 64, **opts) -> Pipeline:
    options = RuntimeOptions(runner="process", max_workers=2, mtp_mode=mtp, **opts)
    return (Pipeline(sources.from_callable(n, F.make_sample), chunk_size=4, seed=3)
            .map(pid_of, parallelism=2).batch(8).options(options))


def epoch(pipe) -> tuple[list, set]:
    """(the sample ids in stream order, the pids that ran the op) of one pass."""
    ids, pids = [], set()
    for batch in pipe:
        ids += np.asarray(batch["id"]).tolist()
        pids |= set(np.asarray(batch["pid"]).tolist())
    return ids, pids


@pytest.mark.parametrize("mtp", [False, True], ids=["process", "mtp"])
def test_three_epochs_start_the_workers_once(mtp):
    pipe = make(mtp)
    try:
        passes = [epoch(pipe) for _ in range(3)]
        pids = [p for _, p in passes]
        assert pids[0] and pids[0] == pids[1] == pids[2], pids
        assert len(pids[0]) <= 2
        # the stream is the one a pipeline without persistent workers gives
        fresh = make(mtp, persistent_workers=False)
        try:
            again = [epoch(fresh) for _ in range(3)]
        finally:
            fresh.close()
        assert [ids for ids, _ in passes] == [ids for ids, _ in again]
        assert passes[0][0] != passes[1][0]  # epochs differ (a real reshuffle)
        assert not pids[0] & again[1][1]  # without them, each epoch has new workers
    finally:
        pipe.close()
    assert not wait_gone(pids[0], HANG_S)


def test_close_stops_the_kept_workers_and_frees_their_shared_memory():
    before = zephon_shm_entries()
    pipe = make()
    _, pids = epoch(pipe)
    assert all(alive(p) for p in pids)  # kept after the pass
    pipe.close()
    assert not wait_gone(pids, HANG_S)
    assert zephon_shm_entries() <= before
    _, again = epoch(pipe)  # a closed pipeline still runs: it starts new workers
    pipe.close()
    assert again and not again & pids
    assert not wait_gone(again, HANG_S)


def test_garbage_collection_stops_the_kept_workers():
    pipe = make()
    _, pids = epoch(pipe)
    del pipe
    gc.collect()
    assert not wait_gone(pids, HANG_S)


def test_idle_timeout_stops_them_and_the_next_epoch_starts_new_ones():
    pipe = make(persistent_workers_idle_s=0.3)
    try:
        first, pids = epoch(pipe)
        assert not wait_gone(pids, HANG_S)  # gone after 0.3 s idle
        second, again = epoch(pipe)
        assert again and not again & pids
        assert second != first and sorted(second) == sorted(first)
    finally:
        pipe.close()


def test_a_run_left_early_stops_its_workers():
    pipe = make()
    try:
        _, pids = epoch(pipe)
        it = iter(pipe)
        next(it)
        it.close()  # left early: its workers are not kept
        assert not wait_gone(pids, HANG_S)
    finally:
        pipe.close()


def test_a_restore_mid_epoch_on_kept_workers_gives_the_same_stream():
    pipe = make()
    try:
        epoch(pipe)
        it = iter(pipe)
        head = [np.asarray(next(it)["id"]).tolist() for _ in range(3)]
        state = it.checkpoint()
        rest = [np.asarray(b["id"]).tolist() for b in it]
        _, pids = epoch(pipe)  # epoch 2, kept workers
        pipe.restore(state)
        ids, again = epoch(pipe)
        assert ids == [i for part in rest for i in part]
        assert again == pids
        assert head  # (the restored run continues after them)
    finally:
        pipe.close()


def test_a_worker_killed_while_kept_is_replaced(tmp_path):
    pipe = make()
    try:
        first, pids = epoch(pipe)
        for pid in pids:
            os.kill(pid, 9)
        assert not wait_gone(pids, HANG_S)
        second, again = epoch(pipe)
        assert again and not again & pids
        assert sorted(second) == sorted(first)
    finally:
        pipe.close()


EXIT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    import _pipeline_fns as F
    from test_pipeline_persistent import make, epoch

    if __name__ == "__main__":
        pipe = make({mtp})
        pids = set()
        for _ in range(2):
            pids |= epoch(pipe)[1]
        print(json.dumps(sorted(pids)), flush=True)
        # no close(): the interpreter exits with the workers kept
""")


@pytest.mark.parametrize("mtp", [False, True], ids=["process", "mtp"])
def test_interpreter_exit_stops_the_kept_workers(tmp_path, mtp):
    before = zephon_shm_entries()
    path = tmp_path / "train.py"
    path.write_text(EXIT_SCRIPT.format(tests=TESTS, mtp=mtp))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=HANG_S * 2)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    pids = json.loads(proc.stdout.splitlines()[-1])
    assert pids
    assert not wait_gone(pids, HANG_S)
    assert zephon_shm_entries() <= before
    assert took < HANG_S  # a hang guard, not a timing: exit does not wait for the idle timer


def test_the_torch_loader_keeps_them_across_epochs():
    pytest.importorskip("torch")
    import zephon.torch as zt

    pipe = make()
    loader = zt.loader(pipe, pin_memory=True)
    try:
        pids = [set(int(p) for b in loader for p in b["pid"].tolist()) for _ in range(3)]
        assert pids[0] and pids[0] == pids[1] == pids[2]
    finally:
        loader.close()
        pipe.close()
    assert not wait_gone(pids[0], HANG_S)


class Level:
    """An op with state the training loop changes between epochs (a curriculum)."""

    def __init__(self) -> None:
        self.level = 0

    def __call__(self, s):
        return {**s, "pid": os.getpid(), "level": self.level}


def test_an_op_changed_between_epochs_gets_workers_that_run_it():
    op = Level()
    pipe = (Pipeline(sources.from_callable(32, F.make_sample), chunk_size=4)
            .map(op, parallelism=2).batch(8)
            .options(RuntimeOptions(runner="process", max_workers=2)))
    try:
        seen = []
        for e in range(3):
            op.level = e // 2  # changed before epoch 2 only: epoch 1 keeps the workers
            levels, pids = set(), set()
            for b in pipe:
                levels |= set(np.asarray(b["level"]).tolist())
                pids |= set(np.asarray(b["pid"]).tolist())
            seen.append((levels, pids))
        assert [lv for lv, _ in seen] == [{0}, {0}, {1}]
        assert seen[0][1] == seen[1][1] and not seen[1][1] & seen[2][1]
    finally:
        pipe.close()
    assert not wait_gone(seen[2][1], HANG_S)


class Trainer:
    """Holds its pipeline, whose op is one of its bound methods (a reference cycle)."""

    def __init__(self) -> None:
        self.pipe = (Pipeline(sources.from_callable(16, F.make_sample), chunk_size=4)
                     .map(self.augment).batch(4)
                     .options(RuntimeOptions(runner="process", max_workers=1)))

    def augment(self, s):
        return {**s, "pid": os.getpid()}


def test_a_pipeline_in_a_cycle_with_its_owner_is_collected_with_its_workers():
    import weakref

    trainer = Trainer()
    pids = set()
    for b in trainer.pipe:
        pids |= set(np.asarray(b["pid"]).tolist())
    gone = weakref.ref(trainer)
    del trainer, b
    gc.collect()
    assert gone() is None
    assert pids and not wait_gone(pids, HANG_S)


def test_a_run_left_early_stops_the_workers_an_earlier_pass_kept():
    pipe = make()
    try:
        _, pids = epoch(pipe)
        it = iter(pipe)  # takes them ...
        next(it)
        it.close()  # ... and leaves early: stopped
        assert not wait_gone(pids, HANG_S)
        _, again = epoch(pipe)
        assert again and not again & pids
    finally:
        pipe.close()
