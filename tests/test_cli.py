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


def test_demo_resumes_identically(tmp_path):
    out = run_cli("demo", env={**__import__("os").environ, "ZEPHON_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resumed stream identical to the uninterrupted one" in out.stdout
    assert "runner=process, workers=2 (per_stage_fixed" in out.stdout
    assert (tmp_path / "demo-tokens-v1.u16").stat().st_size == (8 << 20) * 2
