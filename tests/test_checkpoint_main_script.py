"""A pipeline whose functions live in the training script fingerprints the same in the
script, in its spawn children (``__mp_main__``) and under ``python -m``: a checkpoint
taken in any of them restores in any other. Real interpreters, real spawn children,
torchrun ranks and torch.distributed.checkpoint."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from _aggregate_rank import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture
def job(tmp_path):
    """The script as ``mainpkg/job.py`` under tmp_path; ``run(mode, *argv, module=False,
    launcher=())`` runs it in a fresh interpreter (a launcher such as torchrun first)."""
    pkg = tmp_path / "mainpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    shutil.copy(os.path.join(HERE, "_main_script.py"), pkg / "job.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path)])}
    for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        env.pop(key, None)

    def run(mode, *argv, module=False, launcher=()):
        target = ["-m", "mainpkg.job"] if module else [str(pkg / "job.py")]
        proc = subprocess.run([sys.executable, *launcher, *target, mode, str(tmp_path), *argv],
                              capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                              env=env, start_new_session=True)
        assert proc.returncode == 0 and "OK" in proc.stdout, \
            (proc.stdout + proc.stderr)[-3000:]

    return run


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["spawn-save", "torch-spawn-save"])
def test_a_checkpoint_taken_in_a_spawn_child_restores_in_the_script(job, mode):
    if mode == "torch-spawn-save":
        pytest.importorskip("torch.multiprocessing")
    job(mode)


@pytest.mark.timeout(600)
def test_a_checkpoint_taken_under_python_dash_m_restores_in_the_script_and_back(job):
    job("save", module=True)
    job("restore")
    job("save")
    job("restore", module=True)
    job("spawn-save", module=True)


@pytest.mark.timeout(600)
@pytest.mark.torch
def test_a_dcp_checkpoint_of_torchrun_ranks_loads_in_a_spawn_child_on_one_rank(job):
    pytest.importorskip("torch.distributed.checkpoint")
    job("dcp-save", launcher=("-m", "torch.distributed.run", "--nproc_per_node=2",
                              "--master_addr=127.0.0.1", f"--master_port={free_port()}"))
    job("spawn-dcp-restore", "2")
