"""What the vision benchmarks share: data, features, rows in fresh processes, memory, tables.

Owned here:

- **data**: :func:`data_for` makes (once) or reuses the ImageFolder of ``make_data.py``
  under ``--data`` (default ``~/.cache/zephon/vision``, or ``$ZEPHON_VISION_DATA``) and
  returns its root and manifest;
- **features**: :func:`features` says which of the library's vision pieces this
  interpreter has (the ImageFolder source, the decode ops, the loader's ``normalize``,
  per-sample seeding of the global generators), so a script runs the rows that can run
  and names the ones that cannot;
- **rows**: :func:`run_rows` runs every row of a plan in a **fresh interpreter** (the
  script itself with ``--row JSON``, through ``bench/_fresh.py``), ``reps`` times, the
  order rotated by one row per repetition so that a slow phase of the machine hits every
  row; results are kept per row name;
- **memory and CPU**: :class:`TreeMonitor`, a thread that samples the memory and CPU
  time of this process and all its descendants every 50 ms (see its docstring for
  what is counted);
- **reports**: medians with [min-max] (:func:`summarise`, :func:`spread`) and the JSON
  file every script writes with ``--json PATH``.

Invariants: a row never runs in the process that plans the table (no warm pages,
imports or leftover workers carry from one row to another), ratios are taken between
rows of the same run only, and a row that fails is reported and left out, never
retried silently.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/: the shared fresh-process row runner
sys.path.insert(0, str(HERE))
import make_data  # noqa: E402
from _fresh import run_in_child  # noqa: E402

CROP, BATCH, CLASSES = 224, 64, 10
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
FULL_IMAGES, QUICK_IMAGES = 4000, 200


# -- data ----------------------------------------------------------------------------------

def data_for(args) -> tuple[str, dict]:
    """(root, manifest) of the data set the arguments ask for, made on first use."""
    n = QUICK_IMAGES if args.quick else FULL_IMAGES
    base = Path(args.data) if args.data else None
    root = (base / f"images-{n}-s0-v{make_data.VERSION}") if base else make_data.default_root(n)
    t = time.perf_counter()
    manifest = make_data.ensure(root, n)
    spent = time.perf_counter() - t
    if spent > 1:
        print(f"data: {n} images made in {spent:.0f} s under {root}", file=sys.stderr)
    return str(root), manifest


def image_files(root: str, manifest: dict) -> list[dict]:
    """``[{"path", "label"}]`` in the manifest's order (absolute paths)."""
    return [{"path": os.path.join(root, f["path"]), "label": f["label"]}
            for f in manifest["files"]]


