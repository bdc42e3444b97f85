"""What the framework integrations must not take from the user, and what they refuse:
the LightningModule's own batch hooks still run under ZephonDataModule (which keeps the
position of the batch trained on, not of the one Lightning took ahead); a DataLoader
over zephon.torch.dataset that accelerate's prepare() would deal out among the ranks
again (dropping the other ranks' lanes) is refused on its first batch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from _aggregate_rank import free_port

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


def test_lightning_keeps_the_modules_batch_hook_and_saves_the_batch_trained_on(tmp_path):
    L = pytest.importorskip("lightning")
    from zephon import Pipeline, sources
    from zephon.torch.lightning import ZephonDataModule

    def build(world, rank):
        return Pipeline(sources.from_callable(64, lambda i: {"x": float(i)}), seed=0,
                        num_epochs=None).batch(4)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.hooked = 0

        def on_before_batch_transfer(self, batch, dataloader_idx):
            self.hooked += 1
            return batch

        def training_step(self, batch, batch_idx):
            return ((batch["x"].float() - self.w) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data, module = ZephonDataModule(build), Module()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=data)
    assert module.hooked == 3
    state = data.state_dict()
    data.teardown("fit")
    again = ZephonDataModule(build)
    again.load_state_dict(state)
    again.setup("fit")
    assert again.loader.position().batches == 3  # not 4: Lightning took one ahead
    again.teardown("fit")


ACCELERATE_RANK = textwrap.dedent("""
    import torch
    from accelerate import Accelerator
    import zephon.torch as zt
    from zephon import Pipeline, RuntimeOptions, sources

    acc = Accelerator(cpu=True)
    pipe = Pipeline(sources.from_callable(32, lambda i: {"id": i}), seed=7, chunk_size=2) \\
        .batch(2).options(RuntimeOptions(world_size=acc.num_processes,
                                         global_rank=acc.process_index, canonical_replicas=8,
                                         aggregate_store="torch://"))
    loader = acc.prepare(torch.utils.data.DataLoader(zt.dataset(pipe), batch_size=None))
    print("ids", sorted(i for b in loader for i in b["id"].tolist()), flush=True)
""")


@pytest.mark.slow
@pytest.mark.ci
def test_accelerate_prepare_of_a_dataloader_over_zephon_is_refused(tmp_path):
    pytest.importorskip("accelerate")
    script = tmp_path / "rank.py"
    script.write_text(ACCELERATE_RANK)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, output[-3000:]
    assert "do not pass it to accelerator.prepare()" in output, output[-3000:]
    assert "ids [" not in output  # no rank got a silently halved stream
