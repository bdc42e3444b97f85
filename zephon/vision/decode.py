"""Encoded image bytes to pixels, decoding no more of a JPEG than a crop needs.

This module owns the decoding half of :mod:`zephon.vision`: reading an encoded image's
header without decoding it (:func:`probe`), decoding the part of it that a crop box needs
and resizing that part to the output size (:func:`decode_box`), and the plain full decode
(:func:`decode_image`). The ops of :mod:`zephon.vision.ops` draw the boxes; nothing here
draws anything or keeps state between calls.

How a JPEG is decoded with less work (:func:`decode_box`):

- **DCT scaling.** libjpeg-turbo decodes at 1/2, 1/4 or 1/8 of the size in the DCT domain:
  the inverse DCT, the chroma upsampling and the colour conversion shrink with the output;
  the entropy (Huffman) decoding does not. The scale is the largest ``s`` in (8, 4, 2, 1)
  with ``box_w / s >= out_w`` and ``box_h / s >= out_h``: the box still covers the output
  at full resolution, and the resize that follows only reduces (scale 1 for ``nearest``,
  which has no kernel to antialias with, and for formats other than JPEG).
- **Row limit.** A JPEG's entropy data is in raster order of MCU rows (in every scan of a
  progressive file too), so the rows below the box need not be decoded at all. The
  decoder gets a copy of the bytes whose frame header (SOF0/1/2) says the image is ``H'``
  rows tall: it decodes exactly the first ``H'`` rows (whole MCU rows of entropy data)
  and skips the rest of each scan as extraneous bytes before the next marker. ``H'``
  reaches past the last row the box needs by the rows the chroma upsampling reads below
  a row (the vertical sampling factor, times the DCT scale), so every row used is
  bit-identical to a full decode's (tested for baseline, progressive, restart markers,
  4:2:0, 4:2:2, 4:4:4 and grayscale). The rows above the box and the columns beside it
  cannot be skipped: the entropy data is one sequential stream.
- **Region decode.** Where zephon was built with libjpeg's headers, the optional kernel
  ``zephon._kernels.jpeg_region`` (libjpeg-turbo's partial-decode API:
  ``jpeg_skip_scanlines`` and ``jpeg_crop_scanline``) decodes a YCbCr or grayscale JPEG's
  box alone: the rows above it are entropy-decoded but get no inverse DCT, upsampling or
  colour conversion, the columns beside it get none either, and nothing below it is read
  (with the row limit, not even in a progressive file's later scans). The kernel is asked
  for :data:`REGION_EDGE` more columns on each side than the box needs: libjpeg upsamples
  the chroma of a cropped row's first and last columns from themselves, where a full
  decode reads their neighbours; two columns further in the pixels are a full decode's,
  bit for bit (tested for baseline, progressive, restart markers, 4:2:0, 4:2:2, 4:4:4
  and grayscale, at every scale, with each IDCT and upsampling setting). The kernel
  builds only against libjpeg-turbo 2.1.3 or later (older releases crash or write past
  a cropped row in exactly this API) and declines sampling factors above 2 (4:1:1 and
  the like, whose cropped columns libjpeg-turbo before 3.0 misplaces when scaled); the
  warning libjpeg gives for the scans' data past a cut frame height is expected there
  and not counted. Measured on the bench's images with torchvision's crop boxes, CPU
  time: 1.08x the whole-row decode for baseline files, 1.02x for progressive ones
  (their every scan is still entropy-decoded down to the box). Without the kernel the
  rows above and the columns beside the box are decoded in full.
- **Region only.** Only the box's rows and columns of the decoded image (with the reach
  of the resampling kernel when ``clamp=False``) are resized to the output size, in one
  step with the box's fractional edges: by the compiled resampler
  (``zephon._kernels.resample``, specified by :mod:`zephon.kernels.resample_ref`:
  Pillow 12's ``Image.resize(size, filter, box=...)`` bit for bit) straight from the
  decoded array, mirrored in the same pass when the op flips; by Pillow where the
  kernels are not built, for ``nearest``, and for what Pillow decoded. The compiled
  resampler does a quarter less arithmetic than Pillow (whose RGB is 4 bytes a pixel)
  and copies nothing in or out: measured here 1.2-1.9x Pillow's time per 224x224
  output.

Decoder choice (measured on one core, CPU time, best of 9 per image, over the 60 + 60
JPEGs of ``bench/bench_vision_decode.py``): simplejpeg (libjpeg-turbo's TurboJPEG API)
decodes YCbCr and grayscale JPEGs; Pillow decodes every other JPEG (CMYK, YCCK,
RGB-coded) and every other format. Both bundle libjpeg-turbo, both do DCT scaling, and
with the row limit both decode only the rows needed; with the accurate settings their
pixels are identical at every scale (tested). simplejpeg does the same work faster: it
reads scanlines in blocks straight into a NumPy array (into a reused buffer, below),
where Pillow's decoder reads one scanline per libjpeg call and unpacks each into its own
4-byte pixels (a full decode: 0.74 against 0.81-1.0 ms at 500x375, 7.2 against 8.6 ms
at 1600x1200). PyTurboJPEG is not used: it needs a system libturbojpeg. ``fast_idct``
(the ops' default) is libjpeg-turbo's fast integer inverse DCT: 2-3 % faster, pixels
about 45 dB PSNR from the accurate ones (TensorFlow's ``decode_jpeg`` default too);
``fast_upsample`` (off by default) replicates chroma instead of interpolating it: 3-5 %
faster for 37-41 dB. Pillow's one knob for these (``draft`` mode) sets both, so its path
stays accurate.

Memory: a decode writes its output, and the row-limited copy of the input, into buffers
its thread keeps between decodes (:func:`_scratch`, at most :data:`SCRATCH_MAX` bytes
each). Fresh allocations of that size come from ``mmap`` and fault their pages in on
first touch, which cost a fifth of the op's time on 500x375 JPEGs.

Invariants:

- The pixels depend only on the bytes, the box, the output size and the settings; never
  on the runner, the thread or earlier calls.
- With ``fast_idct=False`` (and ``fast_upsample=False``) a JPEG decoded at scale 1 gives
  exactly the pixels of Pillow's full decode, whatever the row limit (tested), and the
  box resized as Pillow 12 resizes it (Pillow 13 orders its two passes per call: one
  off in places, see :mod:`zephon.kernels.resample_ref`).
- A file the full decode rejects as truncated is rejected: a JPEG with no end-of-image
  marker after its first scan is decoded by Pillow in full, so whether it fails is decided
  as torchvision's loader decides it; what simplejpeg rejects is decoded again by Pillow
  (same verdict as the reference). A corruption confined to the rows below the box of an
  otherwise complete file goes unseen: those bytes are never decoded.
- Every decode failure is a :class:`~zephon.errors.SourceError` naming the file (or the
  byte count when there is no path) and the decoder's reason.

Lifecycle: functions without state but the per-thread buffers (each lives as long as
its thread). Pillow is imported on the first image and simplejpeg on the first JPEG (the
``vision`` extra); a missing one is an ImportError naming the extra.
"""

