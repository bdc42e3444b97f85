"""One epoch of the image workload: zephon's decode op vs Grain, tf.data and torch's DataLoader.

    python bench/vision/compare.py                 # the op and the peers, 3 repetitions
    python bench/vision/compare.py --rows all      # also zephon + torchvision's transform
    python bench/vision/compare.py --quick         # 200 images, one repetition (smoke)
    python bench/vision/compare.py --only grain,zephon --json out.json

Run it with the vision environment's interpreter (``bench/vision/README.md``): it has
torchvision, Grain and tensorflow-cpu; a framework that is not importable is named and
gets no rows. Every row runs in a **fresh process** (the script with ``--row JSON``),
``--reps`` times (3) in an order rotated by one row per repetition; the table shows
medians [min-max], and ratios are taken between rows of this run only.

Workload (the same result in every row): the 4,000-image ImageFolder of
``make_data.py``, shuffled; per image a RandomResizedCrop to 224x224 (scale 0.08-1,
ratio 3/4-4/3) and a horizontal flip with p = 0.5, uint8 out of the workers; batches of
64; in the consumer every batch becomes a float32 NCHW tensor normalised with the
ImageNet mean and std (what a model eats), and one value per image is read. Two
workers (or, for tf.data, its AUTOTUNE'd thread pool on this machine's cores).

Rows, each its framework's idiomatic fast path:

- ``zephon vision op``: ``Pipeline(sources.image_folder(root)).map(
  zephon.vision.RandomResizedCrop(224), parallelism=2).batch(64)`` under
  ``RuntimeOptions(runner="process", max_workers=2)``, iterated through
  ``zephon.torch.loader(pipe, normalize={"image": (mean, std)})``: decode and crop in
  one step (DCT-scaled, row-limited decode);
- ``zephon + torchvision`` (``--rows all``): the same pipeline with Pillow + torchvision v2
  (``RandomResizedCrop(224)``, ``RandomHorizontalFlip()``, ``ToImage()``) in the map
  (the library's overhead apart from its op);
- ``torch DataLoader``: ``torchvision.datasets.ImageFolder`` with the same v2
  transform in ``DataLoader(batch_size=64, shuffle=True, num_workers=2)``;
- ``grain``: ``MapDataset.source(files).shuffle(seed).random_map(decode + crop)
  .batch(64).to_iter_dataset().mp_prefetch(2 workers)``, Pillow's full decode and
  ``resize(box=...)`` (torchvision's PIL path, the box drawn by torchvision's
  algorithm from Grain's per-element RNG);
- ``grain + PIL draft``: the same with Pillow's ``draft()`` asking libjpeg-turbo for
  the smallest DCT scale that keeps the box at least 224 pixels (what an expert
  writes by hand: the library op's first trick, without its row limit);
- ``tf.data``: ``from_tensor_slices(paths).shuffle(n).map(read_file ->
  sample_distorted_bounding_box -> decode_and_crop_jpeg -> resize(224) ->
  random_flip_left_right, num_parallel_calls=AUTOTUNE).batch(64).prefetch(AUTOTUNE)``
  (the official ResNet input pipeline's fast path: it decodes only the crop window).

Reported per row: ``epoch`` (from building the loader to its exhaustion), the images/s
over the epoch, the CPU seconds of the whole process tree (``_common.TreeMonitor``:
robust where the machine is shared, wall seconds are not), the time to the first
batch, the peak PSS of the tree, and ``close`` (shutdown, apart). The bar: the best
peer's epoch seconds / zephon vision op's >= 1.5 (the same ratio on CPU seconds is
printed beside it, prefixed ``cpu:``).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

# -- the consumer: every row's batches become the same float32 NCHW tensors -----------------

_NORM: dict = {}


def normalise(images, layout: str):
    """uint8 batches of HWC or CHW images (tensor or array) -> normalised float32 NCHW."""
    import torch

    if "mean" not in _NORM:
        _NORM["mean"] = torch.tensor(C.MEAN).view(1, 3, 1, 1) * 255
        _NORM["inv"] = 1 / (torch.tensor(C.STD).view(1, 3, 1, 1) * 255)
    x = images if isinstance(images, torch.Tensor) else torch.from_numpy(np.asarray(images))
    if layout == "HWC":
        x = x.permute(0, 3, 1, 2)
    return (x.float() - _NORM["mean"]) * _NORM["inv"]


def _touch(images) -> int:
    assert tuple(images.shape[1:]) == (3, C.CROP, C.CROP), images.shape
    assert str(images.dtype) == "torch.float32", images.dtype
    float(images[:, 0, 0, 0].sum())
    return int(images.shape[0])


# -- the per-image transforms (module level: picklable into every framework's workers) -------

_TV = None


def tv_uint8():
    """torchvision v2 on a PIL image: RandomResizedCrop(224), flip, ToImage (uint8 CHW)."""
    global _TV
    if _TV is None:
        from torchvision.transforms import v2

        _TV = v2.Compose([v2.RandomResizedCrop(C.CROP), v2.RandomHorizontalFlip(),
                          v2.ToImage()])
    return _TV


class TvMap:
    """zephon's map with torchvision (torch's global generator seeded by the library)."""

    def __call__(self, sample: dict) -> dict:
        from PIL import Image

        image = Image.open(io.BytesIO(sample["image"])).convert("RGB")
        return {"image": tv_uint8()(image).numpy(), "label": sample["label"]}


class TvMapSeeded(TvMap):
    """The same, seeded from ``ctx.rng`` by the op (for a zephon without
    ``seed_global_rngs``); the global generator's state is given back."""

    def __call__(self, sample: dict, ctx) -> dict:  # type: ignore[override]
        import torch

        gen = torch.default_generator
        state = gen.get_state()
        gen.manual_seed(int(ctx.rng.integers(2**63)))
        try:
            return super().__call__(sample)
        finally:
            gen.set_state(state)


