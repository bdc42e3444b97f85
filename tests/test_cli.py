"""``python -m zephon options`` as a user runs it (a real subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

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
