"""zephon.vision's decode + crop ops against the full decode they replace (one core).

    python -m pytest bench/bench_vision_decode.py -p no:cacheprovider [--enforce-ratios]
    python bench/bench_vision_decode.py [--rounds 9] [--images 60]    # interleaved, + PSNR

The images: 60 JPEGs of 1600x1200 and 60 of 500x375 (``tests/_images.py``: a smooth
colour field, shapes, texture at several scales and noise; quality 90, 4:2:0; about
650 and 68 KB, 0.34 bytes a pixel), written once under ``$ZEPHON_BENCH_CACHE`` (default
``~/.cache/zephon``) in ``vision-decode-v1/``.

The comparisons (baseline time / zephon time; both sides draw the same boxes from the
same per-image ``OpContext`` generator, inside the timing):

- ``rrc_1600x1200``, ``rrc_500x375``: ``RandomResizedCrop(224)`` (defaults: DCT scaling,
  row limit, fast inverse DCT, flip 0.5) against torchvision's transform on ImageFolder's
  image, written out: ``Image.open(...).convert("RGB").crop(box).resize((224, 224),
  BILINEAR)`` plus the flip (targets 2.0 and 1.25);
- ``center_1600x1200``, ``center_500x375``: ``CenterCrop(224)`` against ``resize`` to
  the shorter side 256, then the centre crop (no target).

Times are the CPU time of the measuring thread (``time.thread_time``): on a machine
shared with other work, the wall clock also counts the time this thread waits for a
core. The allocator moves the ratios: glibc serves a fresh multi-MiB buffer (the full
decode's 7.7 MB image) with ``mmap`` and its pages fault in on first touch, until frees
of that size raise its mmap threshold. For the steady state of a long run (no page
faults, the lower ratios) run with ``MALLOC_MMAP_THRESHOLD_=67108864
MALLOC_TRIM_THRESHOLD_=268435456``. The pytest-benchmark suite times whole passes over the 60 images (rounds of one
pass; median); the script mode alternates zephon and the baseline image by image, keeps
each image's fastest of ``--rounds`` runs and prints per-image means, the ratios, the
PSNR of zephon's pixels against the baseline's (same boxes) and the DCT scales used.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _images import write_jpegs

from zephon.pipeline.ops.base import OpContext
from zephon.vision import CenterCrop, RandomResizedCrop, random_resized_crop_box

SIZES = {"1600x1200": (1600, 1200), "500x375": (500, 375)}
IMAGES, SEED, OUT = 60, 17, 224
TARGETS = {"rrc_1600x1200": 2.0, "rrc_500x375": 1.25}
DATA_VERSION = 1  # part of the cache directory's name: bump it when the images change


def image_set(name: str, n: int = IMAGES) -> list[bytes]:
    """The ``n`` JPEGs of one size, written once into the cache directory."""
    root = Path(os.environ.get("ZEPHON_BENCH_CACHE", Path.home() / ".cache" / "zephon"))
    folder = root / f"vision-decode-v{DATA_VERSION}" / f"{name}-{n}"
    paths = sorted(folder.glob("*.jpg")) if folder.is_dir() else []
    if len(paths) != n:
        paths = [Path(p) for p in write_jpegs(folder, n, SIZES[name], seed=SEED)]
    return [p.read_bytes() for p in paths]


def ctx(i: int) -> OpContext:
    return OpContext(("bench", i, 0), SEED)


# -- the baselines: torchvision's transforms on ImageFolder's PIL image, written out ----------

def reference_rrc(data: bytes, context: OpContext) -> np.ndarray:
    from PIL import Image

    rng = context.rng
    img = Image.open(io.BytesIO(data))
    box = random_resized_crop_box(img.width, img.height, rng)
    flip = rng.random() < 0.5
    img = img.convert("RGB").crop(box).resize((OUT, OUT), Image.Resampling.BILINEAR)
    if flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(img)


def reference_center(data: bytes, context: OpContext) -> np.ndarray:
    from PIL import Image

    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    short, long = min(w, h), max(w, h)
    new_long = int(256 * long / short)
    rw, rh = (256, new_long) if w <= h else (new_long, 256)
    img = img.resize((rw, rh), Image.Resampling.BILINEAR)
    top, left = round((rh - OUT) / 2.0), round((rw - OUT) / 2.0)
    return np.asarray(img.crop((left, top, left + OUT, top + OUT)))


RRC = RandomResizedCrop(OUT)
CENTER = CenterCrop(OUT)


def zephon_rrc(data: bytes, context: OpContext) -> np.ndarray:
    return RRC({"image": data}, context)["image"]


def zephon_center(data: bytes, context: OpContext) -> np.ndarray:
    return CENTER({"image": data}, context)["image"]


PAIRS = {"rrc": (zephon_rrc, reference_rrc), "center": (zephon_center, reference_center)}


def one_pass(fn, images: list[bytes]) -> None:
    for i, data in enumerate(images):
        fn(data, ctx(i))


# -- the pytest-benchmark suite --------------------------------------------------------------

try:
    import pytest
except ImportError:  # the script mode needs no pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:
    pytest.importorskip("PIL")
    pytest.importorskip("simplejpeg")

    @pytest.fixture(scope="module", params=sorted(SIZES))
    def images(request):
        return request.param, image_set(request.param)

    @pytest.mark.parametrize("role", ["subject", "baseline"])
    @pytest.mark.parametrize("kind", sorted(PAIRS))
    @pytest.mark.benchmark(timer=time.thread_time, min_rounds=5, warmup=True)
    def test_vision_decode(benchmark, record_ratio, images, kind, role):
        name, data = images
        fn = PAIRS[kind][0 if role == "subject" else 1]
        benchmark.extra_info["images"] = len(data)
        benchmark.pedantic(one_pass, args=(fn, data), rounds=5, warmup_rounds=1)
        record_ratio(f"{kind}_{name}", role, TARGETS.get(f"{kind}_{name}"))


# -- the script mode: interleaved, per-image minima, PSNR -------------------------------------

def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def measure(kind: str, images: list[bytes], rounds: int) -> dict:
    ours, base = PAIRS[kind]
    best = np.full((2, len(images)), np.inf)
    for _ in range(rounds):
        for i, data in enumerate(images):
            for k, fn in enumerate((ours, base)):
                t0 = time.thread_time_ns()
                fn(data, ctx(i))
                best[k, i] = min(best[k, i], time.thread_time_ns() - t0)
    scores = [psnr(ours(d, ctx(i)), base(d, ctx(i))) for i, d in enumerate(images)]
    ms_ours, ms_base = best.mean(axis=1) / 1e6
    return {"zephon_ms": ms_ours, "baseline_ms": ms_base, "ratio": ms_base / ms_ours,
            "psnr_min": min(scores), "psnr_median": float(np.median(scores))}


def dct_scales(images: list[bytes]) -> dict[int, int]:
    """How many of the images' RRC boxes decode at each DCT scale."""
    from zephon.vision import decode

    counts: dict[int, int] = {}
    for i, data in enumerate(images):
        p = decode.probe(data)
        box = random_resized_crop_box(p.width, p.height, ctx(i).rng)
        s = decode._dct_scale(p, box[2] - box[0], box[3] - box[1], (OUT, OUT), 1.0)
        counts[s] = counts.get(s, 0) + 1
    return dict(sorted(counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--images", type=int, default=IMAGES)
    args = parser.parse_args()
    pairs = []
    for name in SIZES:
        images = image_set(name, args.images)
        print(f"{name}: {len(images)} JPEGs, {np.mean([len(d) for d in images]) / 1e3:.0f} KB "
              f"mean; RRC DCT scales {dct_scales(images)}")
        for kind in PAIRS:
            r = measure(kind, images, args.rounds)
            label = f"{kind}_{name}"
            target = TARGETS.get(label)
            print(f"  {label:18s} zephon {r['zephon_ms']:7.3f} ms  baseline "
                  f"{r['baseline_ms']:7.3f} ms  ratio {r['ratio']:5.2f}"
                  f"{f' (target {target})' if target else ''}  PSNR min "
                  f"{r['psnr_min']:.1f} median {r['psnr_median']:.1f} dB")
            pairs.append(f"{label}={r['ratio']:.3f}")
    print(" ".join(pairs))


if __name__ == "__main__":
    main()