class GrainCrop:
    """Grain's random map: read the file, :func:`_common.pil_crop` with Grain's RNG."""

    def __init__(self, draft: bool) -> None:
        self.draft = draft

    def __call__(self, item: dict, rng) -> dict:
        with open(item["path"], "rb") as f:
            data = f.read()
        return {"image": C.pil_crop(data, rng, self.draft), "label": item["label"]}


# -- loaders: each returns (batches of uint8 images, their layout, close) -------------------

def _zephon_source(spec: dict):
    from zephon import sources

    if spec["features"]["image_folder"]:
        return sources.image_folder(spec["root"])
    raise RuntimeError("sources.image_folder is missing")  # plan() does not ask then


def loader_zephon(spec: dict):
    import zephon.torch as zt
    from zephon import Pipeline, RuntimeOptions

    if spec["op"] == "vision":
        import zephon.vision as zv

        fn, layout = zv.RandomResizedCrop(C.CROP), "HWC"
    else:
        fn = TvMap() if spec["features"]["global_rngs"] else TvMapSeeded()
        layout = "CHW"
    pipe = Pipeline(_zephon_source(spec), seed=0).map(fn, parallelism=2).batch(C.BATCH) \
        .options(RuntimeOptions(runner="process", max_workers=2))
    if spec["features"]["loader_normalize"]:
        loader = zt.loader(pipe, normalize={"image": (C.MEAN, C.STD)}, layout=layout)
        batches = (b["image"] for b in loader)
    else:
        loader = zt.loader(pipe)
        batches = (normalise(b["image"], layout) for b in loader)

    def close():
        loader.close()
        pipe.close()

    return batches, close


def loader_dataloader(spec: dict):
    import torch.utils.data as tud
    from torchvision.datasets import ImageFolder

    loader = tud.DataLoader(ImageFolder(spec["root"], transform=tv_uint8()),
                            batch_size=C.BATCH, shuffle=True, num_workers=2)
    return (normalise(images, "CHW") for images, _ in loader), lambda: None


def loader_grain(spec: dict):
    import grain

    manifest = json.loads((Path(spec["root"]) / "manifest.json").read_text())
    ds = grain.MapDataset.source(C.image_files(spec["root"], manifest)).shuffle(seed=0) \
        .random_map(GrainCrop(spec["draft"]), seed=0).batch(C.BATCH).to_iter_dataset() \
        .mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    return (normalise(b["image"], "HWC") for b in ds), lambda: None


def _tf_load(path, label):
    import tensorflow as tf

    data = tf.io.read_file(path)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        tf.io.extract_jpeg_shape(data), tf.constant([0.0, 0.0, 1.0, 1.0], shape=(1, 1, 4)),
        min_object_covered=0.0, aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0),
        max_attempts=10, use_image_if_no_bounding_boxes=True)
    top, left, _ = tf.unstack(begin)
    height, width, _ = tf.unstack(size)
    image = tf.io.decode_and_crop_jpeg(data, tf.stack([top, left, height, width]), channels=3)
    image = tf.image.resize(image, (C.CROP, C.CROP), method="bilinear")
    image = tf.image.random_flip_left_right(image)
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8), label


def loader_tf(spec: dict):
    import tensorflow as tf

    manifest = json.loads((Path(spec["root"]) / "manifest.json").read_text())
    files = C.image_files(spec["root"], manifest)
    ds = tf.data.Dataset.from_tensor_slices(([f["path"] for f in files],
                                             [f["label"] for f in files]))
    ds = ds.shuffle(len(files), seed=0).map(_tf_load, num_parallel_calls=tf.data.AUTOTUNE) \
        .batch(C.BATCH).prefetch(tf.data.AUTOTUNE)
    return (normalise(images, "HWC") for images, _ in ds.as_numpy_iterator()), lambda: None


