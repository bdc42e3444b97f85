"""Per image, one process: zephon's decode op vs Pillow's full decode + torchvision's crop.

    python bench/vision/decode.py                  # 60 images a set, 3 repetitions
    python bench/vision/decode.py --quick          # 12 images a set, one repetition
    python bench/vision/decode.py --json out.json

Run it with the vision environment's interpreter (``bench/vision/README.md``). Every
row runs in a **fresh process** (the script with ``--row JSON``), repeated ``--reps``
times (3) in an order rotated by one row per repetition; the table shows medians
[min-max], and ratios are taken between rows of this run only.

Two sets from the ``make_data.py`` ImageFolder (its first landscape images of each
size, read into memory before the clock starts): 1600x1200 and 500x375 JPEGs, 60
each. Each timing row goes over its set ``--passes`` times (5, after one pass of
warm-up), a new random crop every time, and reports the mean time per image, wall and
the process's CPU (``time.process_time``: on a machine shared with other work the CPU
time moves far less than the wall time; on a quiet one they agree):

- ``zephon op``: ``zephon.vision.RandomResizedCrop(224)`` (flip 0.5, uint8 HWC out)
  called as the pipeline calls a map op, ``op(sample, ctx)``, with the context the
  pipeline gives it (its ``ctx.rng`` seeded by the sample and the pass);
- ``torchvision``: ``Image.open(...).convert("RGB")`` (Pillow's full decode) then
  torchvision's ``RandomResizedCrop(224)`` and ``RandomHorizontalFlip()`` on the PIL
  image, the result as a uint8 array (``np.asarray``): the reference;
- ``PIL draft`` (context): Pillow's ``draft()`` (DCT-scaled decode) with the same crop
  and resize, the trick without the library.

The bars (torchvision's time / zephon op's): >= 2 on 1600x1200, >= 1.25 on 500x375;
the ratios are printed on wall time and, prefixed ``cpu:``, on CPU time.

Then one ``quality`` row (fresh process, not timed):

- **crop distributions**: 20,000 boxes (2,000 with ``--quick``) for each size from
  zephon's box sampler and from torchvision's own ``RandomResizedCrop.get_params``;
  a two-sample Kolmogorov-Smirnov test on each box's area scale (``w*h / (W*H)``),
  log aspect ratio (``log(w/h)``) and centre (``x/W``, ``y/H``): the statistic D and
  its p-value (scipy's ``ks_2samp`` when importable, else the asymptotic
  Kolmogorov distribution); a p-value above 0.01 means the test finds no difference;
- **pixels**: for every image of both sets, the op (flip off) against Pillow's full
  decode cropped and resized (``resize((224, 224), BILINEAR, box=box)``) on the very box
  the op drew: PSNR in dB (bar: >= 30 on each image).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

SETS = {"1600x1200": (1600, 1200), "500x375": (500, 375)}


def set_files(root: str, manifest: dict, size: tuple[int, int], n: int) -> list[str]:
    """The first ``n`` images of ``size`` (width, height) in the manifest's order."""
    out = [str(Path(root) / f["path"]) for f in manifest["files"]
           if (f["width"], f["height"]) == size]
    if len(out) < n:
        raise SystemExit(f"the data set has {len(out)} images of {size}, {n} are needed")
    return out[:n]


# -- the methods (each: data, pass, index -> uint8 HWC) ------------------------------------

def method_zephon():
    import zephon.vision as zv
    from zephon.pipeline.ops.base import OpContext

    op = zv.RandomResizedCrop(C.CROP)

    def run(data: bytes, p: int, i: int) -> np.ndarray:
        return op({"image": data}, OpContext(("decode-bench", i, p), 0))["image"]

    return run


def method_torchvision():
    import torch
    from PIL import Image
    from torchvision.transforms import v2

    torch.manual_seed(0)
    tv = v2.Compose([v2.RandomResizedCrop(C.CROP), v2.RandomHorizontalFlip()])

    def run(data: bytes, p: int, i: int) -> np.ndarray:
        return np.asarray(tv(Image.open(io.BytesIO(data)).convert("RGB")))

    return run


def method_pil_draft():
    rng = np.random.default_rng(0)

    def run(data: bytes, p: int, i: int) -> np.ndarray:
        return C.pil_crop(data, rng, draft=True)

    return run


METHODS = {"zephon op": method_zephon, "torchvision": method_torchvision,
           "PIL draft": method_pil_draft}


