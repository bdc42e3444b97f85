"""zephon.torch imports torch only when it is used: importing zephon (or zephon.torch)
never does, and the core runs without torch."""

from __future__ import annotations

import subprocess
import sys


def test_importing_zephon_and_zephon_torch_does_not_import_torch():
    code = ("import sys, zephon, zephon.torch, zephon.checkpoint, zephon.pipeline\n"
            "from zephon import Pipeline, sources\n"
            "list(Pipeline(sources.from_sequence(list(range(8)))).map(abs))\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