def tv_box(width: int, height: int, rng, scale=(0.08, 1.0),
           ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box ``(left, top, right, bottom)`` drawn as torchvision's
    ``RandomResizedCrop.get_params`` draws it (10 tries of an area scale and a
    log-uniform ratio, then the centre-crop fallback), from a NumPy Generator."""
    import math

    area = width * height
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(lo, hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, left + w, top + h
    in_ratio = width / height
    w, h = width, height
    if in_ratio < ratio[0]:
        h = round(w / ratio[0])
    elif in_ratio > ratio[1]:
        w = round(h * ratio[1])
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def pil_crop(data: bytes, rng, draft: bool):
    """Pillow decode, :func:`tv_box`'s box, ``resize(box=)`` to 224 (torchvision's PIL
    path), a flip with p = 0.5: uint8 HWC. ``draft``: decode at the smallest DCT scale
    that keeps the box at least 224 pixels wide and high (``Image.draft``)."""
    import io
    import math

    import numpy as np
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    width, height = img.size
    box: tuple = tv_box(width, height, rng)
    if draft:
        bw, bh = box[2] - box[0], box[3] - box[1]
        got = img.draft("RGB", (math.ceil(width * CROP / bw), math.ceil(height * CROP / bh)))
        if got is not None:  # a JPEG: decoded at 1/scale, the box scaled with it
            scale = width / got[1][2]
            box = tuple(v / scale for v in box)
    img = img.convert("RGB").resize((CROP, CROP), Image.Resampling.BILINEAR, box=box)
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(img)


# -- features of this interpreter -------------------------------------------------------------

def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def features() -> dict:
    """Which vision pieces are importable here (names as the JSON reports them)."""
    out = {name: _has(module) for name, module in
           (("torch", "torch"), ("torchvision", "torchvision"), ("grain", "grain"),
            ("tensorflow", "tensorflow"), ("scipy", "scipy"), ("simplejpeg", "simplejpeg"),
            ("zephon_vision", "zephon.vision"), ("global_rngs", "zephon.pipeline.rngs"))}
    from zephon import sources

    out["image_folder"] = hasattr(sources, "image_folder")
    out["loader_normalize"] = False
    if out["torch"]:
        import zephon.torch as zt

        out["loader_normalize"] = "normalize" in inspect.signature(zt.loader).parameters
    from zephon import RuntimeOptions

    fields = getattr(RuntimeOptions, "__dataclass_fields__", {})
    out["persistent_workers_option"] = "persistent_workers" in fields
    import zephon

    out["forkserver_context"] = hasattr(zephon, "forkserver_context")
    return out


def versions() -> dict:
    """Versions of what the rows ran on (for the JSON; read from the installed
    distributions' metadata: nothing is imported)."""
    from importlib import metadata

    out = {"python": platform.python_version(), "cpus": os.cpu_count()}
    for dist in ("numpy", "pillow", "simplejpeg", "torch", "torchvision", "grain",
                 "tensorflow-cpu", "tensorflow", "scipy", "zephon"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


# -- memory of a process tree --------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and every descendant alive now."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(c for c in _children(p) if c not in seen)
    return seen


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (its own threads; 0 when gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class TreeMonitor:
    """Peak memory and CPU time of this process and all its descendants, by a thread.

    Every ``interval`` seconds (50 ms) the thread lists the tree (``/proc/PID/task/*/
    children``, recursively) and sums its RSS (``/proc/PID/statm``: cheap). PSS (from
    ``/proc/PID/smaps_rollup``: shared pages split between the processes that map them,
    so a library mapped by three processes counts once in the sum) costs milliseconds
    per process with torch's CUDA build mapped (its kernel walk of the page tables is
    what would otherwise load a core), so it is read when the RSS sum reaches a new
    peak and at most every ``pss_every`` seconds otherwise (0.25 s apart at the least):
    the peak PSS is the peak of those reads. CPU: the last user + system time seen of
    every process of the tree (``/proc/PID/stat``), summed over every process seen, so
    workers that exited still count (up to the last 50 ms of their life); this process's
    includes the sampling thread's own few per cent of a core. On a machine shared with
    other work, CPU seconds move far less than wall seconds. ``stop()`` returns the
    peaks in MiB, the CPU seconds and the counts of samples and processes.
    """

    def __init__(self, interval: float = 0.05, pss_every: float = 1.0) -> None:
        self.interval, self.pss_every = interval, pss_every
        self.pid = os.getpid()
        self.peak_rss = self.peak_pss = 0
        self.samples = self.pss_samples = self.max_procs = 0
        self.cpu: dict[int, float] = {}
        self._cpu0 = _cpu_s(self.pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-monitor", daemon=True)

    def start(self) -> "TreeMonitor":
        self._thread.start()
        return self

    def _sample(self) -> list[int]:
        pids = tree(self.pid)
        rss = sum(_rss(p) for p in pids)
        for p in pids:
            self.cpu[p] = max(self.cpu.get(p, 0.0), _cpu_s(p))
        self.samples += 1
        self.max_procs = max(self.max_procs, len(pids))
        self.peak_rss = max(self.peak_rss, rss)
        return pids

    def _run(self) -> None:
        last_pss, pss_at_rss = 0.0, 0
        while not self._stop.is_set():
            pids = self._sample()
            now = time.monotonic()
            rising = self.peak_rss > pss_at_rss * 1.02
            if now - last_pss >= (0.25 if rising else self.pss_every):
                self.peak_pss = max(self.peak_pss, sum(_pss(p) for p in pids))
                self.pss_samples += 1
                last_pss, pss_at_rss = now, self.peak_rss
            self._stop.wait(self.interval)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self._sample()  # the CPU of every process still alive, up to now
        cpu = sum(self.cpu.values()) - self._cpu0
        return {"peak_rss_mib": self.peak_rss / 2**20, "peak_pss_mib": self.peak_pss / 2**20,
                "cpu_s": cpu, "mem_samples": self.samples, "pss_samples": self.pss_samples,
                "max_procs": self.max_procs}


# -- rows ----------------------------------------------------------------------------------------

def row_env(malloc_threshold: int = 0) -> dict:
    """The environment every row runs with (quiet TensorFlow and warnings).

    ``malloc_threshold`` > 0 sets glibc's ``MALLOC_MMAP_THRESHOLD_`` and
    ``MALLOC_TRIM_THRESHOLD_`` for every row and its workers: image buffers of a few
    hundred KiB are then reused from the heap instead of being mapped and unmapped per
    image. A process that imported torch behaves so already (its large allocations
    raise glibc's dynamic threshold); one that runs Pillow alone (Grain's workers, the
    ``PIL draft`` rows) pays page faults on every image: Pillow decode + crop of a
    500x375 JPEG took 2.9-3.2 ms here against 1.8-2.1 ms with the thresholds at 256 MiB
    or torch imported. Off by default: the rows run as users run them."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONWARNINGS": "ignore"}
    if malloc_threshold > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = env["MALLOC_TRIM_THRESHOLD_"] = str(malloc_threshold)
    return env


def run_rows(script: str, rows: list[dict], reps: int, timeout: float,
             note=None, malloc_threshold: int = 0) -> dict[str, list[dict]]:
    """Every row ``reps`` times, each in a fresh interpreter, rotated per repetition;
    ``note(spec, result)`` is called after each success (progress on stderr)."""
    results: dict[str, list[dict]] = {r["name"]: [] for r in rows}
    env = row_env(malloc_threshold)
    for rep in range(reps):
        k = rep % max(1, len(rows))
        for spec in rows[k:] + rows[:k]:
            got, _ = run_in_child(script, spec, timeout, env, spec["name"])
            if got is not None:
                results[spec["name"]].append(got)
                if note is not None:
                    note(spec, got)
        print(f"repetition {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    return results


def summarise(results: list[dict], keys) -> dict:
    """Median, min and max of each numeric key over a row's repetitions."""
    out: dict = {"reps": len(results)}
    for k in keys:
        values = [r[k] for r in results if r.get(k) is not None]
        if values:
            out[k] = statistics.median(values)
            out[k + "_min"], out[k + "_max"] = min(values), max(values)
    return out


def spread(row: dict, key: str, fmt: str) -> str:
    """``median [min-max]`` of ``key`` in a summarised row."""
    if key not in row:
        return "-"
    return f"{row[key]:{fmt}} [{row[key + '_min']:{fmt}}-{row[key + '_max']:{fmt}}]"


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=1, sort_keys=True))
        print(f"wrote {path}", file=sys.stderr)


def conclude(script: str, args, rows: list[dict], table: dict, found: dict, skipped: list,
             meta: dict) -> int:
    """The end every script shares: the rows not run, the ratios' line, the JSON
    (``meta``: its script-specific entries) and the exit status."""
    for reason in skipped:
        print(f"not run here: {reason}")
    print(" ".join(f"{k}={v:.3f}" for k, v in found.items()))
    failed = [r["name"] for r in rows if r["name"] not in table]
    write_json(args.json, {"script": script, "skipped": skipped, "versions": versions(),
                           "malloc_threshold": args.malloc_threshold, "failed": failed,
                           "rows": table, "ratios": found, **meta})
    return exit_code(failed)


def exit_code(failed: list[str]) -> int:
    """The script's exit status: 1 when a row gave no result in any repetition."""
    if failed:
        print(f"rows that gave no result: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def add_common_args(parser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: {QUICK_IMAGES} images, one repetition")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per row (3)")
    parser.add_argument("--only", default="",
                        help="rows whose name contains one of these (comma-separated)")
    parser.add_argument("--data", default="",
                        help="directory of the generated data sets "
                             "(default ~/.cache/zephon/vision or $ZEPHON_VISION_DATA)")
    parser.add_argument("--json", default="", help="write the results there as JSON")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per row run")
    parser.add_argument("--malloc-threshold", type=int, default=0, metavar="BYTES",
                        help="glibc's mmap and trim thresholds for every row (e.g. "
                             "268435456; see _common.row_env); default: as users run")
    parser.add_argument("--row", help="internal: run one row (JSON) and print its result")


def select(rows: list[dict], only: str) -> list[dict]:
    wanted = [w for w in only.split(",") if w]
    return [r for r in rows if not wanted or any(w in r["name"] for w in wanted)]
