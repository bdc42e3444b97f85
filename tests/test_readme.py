"""README.md as a newcomer uses it.

- Every Python block runs as written, as a user would run it: ``python -m zephon
  example-data .`` in an empty directory (the command the README names), then the block
  saved to a file there and run with ``python file.py`` in a fresh interpreter. A block
  whose extra is not installed is skipped (``NEEDS``).
- The README names that command once, before the first block that reads one of its
  files, and every example file is read by some block.
- No install line asks the package index for ``zephon`` (a different project of that
  name is published there): zephon is installed from the checkout, ``-e .`` style.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from zephon.example_data import EXAMPLES

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
EXAMPLE_DATA = "python -m zephon example-data ."
# substring of a block -> the module it needs (an extra): without it the block is skipped
NEEDS = {"import torch": "torch", "import zephon.torch": "torch", 'backend="ray"': "ray", '"ray")': "ray", "sources.parquet(": "pyarrow",
         "sources.hf_dataset(": "datasets", "zephon.vision": "simplejpeg"}


def readme() -> str:
    return README.read_text(encoding="utf-8")


def blocks() -> list[str]:
    return BLOCK.findall(readme())


def reads_example_data(code: str) -> bool:
    return any(ex.path.rstrip("/") in code for ex in EXAMPLES)


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory):
    """An empty directory after the README's ``python -m zephon example-data .``."""
    d = tmp_path_factory.mktemp("readme-data")
    argv = shlex.split(EXAMPLE_DATA)
    assert argv[0] == "python"
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=d, capture_output=True,
                          text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    return d


def test_readme_opens_with_the_two_setup_commands():
    first = readme().split("```", 2)[1]
    lines = [line for line in first.splitlines()[1:] if line.strip()]
    assert len(lines) == 2
    assert "zephon demo" in lines[0] and "pytest" in lines[1]


def test_readme_has_python_blocks():
    assert len(blocks()) >= 4


@pytest.mark.parametrize("index", range(len(blocks())))
def test_readme_block_runs_as_written(index, tmp_path, example_dir):
    code = blocks()[index]
    for marker, module in NEEDS.items():
        if marker in code:
            pytest.importorskip(module, reason=f"README block {index} needs {module} "
                                               "(its extra is not installed)")
    shutil.copytree(example_dir, tmp_path, dirs_exist_ok=True)  # a fresh copy per block
    path = tmp_path / f"readme_example_{index}.py"
    path.write_text(code, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, f"README block {index} failed:\n{code}\n{proc.stderr}"
    assert proc.stdout.strip(), f"README block {index} prints nothing:\n{code}"
    if '"train.bin"' in code:  # read as what it holds: uint16 ids, as nanoGPT writes them
        assert "uint16" in proc.stdout and "uint32" not in proc.stdout, proc.stdout


def test_readme_names_the_example_data_command_before_the_first_block_reading_it():
    text = readme()
    assert text.count(EXAMPLE_DATA) == 1, f"the README should name {EXAMPLE_DATA!r} once"
    readers = [m for m in BLOCK.finditer(text) if reads_example_data(m.group(1))]
    assert len(readers) >= 5, "the blocks reading example files are not recognised"
    assert text.index(EXAMPLE_DATA) < readers[0].start()
    for ex in EXAMPLES:  # every file the command writes is read by some block
        assert any(ex.path.rstrip("/") in m.group(1) for m in readers), ex.path


def install_commands(text: str) -> list[list[str]]:
    """The arguments after ``pip install`` of every command in the README's code: each
    line of a fenced block, each inline span (which may wrap over lines), up to ``&&``,
    ``;`` or ``|``."""
    lines = [line for block in FENCE.findall(text) for line in block.splitlines()]
    lines += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", FENCE.sub("", text))]
    out = []
    for line in lines:
        for match in re.finditer(r"pip install\b(.*)", line):
            args = []
            for token in shlex.split(match.group(1)):
                if token in ("&&", ";", "|", "||"):
                    break
                args.append(token)
            out.append(args)
    return out


def zephon_install_problems(args: list[str]) -> list[str]:
    problems = []
    for i, token in enumerate(args):
        if token.startswith("-"):
            continue
        name = re.match(r"[A-Za-z0-9_.-]*", token).group(0)
        if name.lower() == "zephon":
            problems.append(f"{token!r} asks the package index for zephon")
        elif name == "." and (i == 0 or args[i - 1] != "-e"):
            problems.append(f"{token!r} is not an editable install of the checkout")
    return problems


def test_no_install_line_asks_the_index_for_zephon():
    commands = install_commands(readme())
    from_checkout = [args for args in commands if any(a.startswith(".") for a in args)]
    assert len(from_checkout) >= 4, commands  # the setup lines and the extras
    problems = [p for args in commands for p in zephon_install_problems(args)]
    assert not problems, problems


def test_the_install_check_catches_an_index_install():
    assert zephon_install_problems(shlex.split('"zephon[torch]"'))
    assert zephon_install_problems(["zephon"])
    assert zephon_install_problems(shlex.split('".[parquet]"'))
    assert not zephon_install_problems(shlex.split('-e ".[parquet]"'))
    assert not zephon_install_problems(["torch==2.13.0"])
    assert install_commands("run `pip install\n  -e \".[bench]\"` first") == [["-e", ".[bench]"]]


def test_the_ray_block_after_the_jobs_block_finds_its_results_in_the_store(tmp_path):
    # Top to bottom in one directory, as the README says: the Ray study reads the three
    # results the process study stored in `ckpt` (the README says it prints them cached).
    pytest.importorskip("ray", reason="the Ray block needs ray (its extra is not installed)")
    (local,) = [c for c in blocks() if "checkpoint_dir=" in c and 'backend="ray"' not in c]
    (ray_block,) = [c for c in blocks() if 'backend="ray"' in c]
    outputs = []
    for name, code in (("jobs.py", local), ("ray_jobs.py", ray_block)):
        (tmp_path / name).write_text(code, encoding="utf-8")
        proc = subprocess.run([sys.executable, name], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300, env=clean_env())
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout)
    assert "(cached)" not in outputs[0]
    cached = [line for line in outputs[1].splitlines() if line.endswith("(cached)")]
    assert len(cached) == 3, outputs[1]