from __future__ import annotations

import importlib
import io
import math
import struct
import threading
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from zephon.errors import SourceError

__all__ = ["EXTRA_HINT", "FILTERS", "JpegLayout", "Probe", "decode_box", "decode_image",
           "jpeg_layout", "probe", "region_kernel", "resize_kernel", "stored_box"]

EXTRA_HINT = 'python -m pip install -e ".[vision]" (in the zephon checkout)'
#: resampling filters by name (torchvision's InterpolationMode values): Pillow's name and
#: the reach of its kernel in input pixels at scale 1 (0: nearest, no kernel)
FILTERS = {"nearest": ("NEAREST", 0.0), "box": ("BOX", 0.5), "bilinear": ("BILINEAR", 1.0),
           "hamming": ("HAMMING", 1.0), "bicubic": ("BICUBIC", 2.0),
           "lanczos": ("LANCZOS", 3.0)}
DCT_SCALES = (8, 4, 2, 1)
#: EXIF orientation -> the Pillow transpose that displays the stored pixels
ORIENTATION_TRANSPOSE = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM",
                         5: "TRANSPOSE", 6: "ROTATE_270", 7: "TRANSVERSE", 8: "ROTATE_90"}
_FAST_COLORSPACES = {"YCbCr": "RGB", "Gray": "GRAY"}  # simplejpeg's names -> its output
_SOF_LIMITABLE = (0xC0, 0xC1, 0xC2)  # Huffman baseline, extended sequential, progressive
_NOT_SOF = (0xC4, 0xC8, 0xCC)  # DHT, JPG extension, DAC share the 0xC_ range
_STANDALONE = frozenset([0x01, 0xD8, *range(0xD0, 0xD8)])  # markers without a length
_EXIF_ORIENTATION = 0x0112
_MODULES: dict[str, ModuleType] = {}
#: the largest buffer (bytes) a decoding thread keeps between decodes (one for the input,
#: one for the output)
SCRATCH_MAX = 16 << 20
#: columns decoded past each side of a box by the region kernel (see the module docstring)
REGION_EDGE = 2
#: columns crop_scanline may add on the left and the right (iMCU edges: at most 32 each)
_REGION_SLACK = 64
_LOCAL = threading.local()
#: the region kernel: False before the first lookup, None where it was not built
_REGION: dict[str, Any] = {"kernel": False}
#: the compiled resampler: False before the first lookup, None where it was not built
_RESIZE: dict[str, Any] = {"kernel": False}