LOADERS = {"zephon": loader_zephon, "dataloader": loader_dataloader, "grain": loader_grain,
           "tf": loader_tf}


def run_row(spec: dict) -> dict:
    """One epoch here: epoch_s (build to exhausted), first_s, images, images_per_s, close_s,
    and the process tree's CPU seconds and peak memory (``_common.TreeMonitor``)."""
    monitor = C.TreeMonitor().start()
    t0 = time.perf_counter()
    batches, close = LOADERS[spec["loader"]](spec)
    n, first = 0, float("nan")
    try:
        for images in batches:
            n += _touch(images)
            if first != first:  # nan: the first batch
                first = time.perf_counter() - t0
            del images
        epoch = time.perf_counter() - t0
    finally:
        t_close = time.perf_counter()
        close()
        close_s = time.perf_counter() - t_close
    return {"epoch_s": epoch, "first_s": first, "images": n, "images_per_s": n / epoch,
            "close_s": close_s, **monitor.stop()}


# -- the plan ---------------------------------------------------------------------------------

def plan(feat: dict, which: str = "default") -> tuple[list[dict], list[str]]:
    """The rows to run and the reasons others cannot run here."""
    rows, skipped = [], []

    def row(name, loader, needs=(), default=True, **kw):
        missing = [n for n in needs if not feat.get(n)]
        if missing:
            skipped.append(f"{name}: needs {', '.join(missing)}")
        elif default or which == "all":
            rows.append({"name": name, "loader": loader, **kw})

    row("zephon vision op", "zephon", needs=("zephon_vision", "image_folder", "torch"),
        op="vision")
    row("zephon + torchvision", "zephon", needs=("image_folder", "torchvision"), op="tv",
        default=False)
    row("torch DataLoader", "dataloader", needs=("torchvision",))
    row("grain", "grain", needs=("grain",), draft=False)
    row("grain + PIL draft", "grain", needs=("grain",), draft=True)
    row("tf.data", "tf", needs=("tensorflow",))
    return rows, skipped


KEYS = ("epoch_s", "cpu_s", "first_s", "images_per_s", "close_s", "peak_pss_mib")


def ratios(table: dict) -> dict:
    out: dict = {}
    for measure, unit in (("epoch", "epoch_s"), ("cpu", "cpu_s")):
        peers = {n: r[unit] for n, r in table.items() if not n.startswith("zephon")}
        for zname, key in (("zephon vision op", "op"), ("zephon + torchvision", "tv")):
            mine = table.get(zname)
            if mine is None or not peers:
                continue
            best = min(peers, key=lambda n: peers[n])
            out[f"{measure}:best_peer_vs_zephon_{key}({best})"] = peers[best] / mine[unit]
            for name, seconds in peers.items():
                out[f"{measure}:{name}_vs_zephon_{key}"] = seconds / mine[unit]
    return out


def print_table(rows: list[dict], table: dict, reps: int, n: int) -> None:
    print(f"one epoch of {n} images, medians [min-max] of {reps} run(s), each row in a "
          f"fresh process")
    print(f"{'row':<22} {'epoch s':>20} {'images/s':>9} {'CPU s':>6} {'first batch s':>14} "
          f"{'PSS MiB':>8} {'close s':>8}")
    for spec in rows:
        row = table.get(spec["name"])
        if row is None:
            print(f"{spec['name']:<22} failed")
            continue
        print(f"{spec['name']:<22} {C.spread(row, 'epoch_s', '.2f'):>20} "
              f"{row['images_per_s']:>9.0f} {row['cpu_s']:>6.1f} {row['first_s']:>14.2f} "
              f"{row['peak_pss_mib']:>8.0f} {row['close_s']:>8.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_common_args(parser)
    parser.add_argument("--rows", choices=("default", "all"), default="default",
                        help="all: also zephon with torchvision's transform in its map")
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(run_row(json.loads(args.row))), flush=True)
        return 0
    feat = C.features()
    reps = args.reps or (1 if args.quick else 3)
    root, manifest = C.data_for(args)
    rows, skipped = plan(feat, args.rows)
    rows = C.select(rows, args.only)
    specs = [{**r, "root": root, "features": feat} for r in rows]

    def note(spec, got):
        print(f"  {spec['name']}: epoch {got['epoch_s']:.2f} s, first {got['first_s']:.2f} s",
              file=sys.stderr, flush=True)

    results = C.run_rows(str(Path(__file__).resolve()), specs, reps, args.timeout, note,
                         args.malloc_threshold)
    table = {name: C.summarise(rs, KEYS) for name, rs in results.items() if rs}
    print_table(rows, table, reps, manifest["n"])
    return C.conclude("compare", args, rows, table, ratios(table), skipped,
                      {"images": manifest["n"], "reps": reps, "features": feat,
                       "runs": results})


if __name__ == "__main__":
    sys.exit(main())
