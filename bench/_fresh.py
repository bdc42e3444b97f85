"""One benchmark row in a fresh interpreter: the side-by-side scripts' common runner.

A row is the script itself run with ``--row JSON``; it prints its result as one JSON
line on stdout (the last line starting with ``{`` counts). A row that times out, exits
non-zero or prints no result gives None, and the reason (with the tail of its stderr)
goes to stderr, so one failing loader never stops the table.

Before the first row, zephon's own modules are byte-compiled (``compileall``, once per
checkout and change): a fresh checkout has no ``__pycache__``, and where
``PYTHONDONTWRITEBYTECODE`` is set no row ever writes one, so every row's main process
and every spawned worker would compile zephon from source (0.3-0.5 s each, 1.5 s of a
7 s row on 2 workers) while the peers' packages, byte-compiled by pip at install, do
not. An installed zephon is byte-compiled by pip too: this makes the checkout match.
"""

from __future__ import annotations

import compileall
import importlib.util
import json
import subprocess
import sys

_compiled = False


def compile_zephon() -> None:
    """Byte-compile the zephon package this interpreter would import (once a process)."""
    global _compiled
    if _compiled:
        return
    _compiled = True
    spec = importlib.util.find_spec("zephon")
    if spec is not None and spec.submodule_search_locations:
        compileall.compile_dir(next(iter(spec.submodule_search_locations)), quiet=1)


def run_in_child(script: str, spec: dict, timeout: float, env: dict, label: str, *,
            python: str | None = None, tail: int = 8) -> tuple[dict | None, str]:
    """The result of ``script --row spec`` run by ``python`` (default: this interpreter)
    with ``env``, or None; and the row's stderr (for warnings a caller reports)."""
    compile_zephon()
    cmd = [python or sys.executable, script, "--row", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              check=False, env=env)
    except subprocess.TimeoutExpired:
        print(f"  {label}: timed out after {timeout:g} s", file=sys.stderr)
        return None, ""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = "\n".join(proc.stderr.strip().splitlines()[-tail:])
        print(f"  {label}: failed (exit {proc.returncode})\n{last}", file=sys.stderr)
        return None, proc.stderr
    return json.loads(lines[-1]), proc.stderr