def resize_kernel() -> Any:
    """The compiled resampler (``zephon._kernels.resample.resample``: Pillow's resize of a
    uint8 array, specified by :mod:`zephon.kernels.resample_ref`), or None where zephon's
    kernels were not built (Pillow then resizes)."""
    kernel = _RESIZE["kernel"]
    if kernel is False:
        try:
            from zephon._kernels.resample import resample
        except ImportError:
            kernel = None
        else:
            kernel = resample
        _RESIZE["kernel"] = kernel
    return kernel


def region_kernel() -> Any:
    """The region decoder (``zephon._kernels.jpeg_region.decode_region``), or None where
    zephon was built without libjpeg's headers."""
    kernel = _REGION["kernel"]
    if kernel is False:
        try:
            from zephon._kernels.jpeg_region import decode_region
        except ImportError:
            kernel = None
        else:
            kernel = decode_region
        _REGION["kernel"] = kernel
    return kernel


def _module(name: str) -> ModuleType:
    """``PIL.Image`` or ``simplejpeg``, imported once; an ImportError naming the extra."""
    mod = _MODULES.get(name)
    if mod is None:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            dist = "Pillow" if name.startswith("PIL") else name
            raise ImportError(f"zephon.vision needs {dist} to decode images: "
                              f"{EXTRA_HINT}") from None
        _MODULES[name] = mod
    return mod


# -- the JPEG layout: read from the markers, never decoded -----------------------------------

class JpegLayout(NamedTuple):
    """Where a JPEG's frame header is and what it says (:func:`jpeg_layout`)."""

    height_at: int  # offset of the frame header's 2-byte image height
    width: int
    height: int
    context_rows: int  # rows past a row the chroma upsampling reads: the largest vertical
    # sampling factor (1 for one component)
    components: int
    exif: tuple[int, int] | None  # (offset, length) of the Exif TIFF data, if any
    complete: bool  # an end-of-image marker follows the first scan
    max_scale: int = 8  # the largest DCT scale that keeps the chroma: 2 when a component
    # is sampled 4x apart from another (4:1:1, 1x4), whose scaled chroma loses too much


def _segments(data: bytes):
    """``(marker, offset, length)`` of each marker segment before the first scan (SOS
    included); stops at anything that is not a well-formed segment."""
    i, n = 2, len(data)
    while i + 4 <= n and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:  # a fill byte
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        length = (data[i + 2] << 8) | data[i + 3]
        if length < 2 or i + 2 + length > n:
            return
        yield marker, i, length
        if marker == 0xDA:
            return
        i += 2 + length


