"""First contact: the getting-started jobs example (docs/getting-started/jobs.md), run as a real script.

Without the ``if __name__ == "__main__":`` guard every spawn worker re-runs the script;
the run must say so in one sentence with the fix, not report a checkpoint store "in use
by another run" from inside the workers and a callable that is not importable. With the
guard the example works, and a fully cached rerun starts no worker at all.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest

TOKENIZE = '''
from zephon.jobs import RunPolicy, run

def tokenize(shard):               # module level: workers import it
    return {"shard": shard, "tokens": len(shard)}
'''

UNGUARDED = TOKENIZE + '''
job = run(tokenize, ["shard-000", "shard-001"], RunPolicy(workers=4, subject_timeout_sec=600,
          checkpoint_dir="ckpt"), fingerprint="tokenizer-v3")
for r in job:
    print(r.subject_id, "ok" if r.ok else r.error)
print(job.summary)
'''

GUARDED = TOKENIZE + '''
if __name__ == "__main__":         # required: workers are spawned and re-import this file
    job = run(tokenize, ["shard-000", "shard-001"],
              RunPolicy(workers=4, subject_timeout_sec=600, checkpoint_dir="ckpt"),
              fingerprint="tokenizer-v3")
    for r in job:
        print(r.subject_id, "ok" if r.ok else r.error)
    print(job.summary)
'''


def run_script(tmp_path, code: str) -> subprocess.CompletedProcess:
    script = tmp_path / "tokenize_job.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.timeout(180)
def test_the_unguarded_readme_example_names_the_missing_guard(tmp_path):
    out = run_script(tmp_path, UNGUARDED)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("zephon.errors.JobSetupError"), out.stderr
    assert 'if __name__ == "__main__":' in last and "tokenize_job.py" in last
    assert "CheckpointError" not in out.stderr and "in use by another run" not in out.stderr
    assert "importable" not in out.stderr


@pytest.mark.timeout(180)
def test_the_guarded_readme_example_runs_and_a_cached_rerun_starts_no_worker(tmp_path):
    first = run_script(tmp_path, GUARDED)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[:2] == ["shard-000 ok", "shard-001 ok"]
    summary = ast.literal_eval(lines[2])
    assert summary["done"] == 2 and summary["workers_started"] == 2
    again = run_script(tmp_path, GUARDED)
    assert again.returncode == 0, again.stderr
    summary = ast.literal_eval(again.stdout.splitlines()[2])
    assert summary["cached"] == 2 and summary["workers_started"] == 0
