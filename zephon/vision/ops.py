"""The image ops: :class:`RandomResizedCrop` (training) and :class:`CenterCrop` (evaluation).

Each op is a picklable callable for ``Pipeline.map``: ``op(sample, ctx)`` reads the
encoded image (bytes) at ``sample[key]`` and returns a new dict, the sample with
``sample[key]`` replaced by the uint8 RGB pixels of the crop at the output size. This
module owns the geometry: torchvision's box draw, Resize + CenterCrop's window, the EXIF
orientation, the flip and the layout. Decoding only what a box needs is
:mod:`zephon.vision.decode`'s job.

Invariants:

- **Deterministic per sample.** Every random draw comes from ``ctx.rng`` (seeded by the
  sample's identity and the pipeline seed), in a fixed order: the box's draws, then the
  flip's (one ``random()``, none when ``flip=0``). The global generators of ``random``,
  NumPy and torch are never touched, so the stream is the same on every runner, worker
  count and restore.
- **torchvision's crops.** :func:`random_resized_crop_box` is torchvision's
  ``RandomResizedCrop.get_params`` (10 tries of an area fraction drawn uniformly from
  ``scale`` and a ratio drawn log-uniformly from ``ratio``, then the centre-crop
  fallback), drawn from ``ctx.rng`` instead of torch's generator; the crop is resized as
  torchvision resizes a PIL image (Pillow's antialiased filters), then flipped.
  :class:`CenterCrop` is ``Resize(resize)`` then ``CenterCrop(size)`` (zero padding when
  the image is smaller than the crop, as torchvision pads).
- **Colour as ImageFolder's loader.** Grayscale, CMYK, palette and alpha images become
  RGB as ``Image.convert("RGB")`` makes them. The EXIF orientation is ignored, as that
  loader ignores it; ``exif_transpose=True`` applies it (the box is drawn on the image as
  displayed; the decoder still reads the stored pixels and the small output is
  transposed).
- **Plain attributes.** An op's attributes are plain values (tuples, numbers, strings),
  so it pickles into process workers and its pipeline fingerprint is its class and
  settings.
- Output: a C-contiguous, writable ``np.uint8`` array, ``(h, w, 3)`` (``layout="HWC"``)
  or ``(3, h, w)`` (``"CHW"``). A corrupt or truncated image raises
  :class:`~zephon.errors.SourceError` naming ``sample["path"]`` when the sample has one.

Lifecycle: an op is built once, pickled into each worker, and called once per sample; it
keeps nothing between calls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.vision.decode import (
    FILTERS,
    ORIENTATION_TRANSPOSE,
    Probe,
    _module,
    decode_box,
    probe,
    stored_box,
)

__all__ = ["CenterCrop", "RandomResizedCrop", "random_resized_crop_box", "resized_size"]

_LAYOUTS = ("HWC", "CHW")


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator,
                            scale: tuple[float, float] = (0.08, 1.0),
                            ratio: tuple[float, float] = (3 / 4, 4 / 3)
                            ) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box for an image of ``width`` x ``height``, drawn
    from ``rng``: (left, top, right, bottom) in pixels.

    Up to 10 tries: an area of ``scale`` (uniform) times the image's and an aspect ratio
    drawn log-uniformly from ``ratio``; the first box that fits is placed uniformly (top,
    then left). When none fits: the largest centred box whose ratio is within ``ratio``.

    Args:
        width: the image's width in pixels.
        height: the image's height in pixels.
        rng: the generator to draw from (``ctx.rng`` in an op).
        scale: the range of the box's area as a fraction of the image's.
        ratio: the range of the box's width / height.

    Returns:
        (left, top, right, bottom), integers, inside the image.

    Examples:
        >>> from zephon.vision import random_resized_crop_box  # doctest: +SKIP
        >>> random_resized_crop_box(500, 375, np.random.default_rng(0))  # doctest: +SKIP
        (16, 99, 347, 349)
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, left + w, top + h
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return left, top, left + w, top + h


def resized_size(width: int, height: int, resize: int | tuple[int, int]) -> tuple[int, int]:
    """torchvision's ``Resize(resize)`` output size (width, height) for an image of
    ``width`` x ``height``: an int sets the shorter side (the longer one keeps the aspect
    ratio, rounded down); ``(h, w)`` is the size itself.

    Args:
        width: the image's width.
        height: the image's height.
        resize: the shorter side, or (height, width).

    Returns:
        (width, height) after the resize.

    Examples:
        >>> from zephon.vision import resized_size  # doctest: +SKIP
        >>> resized_size(500, 375, 256)  # doctest: +SKIP
        (341, 256)
    """
    if isinstance(resize, int):
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(resize * long / short)
        return (resize, new_long) if width <= height else (new_long, resize)
    return resize[1], resize[0]


# -- argument checks --------------------------------------------------------------------------

def _positive_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and \
        bool(value > 0)


def _check_size(op: str, name: str, value: Any) -> tuple[int, int]:
    """An int or a (h, w) sequence of positive ints -> (h, w)."""
    if _positive_int(value):
        return int(value), int(value)
    if isinstance(value, (tuple, list)) and len(value) in (1, 2) and \
            all(_positive_int(v) for v in value):
        return int(value[0]), int(value[-1])
    raise ZephonConfigError(f"{op}: {name} must be a positive int or (height, width) of "
                            f"positive ints, got {value!r}", field=f"{op}.{name}")


def _check_range(op: str, name: str, value: Any) -> tuple[float, float]:
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and \
        all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    if not ok or not 0 < value[0] <= value[1] or not math.isfinite(value[1]):
        raise ZephonConfigError(f"{op}: {name} must be (low, high) with 0 < low <= high, "
                                f"got {value!r}", field=f"{op}.{name}")
    return float(value[0]), float(value[1])


def _check_common(op: str, interpolation: Any, layout: Any, key: Any) -> tuple[str, str]:
    name = interpolation.lower() if isinstance(interpolation, str) else interpolation
    if name not in FILTERS:
        raise ZephonConfigError(f"{op}: interpolation must be one of {sorted(FILTERS)}, got "
                                f"{interpolation!r}", field=f"{op}.interpolation")
    if layout not in _LAYOUTS:
        raise ZephonConfigError(f"{op}: layout must be 'HWC' (height, width, channels) or "
                                f"'CHW', got {layout!r}", field=f"{op}.layout")
    if not isinstance(key, str) or not key:
        raise ZephonConfigError(f"{op}: key must be the name of the sample's field that holds "
                                f"the encoded image, got {key!r}", field=f"{op}.key")
    return name, layout


def _check_bool(op: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ZephonConfigError(f"{op}: {name} must be True or False, got {value!r}",
                                field=f"{op}.{name}")
    return value


# -- the shared steps ---------------------------------------------------------------------------

def _probe(op: str, key: str, sample: Any, exif: bool) -> Probe:
    """The probed image at ``sample[key]``; a config error for a sample that has none."""
    if not isinstance(sample, Mapping):
        raise ZephonConfigError(f"{op}: a sample must be a dict with the encoded image at "
                                f"[{key!r}], got {type(sample).__name__}")
    if key not in sample:
        raise ZephonConfigError(f"{op}: the sample has no {key!r} field (its fields: "
                                f"{sorted(map(str, sample))}); pass key= the field that "
                                "holds the encoded image", field=f"{op}.key")
    value = sample[key]
    if not isinstance(value, (bytes, bytearray, memoryview)) and \
            not (isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1):
        raise ZephonConfigError(f"{op}: sample[{key!r}] must be the encoded image's bytes, "
                                f"got {type(value).__name__}; is it decoded already?",
                                field=f"{op}.key")
    path = sample.get("path")
    return probe(value, path if isinstance(path, str) else None, exif=exif)


def _render(op: Any, p: Probe, box: tuple[float, float, float, float],
            size: tuple[int, int], clamp: bool, flip: bool = False):
    """The displayed ``box`` of the probed image at ``size`` (h, w), with ``op``'s filter
    and decoder settings, mirrored when ``flip``: a uint8 RGB array (H, W, 3) or a Pillow
    RGB image (see :func:`~zephon.vision.decode.decode_box`)."""
    h, w = size
    o = p.orientation
    settings = {"resample": op.interpolation, "clamp": clamp, "fast_idct": op.fast_idct,
                "fast_upsample": op.fast_upsample}
    if o == 1:
        return decode_box(p, box, (w, h), flip=flip, **settings)
    image = _module("PIL.Image")
    stored = stored_box(box, o, p.width, p.height)
    out = decode_box(p, stored, (w, h) if o < 5 else (h, w), **settings)
    if isinstance(out, np.ndarray):
        out = image.fromarray(out, "RGB")
    out = out.transpose(getattr(image.Transpose, ORIENTATION_TRANSPOSE[o]))
    return out.transpose(image.Transpose.FLIP_LEFT_RIGHT) if flip else out


def _result(sample: Mapping, key: str, img, layout: str) -> dict:
    """The sample with ``img`` (an array the op owns, or a Pillow image) at ``key`` as a
    C-contiguous, writable array in ``layout`` (NumPy's asarray of a Pillow image is
    read-only)."""
    if isinstance(img, np.ndarray) and layout == "HWC":
        arr = img  # fresh from the resampler: C-contiguous, writable, nobody else's
    else:
        arr = np.asarray(img)
        arr = np.array(arr.transpose(2, 0, 1) if layout == "CHW" else arr, order="C")
    out = dict(sample)
    out[key] = arr
    return out


def _center(extent: int, crop: int) -> tuple[int, int, int]:
    """torchvision's centre crop along one axis: (start in the image, start in the output,
    length); an image shorter than the crop is centred in zero padding."""
    if crop > extent:
        return 0, (crop - extent) // 2, extent
    return round((extent - crop) / 2.0), 0, crop


# -- the ops ------------------------------------------------------------------------------------

class RandomResizedCrop:
    """Decode, random-resized-crop and flip an encoded image, deterministic per sample.

    torchvision's ``RandomResizedCrop(size, scale, ratio)`` followed by
    ``RandomHorizontalFlip(flip)`` on the image ImageFolder's loader makes, with every
    draw from ``ctx.rng``. A JPEG is decoded at the smallest DCT scale that still covers
    the crop at the output size, and only down to the crop's last row (see
    :mod:`zephon.vision.decode`); its pixels are those of the full decode within 30 dB
    PSNR (41 to 46 dB measured with the defaults; identical at DCT scale 1 with
    ``fast_idct=False``).

    Args:
        size: the output size: an int (square) or (height, width).
        scale: the range of the crop's area as a fraction of the image's.
        ratio: the range of the crop's aspect ratio (width / height).
        flip: the probability of a horizontal flip.
        interpolation: "bilinear" (torchvision's default), "bicubic", "lanczos",
            "hamming", "box" or "nearest" (decoded at full scale).
        layout: "HWC" (height, width, 3) or "CHW" (3, height, width).
        key: the sample's field with the encoded image (bytes); the output replaces it.
        exif_transpose: apply the EXIF orientation first (torchvision's loader does not).
        fast_idct: libjpeg-turbo's fast integer inverse DCT for JPEGs (pixels about 45 dB
            PSNR from the accurate one, 4 % faster on 500x375); False decodes as Pillow
            does (at DCT scale 1 the output is then torchvision's, bit for bit).
        fast_upsample: libjpeg-turbo's fast chroma upsampling (replication instead of
            interpolation; about 37-41 dB, 3 % faster on 500x375).

    Examples:
        >>> from zephon.vision import RandomResizedCrop  # doctest: +SKIP
        >>> pipe = Pipeline(source).map(RandomResizedCrop(224))  # doctest: +SKIP
        >>> next(iter(pipe))["image"].shape  # doctest: +SKIP
        (224, 224, 3)
    """

    def __init__(self, size: int | tuple[int, int] = 224, *,
                 scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: float = 0.5,
                 interpolation: str = "bilinear", layout: str = "HWC", key: str = "image",
                 exif_transpose: bool = False, fast_idct: bool = True,
                 fast_upsample: bool = False) -> None:
        op = type(self).__name__
        self.size = _check_size(op, "size", size)
        self.scale = _check_range(op, "scale", scale)
        self.ratio = _check_range(op, "ratio", ratio)
        if isinstance(flip, bool) or not isinstance(flip, (int, float)) or \
                not 0.0 <= flip <= 1.0:
            raise ZephonConfigError(f"{op}: flip is a probability in [0, 1], got {flip!r}",
                                    field=f"{op}.flip")
        self.flip = float(flip)
        self.interpolation, self.layout = _check_common(op, interpolation, layout, key)
        self.key = key
        self.exif_transpose = _check_bool(op, "exif_transpose", exif_transpose)
        self.fast_idct = _check_bool(op, "fast_idct", fast_idct)
        self.fast_upsample = _check_bool(op, "fast_upsample", fast_upsample)

    def __call__(self, sample: Mapping, ctx: Any) -> dict:
        """The sample with ``sample[key]`` decoded, cropped, resized and maybe flipped.

        Args:
            sample: a dict with the encoded image at ``key`` (and its ``path``, if any).
            ctx: the op context; its ``rng`` draws the box and the flip.

        Returns:
            A new dict: the sample with the pixels at ``key``.

        Examples:
            >>> op = RandomResizedCrop(224)  # doctest: +SKIP
            >>> op({"image": jpeg_bytes}, ctx)["image"].shape  # doctest: +SKIP
            (224, 224, 3)
        """
        p = _probe(type(self).__name__, self.key, sample, self.exif_transpose)
        rng = ctx.rng
        width, height = p.display_size
        box = random_resized_crop_box(width, height, rng, self.scale, self.ratio)
        flip = self.flip > 0 and rng.random() < self.flip
        img = _render(self, p, box, self.size, clamp=True, flip=flip)
        return _result(sample, self.key, img, self.layout)

    def __repr__(self) -> str:
        return (f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, "
                f"flip={self.flip}, interpolation={self.interpolation!r}, "
                f"layout={self.layout!r}, key={self.key!r})")


class CenterCrop:
    """Decode, resize and centre-crop an encoded image: the usual evaluation transform.

    torchvision's ``Resize(resize)`` (the shorter side to ``resize``, or exactly
    ``(h, w)``) then ``CenterCrop(size)``, on the image ImageFolder's loader makes; the
    resize and the crop are one resample of the crop's window, decoded at the smallest
    DCT scale that still covers the resized size, down to the window's last row.
    ``resize=None`` crops ``size`` from the centre of the full-resolution image (no
    resampling; torchvision's ``CenterCrop(size)`` alone). A dimension shorter than the
    crop is centred in zero padding, as torchvision pads.

    Args:
        size: the output size: an int (square) or (height, width).
        resize: the shorter side before the crop (an int, or a one-element sequence as in
            torchvision), an exact (height, width), or None.
        interpolation: the resize's filter: "bilinear" (torchvision's default),
            "bicubic", "lanczos", "hamming", "box" or "nearest".
        layout: "HWC" (height, width, 3) or "CHW" (3, height, width).
        key: the sample's field with the encoded image (bytes); the output replaces it.
        exif_transpose: apply the EXIF orientation first (torchvision's loader does not).
        fast_idct: libjpeg-turbo's fast integer inverse DCT for JPEGs (about 45 dB PSNR
            from the accurate one); False decodes as Pillow does.
        fast_upsample: libjpeg-turbo's fast chroma upsampling (about 37-41 dB).

    Examples:
        >>> from zephon.vision import CenterCrop  # doctest: +SKIP
        >>> pipe = Pipeline(source, shuffle=False).map(CenterCrop(224))  # doctest: +SKIP
        >>> next(iter(pipe))["image"].shape  # doctest: +SKIP
        (224, 224, 3)
    """

    def __init__(self, size: int | tuple[int, int] = 224, *,
                 resize: int | tuple[int, int] | None = 256, interpolation: str = "bilinear",
                 layout: str = "HWC", key: str = "image", exif_transpose: bool = False,
                 fast_idct: bool = True, fast_upsample: bool = False) -> None:
        op = type(self).__name__
        self.size = _check_size(op, "size", size)
        self.resize: int | tuple[int, int] | None = None
        if isinstance(resize, (int, np.integer)) and _positive_int(resize):
            self.resize = int(resize)
        elif isinstance(resize, (tuple, list)) and len(resize) == 1 and \
                _positive_int(resize[0]):  # torchvision's Resize([n]): the shorter side too
            self.resize = int(resize[0])
        elif resize is not None:
            self.resize = _check_size(op, "resize", resize)
        self.interpolation, self.layout = _check_common(op, interpolation, layout, key)
        self.key = key
        self.exif_transpose = _check_bool(op, "exif_transpose", exif_transpose)
        self.fast_idct = _check_bool(op, "fast_idct", fast_idct)
        self.fast_upsample = _check_bool(op, "fast_upsample", fast_upsample)

    def __call__(self, sample: Mapping, ctx: Any = None) -> dict:
        """The sample with ``sample[key]`` decoded, resized and centre-cropped.

        Args:
            sample: a dict with the encoded image at ``key`` (and its ``path``, if any).
            ctx: the op context (unused: nothing is random).

        Returns:
            A new dict: the sample with the pixels at ``key``.

        Examples:
            >>> CenterCrop(224)({"image": jpeg_bytes})["image"].shape  # doctest: +SKIP
            (224, 224, 3)
        """
        p = _probe(type(self).__name__, self.key, sample, self.exif_transpose)
        width, height = p.display_size
        ch, cw = self.size
        rw, rh = (width, height) if self.resize is None else \
            resized_size(width, height, self.resize)
        sx, dx, lx = _center(rw, cw)
        sy, dy, ly = _center(rh, ch)
        fx, fy = width / rw, height / rh
        box = (sx * fx, sy * fy, (sx + lx) * fx, (sy + ly) * fy)
        img = _render(self, p, box, (ly, lx), clamp=self.resize is None)
        if (lx, ly) != (cw, ch):
            canvas = np.zeros((ch, cw, 3), np.uint8)
            canvas[dy:dy + ly, dx:dx + lx] = np.asarray(img)
            img = canvas
        return _result(sample, self.key, img, self.layout)

    def __repr__(self) -> str:
        return (f"CenterCrop(size={self.size}, resize={self.resize}, "
                f"interpolation={self.interpolation!r}, layout={self.layout!r}, "
                f"key={self.key!r})")
