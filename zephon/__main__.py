"""Command line: ``python -m zephon <command>``.

Commands:
  demo      run a real pipeline on an embedded synthetic token corpus, take a
            checkpoint half-way, resume under another runner and worker count,
            and verify that the resumed stream is identical (see zephon.demo)
  options   print the runtime options resolved for this machine: each value
            and whether it was explicit, derived or a default. ``--set k=v``
            (repeatable; v parsed as JSON when it parses, else a string) and
            ``--config FILE`` (JSON, or YAML with the ``yaml`` extra) supply
            explicit values; ``--json`` prints machine-readable output.
  example-data DIR
            write the small data files the documentation's examples read into DIR
            (see zephon.example_data); prints one line per file written, and for a
            format whose library is missing the line that installs its extra.
            Existing files with other contents are refused unless ``--force``; a
            symbolic link in the way is refused always; nothing is written outside DIR
  profile SCRIPT [ARGS...] [--out FILE]
            run SCRIPT (as ``python SCRIPT ARGS``) with execution tracking on for
            every pipeline it runs, then write a self-contained HTML report of
            those runs to FILE (default zephon-profile.html): plots of where the
            time goes and a diagnosis, whose text is also printed (see
            zephon.report). ``--out FILE`` (or ``--out=FILE``) is zephon's wherever
            it stands, before or after SCRIPT; arguments after a ``--`` that
            follows SCRIPT all go to the script, an ``--out`` of its own too.
            The report is never written through a symbolic link. Exit status: the
            script's (1 if it raised; the report is written all the same)

The CLI is the only part of zephon that prints. A mistake of the user (a missing or
malformed config file, a config that is not a mapping, ``--set`` without ``=``, an
invalid option) is one line ``error: ...`` on stderr and exit status 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any, Sequence


def _regular_package() -> None:
    """Make ``zephon`` the package this file belongs to, here and in the workers.

    Run from a directory that holds a directory named ``zephon`` (the parent of a
    checkout, say), Python's path search finds that directory first and, with no
    ``__init__.py`` in it, takes it for a namespace package; an editable install's
    finder, which comes after the path search, is never asked, so ``zephon/__init__.py``
    never runs and ``from zephon import __version__`` fails with "unknown location".
    The command line drops such entries from ``sys.path`` (spawned workers inherit it,
    so they find the real package too) and loads the real package from beside this file.
    """
    sys.path[:] = [p for p in sys.path if not _shadows_zephon(p)]
    package = sys.modules.get("zephon")
    if package is not None and getattr(package, "__file__", None):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "zephon", os.path.join(here, "__init__.py"), submodule_search_locations=[here])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["zephon"] = module
    spec.loader.exec_module(module)


def _shadows_zephon(entry: str) -> bool:
    """A ``sys.path`` entry holding a ``zephon`` directory that is not this package."""
    folder = os.path.join(entry or os.curdir, "zephon")
    here = os.path.dirname(os.path.abspath(__file__))
    return (os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, "__init__.py"))
            and os.path.realpath(folder) != here)


_regular_package()

from zephon.errors import ZephonConfigError  # noqa: E402 - after the package is the real one
from zephon.options import RuntimeOptions  # noqa: E402


class UsageError(Exception):
    """A mistake on the command line or in a config file: reported as one ``error:`` line
    with exit status 2.

    It stays here rather than in :mod:`zephon.errors`: only the CLI raises it and the CLI
    always catches it (it becomes the exit status), so no library caller ever sees it.
    """


#: The compiled kernels that are not selected by :mod:`zephon.kernels` (no pure Python
#: reference replaces them): name -> what runs where the module is not built.
_OTHER_KERNELS = {
    "heap": "no shared heap: worker results are copied",
    "resample": "Pillow resizes instead",
    "jpeg_region": "simplejpeg and Pillow decode instead; the kernel is optional, built "
                   "where the headers of libjpeg-turbo >= 2.1.3 are",
}


def _relative(path: str | None, top: str) -> str:
    """``path`` relative to the directory holding the ``zephon`` package."""
    return os.path.relpath(path, top or os.curdir) if path else "?"


def _compiled_file(name: str) -> tuple[str | None, str | None]:
    """(file of ``zephon._kernels.<name>``, None), or (None, why it did not load)."""
    from zephon import kernels

    try:
        return kernels.compiled_module(name).__file__, None
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == f"zephon._kernels.{name}":
            return None, "not built"
        # present but broken: a shared library it links is missing, say
        return None, f"does not load: {_one_line(str(exc))}"


def _kernel_lines(per_kernel: dict[str, str], top: str) -> list[str]:
    """One line per kernel: compiled (and its file) or what runs instead."""
    from zephon.transport.heap import heap_enabled

    pure = os.environ.get("ZEPHON_PURE_PYTHON") == "1"
    lines = []
    for name, implementation in per_kernel.items():
        if implementation == "compiled":
            path, _ = _compiled_file(name)
            lines.append(f"  {name}: compiled ({_relative(path, top)})")
            continue
        why = "ZEPHON_PURE_PYTHON=1" if pure else _compiled_file(name)[1]
        reference = _relative(importlib.import_module(f"zephon.kernels.{name}_ref").__file__,
                              top)
        lines.append(f"  {name}: pure Python reference ({reference}; {why})")
    for name, instead in _OTHER_KERNELS.items():
        path, why = _compiled_file(name)
        if path is None:
            lines.append(f"  {name}: {why} ({instead})")
            continue
        line = f"  {name}: compiled ({_relative(path, top)})"
        if name == "heap" and not heap_enabled():
            line += "; the shared heap is off (ZEPHON_WORKER_SHARED_HEAP=0 or no GIL)"
        lines.append(line)
    return lines


def version_text() -> str:
    """zephon's version, where it was imported from, which kernels loaded (a summary
    line, then one line per kernel: compiled and from which file, or what runs
    instead), and the Python and NumPy versions."""
    import warnings

    import numpy

    from zephon import kernels

    with warnings.catch_warnings():  # said below, as a line of its own
        warnings.simplefilter("ignore", RuntimeWarning)
        per_kernel = kernels.loaded()
        implementation = kernels.IMPLEMENTATION
    package = sys.modules["zephon"]
    where = os.path.dirname(package.__file__ or "?")
    lines = [f"zephon {package.__version__} ({where})", f"kernels: {implementation}"]
    missing = sorted(k for k, v in per_kernel.items() if v != "compiled")
    if os.environ.get("ZEPHON_PURE_PYTHON") == "1":
        lines[-1] += " (ZEPHON_PURE_PYTHON=1 asks for the pure Python references)"
    elif missing:
        lines[-1] += (f" (not built: {', '.join(missing)}; the pure Python references run, "
                      "much slower: build them with `python -m pip install -e .` in the "
                      "checkout, or install a wheel)")
    lines += _kernel_lines(per_kernel, os.path.dirname(where))
    lines.append(f"python {sys.version.split()[0]}, numpy {numpy.__version__}")
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _load_config(path: str) -> dict[str, Any]:
    """Read a JSON or YAML (``.yaml``/``.yml``) config file into a dict of option values."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise UsageError(f"cannot read config {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"config {path!r} is not UTF-8 text ({exc.reason} at byte "
                         f"{exc.start})") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:  # pragma: no cover - depends on the extra
            raise UsageError(f"reading {path!r} needs PyYAML: python -m pip install "
                             "-e '.[yaml]' (from the zephon checkout)") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or exc
            raise UsageError(f"config {path!r} is not valid YAML{where}: "
                             f"{_one_line(problem)}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"config {path!r} is not valid JSON at line {exc.lineno}, "
                             f"column {exc.colno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise UsageError(f"config {path!r} holds a {type(data).__name__}; expected a "
                         "mapping of option names to values")
    return data