def time_row(spec: dict) -> dict:
    """ms per image (wall and this process's CPU) of one method on one set, over
    ``passes`` passes after a warm-up."""
    datas = [Path(p).read_bytes() for p in spec["files"]]
    run = METHODS[spec["method"]]()
    for i, data in enumerate(datas):  # warm-up: code paths, allocator, page cache
        out = run(data, spec["passes"], i)
    assert out.shape == (C.CROP, C.CROP, 3) and out.dtype == np.uint8, (out.shape, out.dtype)
    t, cpu = time.perf_counter(), time.process_time()
    for p in range(spec["passes"]):
        for i, data in enumerate(datas):
            run(data, p, i)
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    n = spec["passes"] * len(datas)
    return {"ms_per_image": seconds * 1e3 / n, "cpu_ms_per_image": cpu * 1e3 / n, "images": n}


# -- quality: crop distributions and pixels ------------------------------------------------------

def zephon_sampler():
    """zephon's box sampler, ``fn(width, height, rng) -> (left, top, right, bottom)``:
    what ``RandomResizedCrop`` draws its box with, first, from ``ctx.rng``."""
    import zephon.vision as zv

    return zv.random_resized_crop_box


def torchvision_boxes(width: int, height: int, n: int) -> np.ndarray:
    """``n`` boxes ``(left, top, w, h)`` from torchvision's own ``get_params``."""
    import torch
    from torchvision.transforms import RandomResizedCrop

    torch.manual_seed(1)
    img = torch.empty(1, height, width, dtype=torch.uint8)
    out = np.empty((n, 4), np.int64)
    for k in range(n):
        top, left, h, w = RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3])
        out[k] = (left, top, w, h)
    return out


def zephon_boxes(width: int, height: int, n: int) -> np.ndarray:
    from zephon.pipeline.ops.base import OpContext

    sample = zephon_sampler()
    out = np.empty((n, 4), np.int64)
    for k in range(n):
        left, top, right, bottom = sample(width, height,
                                          OpContext(("ks", k, 0), 2).rng)
        out[k] = (left, top, right - left, bottom - top)
    return out


def _features(boxes: np.ndarray, width: int, height: int) -> dict[str, np.ndarray]:
    left, top, w, h = boxes.T.astype(np.float64)
    return {"scale": w * h / (width * height), "log_ratio": np.log(w / h),
            "centre_x": (left + w / 2) / width, "centre_y": (top + h / 2) / height}


