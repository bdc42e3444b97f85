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

The CLI is the only part of zephon that prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

from zephon.errors import ZephonConfigError
from zephon.options import RuntimeOptions


def _load_config(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as exc:  # pragma: no cover - depends on the extra
            raise SystemExit(f"reading {path} needs PyYAML: pip install 'zephon[yaml]'") from exc
        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: expected a mapping of option names to values")
    return data


def _parse_sets(pairs: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set expects key=value, got {pair!r}")
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
        print(f"error: {exc}", file=sys.stderr)
        return 2
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zephon")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    p_opts = sub.add_parser("options", help="print the resolved runtime options")
    p_opts.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="an explicit option value (JSON or a bare string); repeatable")
    p_opts.add_argument("--config", metavar="FILE", help="JSON or YAML file of option values")
    p_opts.add_argument("--cpu-count", type=int, default=None,
                        help="resolve as if the machine had this many CPUs")
    p_opts.add_argument("--json", action="store_true", help="machine-readable output")
    p_opts.set_defaults(func=cmd_options)
    p_demo = sub.add_parser("demo", help="run the demo pipeline, checkpoint half-way, resume "
                                         "under another runner and verify the stream")
    p_demo.set_defaults(func=lambda args: __import__("zephon.demo", fromlist=["main"]).main())
    args = parser.parse_args(argv)
    if args.version:
        from zephon import __version__

        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # output piped into e.g. `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
