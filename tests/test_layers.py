"""Layering (docs/architecture.md): lower layers never import higher ones.

The options core imports the standard library and zephon.errors only; every
other import rule is checked against the tables below by reading the source
(top-level and function-level imports alike): between packages (``ALLOWED``) and
between the modules of ``zephon.pipeline`` (``PIPELINE_ALLOWED``).
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

import zephon

ROOT = pathlib.Path(zephon.__file__).parent
# package -> zephon packages it may import (besides itself and zephon.errors)
ALLOWED = {
    "options": set(),
    "kernels": set(),
    "_kernels": {"kernels"},
    "transport": {"options", "kernels", "_kernels"},
    "runners": {"transport", "options", "kernels", "_kernels"},
    "checkpoint": {"options"},
    "io": {"options"},  # reading files (local, cached, remote); pipeline sources use it
    "pipeline": {"runners", "options", "kernels", "_kernels", "checkpoint", "transport", "io"},
    "jobs": {"transport", "runners", "options", "kernels"},  # kernels: the dtype token
    # the top layer: integrations may import everything below them
    "torch": {"pipeline", "checkpoint", "transport", "runners", "options", "kernels",
              "_kernels", "jobs"},
    "report": {"pipeline", "options"},  # profiling runs and renders pipeline statistics
}
# zephon.pipeline module (or subpackage) -> pipeline modules it may import (besides
# itself). Bottom: what flows down a lane and how callables are named; then the ops;
# then lanes and dispatch; the plan; the carry and the stage program; the engine; and on
# top the run (state, iterator) and the user-facing Pipeline, which may import anything.
PIPELINE_ALLOWED = {
    "records": set(),
    "fingerprint": set(),
    "collate": set(),
    "stats": set(),
    "autotune": set(),
    "shares": set(),
    "sources": {"fingerprint", "collate", "shares"},
    "ops": {"records", "fingerprint", "collate", "shares"},
    "shards": set(),
    "lanes": {"records", "shards"},
    "columnar": {"records", "collate", "sources"},
    "dispatch": {"records", "lanes"},
    "validate": {"ops"},
    "plan": {"ops", "lanes", "dispatch"},
    "carry": {"records", "ops", "lanes", "plan"},
    "program": {"records", "ops", "lanes", "columnar", "sources", "collate"},
    "engine": {"records", "ops", "lanes", "dispatch", "plan", "carry", "program", "stats",
               "autotune"},
    "text": {"records", "ops"},
    "training": {"records"},
}
PIPELINE_TOP = {"state", "iterator", "progress", "pipeline"}
THIRD_PARTY_OK = {
    "options": set(),
    "kernels": {"numpy"},
}


def _imports(path: pathlib.Path, submodules: bool = False):
    """The modules ``path`` imports; ``submodules``: ``from pkg import mod`` also yields
    ``pkg.mod`` (a name imported from a package may be a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            if submodules:
                for alias in node.names:
                    yield f"{node.module}.{alias.name}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_downward(package):
    base = ROOT / package
    if not base.exists():
        pytest.skip(f"zephon/{package} does not exist yet")
    for path in base.rglob("*.py"):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "zephon":
                if len(parts) == 1 or parts[1] in ("errors", package):
                    continue
                assert parts[1] in ALLOWED[package], f"{path}: imports {name}"
            elif package in THIRD_PARTY_OK:
                stdlib = parts[0] in sys.stdlib_module_names or parts[0] == "__future__"
                assert stdlib or parts[0] in THIRD_PARTY_OK[package], f"{path}: imports {name}"


def _pipeline_layer(path: pathlib.Path) -> str:
    """The layer of a module of zephon/pipeline: its module or subpackage name."""
    rel = path.relative_to(ROOT / "pipeline")
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_pipeline_modules_import_only_lower_layers():
    known = set(PIPELINE_ALLOWED) | PIPELINE_TOP
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        layer = _pipeline_layer(path)
        if layer == "__init__":
            continue
        assert layer in known, f"zephon/pipeline/{layer}: give it a row in PIPELINE_ALLOWED"
        if layer in PIPELINE_TOP:
            continue
        for name in _imports(path, submodules=True):
            parts = name.split(".")
            if parts[:2] != ["zephon", "pipeline"] or len(parts) < 3 or parts[2] == layer:
                continue
            if parts[2] in known:
                assert parts[2] in PIPELINE_ALLOWED[layer], f"{path}: imports {name}"


def test_the_pipeline_layers_have_no_cycle():
    """Every layer's allowed imports sit strictly below it (a topological order exists)."""
    placed: list[str] = []
    left = dict(PIPELINE_ALLOWED)
    while left:
        ready = [m for m, deps in left.items() if deps <= set(placed)]
        assert ready, f"a cycle among {sorted(left)}"
        placed += sorted(ready)
        for m in ready:
            del left[m]


def test_errors_module_is_stdlib_only():
    for name in _imports(ROOT / "errors.py"):
        assert name.split(".")[0] in sys.stdlib_module_names or name == "__future__"
