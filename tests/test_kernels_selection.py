"""Which implementation runs: compiled by default, references on request or as a fallback.

The equivalence tests skip when the extensions are missing; this file makes
that state fail loudly instead, unless ZEPHON_PURE_PYTHON=1 asked for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import zephon.kernels as zk


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})


@pytest.mark.skipif(os.environ.get("ZEPHON_PURE_PYTHON") == "1", reason="references forced")
def test_compiled_kernels_are_built_and_selected():
    assert zk.IMPLEMENTATION == "compiled"
    for name in ("pack", "compaction", "reorder", "shuffle"):
        module = zk.compiled_module(name)
        assert module.__file__.endswith((".so", ".pyd")), module.__file__
    assert zk.pack_plan is zk.compiled_module("pack").pack_plan
    assert zk.ReorderBuffer is zk.compiled_module("reorder").ReorderBuffer
    assert zk.permute_range is zk.compiled_module("shuffle").permute_range


def test_pure_python_switch_selects_references():
    out = run_python("""
        import warnings; warnings.simplefilter("error")
        import zephon.kernels as k
        from zephon.kernels import pack_ref, reorder_ref, compaction_ref, shuffle_ref
        assert k.pack_plan is pack_ref.pack_plan and k.ReorderBuffer is reorder_ref.ReorderBuffer
        assert k.compaction_plan is compaction_ref.compaction_plan
        assert k.permute_range is shuffle_ref.permute_range
        print(k.IMPLEMENTATION)
    """, ZEPHON_PURE_PYTHON="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "reference"


def test_missing_extension_falls_back_with_one_warning():
    out = run_python("""
        import sys, warnings
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.startswith("zephon._kernels."):
                    raise ImportError("blocked for the test")
        sys.meta_path.insert(0, Block())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import zephon.kernels as k
            k.pack_plan, k.ReorderBuffer, k.compaction_plan  # first use selects
            import zephon.kernels  # a second import does not warn again
            k.pack_copy, k.LaneRoundRobin, k.permute_range
        runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(runtime) == 1, [str(w.message) for w in caught]
        assert "pack, compaction, reorder, shuffle" in str(runtime[0].message)
        print(k.IMPLEMENTATION)
    """, ZEPHON_PURE_PYTHON="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "reference"


@pytest.mark.parametrize("name", ["pack", "compaction", "reorder", "heap", "shuffle"])
def test_each_compiled_module_imports_on_its_own(name):
    if os.environ.get("ZEPHON_PURE_PYTHON") == "1":
        pytest.skip("references forced")
    out = run_python(f"import zephon._kernels.{name} as m; print(m.__name__)")
    assert out.returncode == 0, out.stderr