def jpeg_layout(data: bytes) -> JpegLayout | None:
    """The layout of an 8-bit Huffman-coded JPEG (baseline, extended or progressive) whose
    rows can be limited; None for anything else (not a JPEG, lossless, arithmetic-coded,
    12-bit, a height defined later by a DNL marker, or malformed markers): such bytes go
    to Pillow whole."""
    if len(data) < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    sof, exif = None, None
    for marker, at, length in _segments(data):
        if marker == 0xDA:
            return _layout(data, sof, exif, at) if sof is not None else None
        if 0xC0 <= marker <= 0xCF and marker not in _NOT_SOF:
            if marker not in _SOF_LIMITABLE:
                return None
            sof = (at, length)
        elif marker == 0xE1 and exif is None and data[at + 4:at + 10] == b"Exif\0\0":
            exif = (at + 10, length - 8)
    return None


def _layout(data: bytes, sof: tuple[int, int], exif: tuple[int, int] | None,
            sos: int) -> JpegLayout | None:
    at, length = sof
    if length < 8:
        return None
    precision, height, width, comps = struct.unpack_from(">BHHB", data, at + 4)
    if precision != 8 or height == 0 or width == 0 or comps not in (1, 3, 4) or \
            length != 8 + 3 * comps:
        return None
    factors = [data[at + 11 + 3 * c] for c in range(comps)]
    hs, vs = [f >> 4 for f in factors], [f & 0x0F for f in factors]
    vmax = max(vs)
    if not 1 <= vmax <= 4 or min(vs) < 1 or min(hs) < 1:
        return None
    complete = data.rfind(b"\xff\xd9", sos) >= 0
    apart = max(max(hs) // min(hs), vmax // min(vs))
    return JpegLayout(at + 5, width, height, vmax if comps > 1 else 1, comps, exif, complete,
                      2 if apart >= 4 else 8)


def _exif_orientation(data: bytes, exif: tuple[int, int]) -> int:
    """The Orientation tag (1-8) of IFD0 in the Exif TIFF data at ``exif``; 1 when absent
    or malformed."""
    start, length = exif
    tiff = data[start:start + max(0, length)]
    order = {b"II": "<", b"MM": ">"}.get(bytes(tiff[:2]))
    if order is None or len(tiff) < 8:
        return 1
    (ifd,) = struct.unpack_from(order + "I", tiff, 4)
    if ifd + 2 > len(tiff):
        return 1
    (count,) = struct.unpack_from(order + "H", tiff, ifd)
    for k in range(count):
        entry = ifd + 2 + 12 * k
        if entry + 12 > len(tiff):
            break
        tag, kind = struct.unpack_from(order + "HH", tiff, entry)
        if tag == _EXIF_ORIENTATION and kind == 3:  # SHORT
            (value,) = struct.unpack_from(order + "H", tiff, entry + 8)
            return value if 1 <= value <= 8 else 1
    return 1


def stored_box(box: tuple[float, float, float, float], orientation: int, width: int,
               height: int) -> tuple[float, float, float, float]:
    """A box in displayed coordinates (after the EXIF ``orientation`` is applied) as the
    box of the same pixels in the stored image of ``width`` x ``height``."""
    left, top, right, bottom = box
    w, h = width, height
    return {1: (left, top, right, bottom), 2: (w - right, top, w - left, bottom),
            3: (w - right, h - bottom, w - left, h - top),
            4: (left, h - bottom, right, h - top), 5: (top, left, bottom, right),
            6: (top, h - right, bottom, h - left), 7: (w - bottom, h - right, w - top, h - left),
            8: (w - bottom, left, w - top, right)}[orientation]


# -- the probe -----------------------------------------------------------------------------

class Probe:
    """One encoded image with its header read and nothing decoded yet.

    ``width`` x ``height`` are the stored pixels' size; ``display_size`` is the size
    after ``orientation`` (1 unless :func:`probe` was asked to read it). ``jpeg`` is the
    layout of a JPEG whose rows can be limited (None otherwise), ``colorspace`` simplejpeg's
    name of its colour space (None when Pillow decodes it), ``image`` the opened Pillow
    image of any other format.
    """

    __slots__ = ("colorspace", "data", "height", "image", "jpeg", "orientation", "path",
                 "width")

    def __init__(self, data: bytes, path: str | None) -> None:
        self.data, self.path = data, path
        self.jpeg: JpegLayout | None = None
        self.colorspace: str | None = None
        self.image: Any = None
        self.width = self.height = 0
        self.orientation = 1

    @property
    def display_size(self) -> tuple[int, int]:
        """(width, height) as displayed: swapped for the orientations that transpose."""
        swap = self.orientation >= 5
        return (self.height, self.width) if swap else (self.width, self.height)

    def where(self) -> str:
        """The file's name for messages (its byte count when it has no path)."""
        return repr(self.path) if self.path else f"an image of {len(self.data)} bytes (no path)"


def _as_bytes(data: Any) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview, np.ndarray)):
        return bytes(memoryview(data).cast("B")) if not isinstance(data, np.ndarray) \
            else np.ascontiguousarray(data).tobytes()
    raise SourceError(f"expected the encoded image as bytes, got {type(data).__name__}")


