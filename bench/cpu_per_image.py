"""Where the CPU goes on the image workload: zephon vs torch's DataLoader (Linux).

    python bench/cpu_per_image.py                       # 960 JPEGs, 3 rounds
    python bench/cpu_per_image.py --images 2560 --rounds 5
    python bench/cpu_per_image.py --zephon before=/path/to/an/older/checkout
    python bench/cpu_per_image.py --grain .venv-peers/bin/python   # a Grain row too

The image workload of ``bench/compare_workloads.py`` (PIL decode, RandomResizedCrop(224),
flip, normalise; batches of 64; 2 spawn workers) for ``zephon`` (default options) and
``torch`` (``DataLoader``), each run in a fresh process, alternating and rotated per round.
Over the steady part of a run (from batch 6 to 2 batches before the end) it reads the CPU
time (user + system, ``/proc``) of the consumer's process (every thread) and of all its
descendants (the workers), per image, and the wall-clock images/s. On a loaded machine the
CPU per image is the stable figure; wall rates are compared within one round only. A
loader that reads far ahead of its consumer (Grain's ``to_iter_dataset`` prefetches 500
elements, here batches, per worker with 16 threads) does much of its work before that window, so the
window understates its CPU and overstates its rate; ``epoch`` is every process's CPU from
building the loader to 2 batches before the end, per image of the epoch (start-up and
read-ahead included), the figure to compare across such loaders. The
last line is machine-readable ``key=value`` pairs (medians). ``--zephon NAME=PATH``
(repeatable) adds a zephon row importing zephon from ``PATH`` (a before/after comparison
in one run). ``--grain PYTHON`` adds a ``grain`` row (``compare_workloads.py``'s Grain
loader: ``mp_prefetch`` with 2 workers) run by that interpreter (Grain is not in zephon's
venv; see ``compare_workloads.py`` for the peers' venv).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_workloads as cw  # the workload itself

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
START, TAIL = 6, 2
LOADERS = ("zephon", "torch", "grain")


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _cpu(pid: int) -> float:
    fields = _stat(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / _TICK


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (workers, their helpers)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                parent[int(entry)] = int(fields[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def one_run(loader: str, folder: str, n_batches: int) -> dict:
    me, got, images = os.getpid(), 0, 0
    m_start = _cpu(me)
    batches, close = cw.LOADERS[f"image/{loader}"]({"folder": folder})
    stop = n_batches - TAIL
    try:
        for batch in batches:
            images += cw._rows_of(batch)
            got += 1
            if got == START:
                workers = descendants(me)
                t0, m0 = time.perf_counter(), _cpu(me)
                w0 = {p: _cpu(p) for p in workers}
                i0 = images
            elif got == stop:
                t1, m1 = time.perf_counter(), _cpu(me)
                spent = sum(_cpu(p) - w0[p] for p in workers)
                k = images - i0
                # everything every process did since the loader was built: what a loader
                # that reads far ahead did before the window is in it too
                whole = m1 - m_start + sum(_cpu(p) for p in descendants(me))
            del batch
    finally:
        close()
    return {"main_us": (m1 - m0) / k * 1e6, "workers_us": spent / k * 1e6,
            "epoch_us": whole / images * 1e6, "img_s": k / (t1 - t0), "workers": len(workers)}


def _fresh(loader: str, folder: str, n_batches: int, path: str | None = None,
           python: str | None = None) -> dict:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([path, env.get("PYTHONPATH", "")])
    proc = subprocess.run([python or sys.executable, str(Path(__file__).resolve()), "--one", loader,
                           "--folder", folder, "--batches", str(n_batches)],
                          capture_output=True, text=True, check=False, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{loader} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=cw.QUICK["images"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", default=str(Path.home() / ".cache" / "zephon" / "workloads"))
    parser.add_argument("--zephon", action="append", default=[], metavar="NAME=PATH",
                        help="another zephon row, importing zephon from PATH")
    parser.add_argument("--grain", metavar="PYTHON", help="a grain row, run by PYTHON")
    parser.add_argument("--one", choices=LOADERS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one_run(args.one, args.folder, args.batches)), flush=True)
        return 0
    paths = cw.ensure_data(Path(args.data), {"images": args.images}, {"image"})
    n_batches = -(-args.images // cw.IMAGE_BATCH)
    rows = {name: (name, None, None) for name in ("zephon", "torch")}
    if args.grain:
        rows["grain"] = ("grain", None, args.grain)
    for extra in args.zephon:
        name, _, path = extra.partition("=")
        rows[f"zephon {name}"] = ("zephon", path, None)
    names = list(rows)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names if name != "torch"}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        got = {name: _fresh(rows[name][0], paths["folder"], n_batches, *rows[name][1:])
               for name in order}
        for name in names:
            runs[name].append(got[name])
            g = got[name]
            print(f"round {r} {name:>14}: consumer {g['main_us']:6.0f} us/img, workers "
                  f"{g['workers_us']:6.0f} us/img, {g['img_s']:6.0f} img/s; epoch, all "
                  f"processes {g['epoch_us']:6.0f} us/img", flush=True)
            if name in ratios:
                ratios[name].append(g["img_s"] / got["torch"]["img_s"])
    med = {f"{name.replace(' ', '_')}_{k}": statistics.median(x[k] for x in runs[name])
           for name in names for k in ("main_us", "workers_us", "epoch_us", "img_s")}
    for name, values in ratios.items():
        print(f"wall ratio {name}/torch per round: {' '.join(f'{x:.2f}' for x in values)}")
        med[f"{name.replace(' ', '_')}_vs_torch"] = statistics.median(values)
    print(" ".join(f"{k}={v:.3g}" for k, v in med.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
