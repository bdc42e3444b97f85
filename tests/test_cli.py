"""``python -m zephon options``, ``demo`` and ``example-data`` as a user runs them (real
subprocesses, real files)."""

from __future__ import annotations

import json
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest


def run_cli(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "zephon", *args], capture_output=True,
                          text=True, timeout=60, **kwargs)


def test_options_table_shows_values_and_provenance():
    out = run_cli("options", "--set", "max_workers=24", "--set", "run_id=exp1",
                  "--cpu-count", "2")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[1:]}
    assert rows["max_workers"] == ["explicit", "24"]
    assert rows["prefetch_batches"] == ["derived", "48"]
    assert rows["run_id"] == ["explicit", '"exp1"']
    assert rows["shm_enabled"] == ["default", "true"]


def test_options_json_and_config_file(tmp_path):
    cfg = tmp_path / "opts.json"
    cfg.write_text(json.dumps({"prefetch_batches": 64, "per_stage_runner": {"1": "process"}}))
    out = run_cli("options", "--config", str(cfg), "--json", "--cpu-count", "2")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["max_workers"] == {"value": 4, "source": "derived"}
    assert data["mtp_buffer"] == {"value": 32, "source": "derived"}
    assert data["per_stage_runner"] == {"value": {"1": "process"}, "source": "explicit"}