def _failure(p: Probe, exc: BaseException) -> SourceError:
    reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return SourceError(f"cannot decode {p.where()}: {reason}; the file is corrupt, truncated "
                       "or not in an image format Pillow reads (re-encode it or leave it out "
                       "of the source)")


def probe(data: Any, path: str | None = None, *, exif: bool = False) -> Probe:
    """Read the header of the encoded image ``data`` (bytes-like): its size, and for a
    JPEG where its frame header is. ``exif``: also read the EXIF orientation.
    A header no decoder reads raises :class:`~zephon.errors.SourceError` naming ``path``."""
    p = Probe(_as_bytes(data), path)
    layout = jpeg_layout(p.data)
    if layout is not None:
        p.jpeg, p.width, p.height = layout, layout.width, layout.height
        _refuse_bomb(p)
        if layout.components != 4:
            p.colorspace = _jpeg_colorspace(p.data)
        if exif and layout.exif is not None:
            p.orientation = _exif_orientation(p.data, layout.exif)
        return p
    image = _module("PIL.Image")
    try:
        p.image = image.open(io.BytesIO(p.data))
        p.width, p.height = p.image.size
        if exif:
            value = p.image.getexif().get(_EXIF_ORIENTATION, 1)
            p.orientation = value if isinstance(value, int) and 1 <= value <= 8 else 1
    except Exception as exc:  # Pillow raises many types for bad headers
        raise _failure(p, exc) from exc
    return p


def _refuse_bomb(p: Probe) -> None:
    """Pillow's decompression-bomb guard, which a JPEG read from its markers skips: more
    than twice ``PIL.Image.MAX_IMAGE_PIXELS`` pixels is refused as Pillow refuses it
    (torchvision's loader too); ``MAX_IMAGE_PIXELS = None`` lifts it, as in Pillow."""
    image = _module("PIL.Image")
    limit = image.MAX_IMAGE_PIXELS
    if limit is not None and p.width * p.height > 2 * limit:
        bomb = image.DecompressionBombError(
            f"image size ({p.width * p.height} pixels) exceeds limit of {2 * limit} pixels, "
            "could be decompression bomb DOS attack (raise PIL.Image.MAX_IMAGE_PIXELS, or "
            "set it to None, in every worker: e.g. in the module that defines your ops)")
        raise _failure(p, bomb) from bomb


def _jpeg_colorspace(data: bytes) -> str | None:
    """simplejpeg's colour space name when it should decode these bytes, else None."""
    try:
        space = _module("simplejpeg").decode_jpeg_header(data, strict=False)[2]
    except Exception:  # noqa: BLE001 - ValueError, or KeyError for 4:4:1: Pillow decides
        return None
    return space if space in _FAST_COLORSPACES else None


# -- decoding -------------------------------------------------------------------------------

class _Decoded(NamedTuple):
    """A decoded image at DCT scale ``scale``: a NumPy array (H, W, C) or a Pillow image."""

    pixels: Any
    scale: int


def _dct_scale(p: Probe, box_w: float, box_h: float, size: tuple[int, int],
               support: float) -> int:
    """The largest DCT scale at which the box still covers ``size`` (1 for formats other
    than JPEG and for ``nearest``)."""
    if p.jpeg is None or support == 0:
        return 1
    for s in DCT_SCALES:
        if s <= p.jpeg.max_scale and box_w / s >= size[0] and box_h / s >= size[1]:
            return s
    return 1


