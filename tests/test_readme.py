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

def _parquet_corpus(d):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    (d / "corpus").mkdir(exist_ok=True)
    for f in range(2):
        pq.write_table(pa.table({"text": [f"document {f}-{i}" for i in range(100)],
                                 "score": np.linspace(0, 1, 100, dtype=np.float32)}),
                       d / "corpus" / f"part-{f:03d}.parquet", row_group_size=25)


def _tar_shards(d):
    import io
    import json
    import tarfile

    (d / "shards").mkdir(exist_ok=True)
    for s in range(2):
        with tarfile.open(d / "shards" / f"train-{s:03d}.tar", "w") as tar:
            for k in range(50):
                for ext, data in (("txt", f"caption {s}-{k}".encode()),
                                  ("json", json.dumps({"label": k % 10}).encode())):
                    info = tarfile.TarInfo(f"{s * 50 + k:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def _token_file(d):
    import numpy as np

    np.arange(100_000, dtype=np.uint32).tofile(d / "train.bin")


def _jsonl_zst(d):
    import json

    import zstandard

    lines = "".join(json.dumps({"text": f"note {i}", "stars": i % 5}) + "\n" for i in range(200))
    (d / "notes.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))


def _hf_saved(d):
    import datasets

    datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(64)],
                                "label": [i % 2 for i in range(64)]}).save_to_disk(
        str(d / "hf_saved"))


# substring of a block -> function(directory) writing the files that block reads
PREPARERS: dict = {"corpus/*.parquet": _parquet_corpus, "shards/": _tar_shards,
                   '"train.bin"': _token_file, "notes.jsonl.zst": _jsonl_zst,
                   '"hf_saved"': _hf_saved}
# substring of a block -> the module it needs (an extra): without it the block is skipped
NEEDS = {"import torch": "torch", 'backend="ray"': "ray", "sources.parquet(": "pyarrow",
         "sources.hf_dataset(": "datasets"}


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
