"""Three epochs of an ImageFolder with torchvision transforms: zephon vs torch's DataLoader.

    python bench/vision/epochs.py                  # DataLoader vs zephon, 3 repetitions
    python bench/vision/epochs.py --quick          # 200 images, one repetition (smoke)
    python bench/vision/epochs.py --rows all --json out.json

Run it with the vision environment's interpreter (``bench/vision/README.md``):
torchvision is required. Every row runs in a **fresh process** (the script with
``--row JSON``), repeated ``--reps`` times (3) in an order rotated by one row per
repetition; the table shows medians [min-max], and ratios are taken between rows of
this run only.

Workload (the same in every row): the 4,000-image ImageFolder of ``make_data.py``;
per image: Pillow decode (``.convert("RGB")``), torchvision v2
``RandomResizedCrop(224)``, ``RandomHorizontalFlip()``, ``ToImage()``,
``ToDtype(float32, scale=True)``, ``Normalize(ImageNet mean, std)``; batches of 64,
shuffled every epoch, 2 worker processes, three epochs. Nothing is trained: the loop
checks each batch's shape and reads one value per image, so the loader is what is
measured.

Rows:

- ``torch DataLoader``: ``torchvision.datasets.ImageFolder(root, transform)`` in
  ``DataLoader(batch_size=64, shuffle=True, num_workers=2, persistent_workers=True)``
  (the platform's default start method: fork on Linux);
- ``torch DataLoader spawn`` (``--rows all``): the same with
  ``multiprocessing_context="spawn"`` (workers that import torch themselves, as
  zephon's do: the memory column's reference);
- ``zephon``: ``Pipeline(sources.image_folder(root)).map(transform, parallelism=2)
  .batch(64)`` under ``RuntimeOptions(runner="process", max_workers=2)``, iterated
  through ``zephon.torch.loader``: the same torchvision transform inside zephon's map
  (its random draws from torch's global generator, seeded per sample by the library's
  ``seed_global_rngs``; where that is missing, by the transform from ``ctx.rng``);
- ``zephon uint8 + normalize`` (``--rows all``): the transform stops at ``ToImage()``
  (uint8 CHW), and
  ``zephon.torch.loader(normalize={"image": (mean, std)}, layout="CHW")`` makes the
  float32 batch in the consumer: 4x fewer bytes cross processes;
- ``zephon forkserver`` (``--rows all``): the ``zephon`` row with
  ``RuntimeOptions(mp_context=zephon.forkserver_context("torch",
  "torchvision.transforms.v2", "PIL.Image"))``: the workers fork from one server that
  imported those once and froze its heap (less memory per worker, see
  ``zephon.transport.preload``);
- ``zephon vision op`` (``--rows all``): ``zephon.vision.RandomResizedCrop(224)`` in
  place of Pillow + torchvision (decode and crop in one step) with the loader's
  ``normalize``.

A row whose library piece is missing here (the ImageFolder source, the loader's
``normalize``, ``zephon.vision``) is named and skipped; without
``sources.image_folder`` the zephon rows read the same files through
``sources.from_sequence`` of ``{"path", "label"}`` and a read in the map.

Reported per row: ``total`` (from building the loader to the end of the third epoch;
worker shutdown is ``close``, apart), the time to the first batch of each epoch (epoch
1 from building the loader, workers' start included; epochs 2 and 3 from the
``iter()`` that starts them), and the peak memory of the whole process tree (this
process and every descendant, sampled every 50 ms: the sum of RSS, and of PSS, which
splits shared pages between the processes that map them; see
``_common.TreeMonitor``), and the CPU seconds the tree used (robust where the
machine is shared: wall seconds are not). Bars (ratios of this run's medians): total DataLoader /
zephon >= 1.3; first batch of epochs 2 and 3 <= 0.1x epoch 1's; peak PSS zephon /
DataLoader <= 1.2.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

EPOCHS = 3


# -- the transform (module level: picklable into every worker) --------------------------------

_TV: dict = {}


def tv_transform(out: str):
    """torchvision v2's train transform on a PIL image; ``out`` "float" (normalised
    float32 CHW) or "uint8" (CHW, before ToDtype/Normalize). Made once per process."""
    made = _TV.get(out)
    if made is None:
        import torch
        from torchvision.transforms import v2

        steps = [v2.RandomResizedCrop(C.CROP), v2.RandomHorizontalFlip(), v2.ToImage()]
        if out == "float":
            steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(C.MEAN, C.STD)]
        made = _TV[out] = v2.Compose(steps)
    return made


def _pil(sample: dict):
    import io

    from PIL import Image

    data = sample.get("image")
    if data is None:  # the from_sequence fallback: {"path", "label"}
        with open(sample["path"], "rb") as f:
            data = f.read()
    return Image.open(io.BytesIO(data)).convert("RGB")


class TvMap:
    """zephon's map: Pillow decode + the torchvision transform; the global generator is
    seeded per sample by the library (``seed_global_rngs``)."""

    def __init__(self, out: str = "float") -> None:
        self.out = out

    def __call__(self, sample: dict) -> dict:
        image = tv_transform(self.out)(_pil(sample))
        return {"image": image.numpy(), "label": sample["label"]}


class TvMapSeeded(TvMap):
    """The same, seeding torch's global generator from ``ctx.rng`` itself and giving its
    state back after the call (for a zephon without ``seed_global_rngs``)."""

    def __call__(self, sample: dict, ctx) -> dict:  # type: ignore[override]
        import torch

        gen = torch.default_generator
        state = gen.get_state()  # given back: the op leaves the global generator as it was
        gen.manual_seed(int(ctx.rng.integers(2**63)))
        try:
            return super().__call__(sample)
        finally:
            gen.set_state(state)


# -- loaders: each returns (an iterable that restarts per epoch, close) -----------------------

def loader_dataloader(spec: dict):
    import torch.utils.data as tud
    from torchvision.datasets import ImageFolder

    ctx = {"multiprocessing_context": "spawn"} if spec.get("spawn") else {}
    dataset = ImageFolder(spec["root"], transform=tv_transform("float"))
    loader = tud.DataLoader(dataset, batch_size=C.BATCH, shuffle=True, num_workers=2,
                            persistent_workers=True, **ctx)

    def close():
        nonlocal loader
        it = getattr(loader, "_iterator", None)
        if it is not None:
            it._shutdown_workers()
        loader = None

    return loader, close, lambda batch: batch[0]


def _zephon_source(spec: dict):
    from zephon import sources

    if spec["features"]["image_folder"]:
        return sources.image_folder(spec["root"]), "image_folder"
    manifest = json.loads((Path(spec["root"]) / "manifest.json").read_text())
    return sources.from_sequence(C.image_files(spec["root"], manifest)), "from_sequence"


def loader_zephon(spec: dict):
    import zephon.torch as zt
    from zephon import Pipeline, RuntimeOptions

    source, spec["used_source"] = _zephon_source(spec)
    op = spec["op"]
    if op == "vision":
        import zephon.vision as zv

        fn = zv.RandomResizedCrop(C.CROP)
        kw = {"normalize": {"image": (C.MEAN, C.STD)}, "layout": "HWC"}
    else:
        seeded = spec["features"]["global_rngs"]
        spec["rng"] = "seed_global_rngs" if seeded else "manual (ctx.rng)"
        fn = (TvMap if seeded else TvMapSeeded)("uint8" if op == "tv_uint8" else "float")
        kw = {"normalize": {"image": (C.MEAN, C.STD)}, "layout": "CHW"} \
            if op == "tv_uint8" else {}
    extra = {}
    if spec.get("forkserver"):
        import zephon

        extra["mp_context"] = zephon.forkserver_context(
            "torch", "torchvision.transforms.v2", "PIL.Image")
    pipe = Pipeline(source, seed=0).map(fn, parallelism=2).batch(C.BATCH) \
        .options(RuntimeOptions(runner="process", max_workers=2, **extra))
    loader = zt.loader(pipe, **kw)

    def close():
        loader.close()
        pipe.close()

    return loader, close, lambda batch: batch["image"]


LOADERS = {"dataloader": loader_dataloader, "zephon": loader_zephon}


# -- one row ------------------------------------------------------------------------------------

def _touch(images) -> int:
    """Check a batch of float32 NCHW images and read one value per image."""
    n = int(images.shape[0])
    assert tuple(images.shape[1:]) == (3, C.CROP, C.CROP), images.shape
    assert str(images.dtype) == "torch.float32", images.dtype
    float(images[:, 0, 0, 0].sum())
    return n


def run_row(spec: dict) -> dict:
    """Three epochs here: total_s, first_s and epoch_s per epoch, images, close_s, memory."""
    monitor = C.TreeMonitor().start()
    t0 = time.perf_counter()
    loader, close, images_of = LOADERS[spec["loader"]](spec)
    firsts, epochs, counts = [], [], []
    try:
        for epoch in range(EPOCHS):
            start = t0 if epoch == 0 else time.perf_counter()
            n = 0
            for batch in loader:
                if n == 0:
                    firsts.append(time.perf_counter() - start)
                n += _touch(images_of(batch))
                del batch
            epochs.append(time.perf_counter() - start)
            counts.append(n)
        total = time.perf_counter() - t0
    finally:
        t_close = time.perf_counter()
        close()
        gc.collect()
        close_s = time.perf_counter() - t_close
    out = {"total_s": total, "close_s": close_s, "images": counts,
           "first_s": firsts, "epoch_s": epochs, **monitor.stop()}
    for i in range(EPOCHS):
        out[f"first{i + 1}_s"] = firsts[i]
        out[f"epoch{i + 1}_s"] = epochs[i]
    out["first_later_vs_first"] = max(firsts[1:]) / firsts[0]
    for key in ("used_source", "rng"):
        if key in spec:
            out[key] = spec[key]
    return out


# -- the plan -----------------------------------------------------------------------------------

def plan(feat: dict, which: str) -> tuple[list[dict], list[str]]:
    """The rows to run and the reasons others cannot run here."""
    rows, skipped = [], []

    def row(name, loader, default=True, needs=(), **kw):
        missing = [n for n in needs if not feat.get(n)]
        if missing:
            skipped.append(f"{name}: needs {', '.join(missing)}")
        elif default or which == "all":
            rows.append({"name": name, "loader": loader, **kw})

    row("torch DataLoader", "dataloader")
    row("torch DataLoader spawn", "dataloader", default=False, spawn=True)
    row("zephon", "zephon", op="tv_float")
    row("zephon uint8 + normalize", "zephon", default=False, op="tv_uint8",
        needs=("loader_normalize",))
    row("zephon forkserver", "zephon", default=False, op="tv_float", forkserver=True,
        needs=("forkserver_context",))
    row("zephon vision op", "zephon", default=False, op="vision",
        needs=("zephon_vision", "loader_normalize"))
    return rows, skipped


KEYS = ("total_s", "cpu_s", "close_s", "first1_s", "first2_s", "first3_s", "epoch1_s", "epoch2_s",
        "epoch3_s", "first_later_vs_first", "peak_rss_mib", "peak_pss_mib", "max_procs")


def ratios(table: dict) -> dict:
    """The bars' ratios from this run's medians."""
    out: dict = {}
    dl = table.get("torch DataLoader")
    for name, row in table.items():
        if not name.startswith("zephon"):
            continue
        key = name.replace("zephon", "").strip().replace(" + ", "_").replace(" ", "_") or "tv"
        out[f"first_later_vs_first[{key}]"] = row["first_later_vs_first"]
        if dl:
            out[f"total_dataloader_vs_zephon[{key}]"] = dl["total_s"] / row["total_s"]
            out[f"cpu_dataloader_vs_zephon[{key}]"] = dl["cpu_s"] / row["cpu_s"]
            out[f"pss_zephon_vs_dataloader[{key}]"] = row["peak_pss_mib"] / dl["peak_pss_mib"]
            out[f"rss_zephon_vs_dataloader[{key}]"] = row["peak_rss_mib"] / dl["peak_rss_mib"]
        spawn = table.get("torch DataLoader spawn")
        if spawn:
            out[f"pss_zephon_vs_dataloader_spawn[{key}]"] = \
                row["peak_pss_mib"] / spawn["peak_pss_mib"]
    if dl:
        out["first_later_vs_first[dataloader]"] = dl["first_later_vs_first"]
    return out


def print_table(rows: list[dict], table: dict, reps: int) -> None:
    print(f"three epochs, medians [min-max] of {reps} run(s), each row in a fresh process")
    print(f"{'row':<26} {'total s':>18} {'CPU s':>7} {'first batch s: 1 / 2 / 3':>26} "
          f"{'peak PSS MiB':>20} {'RSS MiB':>8} {'close s':>8}")
    for spec in rows:
        row = table.get(spec["name"])
        if row is None:
            print(f"{spec['name']:<26} failed")
            continue
        firsts = " / ".join(f"{row[f'first{i}_s']:.2f}" for i in (1, 2, 3))
        print(f"{spec['name']:<26} {C.spread(row, 'total_s', '.1f'):>18} {row['cpu_s']:>7.0f} "
              f"{firsts:>26} {C.spread(row, 'peak_pss_mib', '.0f'):>20} "
              f"{row['peak_rss_mib']:>8.0f} {row['close_s']:>8.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(parser)
    parser.add_argument("--rows", choices=("default", "all"), default="default",
                        help="all: also the spawn DataLoader, zephon's uint8 + normalize "
                             "and the zephon vision op rows")
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(run_row(json.loads(args.row))), flush=True)
        return 0
    feat = C.features()
    if not feat["torchvision"]:
        print("epochs.py needs torchvision: run it with the vision environment's python "
              "(bench/vision/README.md)", file=sys.stderr)
        return 2
    reps = args.reps or (1 if args.quick else 3)
    root, manifest = C.data_for(args)
    rows, skipped = plan(feat, args.rows)
    rows = C.select(rows, args.only)
    specs = [{**r, "root": root, "features": feat} for r in rows]

    def note(spec, got):
        print(f"  {spec['name']}: total {got['total_s']:.1f} s, CPU {got['cpu_s']:.0f} s, first "
              f"{' / '.join(f'{x:.2f}' for x in got['first_s'])} s, PSS "
              f"{got['peak_pss_mib']:.0f} MiB", file=sys.stderr, flush=True)

    results = C.run_rows(str(Path(__file__).resolve()), specs, reps, args.timeout, note,
                         args.malloc_threshold)
    table = {name: C.summarise(rs, KEYS) for name, rs in results.items() if rs}
    print_table(rows, table, reps)
    return C.conclude("epochs", args, rows, table, ratios(table), skipped,
                      {"images": manifest["n"], "reps": reps, "features": feat,
                       "runs": results})


if __name__ == "__main__":
    sys.exit(main())