def _limited(p: Probe, rows: int, scale: int = 1, reuse: bool = False) -> tuple[Any, int]:
    """The bytes with the frame header's height cut to the rows a decode at ``scale``
    needs (``rows`` plus the rows the chroma upsampling reads below them), and that
    height. ``reuse``: the copy is written into this thread's input buffer (valid until
    the thread's next decode)."""
    jpeg = p.jpeg
    assert jpeg is not None
    limit = rows + jpeg.context_rows * scale
    if not jpeg.complete or limit >= jpeg.height:
        return p.data, jpeg.height
    n = len(p.data)
    buf = _scratch("input", n) if reuse else None
    patched = bytearray(p.data) if buf is None else memoryview(buf)[:n]
    if buf is not None:
        patched[:] = p.data
    patched[jpeg.height_at:jpeg.height_at + 2] = limit.to_bytes(2, "big")
    return patched, limit


def _scratch(name: str, nbytes: int) -> bytearray | None:
    """This thread's reusable buffer ``name`` ("input": the row-limited copy of the bytes;
    "output": the decoded pixels) of at least ``nbytes``; None past :data:`SCRATCH_MAX`.
    A decode then reads and writes memory already mapped instead of fresh allocations
    whose pages fault in on first touch (measured: a fifth of the op's time on 500x375
    JPEGs). What a decode writes into "output" is copied out (into the region's Pillow
    image) before the thread decodes again."""
    if nbytes > SCRATCH_MAX:
        return None
    buf = getattr(_LOCAL, name, None)
    if buf is None or len(buf) < nbytes:
        buf = bytearray(max(nbytes, 1 << 20))
        setattr(_LOCAL, name, buf)
    return buf