def ks_2samp(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Two-sample KS statistic D and its p-value (scipy's when importable, else the
    asymptotic Kolmogorov distribution, accurate for samples of this size)."""
    try:
        from scipy.stats import ks_2samp as scipy_ks
    except ImportError:
        scipy_ks = None
    if scipy_ks is not None:
        res = scipy_ks(a, b)
        return float(res.statistic), float(res.pvalue)
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    d = float(np.max(np.abs(np.searchsorted(a, grid, side="right") / a.size -
                            np.searchsorted(b, grid, side="right") / b.size)))
    en = math.sqrt(a.size * b.size / (a.size + b.size))
    lam = (en + 0.12 + 0.11 / en) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(1.0, max(0.0, p))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def quality_row(spec: dict) -> dict:
    """KS statistics per size and feature, and PSNR per set (min, median)."""
    out: dict = {"ks": {}, "psnr": {}}
    for name, (width, height) in SETS.items():
        ours = _features(zephon_boxes(width, height, spec["draws"]), width, height)
        theirs = _features(torchvision_boxes(width, height, spec["draws"]), width, height)
        out["ks"][name] = {}
        for k in ours:
            d, p = ks_2samp(ours[k], theirs[k])
            out["ks"][name][k] = {"D": d, "p": p}
    for name, files in spec["sets"].items():
        values = [_psnr_one(Path(p).read_bytes(), i) for i, p in enumerate(files)]
        out["psnr"][name] = {"min": min(values), "median": float(np.median(values)),
                             "images": len(values)}
    return out


def _psnr_one(data: bytes, i: int) -> float:
    """The op (flip off) against the full decode + crop + resize on the box it drew."""
    from PIL import Image

    import zephon.vision as zv
    from zephon.pipeline.ops.base import OpContext

    op = zv.RandomResizedCrop(C.CROP, flip=0.0)
    img = Image.open(io.BytesIO(data)).convert("RGB")
    box = zephon_sampler()(img.width, img.height, OpContext(("psnr", i, 0), 3).rng)
    got = op({"image": data}, OpContext(("psnr", i, 0), 3))["image"]
    want = np.asarray(img.resize((C.CROP, C.CROP), Image.Resampling.BILINEAR, box=box))
    return psnr(got, want)


def run_row(spec: dict) -> dict:
    return quality_row(spec) if spec["kind"] == "quality" else time_row(spec)


# -- the plan --------------------------------------------------------------------------------

def plan(feat: dict, root: str, manifest: dict, per_set: int, passes: int,
         draws: int) -> tuple[list[dict], list[str]]:
    rows, skipped = [], []
    sets = {name: set_files(root, manifest, size, per_set) for name, size in SETS.items()}
    needs = {"zephon op": ("zephon_vision",), "torchvision": ("torchvision",),
             "PIL draft": ()}
    for method, need in needs.items():
        missing = [n for n in need if not feat.get(n)]
        for name, files in sets.items():
            label = f"{method} / {name}"
            if missing:
                skipped.append(f"{label}: needs {', '.join(missing)}")
            else:
                rows.append({"name": label, "kind": "time", "method": method, "set": name,
                             "files": files, "passes": passes})
    if feat.get("zephon_vision") and feat.get("torchvision"):
        rows.append({"name": "quality", "kind": "quality", "sets": sets, "draws": draws})
    else:
        skipped.append("quality: needs zephon_vision and torchvision")
    return rows, skipped


def ratios(table: dict) -> dict:
    """torchvision's time / each method's, per set, on wall and on CPU milliseconds."""
    out = {}
    for name in SETS:
        ref = table.get(f"torchvision / {name}")
        for method, key in (("zephon op", "zephon"), ("PIL draft", "pil_draft")):
            row = table.get(f"{method} / {name}")
            if ref and row:
                out[f"torchvision_vs_{key}[{name}]"] = ref["ms_per_image"] / row["ms_per_image"]
                out[f"cpu:torchvision_vs_{key}[{name}]"] = \
                    ref["cpu_ms_per_image"] / row["cpu_ms_per_image"]
    return out


def print_tables(rows: list[dict], table: dict, quality: dict | None, reps: int) -> None:
    print(f"ms per image, one process, medians [min-max] of {reps} run(s), each row in a "
          f"fresh process: wall, and this process's CPU")
    for spec in rows:
        if spec["kind"] != "time":
            continue
        row = table.get(spec["name"])
        shown = "failed" if row is None else \
            f"{C.spread(row, 'ms_per_image', '.2f'):<22} CPU " \
            f"{C.spread(row, 'cpu_ms_per_image', '.2f')}"
        print(f"  {spec['name']:<26} {shown}")
    if quality is None:
        return
    print("\ncrop boxes, zephon vs torchvision get_params: two-sample KS D (p)")
    for name, feats in quality["ks"].items():
        print(f"  {name:<10} " + "  ".join(f"{k} {v['D']:.4f} ({v['p']:.3f})"
                                           for k, v in feats.items()))
    print("PSNR of the op vs full decode + crop + resize on the same box (dB)")
    for name, v in quality["psnr"].items():
        print(f"  {name:<10} min {v['min']:.1f}  median {v['median']:.1f}  "
              f"({v['images']} images)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(parser)
    parser.add_argument("--per-set", type=int, default=None, help="images per set (60)")
    parser.add_argument("--passes", type=int, default=None, help="timed passes (5)")
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(run_row(json.loads(args.row))), flush=True)
        return 0
    feat = C.features()
    reps = args.reps or (1 if args.quick else 3)
    per_set = args.per_set or (12 if args.quick else 60)
    passes = args.passes or (2 if args.quick else 5)
    root, manifest = C.data_for(args)
    rows, skipped = plan(feat, root, manifest, per_set, passes, 2000 if args.quick else 20000)
    rows = C.select(rows, args.only)
    timed = [r for r in rows if r["kind"] == "time"]
    results = C.run_rows(str(Path(__file__).resolve()), timed, reps, args.timeout,
                         malloc_threshold=args.malloc_threshold)
    table = {name: C.summarise(rs, ("ms_per_image", "cpu_ms_per_image"))
             for name, rs in results.items() if rs}
    quality = None
    for spec in rows:
        if spec["kind"] == "quality":
            quality = C.run_rows(str(Path(__file__).resolve()), [spec], 1,
                                 args.timeout)["quality"]
            quality = quality[0] if quality else None
    print_tables(rows, table, quality, reps)
    for reason in skipped:
        print(f"not run here: {reason}")
    found = ratios(table)
    print(" ".join(f"{k}={v:.3f}" for k, v in found.items()))
    failed = [r["name"] for r in timed if r["name"] not in table] + \
        (["quality"] if any(r["kind"] == "quality" for r in rows) and quality is None else [])
    C.write_json(args.json, {"script": "decode", "reps": reps, "per_set": per_set,
                             "passes": passes, "features": feat, "versions": C.versions(),
                             "malloc_threshold": args.malloc_threshold,
                             "skipped": skipped, "failed": failed, "rows": table,
                             "runs": results, "quality": quality, "ratios": found})
    return C.exit_code(failed)


if __name__ == "__main__":
    sys.exit(main())