def test_options_yaml_config(tmp_path):
    pytest.importorskip("yaml")
    cfg = tmp_path / "opts.yaml"
    cfg.write_text("max_workers: 6\nper_stage_prefetch:\n  0: 3\n")
    out = run_cli("options", "--config", str(cfg), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["per_stage_prefetch"]["value"] == {"0": 3}


def test_options_bad_value_is_a_clear_error():
    out = run_cli("options", "--set", "max_worker=3")
    assert out.returncode == 2
    assert "did you mean 'max_workers'" in out.stderr
    out = run_cli("options", "--set", "max_workers=true")
    assert out.returncode == 2 and "RuntimeOptions.max_workers: got True" in out.stderr


def assert_usage_error(out, *fragments):
    """One line starting ``error:`` on stderr, exit status 2, no traceback."""
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_missing_config_file(tmp_path):
    out = run_cli("options", "--config", str(tmp_path / "missing.yaml"))
    assert_usage_error(out, "missing.yaml", "No such file")
    out = run_cli("options", "--config", str(tmp_path))  # a directory
    assert_usage_error(out, "cannot read config")


@pytest.mark.parametrize("name,text,fragment", [
    ("bad.yaml", "max_workers: [1,\n", "not valid YAML at line"),
    ("bad.yml", "a: b: c\n", "not valid YAML at line 1"),
    ("bad.json", '{"max_workers": 4,}', "not valid JSON at line 1"),
    ("bad.json", "", "not valid JSON"),
])
def test_malformed_config_file(tmp_path, name, text, fragment):
    if name.endswith((".yaml", ".yml")):
        pytest.importorskip("yaml")
    cfg = tmp_path / name
    cfg.write_text(text)
    assert_usage_error(run_cli("options", "--config", str(cfg)), fragment)


def test_config_file_not_utf8(tmp_path):
    cfg = tmp_path / "opts.json"
    cfg.write_bytes(b"\xff\xfe{}")
    assert_usage_error(run_cli("options", "--config", str(cfg)), "not UTF-8")


@pytest.mark.parametrize("name,text,kind", [
    ("list.json", "[1, 2]", "list"),
    ("scalar.json", "4", "int"),
    ("empty.yaml", "", "NoneType"),
    ("list.yaml", "- max_workers\n", "list"),
])
def test_config_that_is_not_a_mapping(tmp_path, name, text, kind):
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    cfg = tmp_path / name
    cfg.write_text(text)
    assert_usage_error(run_cli("options", "--config", str(cfg)), f"holds a {kind}",
                       "expected a mapping")


def test_set_without_equals_sign():
    assert_usage_error(run_cli("options", "--set", "max_workers"),
                       "--set expects KEY=VALUE, got 'max_workers'")
    assert_usage_error(run_cli("options", "--set", "=4"), "--set expects KEY=VALUE")


def test_invalid_values_are_one_error_line():
    out = run_cli("options", "--set", "max_worker=3")
    assert_usage_error(out, "did you mean 'max_workers'", "RuntimeOptions.field_names()")
    assert len(out.stderr) < 250
    assert_usage_error(run_cli("options", "--set", "max_workers=1e999"),
                       "RuntimeOptions.max_workers")
    assert_usage_error(run_cli("options", "--set", "ipc_buffer_bytes=2147483648"),
                       "<= 1073741824")
    assert_usage_error(run_cli("options", "--set", 'per_stage_prefetch={"x": [1]}'),
                       "per_stage_prefetch")


def test_demo_help_has_a_description():
    out = run_cli("demo", "--help")
    assert out.returncode == 0, out.stderr
    assert "synthetic" in out.stdout and "resumed on the threads runner" in out.stdout
    out = run_cli("options", "--help")
    assert "explicit, derived or a default" in out.stdout


def test_demo_resumes_identically(tmp_path):
    out = run_cli("demo", env={**__import__("os").environ, "ZEPHON_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resumed stream identical to the uninterrupted one" in out.stdout
    assert "runner=process, workers=2 (per_stage_fixed" in out.stdout
    # Off a terminal (stdout/stderr are pipes here) the phases are still announced.
    assert "run 1: uninterrupted, process runner, 2 workers per stage" in out.stdout
    assert ("run 2: resumed from the checkpoint on the threads runner, 3 workers per stage"
            in out.stdout)
    assert (tmp_path / "demo-tokens-v1.u16").stat().st_size == (8 << 20) * 2


# ``python -m zephon example-data DIR``: the files the documentation's examples read.

def _files(root):
    """{relative path: bytes} of every file under ``root``."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _read_all(src):
    from zephon import Pipeline

    return [b for b in Pipeline(src, shuffle=False).batch(1_000)]


def test_example_data_writes_what_the_sources_read(tmp_path):
    from zephon import example_data, sources

    out = run_cli("example-data", "data", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    data = tmp_path / "data"  # created by the command
    lines = out.stdout.splitlines()
    assert len(lines) == len(example_data.EXAMPLES)
    for line, ex in zip(lines, example_data.EXAMPLES, strict=True):
        assert line.startswith(("wrote ", "skipped ")) and f"{ex.path}:" in line, line

    (tokens,) = _read_all(sources.token_windows(str(data / "train.bin"), seq_len=1024,
                                                dtype="uint16"))
    assert tokens["tokens"].shape == (64, 1024) and tokens["tokens"].dtype == np.uint16
    assert 0 <= int(tokens["tokens"].min()) and int(tokens["tokens"].max()) < 50257
    assert len(np.unique(tokens["tokens"])) > 1000  # ids spread over the vocabulary

    (shards,) = _read_all(sources.webdataset(str(data / "shards/train-{000..001}.tar")))
    assert len(shards["__key__"]) == 100 and len(set(shards["__key__"])) == 100
    assert {json.loads(j)["label"] for j in shards["json"]} == set(range(10))
    assert all(t.decode().startswith("caption ") for t in shards["txt"])

    (notes,) = _read_all(sources.jsonl(str(data / "notes.jsonl.zst")))
    assert sorted(set(notes["stars"].tolist())) == [0, 1, 2, 3, 4]
    assert len(notes["text"]) == 200

    if "wrote   " + os.path.join("data", "corpus/") in out.stdout:
        (rows,) = _read_all(sources.parquet(str(data / "corpus/*.parquet"),
                                            columns=["text", "score"]))
        assert len(rows["text"]) == 200 and rows["score"].dtype == np.float32
        assert all(isinstance(t, str) and t for t in rows["text"])
    if "wrote   " + os.path.join("data", "hf_saved/") in out.stdout:
        (hf,) = _read_all(sources.hf_dataset(str(data / "hf_saved"),
                                             columns=["text", "label"]))
        assert len(hf["text"]) == 64 and sorted(set(hf["label"].tolist())) == [0, 1]


def test_example_data_is_deterministic_and_rewritable(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "mine.txt").write_text("not the command's")
    for _ in range(2):  # the second run replaces its own files in place
        out = run_cli("example-data", "a", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
    assert run_cli("example-data", str(tmp_path / "b")).returncode == 0
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a.pop("mine.txt") == b"not the command's"  # nothing else is touched
    assert a == b and len(a) >= 4  # 4 without pyarrow (no parquet, no hf)
    assert sum(map(len, a.values())) < 1 << 20  # small


def test_example_data_skips_a_format_whose_library_is_missing(tmp_path):
    # An interpreter where pyarrow (and so datasets) cannot be imported.
    shadow = tmp_path / "shadow"
    for name in ("pyarrow", "datasets"):
        (shadow / name).mkdir(parents=True)
        (shadow / name / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(shadow), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = run_cli("example-data", str(tmp_path / "data"), env=env)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    skipped = [line for line in out.stdout.splitlines() if line.startswith("skipped")
               and "images/:" not in line]  # skipped too where Pillow is missing
    assert len(skipped) == 2, out.stdout
    assert 'corpus/: needs its extra: python -m pip install -e ".[parquet]"' in skipped[0]
    assert 'hf_saved/: needs its extra: python -m pip install -e ".[hf]"' in skipped[1]
    written = _files(tmp_path / "data")
    images = {name for name in written if name.startswith("images/")}
    assert len(images) == (24 if importlib.util.find_spec("PIL") else 0)
    assert set(written) - images == {"shards/train-000.tar", "shards/train-001.tar",
                                     "train.bin", "notes.jsonl.zst"}


def test_example_data_into_a_file_is_a_usage_error(tmp_path):
    target = tmp_path / "taken"
    target.write_text("a file, not a directory")
    assert_usage_error(run_cli("example-data", str(target)), "cannot write the example data",
                       "taken")
    assert target.read_text() == "a file, not a directory"
    out = run_cli("example-data")
    assert out.returncode == 2 and "DIR" in out.stderr