def _decode_fast(p: Probe, scale: int, rows: int, fast: tuple[bool, bool]) -> _Decoded | None:
    """simplejpeg's decode at ``scale`` of the rows needed; None when it refuses the bytes
    (Pillow then decides)."""
    data, height = _limited(p, rows, scale, reuse=True)
    shape = (-(-height // scale), -(-p.width // scale))
    space = _FAST_COLORSPACES[p.colorspace or ""]
    try:
        arr = _module("simplejpeg").decode_jpeg(
            data, colorspace=space, fastdct=fast[0], fastupsample=fast[1],
            min_height=shape[0], min_width=shape[1], strict=False,
            buffer=_scratch("output", shape[0] * shape[1] * (3 if space == "RGB" else 1)))
    except ValueError:
        return None
    if arr.shape[:2] != shape:
        return None  # not the scale asked for
    return _Decoded(arr, scale)


def _decode_pil(p: Probe, scale: int, rows: int | None) -> _Decoded:
    """Pillow's decode: a JPEG at ``scale`` (``rows`` None: every row), else the image."""
    if p.jpeg is None:
        try:
            p.image.load()
        except Exception as exc:  # Pillow raises many types for bad data
            raise _failure(p, exc) from exc
        return _Decoded(p.image, 1)
    data, height = _limited(p, rows, scale) if rows is not None else (p.data, p.height)
    image = _module("PIL.Image")
    try:
        img = image.open(io.BytesIO(data))
        if scale > 1:
            img.draft(None, (max(1, p.width // scale), max(1, height // scale)))
        img.load()
    except Exception as exc:  # Pillow raises many types for bad data
        raise _failure(p, exc) from exc
    for s in (scale, 1):  # draft may decline (the scale it picks is the one asked for)
        if img.size[0] == -(-p.width // s):
            return _Decoded(img, s)
    raise SourceError(f"cannot decode {p.where()}: Pillow decoded {img.size[0]} columns, "
                      f"neither the {p.width} of its header nor 1/{scale} of them")


def _decode(p: Probe, scale: int, rows: int, fast: tuple[bool, bool]) -> _Decoded:
    if p.colorspace is not None and p.jpeg is not None and p.jpeg.complete:
        done = _decode_fast(p, scale, rows, fast)
        if done is not None:
            return done
        return _decode_pil(p, scale, None)  # Pillow judges what simplejpeg refused
    limit = rows if p.jpeg is not None and p.jpeg.complete else None
    return _decode_pil(p, scale, limit)


def _decode_region(p: Probe, scale: int, bounds: tuple[int, int, int, int], rows: int,
                   fast: tuple[bool, bool]):
    """The pixels of ``bounds`` (x0, y0, x1, y1, at ``scale``) decoded by the region kernel
    (a view (y1 - y0, x1 - x0, C) of this thread's output buffer, C 3 or 1), or None
    where it is missing or declines (it failed, warned of corrupt data,
    or the box is too wide for the scratch buffer): the whole-row path then decides, as
    it always did."""
    kernel = region_kernel()
    if kernel is None or p.colorspace is None or p.jpeg is None or not p.jpeg.complete:
        return None
    x0, y0, x1, y1 = bounds
    data, height = _limited(p, rows, scale, reuse=True)
    xa = max(0, x0 - REGION_EDGE)
    xb = min(-(-p.width // scale), x1 + REGION_EDGE)
    comps = 3 if p.colorspace == "YCbCr" else 1
    out = _scratch("output", (y1 - y0) * (xb - xa + _REGION_SLACK) * comps)
    if out is None:
        return None
    status, xoff, width, got, warnings, _ = kernel(
        data, scale, xa, y0, xb - xa, y1 - y0, comps == 1, fast[0], fast[1], out,
        height < p.height)
    if status != 0 or warnings or got != comps:
        return None
    px = np.frombuffer(out, np.uint8, (y1 - y0) * width * comps).reshape(y1 - y0, width, comps)
    return px[:, x0 - xoff:x1 - xoff]


def _region(decoded: _Decoded, bounds: tuple[int, int, int, int]):
    """The Pillow image of ``bounds`` (x0, y0, x1, y1) of the decoded pixels, in RGB or L
    (every other mode converted: Pillow's conversions to RGB are per pixel, so converting
    the region is converting the image)."""
    image = _module("PIL.Image")
    x0, y0, x1, y1 = bounds
    px = decoded.pixels
    if isinstance(px, np.ndarray):
        _, w, c = px.shape
        if c == 1:  # Pillow maps an L buffer in place, wanting whole rows of the stride
            # past the region's start (one short at the last row when x0 > 0): a copy
            return image.fromarray(np.ascontiguousarray(px[y0:y1, x0:x1, 0]), "L")
        flat = px.reshape(-1).data[(y0 * w + x0) * c:]  # RGB is read row by row: no copy
        return image.frombuffer("RGB", (x1 - x0, y1 - y0), flat, "raw", "RGB", w * c, 1)
    region = px if bounds == (0, 0, *px.size) else px.crop(bounds)
    return region if region.mode in ("RGB", "L") else region.convert("RGB")


def _margin(clamp: bool, support: float, box: tuple[float, float, float, float],
            size: tuple[int, int], scale: int) -> int:
    """Pixels of the decoded image the kernel reads past the box's edges (0 when clamped)."""
    if clamp:
        return 0
    left, top, right, bottom = box
    reach = max(1.0, (right - left) / scale / size[0], (bottom - top) / scale / size[1])
    return math.ceil(support * reach) + 1


def _bounds(box: tuple[float, float, float, float], margin: int, scale: int,
            have: tuple[int, int]) -> tuple[int, int, int, int]:
    """The pixels (x0, y0, x1, y1) of an image decoded at ``scale``, ``have`` (width,
    height) in size, that cover ``box`` with ``margin`` more on each side."""
    left, top, right, bottom = box
    return (max(0, math.floor(left / scale) - margin), max(0, math.floor(top / scale) - margin),
            min(have[0], math.ceil(right / scale) + margin),
            min(have[1], math.ceil(bottom / scale) + margin))


def decode_box(p: Probe, box: tuple[float, float, float, float], size: tuple[int, int], *,
               resample: str = "bilinear", clamp: bool = True, fast_idct: bool = True,
               fast_upsample: bool = False, flip: bool = False):
    """The pixels of ``box`` (left, top, right, bottom in the stored image's pixels) of the
    probed image, resized to ``size`` (width, height) and mirrored left to right when
    ``flip``: a uint8 array (height, width, 3), RGB, C-contiguous and writable, or, where
    Pillow resized it, a Pillow RGB image.

    ``clamp=True`` gives crop-then-resize (the kernel stops at the box's edges, as
    torchvision's RandomResizedCrop on a PIL image); ``clamp=False`` gives
    resize-then-crop (the kernel reads past the edges, as Resize then CenterCrop).
    ``fast_idct``, ``fast_upsample``: libjpeg-turbo's fast inverse DCT and chroma
    upsampling for the JPEGs simplejpeg decodes (see the module docstring).
    """
    name, support = FILTERS[resample]
    left, top, right, bottom = box
    s = _dct_scale(p, right - left, bottom - top, size, support)
    rows = min(p.height, s * (math.ceil(bottom / s) + _margin(clamp, support, box, size, s)))
    fast = (fast_idct, fast_upsample)
    bounds = _bounds(box, _margin(clamp, support, box, size, s), s,
                     (-(-p.width // s), -(-rows // s)))
    # the box's pixels as an array (a view) where a decoder gave one, and the decoded
    # image with the bounds of the box for Pillow's resize
    view = _decode_region(p, s, bounds, rows, fast)
    if view is not None:
        decoded, within = _Decoded(view, s), (0, 0, view.shape[1], view.shape[0])
    else:
        decoded = _decode(p, s, rows, fast)
        s = decoded.scale
        px = decoded.pixels
        have = (px.shape[1], px.shape[0]) if isinstance(px, np.ndarray) else px.size
        bounds = _bounds(box, _margin(clamp, support, box, size, s), s, have)
        within = bounds
        if isinstance(px, np.ndarray):
            view = px[bounds[1]:bounds[3], bounds[0]:bounds[2]]
    x0, y0 = bounds[:2]
    rel = (left / s - x0, top / s - y0, right / s - x0, bottom / s - y0)
    kernel = resize_kernel()
    if view is not None and kernel is not None and support > 0:
        out = kernel(view, rel, size, resample, flip)
        return np.repeat(out, 3, axis=2) if out.shape[2] == 1 else out
    if decoded.pixels is view and view is not None:  # Pillow reads whole rows of a stride
        decoded = _Decoded(np.ascontiguousarray(view), s)
    region = _region(decoded, within)
    if region.size == size and rel == (0, 0, *size):
        out = region
    else:
        filt = getattr(_module("PIL.Image").Resampling, name)
        out = region.resize(size, filt, box=rel)
    if flip:
        out = out.transpose(_module("PIL.Image").Transpose.FLIP_LEFT_RIGHT)
    return out if out.mode == "RGB" else out.convert("RGB")


def decode_image(data: Any, *, path: str | None = None, exif_transpose: bool = False
                 ) -> np.ndarray:
    """The full decode of an encoded image: a uint8 array (height, width, 3), RGB.

    Grayscale, CMYK, palette and alpha images are converted as ``Image.convert("RGB")``
    converts them (torchvision's ImageFolder loader); the EXIF orientation is ignored, as
    that loader ignores it, unless ``exif_transpose``. JPEGs in YCbCr or grayscale are
    decoded by simplejpeg (pixels identical to Pillow's), everything else by Pillow.

    Args:
        data: the encoded image (bytes-like): JPEG, PNG, or anything Pillow reads.
        path: the file's name, for the error message.
        exif_transpose: apply the EXIF orientation (rotate/mirror as displayed).

    Returns:
        A C-contiguous, writable ``np.uint8`` array of shape (height, width, 3).

    Raises:
        SourceError: the bytes are corrupt, truncated or no image; names ``path``.

    Examples:
        >>> from zephon.vision import decode_image  # doctest: +SKIP
        >>> decode_image(open("cat.jpg", "rb").read()).shape  # doctest: +SKIP
        (375, 500, 3)
    """
    p = probe(data, path, exif=exif_transpose)
    img = _region(_decode(p, 1, p.height, (False, False)), (0, 0, p.width, p.height))
    if img.mode != "RGB":
        img = img.convert("RGB")
    if p.orientation != 1:
        method = ORIENTATION_TRANSPOSE[p.orientation]
        img = img.transpose(getattr(_module("PIL.Image").Transpose, method))
    return np.array(img)
