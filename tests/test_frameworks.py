"""End to end under torchrun (gloo, CPU) for each framework integration: Lightning
(zephon.torch.lightning), transformers' Trainer and accelerate (zephon.torch.hf), and
torchtitan's data loader and CheckpointManager (zephon.torch.titan; it installs in an
environment of its own, see the torchtitan extra).

For each, examples/frameworks/<framework>_train.py trains K steps on 2 ranks, writes a
checkpoint (model, optimizer and data, through the framework's own checkpointing) and
is SIGKILLed there; the checkpoint then resumes on 1 rank and on 4 ranks with the global
batch fixed, and every step after the resume takes exactly the samples the
uninterrupted 2-rank run took (its per-step global batch: the ids of every rank's
micro-batches). A resume into another pipeline (another seed) fails with the diff."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from _aggregate_rank import free_port

pytest.importorskip("torch.distributed")
pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.ci]

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "frameworks")
STEPS, K = 6, 3
FRAMEWORKS = {  # example -> the module it needs
    "lightning_train.py": "lightning",
    "hf_trainer_train.py": "transformers",
    "accelerate_train.py": "accelerate",
    "torchtitan_train.py": "torchtitan",
}
CHECKPOINT = {  # where each example's step-K checkpoint is
    "lightning_train.py": os.path.join("ckpt", f"step{K}.ckpt"),
    "hf_trainer_train.py": os.path.join("ckpt", f"checkpoint-{K}"),
    "accelerate_train.py": os.path.join("ckpt", f"step-{K}"),
    "torchtitan_train.py": os.path.join("ckpt", f"step-{K}"),
}


def launch(example: str, nproc: int, out, *args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           os.path.join(EXAMPLES, example), "--out", str(out), "--steps", str(STEPS), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # torchrun and its ranks, whatever happened
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, output or ""


def run(example: str, nproc: int, out, *args) -> str:
    code, output = finish(launch(example, nproc, out, *args))
    assert code == 0, output[-4000:]
    return output


def run_and_kill_after_save(example: str, out) -> None:
    """2 ranks to the checkpoint of step K, then SIGKILL (torchrun and every rank)."""
    proc = launch(example, 2, out, "--save-at", str(K), "--hold-after-save")
    marker = out / f"saved-{K}"
    deadline = time.monotonic() + 300
    try:
        while not marker.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                _, output = finish(proc, 5)
                pytest.fail(f"no checkpoint of step {K}: {output[-4000:]}")
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0  # killed, not finished
    if proc.stdout is not None:
        proc.stdout.close()


def global_steps(out) -> dict[int, str]:
    """step -> the hash of its global batch (every rank's sample ids, sorted)."""
    ids: dict[int, list] = {}
    for name in os.listdir(out):
        if name.startswith("rank-") and name.endswith(".jsonl"):
            with open(os.path.join(out, name)) as fh:
                for line in fh:
                    rec = json.loads(line)
                    ids.setdefault(rec["step"], []).extend(rec["ids"])
    return {step: hashlib.sha256(repr(sorted(v)).encode()).hexdigest()[:16]
            for step, v in ids.items()}


@pytest.mark.parametrize("example", sorted(FRAMEWORKS))
def test_sigkilled_after_a_checkpoint_resumes_on_1_and_4_ranks_with_the_same_steps(
        tmp_path, example):
    pytest.importorskip(FRAMEWORKS[example])
    ref = tmp_path / "ref"
    run(example, 2, ref)
    reference = global_steps(ref)
    assert sorted(reference) == list(range(STEPS))

    killed = tmp_path / "killed"
    run_and_kill_after_save(example, killed)
    before = global_steps(killed)
    assert all(before[s] == reference[s] for s in range(K))  # the same run up to there
    ckpt = killed / CHECKPOINT[example]
    assert ckpt.exists()

    for nproc in (1, 4):
        out = tmp_path / f"resumed-{nproc}"
        run(example, nproc, out, "--resume", str(ckpt))
        resumed = global_steps(out)
        assert sorted(resumed) == list(range(K, STEPS)), (nproc, sorted(resumed))
        assert {s: resumed[s] for s in resumed} == {s: reference[s] for s in resumed}, nproc

    # another pipeline (another seed): a clear error, before any step
    code, output = finish(launch(example, 1, tmp_path / "other", "--resume", str(ckpt),
                                 "--seed", "8"))
    assert code != 0
    assert "checkpoint is from a different pipeline" in output
    assert "seed: 'seed=7' at the checkpoint, now 'seed=8'" in output
