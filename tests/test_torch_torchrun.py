"""End to end under torchrun: examples/train_ddp.py trains a tiny model with DDP (gloo) on
2 ranks, checkpoints model + optimizer + data at step K, and is resumed from that file in
new processes on 2 ranks (process runner, 2 workers), on 1 rank (process runner, 3
workers) and on 4 ranks (inline, as the first run). The global sample stream after the resume equals the uninterrupted run's, and
with mapping_strategy="interleaved" every optimizer step sees the same samples: losses are
bit-identical across world sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _aggregate_rank import free_port

pytest.importorskip("torch.distributed")
pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.ci]

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "train_ddp.py")
STEPS, K = 6, 3


def torchrun(nproc: int, out, *args) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", EXAMPLE,
           "--out", str(out), "--steps", str(STEPS), "--exact", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # kill torchrun and its ranks, whatever happened
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, output[-4000:]


def records(out):
    micro, steps = [], {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".jsonl"):
            with open(os.path.join(out, name)) as fh:
                for line in fh:
                    rec = json.loads(line)
                    if "step_loss" in rec:
                        steps[rec["step_loss"]] = rec["loss"]
                    else:
                        micro.append(rec)
    # the global stream: by step, then by position in the one-rank stream
    micro.sort(key=lambda r: (r["step"], r["lane_index"], r["lane"]))
    return micro, steps


def view(micro, start=0):
    return [(r["step"], r["lane"], r["lane_index"], tuple(r["ids"]), r["loss"])
            for r in micro if r["step"] >= start]


def test_resume_on_1_2_4_ranks_and_other_runners_continues_the_exact_stream(tmp_path):
    ref = tmp_path / "ref"
    torchrun(2, ref, "--save-at", str(K))
    ckpt = ref / f"ckpt-{K}.pt"
    assert ckpt.exists()
    ref_micro, ref_steps = records(ref)
    assert sorted(ref_steps) == list(range(STEPS))
    assert len(ref_micro) == STEPS * 4
    # every sample of the run is distinct: nothing repeated, nothing skipped
    ids = [i for r in ref_micro for i in r["ids"]]
    assert len(ids) == len(set(ids))

    for nproc, extra in ((2, ["--runner", "process", "--workers", "2"]),
                         (1, ["--runner", "process", "--workers", "3"]),
                         (4, [])):
        out = tmp_path / f"resumed-{nproc}"
        torchrun(nproc, out, "--resume", str(ckpt), *extra)
        micro, steps = records(out)
        assert view(micro) == view(ref_micro, K), f"{nproc} ranks {extra}: stream differs"
        assert steps == {s: ref_steps[s] for s in range(K, STEPS)}, \
            f"{nproc} ranks {extra}: step losses differ"
