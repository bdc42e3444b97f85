"""Processes for tests/test_index_shared.py: a rank building a webdataset source over shards
with the shared index, reporting what it opened and read as one JSON line on stdout.

    python tests/_index_ranks.py opens SHARDS [--read I,J,...]
    python tests/_index_ranks.py rank SHARDS --barrier DIR --ranks N --rank R

``SHARDS`` is a directory (its ``*.tar``) or a comma-separated list of paths. ``opens``:
the files opened (``sys.addaudithook``, event ``open``) while the source is built, then
while each sample ``I`` is read. ``rank``: waits until ``N`` ranks are ready (a file each in
``--barrier DIR``), so that all build at once, then builds and reads every sample.

Also imported by the test module for :func:`digest`, :func:`shard_list`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time


def digest(src, indices=None) -> str:
    """SHA-256 of samples ``indices`` (default: all) of ``src``: keys, fields and bytes."""
    h = hashlib.sha256()
    for i in range(len(src)) if indices is None else indices:
        sample = src.get(i)
        for field in sorted(sample):
            value = sample[field]
            data = value if isinstance(value, bytes) else str(value).encode()
            h.update(b"%s=%d:" % (field.encode(), len(data)) + data)
        h.update(b";")
    return h.hexdigest()


def shard_list(spec: str):
    """A directory stays a directory (the source lists it); a list is split."""
    return spec if "," not in spec else spec.split(",")


def _opened(events: list, root: str) -> list[str]:
    out = []
    for path in events:
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.fsdecode(path)
            if os.path.abspath(path).startswith(root):
                out.append(os.path.abspath(path))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["opens", "rank"])
    ap.add_argument("shards")
    ap.add_argument("--read", default="")
    ap.add_argument("--barrier", default=None)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args(argv)

    from zephon import sources

    shards = shard_list(args.shards)
    first = shards if isinstance(shards, str) else shards[0]
    root = os.path.dirname(os.path.abspath(first.rstrip("/"))) if not os.path.isdir(first) \
        else os.path.abspath(first)
    events: list = []

    def hook(event, hook_args):
        if event == "open" and hook_args:
            events.append(hook_args[0])

    sys.addaudithook(hook)
    out: dict = {"pid": os.getpid()}
    if args.mode == "rank":
        mark = os.path.join(args.barrier, f"ready-{args.rank}")
        with open(mark, "w"):
            pass
        deadline = time.monotonic() + 60
        while len([n for n in os.listdir(args.barrier) if n.startswith("ready-")]) < args.ranks:
            if time.monotonic() > deadline:
                print(json.dumps({"error": "barrier timed out"}))
                return 3
            time.sleep(0.002)
        out["start"] = time.time()
    events.clear()
    src = sources.webdataset(shards)
    out["build_opens"] = _opened(events, root)
    out["counts"] = list(src.index_counts)
    out["objects_read"] = src.index_store.objects_read if src.index_store is not None else None
    out["top"] = src.index_store.top if src.index_store is not None else None
    out["len"] = len(src)
    if args.mode == "opens":
        reads = []
        for i in [int(x) for x in args.read.split(",") if x]:
            events.clear()
            before = src.index_store.objects_read
            sample = src.get(i)
            reads.append({"i": i, "opens": _opened(events, root), "key": sample["__key__"],
                          "objects_read": src.index_store.objects_read - before})
        out["reads"] = reads
    else:
        out["digest"] = digest(src)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
