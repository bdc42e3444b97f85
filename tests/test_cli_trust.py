"""The command line touches nothing of the user's it was not asked to, and says what it
runs: ``example-data`` refuses existing files and symbolic links, ``profile`` takes its
``--out`` where the README writes it and never writes through a link, ``--version``
works from any directory and names the kernels that loaded (real subprocesses, real
files and links)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from zephon import example_data

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "zephon", *args], capture_output=True,
                          text=True, timeout=120, **kwargs)


def assert_usage_error(out, *fragments):
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr, out.stderr
    for fragment in fragments:
        assert fragment in out.stderr, (fragment, out.stderr)


def tree(root):
    """{relative path: bytes} of every file under ``root`` (links not followed)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if not os.path.islink(p):
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = fh.read()
    return out


# -- example-data -------------------------------------------------------------------

def test_example_data_refuses_to_replace_a_users_file_without_force(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.bin").write_bytes(b"my own nanoGPT tokens")
    (data / "corpus").mkdir()
    (data / "corpus" / "part-000.parquet").write_bytes(b"my own parquet")
    out = run_cli("example-data", str(data))
    assert_usage_error(out, "train.bin", "--force", "nothing was written")
    # Nothing written at all: the refusal comes before any file moves.
    assert tree(data) == {"train.bin": b"my own nanoGPT tokens",
                          "corpus/part-000.parquet": b"my own parquet"}
    assert not [n for n in os.listdir(data) if n.startswith(".zephon")]

    out = run_cli("example-data", "--force", str(data))
    assert out.returncode == 0, out.stderr
    assert (data / "train.bin").stat().st_size == example_data.TOKENS_WINDOWS * \
        example_data.TOKENS_SEQ_LEN * 2
    assert not [n for n in os.listdir(data) if n.startswith(".zephon")]


def test_example_data_again_keeps_identical_files_and_the_users_own(tmp_path):
    data = tmp_path / "data"
    assert run_cli("example-data", str(data)).returncode == 0
    (data / "shards" / "mine.tar").write_bytes(b"the user's shard")
    first = tree(data)
    out = run_cli("example-data", str(data))  # the same bytes again: nothing to refuse
    assert out.returncode == 0, out.stderr
    assert all(line.startswith(("kept ", "skipped ")) for line in out.stdout.splitlines())
    assert tree(data) == first


@pytest.mark.parametrize("where", ["train.bin", "shards", "corpus/part-001.parquet"])
@pytest.mark.parametrize("force", [False, True])
def test_example_data_never_writes_through_a_symlink(tmp_path, where, force):
    pytest.importorskip("pyarrow") if where.startswith("corpus") else None
    data, outside = tmp_path / "data", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.bin").write_bytes(b"outside DIR")
    (data / os.path.dirname(where)).mkdir(parents=True, exist_ok=True)
    if where == "shards":  # a link to a directory: tar shards would land outside
        os.symlink(outside, data / "shards")
    else:
        os.symlink(outside / "precious.bin", data / where)
    before = tree(outside)
    out = run_cli("example-data", *(["--force"] if force else []), str(data))
    assert_usage_error(out, "symbolic link", where.split("/")[0])
    assert tree(outside) == before  # nothing outside DIR written or replaced
    assert os.path.islink(data / where)  # and the user's link is still theirs
    assert tree(data) == {}  # the refusal wrote nothing at all


def test_example_data_library_call_refuses_too(tmp_path):
    (tmp_path / "train.bin").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="train.bin"):
        example_data.write_examples(str(tmp_path))
    assert (tmp_path / "train.bin").read_bytes() == b"x"
    entries = example_data.write_examples(str(tmp_path), force=True)
    assert {e.path for e in entries if e.written} >= {"train.bin", "shards/"}


# -- profile --------------------------------------------------------------------------

