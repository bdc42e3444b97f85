"""The vision benchmarks' data: a deterministic ImageFolder of natural-ish JPEGs.

    python bench/vision/make_data.py DIR                # 4,000 images (the default)
    python bench/vision/make_data.py DIR --n 256        # a smaller set (the --quick runs)

What it owns: the layout and content of the benchmark images, and their manifest.
``DIR/class_NN/IIIII.jpg`` (10 classes, image ``i`` in class ``i % 10``: torchvision's
``ImageFolder`` and ``zephon.sources.image_folder`` read the tree as it is) and
``DIR/manifest.json`` (``version``, ``n``, ``seed``, ``classes`` and one entry per file:
``path`` relative to DIR, ``label``, ``width``, ``height``) beside them; the manifest
lies outside every class directory, so it is never taken for an image.

Content: a linear gradient between two random colours at a random angle, a smooth
random field (a coarse grid upsampled bicubically), 3 to 8 filled shapes (ellipses,
rectangles, polygons) blended in, and Gaussian grain (sigma 6), saved by Pillow at
quality 90 (baseline, 4:2:0). Sizes: 85 % 500x375 (a quarter of them portrait,
375x500), 15 % 1600x1200 (a quarter portrait, 1200x1600).

Invariants: image ``i`` is a pure function of ``(seed, i)`` (its own generator,
``numpy.random.default_rng([seed, i])``), so the same arguments give the same bytes
on every run and machine with the same Pillow/libjpeg; the directory appears
complete or not at all (built in a sibling temporary directory and renamed into
place), and an existing DIR whose manifest matches the arguments is reused as it is.
An existing DIR that does not match is an error, never overwritten.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VERSION = 1  # bump when the generator changes: the manifests then no longer match
CLASSES = 10
QUALITY = 90
SMALL, LARGE = (500, 375), (1600, 1200)
LARGE_SHARE, PORTRAIT_SHARE = 0.15, 0.25


def image_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height) of the next image: 85 % 500x375, 15 % 1600x1200, a quarter portrait."""
    w, h = LARGE if rng.random() < LARGE_SHARE else SMALL
    return (h, w) if rng.random() < PORTRAIT_SHARE else (w, h)


def render(seed: int, i: int) -> tuple[bytes, int, int]:
    """Image ``i``'s JPEG bytes, width and height (a pure function of ``(seed, i)``)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([seed, i])
    width, height = image_size(rng)
    # a gradient between two colours along a random direction
    angle = rng.uniform(0, 2 * np.pi)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    t = xs * np.cos(angle) / width + ys * np.sin(angle) / height
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    img = c0 + t[..., None] * (c1 - c0)
    # a smooth random field (clouds, foliage, sky at a distance)
    coarse = rng.integers(0, 256, (int(rng.integers(3, 9)), int(rng.integers(4, 12)), 3),
                          dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((width, height),
                                                      Image.Resampling.BICUBIC), np.float32)
    img = 0.55 * img + 0.45 * field
    # shapes with edges: what makes the high frequencies a photo has
    canvas = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(canvas)
    for _ in range(int(rng.integers(3, 9))):
        _shape(draw, rng, width, height)
    img = np.asarray(canvas, np.float32)
    img += rng.normal(0.0, 6.0, img.shape).astype(np.float32)  # grain
    out = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    out.save(buf, format="JPEG", quality=QUALITY)
    return buf.getvalue(), width, height


def _shape(draw, rng: np.random.Generator, width: int, height: int) -> None:
    colour = tuple(int(c) for c in rng.integers(0, 256, 3))
    x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
    w = int(rng.integers(width // 10, width // 2))
    h = int(rng.integers(height // 10, height // 2))
    kind = int(rng.integers(0, 3))
    if kind == 0:
        draw.ellipse((x0, y0, x0 + w, y0 + h), fill=colour)
    elif kind == 1:
        draw.rectangle((x0, y0, x0 + w, y0 + h), fill=colour)
    else:
        points = [(x0 + int(rng.integers(-w, w)), y0 + int(rng.integers(-h, h)))
                  for _ in range(int(rng.integers(3, 7)))]
        draw.polygon(points, fill=colour)


def _manifest(n: int, seed: int) -> dict:
    return {"version": VERSION, "n": n, "seed": seed,
            "classes": [f"class_{c:02d}" for c in range(CLASSES)], "files": []}


def _matches(manifest: dict, n: int, seed: int) -> bool:
    return (manifest.get("version"), manifest.get("n"), manifest.get("seed")) == \
        (VERSION, n, seed)


def _build(tmp: Path, n: int, seed: int) -> None:
    manifest = _manifest(n, seed)
    for name in manifest["classes"]:
        (tmp / name).mkdir()
    for i in range(n):
        data, width, height = render(seed, i)
        label = i % CLASSES
        rel = f"{manifest['classes'][label]}/{i:05d}.jpg"
        (tmp / rel).write_bytes(data)
        manifest["files"].append({"path": rel, "label": label, "width": width,
                                  "height": height})
    (tmp / "manifest.json").write_text(json.dumps(manifest))


def ensure(root: str | os.PathLike, n: int = 4000, seed: int = 0) -> dict:
    """The manifest of the ImageFolder at ``root`` with ``n`` images, made if absent.

    Raises:
        FileExistsError: ``root`` exists and is not this data set (another ``n``, seed
            or generator version, or no manifest): remove it or choose another DIR.
    """
    root = Path(root)
    manifest_path = root / "manifest.json"
    if root.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError):
            manifest = {}
        if _matches(manifest, n, seed):
            return manifest
        raise FileExistsError(
            f"{root} exists but is not the benchmark data set (n={n}, seed={seed}, "
            f"version={VERSION}): remove it or pass another directory")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    try:
        _build(tmp, n, seed)
        os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return json.loads(manifest_path.read_text())


def default_root(n: int, seed: int = 0) -> Path:
    """Where the benchmark scripts keep a data set of ``n`` images unless told otherwise."""
    base = os.environ.get("ZEPHON_VISION_DATA", os.path.expanduser("~/.cache/zephon/vision"))
    return Path(base) / f"images-{n}-s{seed}-v{VERSION}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="the ImageFolder root to create (or reuse)")
    parser.add_argument("--n", type=int, default=4000, help="images (4000)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (0)")
    args = parser.parse_args(argv)
    t = time.perf_counter()
    manifest = ensure(args.dir, args.n, args.seed)
    sizes: dict[str, int] = {}
    for f in manifest["files"]:
        key = f"{f['width']}x{f['height']}"
        sizes[key] = sizes.get(key, 0) + 1
    total = sum(os.path.getsize(os.path.join(args.dir, f["path"])) for f in manifest["files"])
    print(f"{args.dir}: {manifest['n']} JPEGs in {len(manifest['classes'])} classes, "
          f"{total / 2**20:.0f} MiB, sizes {dict(sorted(sizes.items()))} "
          f"({time.perf_counter() - t:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
