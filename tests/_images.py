"""Synthetic images with natural-ish content for the image tests and benchmarks.

Flat colour compresses to nothing and decodes unrealistically fast, so every image
here is a smooth low-frequency colour field (a few random control points upscaled
bicubically), a handful of filled shapes with soft edges, and mild per-pixel noise:
JPEG files of it at quality 90 are about the size of photographs of the same
dimensions. Everything is a pure function of its arguments (seeded NumPy generators,
no global state), so two processes writing the same set get the same bytes.

Sizes are ``(width, height)``, as Pillow writes them.

    write_jpegs(dir, n, size, seed)          # n JPEG files -> their paths
    jpeg_bytes(image, quality=90, ...)       # one encoded image
    make_image(size, rng, mode="RGB")        # one PIL image
"""

from __future__ import annotations

import io
import os

import numpy as np


def make_image(size: tuple[int, int], rng: np.random.Generator, mode: str = "RGB"):
    """A PIL image of ``size`` (width, height): smooth colour field + shapes + noise,
    converted to ``mode`` ("RGB", "L", "CMYK", ...)."""
    from PIL import Image, ImageDraw, ImageFilter

    w, h = size
    grid = rng.integers(0, 256, size=(4 + int(rng.integers(0, 4)), 5 + int(rng.integers(0, 4)), 3),
                        dtype=np.uint8)
    img = Image.fromarray(grid, "RGB").resize((w, h), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(4, 10))):
        x0, x1 = sorted(rng.integers(-w // 4, w + w // 4, size=2).tolist())
        y0, y1 = sorted(rng.integers(-h // 4, h + h // 4, size=2).tolist())
        color = tuple(int(c) for c in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            draw.ellipse((x0, y0, x1 + 1, y1 + 1), fill=color)
        else:
            draw.rectangle((x0, y0, x1, y1), fill=color)
    img = img.filter(ImageFilter.GaussianBlur(radius=max(1.0, min(w, h) / 400)))
    arr = np.asarray(img, dtype=np.float32) + _texture(w, h, rng)
    arr += rng.normal(0.0, 6.0, size=arr.shape).astype(np.float32)
    img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")
    return img if mode == "RGB" else img.convert(mode)


def _texture(w: int, h: int, rng: np.random.Generator) -> np.ndarray:
    """Texture at several scales (cells of 3 to 48 pixels, larger cells stronger, as in
    photographs), float32 (h, w, 3) around 0."""
    from PIL import Image

    out = np.zeros((h, w, 3), dtype=np.float32)
    for cell, amp in ((2, 14.0), (5, 14.0), (12, 12.0), (40, 12.0)):
        gh, gw = max(2, h // cell), max(2, w // cell)
        grid = rng.integers(0, 256, size=(gh, gw, 3), dtype=np.uint8)
        up = Image.fromarray(grid, "RGB").resize((w, h), Image.Resampling.BILINEAR)
        out += (np.asarray(up, dtype=np.float32) - 127.5) * (amp / 74.0)
    return out


def jpeg_bytes(image, quality: int = 90, progressive: bool = False,
               orientation: int | None = None, subsampling: int = 2) -> bytes:
    """``image`` encoded as JPEG (4:2:0 by default); ``orientation``: an EXIF
    Orientation tag (1-8) written into the file (the pixels are stored as given)."""
    out = io.BytesIO()
    kwargs: dict = {"quality": quality, "progressive": progressive}
    if image.mode != "CMYK":
        kwargs["subsampling"] = subsampling
    if orientation is not None:
        from PIL import Image

        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif.tobytes()
    image.save(out, "JPEG", **kwargs)
    return out.getvalue()


def image_bytes(image, fmt: str) -> bytes:
    """``image`` encoded in any format Pillow writes ("PNG", "WEBP", ...)."""
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def write_jpegs(directory, n: int, size: tuple[int, int], seed: int, quality: int = 90,
                progressive: bool = False) -> list[str]:
    """``n`` JPEG files ``img-00000.jpg``, ... in ``directory`` (made if missing), each
    ``size`` (width, height) RGB, seeded by ``(seed, i)``; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        path = os.path.join(str(directory), f"img-{i:05d}.jpg")
        with open(path, "wb") as f:
            f.write(jpeg_bytes(make_image(size, rng), quality, progressive))
        paths.append(path)
    return paths