SCRIPT = """
import json, sys
from zephon import Pipeline, sources
if __name__ == "__main__":
    with open(sys.argv[1], "w") as fh:
        json.dump(sys.argv[2:], fh)
    for _ in Pipeline(sources.from_sequence(list(range(64))), seed=0).batch(8):
        pass
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_profile_takes_out_where_the_readme_writes_it(tmp_path, script):
    argv_file = tmp_path / "argv.json"
    out = run_cli("profile", str(script), str(argv_file), "--lr", "3", "--out",
                  "report.html", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "report.html").is_file()
    assert not (tmp_path / "zephon-profile.html").exists()
    assert argv_file.read_text() == '["--lr", "3"]'  # the script never saw --out
    assert "wrote report.html" in out.stdout


def test_profile_passes_everything_after_a_double_dash_to_the_script(tmp_path, script):
    argv_file = tmp_path / "argv.json"
    out = run_cli("profile", "--out", "r.html", str(script), "--", str(argv_file),
                  "--out", "theirs.txt", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "r.html").is_file()
    assert argv_file.read_text() == '["--out", "theirs.txt"]'
    out = run_cli("profile", "--out", "a.html", str(script), str(argv_file), "--out",
                  "b.html", cwd=tmp_path)
    assert_usage_error(out, "--out given twice")


def test_profile_refuses_a_symlink_at_the_report_path(tmp_path, script):
    victim = tmp_path / "victim.txt"
    victim.write_text("not a report")
    os.symlink(victim, tmp_path / "report.html")
    out = run_cli("profile", str(script), str(tmp_path / "argv.json"), "--out",
                  "report.html", cwd=tmp_path)
    assert_usage_error(out, "symbolic link")
    assert victim.read_text() == "not a report"
    assert os.path.islink(tmp_path / "report.html")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".zephon-report")]


def test_report_file_mode_follows_the_umask(tmp_path):
    from zephon.report.run import write_new_file

    old = os.umask(0o077)
    try:
        write_new_file(tmp_path / "a.html", b"<html/>")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.html").stat().st_mode) == 0o600
    old = os.umask(0o022)
    try:
        write_new_file(tmp_path / "a.html", b"<html>2</html>")  # replaced in place
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.html").stat().st_mode) == 0o644
    assert (tmp_path / "a.html").read_bytes() == b"<html>2</html>"


# -- --version ------------------------------------------------------------------------

#: the compiled kernels that zephon.kernels does not select (no pure Python reference)
OTHER_KERNELS = ["heap", "resample", "jpeg_region"]


def kernel_lines(stdout):
    """{name: state} of the per-kernel lines of ``--version`` (indented, after the
    ``kernels:`` summary, in the order they were printed)."""
    lines = stdout.splitlines()
    assert lines[1].startswith("kernels: ") and lines[-1].startswith("python "), stdout
    out = {}
    for line in lines[2:-1]:
        assert line.startswith("  ") and ": " in line, (line, stdout)
        name, state = line.strip().split(": ", 1)
        out[name] = state
    return out


def test_version_names_the_kernels_that_loaded():
    from zephon import kernels

    out = run_cli("--version")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("zephon ")
    assert lines[1].startswith(f"kernels: {kernels.IMPLEMENTATION}")
    per_kernel = kernels.loaded()
    states = kernel_lines(out.stdout)
    assert list(states) == [*per_kernel, *OTHER_KERNELS]
    top = os.path.dirname(lines[0].split("(", 1)[1].rstrip(")"))  # holds the package
    for name, state in states.items():
        if name in per_kernel and per_kernel[name] == "reference":
            assert state.startswith(f"pure Python reference (zephon/kernels/{name}_ref.py; ")
            continue
        if name in per_kernel or state.startswith("compiled"):
            # compiled, and the file named is the extension module that loaded
            path = state.split("(", 1)[1].split(")", 1)[0]
            assert state.startswith("compiled ("), (name, state)
            assert path.startswith(f"zephon/_kernels/{name}.") and path.endswith((".so", ".pyd"))
            assert os.path.isfile(os.path.join(top, path)), (top, path)

    pure = run_cli("--version", env={**os.environ, "ZEPHON_PURE_PYTHON": "1"})
    assert pure.returncode == 0, pure.stderr
    assert pure.stdout.splitlines()[1].startswith("kernels: reference (ZEPHON_PURE_PYTHON")
    pure_states = kernel_lines(pure.stdout)
    assert list(pure_states) == [*per_kernel, *OTHER_KERNELS]
    for name in per_kernel:  # every selected kernel reads its reference, and why
        assert pure_states[name] == (f"pure Python reference (zephon/kernels/{name}_ref.py; "
                                     "ZEPHON_PURE_PYTHON=1)")
    for name in OTHER_KERNELS:  # ZEPHON_PURE_PYTHON leaves these as they are
        assert pure_states[name] == states[name]
    assert set(per_kernel.values()) <= {"compiled", "reference"}


def test_version_of_a_package_without_its_compiled_kernels(tmp_path):
    # A copy of the package with no extension module, and one that is present but does
    # not load: every kernel reads its fallback, the broken one says why.
    import shutil
    from importlib.machinery import EXTENSION_SUFFIXES

    from zephon import kernels

    shutil.copytree(os.path.join(CHECKOUT, "zephon"), tmp_path / "zephon",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    (tmp_path / "zephon" / "_kernels" / f"jpeg_region{EXTENSION_SUFFIXES[0]}").write_bytes(
        b"not a shared library")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZEPHON_PURE_PYTHON")}
    out = run_cli("--version", cwd=tmp_path, env=env)  # the copy comes first on sys.path
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].endswith(f"({tmp_path / 'zephon'})"), lines[0]
    assert lines[1].startswith("kernels: reference (not built: "), lines[1]
    states = kernel_lines(out.stdout)
    names = list(kernels.loaded())
    assert list(states) == [*names, *OTHER_KERNELS]
    for name in names:
        assert states[name] == f"pure Python reference (zephon/kernels/{name}_ref.py; not built)"
    assert states["heap"].startswith("not built (no shared heap")
    assert states["resample"].startswith("not built (Pillow resizes")
    assert states["jpeg_region"].startswith("does not load: "), states["jpeg_region"]
    assert "compiled" not in "".join(states.values())


def test_version_from_the_parent_directory_of_a_checkout(tmp_path):
    # The parent of a checkout named like the package: Python's path search takes the
    # checkout for a namespace package before an editable install's finder is asked.
    parent = tmp_path / "src"
    parent.mkdir()
    os.symlink(CHECKOUT, parent / "zephon")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = run_cli("--version", cwd=parent, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("zephon ") and "kernels: " in out.stdout


PROCESS_SCRIPT = """
import os, sys
import helper
from zephon import Pipeline, RuntimeOptions, sources
if __name__ == "__main__":
    pipe = (Pipeline(sources.from_sequence(list(range(32))), seed=0).map(helper.double)
            .batch(8).options(RuntimeOptions(runner="process", max_workers=2)))
    total = sum(int(b.sum()) for b in pipe)
    os.chdir(sys.argv[1])  # as Hydra does: the report still lands where --out said
    print("total", total)
