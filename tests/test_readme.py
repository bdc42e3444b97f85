"""Every Python block of README.md runs as written, as a user would run it: saved to a
file in an empty directory and run with ``python file.py`` in a fresh interpreter.

Blocks that read data files get them written first by a preparer (see ``PREPARERS``):
the README shows real formats, the test supplies small real files of those formats.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

# substring of a block -> function(directory) writing the files that block reads
PREPARERS: dict = {}
# substring of a block -> the module it needs (an extra): without it the block is skipped
NEEDS = {"import torch": "torch", 'backend="ray"': "ray"}


def blocks() -> list[str]:
    return BLOCK.findall(README.read_text(encoding="utf-8"))


def test_readme_opens_with_the_two_setup_commands():
    text = README.read_text(encoding="utf-8")
    first = text.split("```", 2)[1]
    lines = [line for line in first.splitlines()[1:] if line.strip()]
    assert len(lines) == 2
    assert "zephon demo" in lines[0] and "pytest" in lines[1]


def test_readme_has_python_blocks():
    assert len(blocks()) >= 4


@pytest.mark.parametrize("index", range(len(blocks())))
def test_readme_block_runs_as_written(index, tmp_path):
    code = blocks()[index]
    for marker, module in NEEDS.items():
        if marker in code:
            pytest.importorskip(module, reason=f"README block {index} needs {module} "
                                               "(its extra is not installed)")
    for marker, prepare in PREPARERS.items():
        if marker in code:
            prepare(tmp_path)
    path = tmp_path / f"readme_example_{index}.py"
    path.write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"README block {index} failed:\n{code}\n{proc.stderr}"