def _parse_sets(pairs: Sequence[str]) -> dict[str, Any]:
    """``["k=v", ...]`` to a dict; ``v`` is parsed as JSON when it parses, else kept as text."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--set expects KEY=VALUE, got {pair!r} (e.g. --set "
                             "max_workers=4)")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _plain(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "get_start_method"):
        return value.get_start_method()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "value"):  # enums
        return value.value
    if hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    return str(value)


def cmd_options(args: argparse.Namespace) -> int:
    data: dict[str, Any] = {}
    if args.config:
        data.update(_load_config(args.config))
    data.update(_parse_sets(args.set or []))
    try:
        opts = RuntimeOptions.from_dict(data)
    except ZephonConfigError as exc:
        raise UsageError(str(exc)) from None
    resolved = opts.resolved(cpu_count=args.cpu_count)
    if args.json:
        print(json.dumps({k: {"value": _plain(v.value), "source": v.source}
                          for k, v in resolved.items()}, indent=2))
        return 0
    cpus = args.cpu_count if args.cpu_count is not None else os.cpu_count()
    print(f"zephon runtime options (cpu_count={cpus})")
    width = max(len(k) for k in resolved)
    for name, item in resolved.items():
        print(f"  {name:<{width}}  {item.source:<8}  {json.dumps(_plain(item.value))}")
    return 0


def cmd_example_data(args: argparse.Namespace) -> int:
    from zephon.example_data import write_examples

    try:
        entries = write_examples(args.directory, force=args.force)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise UsageError(f"cannot write the example data to {args.directory!r}: "
                         f"{exc.strerror or exc}{where}") from None
    for entry in entries:
        path = os.path.join(args.directory, entry.path)
        if not entry.written:
            print(f"skipped {path}: needs its extra: {entry.install}")
        elif entry.unchanged:
            print(f"kept    {path}: {entry.what} (already there, the same bytes)")
        else:
            print(f"wrote   {path}: {entry.what}")
    return 0


#: file endings -> the source ``python -m zephon index`` builds over them
_INDEX_KINDS = ((".tar", "webdataset"), (".parquet", "parquet"), (".jsonl", "jsonl"),
                (".jsonl.gz", "jsonl"), (".jsonl.zst", "jsonl"), (".array_record", "array_record"))


def _listed(path: str, storage_options: dict | None) -> list[str]:
    """The names in ``path`` when it is a directory or a remote prefix, else ``[path]``."""
    if "://" in path and not path.startswith("file://"):
        from zephon.io.remote import filesystem

        fs = filesystem(path, storage_options)
        if fs.isdir(path):
            return fs.ls(path, detail=False)
        return [path]
    local = path[len("file://"):] if path.startswith("file://") else path
    return os.listdir(local) if os.path.isdir(local) else [path]


def _index_kind(paths: Sequence[str], kind: str | None, storage_options: dict | None) -> str:
    if kind:
        return kind
    names = [name for path in paths for name in _listed(path, storage_options)]
    found = {k for n in names for suffix, k in _INDEX_KINDS if n.endswith(suffix)
             or (k == "array_record" and ".array_record-" in n)}
    if len(found) != 1:
        raise UsageError(f"index: cannot tell the kind of {list(paths)} (found "
                         f"{sorted(found) or 'no known file ending'}); name it with --kind")
    return found.pop()


def cmd_index(args: argparse.Namespace) -> int:
    from zephon import sources
    from zephon.io.errors import SourceError
    from zephon.io.index import building

    storage = json.loads(args.storage_options) if args.storage_options else None
    kind = _index_kind(args.paths, args.kind, storage)
    make = getattr(sources, kind, None)
    if make is None:
        raise UsageError(f"index: no source {kind!r}")
    try:
        with building(args.workers, args.save_every, args.rebuild):
            src = make(args.paths if len(args.paths) > 1 else args.paths[0],
                       index=args.index or None, storage_options=storage)
    except SourceError as exc:
        raise UsageError(str(exc)) from None
    read, scanned = src.index_counts
    store = src.index_store
    pruned = store.prune() if store is not None and args.prune else 0
    print(f"{kind}: {len(src.files)} files, {len(src)} samples: {scanned} scanned, "
          f"{read} already in the index {store.top if store is not None else '(none)'}"
          + (f"; {pruned} stale blobs removed" if pruned else ""))
    return 0


def split_profile_args(tail: Sequence[str]) -> tuple[str | None, list[str]]:
    """zephon's ``--out`` and the script's arguments from what follows SCRIPT on the
    command line: ``--out FILE`` and ``--out=FILE`` are zephon's wherever they stand
    before a ``--``; everything after the first ``--`` is the script's, untouched."""
    out: str | None = None
    script_args: list[str] = []
    k = 0
    while k < len(tail):
        arg = tail[k]
        if arg == "--":
            script_args += tail[k + 1:]
            break
        if arg == "--out" or arg.startswith("--out="):
            if out is not None:
                raise UsageError("profile: --out given twice (to pass an --out of the "
                                 "script's own, put the script's arguments after --)")
            if arg == "--out":
                if k + 1 == len(tail):
                    raise UsageError("profile: --out needs a FILE")
                out, k = tail[k + 1], k + 2
                continue
            out = arg.partition("=")[2]
        else:
            script_args.append(arg)
        k += 1
    return out, script_args