"""


def test_profile_runs_the_script_as_python_does_from_the_parent_of_a_checkout(tmp_path):
    # From the parent directory of a checkout named like the package, process workers
    # imported the checkout as a namespace package; the script's own directory must be
    # first on sys.path (a sibling module imports); a chdir must not move the report.
    parent = tmp_path / "src"
    proj = tmp_path / "proj"
    parent.mkdir(), proj.mkdir()
    os.symlink(CHECKOUT, parent / "zephon")
    (proj / "helper.py").write_text("def double(x):\n    return 2 * x\n")
    (proj / "train.py").write_text(PROCESS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = run_cli("profile", str(proj / "train.py"), str(tmp_path), "--out", "r.html",
                  cwd=parent, env=env)
    assert out.returncode == 0, out.stderr
    assert f"total {2 * sum(range(32))}" in out.stdout
    assert (parent / "r.html").is_file() and not (tmp_path / "r.html").exists()


def test_profile_checks_out_before_the_script_runs_and_reports_sys_exit(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\nimport sys\n"
                      "sys.exit('fatal: no data')\n")
    assert_usage_error(run_cli("profile", str(script), "--out", "typo_dir/r.html",
                               cwd=tmp_path), "no directory")
    assert_usage_error(run_cli("profile", str(script), "--out=", cwd=tmp_path), "empty")
    assert not marker.exists()  # refused before a single line of the script ran
    out = run_cli("profile", str(script), "--out", "r.html", cwd=tmp_path)
    assert out.returncode == 1 and "fatal: no data" in out.stderr, out.stderr
    assert marker.exists() and (tmp_path / "r.html").is_file()