def _profile_script_tail(argv: Sequence[str]) -> list[str] | None:
    """What follows SCRIPT in ``profile ... SCRIPT ...``, exactly as written (None when
    ``argv`` is not the profile command or names no script)."""
    if argv[:1] != ["profile"]:
        return None
    k = 1
    while k < len(argv):
        arg = argv[k]
        if arg == "--out":
            k += 2
        elif arg == "--":
            return list(argv[k + 2:]) if k + 1 < len(argv) else None
        elif arg.startswith("-"):
            k += 1
        else:
            return list(argv[k + 1:])
    return None


def _report_path(out: str) -> str:
    """The report's absolute path (a script that changes directory does not move it),
    checked before the script runs: a typo costs nothing, not a whole run."""
    if not out:
        raise UsageError("profile: --out needs a FILE (got an empty one)")
    path = os.path.abspath(out)
    folder = os.path.dirname(path)
    if os.path.islink(path):
        raise UsageError(f"profile: {out!r} is a symbolic link: the report is not written "
                         "through a link (remove it or choose another path)")
    if os.path.isdir(path):
        raise UsageError(f"profile: {out!r} is a directory; --out names the report's file")
    if not os.path.isdir(folder):
        raise UsageError(f"profile: no directory {folder!r} for the report {out!r}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"profile: cannot write the report into {folder!r}")
    return path


def _script_status(raised: BaseException | None) -> int:
    """The exit status ``python SCRIPT`` would give, reporting what it raised as
    Python does (a traceback; the message of ``sys.exit("...")``)."""
    import traceback

    if isinstance(raised, SystemExit):
        if isinstance(raised.code, int):
            return raised.code
        print(raised.code, file=sys.stderr)
        return 1
    if raised is not None:
        traceback.print_exception(raised)
        return 1
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from zephon.report import profile_script

    late_out, script_args = split_profile_args(args.args)
    if late_out is not None and args.out is not None:
        raise UsageError("profile: --out given twice (to pass an --out of the script's "
                         "own, put the script's arguments after --)")
    out = late_out if late_out is not None else args.out
    out = "zephon-profile.html" if out is None else out
    path = _report_path(out)
    if not os.path.isfile(args.script):
        raise UsageError(f"profile: no script at {args.script!r}")
    report, raised = profile_script(args.script, script_args)
    try:
        report.write(path)
    except OSError as exc:
        status = _script_status(raised)  # the script's own failure is not hidden
        print(f"error: cannot write the report to {out!r}: {exc.strerror or exc}",
              file=sys.stderr)
        return status or 2
    runs = len(report.runs)
    print(f"wrote {out}: {runs} pipeline run(s)")
    if runs:
        print(report.diagnosis.text)
    return _script_status(raised)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zephon")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    p_opts = sub.add_parser(
        "options", help="print the resolved runtime options",
        description="Print the runtime options resolved for this machine: each value and "
                    "whether it was explicit, derived or a default.")
    p_opts.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="an explicit option value (JSON or a bare string); repeatable")
    p_opts.add_argument("--config", metavar="FILE", help="JSON or YAML file of option values")
    p_opts.add_argument("--cpu-count", type=int, default=None,
                        help="resolve as if the machine had this many CPUs")
    p_opts.add_argument("--json", action="store_true", help="machine-readable output")
    p_opts.set_defaults(func=cmd_options)
    p_demo = sub.add_parser(
        "demo", help="run the demo pipeline, checkpoint half-way, resume under another "
                     "runner and verify the stream",
        description="Run a real pipeline (token windows -> shuffle -> pack -> batch) on a "
                    "synthetic 16 MiB token corpus cached under $ZEPHON_CACHE_DIR or "
                    "~/.cache/zephon: once uninterrupted on the process runner, then again "
                    "with a checkpoint half-way, resumed on the threads runner with another "
                    "worker count; it checks that the resumed stream is identical batch for "
                    "batch and exits 0 if so, 1 if not.")
    p_demo.set_defaults(func=lambda args: __import__("zephon.demo", fromlist=["main"]).main())
    p_data = sub.add_parser(
        "example-data", help="write the data files the documentation's examples read",
        description="Write the small, deterministic data files the documentation's "
                    "examples read (Parquet, WebDataset tar shards, a uint16 token file, "
                    "zstd JSON lines, a saved Hugging Face dataset, an ImageFolder of "
                    "JPEGs) into DIR. A format whose "
                    "library is missing is skipped with the line that installs it.")
    p_data.add_argument("directory", metavar="DIR", help="where to write (created if missing)")
    p_data.add_argument("--force", action="store_true",
                        help="replace existing files of the same names whose contents "
                             "differ (refused without it; a symbolic link is refused always)")
    p_data.set_defaults(func=cmd_example_data)
    p_index = sub.add_parser(
        "index", help="build the shared index of data files ahead of training",
        description="Learn what the sources need of each file (a tar's members, a Parquet "
                    "footer, a jsonl's lines, an ArrayRecord's record count) once, on "
                    "several processes, into the shared index (_zephon_index/ beside the "
                    "data, or --index): every later build of a source over these files, on "
                    "every rank, reads it instead of opening them. Files already indexed at "
                    "their current version are skipped (their member tables checked), so "
                    "an interrupted build resumes; an index that is refused is replaced.")
    p_index.add_argument("paths", nargs="+", metavar="PATH",
                         help="the files, globs, brace patterns or directories (local or "
                              "fsspec URLs) a source reads")
    p_index.add_argument("--kind", default=None,
                         choices=["webdataset", "parquet", "jsonl", "array_record"],
                         help="the source kind (default: told from the file endings)")
    p_index.add_argument("--index", default=None, metavar="DIR",
                         help="where the index lives (default: _zephon_index/ beside the "
                              "first file)")
    p_index.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                         help="processes scanning files (default: the CPU count)")
    p_index.add_argument("--save-every", type=float, default=5.0, metavar="SECONDS",
                         help="how often what was learnt is saved (default 5)")
    p_index.add_argument("--storage-options", default=None, metavar="JSON",
                         help="fsspec options for remote paths (endpoint, credentials)")
    p_index.add_argument("--rebuild", action="store_true",
                         help="learn every file again, whatever the index holds")
    p_index.add_argument("--prune", action="store_true",
                         help="then remove the member tables no entry names any more "
                              "(those of files that changed), once an hour old")
    p_index.set_defaults(func=cmd_index)
    p_prof = sub.add_parser(
        "profile", help="run a script with execution tracking on and write an HTML report",
        description="Run SCRIPT as `python SCRIPT ARGS` with execution tracking on for every "
                    "pipeline it runs, then write a self-contained HTML report of those runs "
                    "(plots of where the time goes, and a diagnosis, also printed).")
    p_prof.add_argument("--out", default=None, metavar="FILE",
                        help="where to write the report (default zephon-profile.html); "
                             "also taken after SCRIPT, up to a --")
    p_prof.add_argument("script", metavar="SCRIPT", help="the Python script to run")
    p_prof.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments for the script")
    p_prof.set_defaults(func=cmd_profile)
    argv = list(sys.argv[1:] if argv is None else argv)
    script_tail = _profile_script_tail(argv)
    if script_tail is not None:  # argparse would drop a "--" from it: kept as written
        argv = argv[:len(argv) - len(script_tail)]
    args = parser.parse_args(argv)
    if script_tail is not None:
        args.args = script_tail
    if args.version:
        print(version_text())
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"error: {_one_line(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # output piped into e.g. `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
