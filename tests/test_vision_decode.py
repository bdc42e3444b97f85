"""zephon.vision: the decode + crop ops against the full decode they replace.

The reference everywhere is what torchvision does on ImageFolder's PIL image:
``Image.open(...).convert("RGB")``, then ``crop(box).resize(size, filter)`` (its
RandomResizedCrop on a PIL image), or ``resize`` then a centre crop (Resize +
CenterCrop), then the flip; the resize is Pillow 12's, which the op's compiled
resampler reproduces (``pil_resize``; tests/test_kernels_resample.py holds it to
Pillow). With ``fast_idct=False`` and a crop decoded at DCT scale 1
the ops must give exactly its pixels; at other scales and with the fast inverse DCT
they must stay within 30 dB PSNR. The box sampler is checked against an independent
implementation of torchvision's algorithm (a different generator) with two-sample
Kolmogorov-Smirnov tests, and the test's power is checked on a sampler that is wrong.
"""

from __future__ import annotations

import io
import math
import pickle
import random
import struct
import subprocess
import sys

import numpy as np
import pytest

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("simplejpeg")
from _images import image_bytes, jpeg_bytes, make_image  # noqa: E402
from PIL import ImageOps  # noqa: E402

from zephon import Pipeline, RuntimeOptions, sources  # noqa: E402
from zephon.errors import SourceError, ZephonConfigError  # noqa: E402
from zephon.pipeline.fingerprint import fn_identity  # noqa: E402
from zephon.pipeline.ops.base import OpContext  # noqa: E402
from zephon.vision import (  # noqa: E402
    CenterCrop,
    RandomResizedCrop,
    decode_image,
    random_resized_crop_box,
    resized_size,
)
from zephon.kernels import resample_ref  # noqa: E402
from zephon.vision import decode as dec  # noqa: E402

FILTERS = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
           "lanczos": Image.Resampling.LANCZOS, "nearest": Image.Resampling.NEAREST}


def ctx(i: int, seed: int = 0) -> OpContext:
    return OpContext(("test", i, 0), seed)


def picture(size=(320, 240), seed=0, mode="RGB"):
    return make_image(size, np.random.default_rng(seed), mode)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def draws(width, height, i, seed=0, op=None):
    """The box and the flip the op draws for sample ``i`` (the same generator, the same
    order: box, then flip)."""
    op = op or RandomResizedCrop()
    rng = ctx(i, seed).rng
    box = random_resized_crop_box(width, height, rng, op.scale, op.ratio)
    return box, op.flip > 0 and rng.random() < op.flip


def pil_resize(img, size_wh, interpolation):
    """Pillow's resize as the op's resampler does it where it is compiled: the reference
    of the kernel (``zephon.kernels.resample_ref``, Pillow 12's resize bit for bit; Pillow
    13 may order its passes otherwise, one off in places); Pillow's own where the kernel is
    missing, and for ``nearest`` (no kernel)."""
    if interpolation == "nearest" or dec.resize_kernel() is None:
        return img.resize(size_wh, FILTERS[interpolation])
    out = resample_ref.resample(np.asarray(img), (0, 0, *img.size), size_wh, interpolation)
    return Image.fromarray(out)


def reference_rrc(data, box, size_hw, flip, interpolation="bilinear", exif=False):
    img = Image.open(io.BytesIO(data))
    if exif:
        img = ImageOps.exif_transpose(img)
    img = pil_resize(img.convert("RGB").crop(box), size_hw[::-1], interpolation)
    if flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(img)


def run_rrc(op, data, i, path="img.jpg", seed=0):
    return op({"image": data, "path": path, "label": 3}, ctx(i, seed))


def display_size(data, exif=False):
    img = Image.open(io.BytesIO(data))
    return ImageOps.exif_transpose(img).size if exif else img.size


# -- the box sampler: torchvision's distribution ------------------------------------------------

def torchvision_box(width, height, r: random.Random, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                    log_uniform=True):
    """torchvision's ``RandomResizedCrop.get_params``, written from its documentation with
    Python's generator: (left, top, right, bottom)."""
    area = width * height
    for _ in range(10):
        target_area = area * r.uniform(*scale)
        if log_uniform:
            aspect = math.exp(r.uniform(math.log(ratio[0]), math.log(ratio[1])))
        else:  # the wrong sampler the test must catch
            aspect = r.uniform(*ratio)
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            i, j = r.randint(0, height - h), r.randint(0, width - w)
            return j, i, j + w, i + h
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, (width - w) // 2 + w, (height - h) // 2 + h


def ks_statistic(a, b) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two
    empirical distribution functions."""
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    values = np.concatenate([a, b])
    fa = np.searchsorted(a, values, side="right") / len(a)
    fb = np.searchsorted(b, values, side="right") / len(b)
    return float(np.max(np.abs(fa - fb)))


def ks_critical(n: int, m: int, alpha: float = 0.001) -> float:
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


def box_stats(boxes, width, height) -> dict:
    b = np.asarray(boxes, float)
    w, h = b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
    free_x, free_y = np.maximum(width - w, 1), np.maximum(height - h, 1)
    return {"area": w * h / (width * height), "log_ratio": np.log(w / h),
            "left": b[:, 0] / free_x, "top": b[:, 1] / free_y}


N_BOXES = 20_000


@pytest.mark.parametrize("size", [(500, 375), (1600, 1200), (375, 500), (300, 40)])
def test_the_box_sampler_has_torchvision_s_distribution(size):
    width, height = size
    rng = np.random.default_rng(11)
    ours = [random_resized_crop_box(width, height, rng) for _ in range(N_BOXES)]
    r = random.Random(12)
    theirs = [torchvision_box(width, height, r) for _ in range(N_BOXES)]
    a, b = box_stats(ours, width, height), box_stats(theirs, width, height)
    crit = ks_critical(N_BOXES, N_BOXES)
    for name in a:
        assert ks_statistic(a[name], b[name]) < crit, name
    for box in ours[:2000]:
        left, top, right, bottom = box
        assert 0 <= left < right <= width and 0 <= top < bottom <= height


def test_the_ks_check_catches_a_sampler_that_is_not_torchvision_s():
    """Power: a uniform (not log-uniform) ratio, or a scale range off by 0.02, fails."""
    width, height = 500, 375
    rng = np.random.default_rng(11)
    ours = box_stats([random_resized_crop_box(width, height, rng) for _ in range(N_BOXES)],
                     width, height)
    r = random.Random(12)
    uniform = box_stats([torchvision_box(width, height, r, log_uniform=False)
                         for _ in range(N_BOXES)], width, height)
    shifted = box_stats([torchvision_box(width, height, r, scale=(0.1, 1.0))
                         for _ in range(N_BOXES)], width, height)
    crit = ks_critical(N_BOXES, N_BOXES)
    assert ks_statistic(ours["log_ratio"], uniform["log_ratio"]) > crit
    assert ks_statistic(ours["area"], shifted["area"]) > crit


def test_the_box_sampler_matches_torchvision_itself_when_it_is_installed():
    transforms = pytest.importorskip("torchvision.transforms")
    torch = pytest.importorskip("torch")
    width, height = 500, 375
    torch.manual_seed(0)
    img = Image.new("RGB", (width, height))
    theirs = []
    for _ in range(5000):
        i, j, h, w = transforms.RandomResizedCrop.get_params(img, (0.08, 1.0), (3 / 4, 4 / 3))
        theirs.append((j, i, j + w, i + h))
    rng = np.random.default_rng(5)
    ours = [random_resized_crop_box(width, height, rng) for _ in range(5000)]
    a, b = box_stats(ours, width, height), box_stats(theirs, width, height)
    for name in a:
        assert ks_statistic(a[name], b[name]) < ks_critical(5000, 5000), name


def test_the_fallback_is_the_centred_crop_of_the_allowed_ratio():
    # an area past the image's: no try fits, so the centred box of the nearest ratio
    assert random_resized_crop_box(300, 40, np.random.default_rng(0), scale=(2.0, 3.0)) == \
        ((300 - 53) // 2, 0, (300 - 53) // 2 + 53, 40)
    assert random_resized_crop_box(40, 300, np.random.default_rng(0), scale=(2.0, 3.0)) == \
        (0, (300 - 53) // 2, 40, (300 - 53) // 2 + 53)
    assert random_resized_crop_box(100, 90, np.random.default_rng(0), scale=(2.0, 3.0)) == \
        (0, 0, 100, 90)


def test_the_flip_is_drawn_after_the_box_with_its_probability():
    data = jpeg_bytes(picture((96, 64)))
    op = RandomResizedCrop(32, flip=0.5, fast_idct=False)
    flips = [draws(96, 64, i)[1] for i in range(400)]
    assert 150 < sum(flips) < 250  # binomial(400, 0.5): 6 sigma
    for i in range(6):
        box, flip = draws(96, 64, i)
        got = run_rrc(op, data, i)["image"]
        assert np.array_equal(got, reference_rrc(data, box, (32, 32), flip))
    no_flip = RandomResizedCrop(32, flip=0.0, fast_idct=False)
    box, _ = draws(96, 64, 1, op=no_flip)
    assert np.array_equal(run_rrc(no_flip, data, 1)["image"],
                          reference_rrc(data, box, (32, 32), False))


# -- pixels: exact at DCT scale 1, within 30 dB elsewhere ------------------------------------

JPEG_KINDS = {
    "baseline-420": {},
    "progressive-420": {"progressive": True},
    "baseline-444": {"subsampling": 0},
    "baseline-422": {"subsampling": 1},
    "progressive-444": {"progressive": True, "subsampling": 0},
}


@pytest.mark.parametrize("kind", sorted(JPEG_KINDS))
def test_scale_one_crops_are_torchvision_s_pixels_exactly(kind):
    """320x240 to 224: every crop is below 448 pixels, so DCT scale 1; the row limit is in
    force whenever the crop ends above the last MCU rows."""
    op = RandomResizedCrop(224, fast_idct=False)
    limited = 0
    for i in range(12):
        data = jpeg_bytes(picture((320, 240), seed=i), **JPEG_KINDS[kind])
        box, flip = draws(320, 240, i)
        limited += box[3] < 240 - 32
        got = run_rrc(op, data, i)["image"]
        assert got.dtype == np.uint8 and got.shape == (224, 224, 3)
        assert np.array_equal(got, reference_rrc(data, box, (224, 224), flip)), (kind, i)
    assert limited >= 3


@pytest.mark.parametrize("size", [(1024, 768), (320, 240)])
@pytest.mark.parametrize("progressive", [False, True])
def test_default_settings_stay_within_30_db_at_every_dct_scale(size, progressive):
    scales = set()
    for i in range(14):
        out = 160 if i % 2 else 64
        data = jpeg_bytes(picture(size, seed=i), progressive=progressive)
        box, flip = draws(*size, i)
        p = dec.probe(data)
        scales.add(dec._dct_scale(p, box[2] - box[0], box[3] - box[1], (out, out), 1.0))
        got = run_rrc(RandomResizedCrop(out), data, i)["image"]
        assert psnr(got, reference_rrc(data, box, (out, out), flip)) >= 30.0, i
    if size[0] > 500:
        assert len(scales) >= 3  # the test covers DCT scaling, not just scale 1


def test_the_dct_scale_is_the_smallest_that_covers_the_output():
    p = dec.probe(jpeg_bytes(picture((1600, 1200))))
    for crop, want in ((223, 1), (447, 1), (448, 2), (895, 2), (896, 4), (1200, 4)):
        assert dec._dct_scale(p, crop, crop, (224, 224), 1.0) == want
    assert dec._dct_scale(p, 1600, 1200, (100, 100), 1.0) == 8
    assert dec._dct_scale(p, 1600, 1200, (100, 100), 0.0) == 1  # nearest: full scale
    assert dec._dct_scale(p, 900, 300, (224, 224), 1.0) == 1  # the short side decides
    png = dec.probe(image_bytes(picture((1600, 1200)), "PNG"))
    assert dec._dct_scale(png, 1600, 1200, (100, 100), 1.0) == 1


def _rgb(pixels) -> np.ndarray:
    px = np.asarray(pixels)
    if px.ndim == 2:
        px = px[..., None]
    return np.repeat(px, 3, axis=2) if px.shape[2] == 1 else px


@pytest.mark.parametrize("kind", ["baseline", "progressive", "restarts", "gray", "444", "422"])
def test_the_row_limit_decodes_exactly_the_rows_a_full_decode_gives(kind, capfd):
    img = picture((333, 251), seed=3, mode="L" if kind == "gray" else "RGB")
    out = io.BytesIO()
    extra = {"baseline": {}, "progressive": {"progressive": True},
             "restarts": {"restart_marker_rows": 1}, "gray": {},
             "444": {"subsampling": 0}, "422": {"subsampling": 1}}[kind]
    img.save(out, "JPEG", quality=90, **extra)
    data = out.getvalue()
    p = dec.probe(data)
    for scale in (1, 2, 4):
        full = dec._decode_pil(p, scale, None)  # no row limit
        assert full.scale == scale
        full_px = _rgb(full.pixels)
        for rows in range(1, 251, 9):
            _, height = dec._limited(p, rows, scale)
            assert height == min(251, rows + p.jpeg.context_rows * scale)
            need = -(-rows // scale)
            for decoded in (dec._decode_fast(p, scale, rows, (False, False)),
                            dec._decode_pil(p, scale, rows)):
                assert decoded is not None and decoded.scale == scale
                px = _rgb(decoded.pixels)
                assert px.shape[0] == -(-height // scale)
                assert np.array_equal(px[:need], full_px[:need]), (kind, scale, rows)
    assert "Corrupt" not in capfd.readouterr().err  # libjpeg's warnings stay quiet


def test_grayscale_jpegs_become_rgb_as_convert_makes_them():
    data = jpeg_bytes(picture((320, 240), seed=1, mode="L"))
    assert dec.probe(data).colorspace == "Gray"
    op = RandomResizedCrop(224, fast_idct=False)
    for i in range(4):
        box, flip = draws(320, 240, i)
        got = run_rrc(op, data, i)["image"]
        assert np.array_equal(got, reference_rrc(data, box, (224, 224), flip))
        assert np.array_equal(got[..., 0], got[..., 2])


def test_cmyk_jpegs_go_through_pillow_at_every_scale():
    small = jpeg_bytes(picture((320, 240), seed=2, mode="CMYK"))
    large = jpeg_bytes(picture((1024, 768), seed=2, mode="CMYK"))
    assert dec.probe(small).colorspace is None and dec.probe(small).jpeg is not None
    op = RandomResizedCrop(224, fast_idct=False)
    for i in range(3):
        box, flip = draws(320, 240, i)
        assert np.array_equal(run_rrc(op, small, i)["image"],
                              reference_rrc(small, box, (224, 224), flip))
        box, flip = draws(1024, 768, i, op=RandomResizedCrop(64))
        got = run_rrc(RandomResizedCrop(64), large, i)["image"]
        assert psnr(got, reference_rrc(large, box, (64, 64), flip)) >= 30.0


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "P", "L", "LA"])
def test_png_images_are_decoded_by_pillow_exactly(mode):
    img = picture((200, 150), seed=4)
    img = img.convert(mode) if mode != "P" else img.quantize(64)
    data = image_bytes(img, "PNG")
    op = RandomResizedCrop((120, 96))
    for i in range(3):
        box, flip = draws(200, 150, i)
        got = run_rrc(op, data, i, path="x.png")["image"]
        assert got.shape == (120, 96, 3)
        assert np.array_equal(got, reference_rrc(data, box, (120, 96), flip))


@pytest.mark.parametrize("interpolation", ["bicubic", "lanczos", "nearest"])
def test_other_filters(interpolation):
    data = jpeg_bytes(picture((1024, 768), seed=5))
    op = RandomResizedCrop(80, interpolation=interpolation, fast_idct=False)
    for i in range(4):
        box, flip = draws(1024, 768, i)
        got = run_rrc(op, data, i)["image"]
        want = reference_rrc(data, box, (80, 80), flip, interpolation)
        if interpolation == "nearest":  # no kernel: decoded at full scale, exact
            assert np.array_equal(got, want)
        else:
            assert psnr(got, want) >= 30.0


def test_chw_layout_and_rectangular_sizes():
    data = jpeg_bytes(picture((320, 240), seed=6))
    hwc = run_rrc(RandomResizedCrop((48, 64)), data, 2)["image"]
    chw = run_rrc(RandomResizedCrop((48, 64), layout="CHW"), data, 2)["image"]
    assert hwc.shape == (48, 64, 3) and chw.shape == (3, 48, 64)
    assert np.array_equal(chw, hwc.transpose(2, 0, 1))
    for arr in (hwc, chw):
        assert arr.flags.c_contiguous and arr.flags.writeable


def test_the_sample_keeps_its_other_fields_and_is_not_mutated():
    data = jpeg_bytes(picture((64, 48)))
    sample = {"image": data, "label": 7, "path": "a/b.jpg"}
    out = RandomResizedCrop(16, key="image")(sample, ctx(0))
    assert sample["image"] is data and out["label"] == 7 and out["path"] == "a/b.jpg"
    other = RandomResizedCrop(16, key="jpg")({"jpg": data}, ctx(0))
    assert other["jpg"].shape == (16, 16, 3)
    view = RandomResizedCrop(16)({"image": memoryview(data)}, ctx(0))
    assert np.array_equal(view["image"], out["image"])


# -- EXIF orientation ---------------------------------------------------------------------------

@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_ignored_by_default_and_applied_on_request(orientation):
    data = jpeg_bytes(picture((160, 96), seed=7), orientation=orientation)
    assert dec.probe(data, exif=True).orientation == orientation
    assert dec.probe(data).orientation == 1
    box, flip = draws(160, 96, 1)
    got = run_rrc(RandomResizedCrop((40, 56), fast_idct=False), data, 1)["image"]
    assert np.array_equal(got, reference_rrc(data, box, (40, 56), flip))
    op = RandomResizedCrop((40, 56), exif_transpose=True, fast_idct=False)
    shown = display_size(data, exif=True)
    box, flip = draws(*shown, 1)
    got = run_rrc(op, data, 1)["image"]
    want = reference_rrc(data, box, (40, 56), flip, exif=True)
    assert got.shape == want.shape == (40, 56, 3)
    assert np.abs(got.astype(int) - want).max() <= 2  # resize passes swap with a transpose
    full = decode_image(data, exif_transpose=True)
    assert np.array_equal(full, np.asarray(ImageOps.exif_transpose(
        Image.open(io.BytesIO(data))).convert("RGB")))


def _with_app1(data: bytes, tiff: bytes) -> bytes:
    payload = b"Exif\0\0" + tiff
    return data[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + data[2:]


def test_the_exif_reader_reads_both_byte_orders_and_survives_junk():
    data = jpeg_bytes(picture((64, 48)))
    big_endian = b"MM\x00\x2a\x00\x00\x00\x08" + struct.pack(">H", 1) + \
        struct.pack(">HHIHH", 0x0112, 3, 1, 6, 0) + b"\0\0\0\0"
    assert dec.probe(_with_app1(data, big_endian), exif=True).orientation == 6
    for junk in (b"", b"XX", b"II\x2a\x00\xff\xff\xff\x7f", b"MM\x00\x2a\x00\x00\x00\x08\x00"):
        assert dec.probe(_with_app1(data, junk), exif=True).orientation == 1
    assert dec.probe(_with_app1(data, big_endian.replace(b"\x00\x06\x00\x00",
                                                         b"\x00\x09\x00\x00")),
                     exif=True).orientation == 1  # out of range


# -- broken inputs ---------------------------------------------------------------------------

def test_truncated_jpegs_fail_as_the_full_decode_fails_naming_the_file():
    data = jpeg_bytes(picture((320, 240), seed=8))
    op = RandomResizedCrop(64)
    for cut in (len(data) // 3, len(data) - 400):
        with pytest.raises(SourceError, match=r"'train/cat\.jpg'.*truncated"):
            run_rrc(op, data[:cut], 0, path="train/cat.jpg")
        with pytest.raises(OSError):
            Image.open(io.BytesIO(data[:cut])).convert("RGB")  # the reference fails too
    # only the end-of-image marker missing: Pillow still wants the bytes its Huffman
    # decoder reads ahead, so the reference fails, and so do we, whatever the crop
    with pytest.raises(OSError, match="truncated"):
        Image.open(io.BytesIO(data[:-2])).convert("RGB")
    for i in range(4):
        with pytest.raises(SourceError, match="truncated"):
            run_rrc(op, data[:-2], i)


@pytest.mark.parametrize("blob", [b"", b"garbage", bytes(range(256)) * 8,
                                  b"\xff\xd8\xff\xe0\x00\x10JFIF" + bytes(500),
                                  b"\x89PNG\r\n\x1a\n" + bytes(100)])
def test_garbage_raises_a_source_error_naming_the_file(blob):
    with pytest.raises(SourceError, match=r"'bad/file\.jpg'"):
        run_rrc(RandomResizedCrop(32), blob, 0, path="bad/file.jpg")
    with pytest.raises(SourceError, match=r"image of \d+ bytes \(no path\)"):
        RandomResizedCrop(32)({"image": blob}, ctx(0))
    with pytest.raises(SourceError):
        decode_image(blob)


def test_a_corrupt_frame_header_goes_to_pillow_and_fails_there():
    data = bytearray(jpeg_bytes(picture((64, 48))))
    layout = dec.jpeg_layout(bytes(data))
    data[layout.height_at - 1] = 12  # 12-bit precision: no limit, Pillow decides
    assert dec.jpeg_layout(bytes(data)) is None
    with pytest.raises(SourceError, match=r"x\.jpg"):
        run_rrc(RandomResizedCrop(32), bytes(data), 0, path="x.jpg")


def test_a_sample_without_encoded_bytes_is_a_config_error():
    op = RandomResizedCrop(32)
    with pytest.raises(ZephonConfigError, match="no 'image' field"):
        op({"jpg": b"..."}, ctx(0))
    with pytest.raises(ZephonConfigError, match="decoded already"):
        op({"image": np.zeros((4, 4, 3), np.uint8)}, ctx(0))
    with pytest.raises(ZephonConfigError, match="a dict"):
        op(b"...", ctx(0))


# -- CenterCrop -----------------------------------------------------------------------------------

def reference_center(data, size_hw, resize, interpolation="bilinear"):
    """torchvision's Resize(resize) then CenterCrop(size) on the PIL image (its padding
    included), written out."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    if resize is not None:
        if isinstance(resize, int):
            short, long = min(w, h), max(w, h)
            new_long = int(resize * long / short)
            w, h = (resize, new_long) if img.width <= img.height else (new_long, resize)
        else:
            h, w = resize
        img = pil_resize(img, (w, h), interpolation)
    ch, cw = size_hw
    if cw > w or ch > h:
        pad = Image.new("RGB", (max(w, cw), max(h, ch)))
        pad.paste(img, ((cw - w) // 2 if cw > w else 0, (ch - h) // 2 if ch > h else 0))
        img, w, h = pad, max(w, cw), max(h, ch)
    top, left = round((h - ch) / 2.0), round((w - cw) / 2.0)
    return np.asarray(img.crop((left, top, left + cw, top + ch)))


@pytest.mark.parametrize("size,resize", [((224, 224), 256), ((64, 80), 72), ((32, 32), None),
                                         ((60, 60), (70, 90)), ((128, 300), 100)])
def test_center_crop_is_resize_then_centre_crop(size, resize):
    for source_size in ((320, 240), (240, 331), (1600, 1200)):
        data = jpeg_bytes(picture(source_size, seed=9))
        got = CenterCrop(size, resize=resize, fast_idct=False)({"image": data})["image"]
        want = reference_center(data, size, resize)
        assert got.shape == want.shape == (*size, 3)
        rw, rh = (source_size if resize is None else
                  resized_size(*source_size, resize))
        scale = dec._dct_scale(dec.probe(data), source_size[0] * min(1, size[1] / rw),
                               source_size[1] * min(1, size[0] / rh),
                               (min(size[1], rw), min(size[0], rh)), 1.0)
        if scale == 1:  # the same resample of the same pixels, the window taken apart
            assert np.abs(got.astype(int) - want).max() <= 1, (size, resize, source_size)
        else:
            assert psnr(got, want) >= 30.0
    fast = CenterCrop(size, resize=resize)({"image": data})["image"]
    assert psnr(fast, reference_center(data, size, resize)) >= 30.0


def test_center_crop_pads_an_image_smaller_than_the_crop():
    data = image_bytes(picture((50, 30), seed=10), "PNG")
    got = CenterCrop((40, 64), resize=None)({"image": data})["image"]
    assert np.array_equal(got, reference_center(data, (40, 64), None))
    assert not got[:5].any() and not got[:, :7].any()


def test_resized_size_is_torchvision_s():
    assert resized_size(500, 375, 256) == (341, 256)
    assert resized_size(375, 500, 256) == (256, 341)
    assert resized_size(300, 300, 256) == (256, 256)
    assert resized_size(500, 375, (100, 200)) == (200, 100)


# -- the op as a pipeline component -----------------------------------------------------------

def test_decode_image_is_pillow_s_full_decode():
    for data in (jpeg_bytes(picture((123, 77), seed=1)),
                 jpeg_bytes(picture((123, 77), seed=1), progressive=True),
                 jpeg_bytes(picture((123, 77), seed=1, mode="L")),
                 jpeg_bytes(picture((123, 77), seed=1, mode="CMYK")),
                 image_bytes(picture((123, 77), seed=1).convert("P"), "PNG")):
        got = decode_image(data)
        assert got.flags.writeable and got.shape == (77, 123, 3)
        assert np.array_equal(got, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def test_ops_pickle_and_their_settings_are_their_fingerprint():
    op = RandomResizedCrop(96, scale=(0.2, 1.0), flip=0.25, layout="CHW")
    again = pickle.loads(pickle.dumps(op))
    data = jpeg_bytes(picture((200, 150)))
    assert np.array_equal(again({"image": data}, ctx(3))["image"],
                          op({"image": data}, ctx(3))["image"])
    assert fn_identity(again) == fn_identity(op)
    assert fn_identity(op) != fn_identity(RandomResizedCrop(96, scale=(0.3, 1.0), flip=0.25,
                                                            layout="CHW"))
    assert fn_identity(CenterCrop(224)) != fn_identity(CenterCrop(224, resize=None))


def test_the_stream_is_the_same_on_every_runner():
    samples = [{"image": jpeg_bytes(picture((96, 72), seed=i)), "label": i,
                "path": f"img-{i}.jpg"} for i in range(12)]

    def run(**opts):
        pipe = Pipeline(sources.from_sequence(samples), seed=5, chunk_size=4) \
            .map(RandomResizedCrop(24)).batch(4).options(RuntimeOptions(**opts))
        return [(b["label"].tolist(), b["image"].tobytes()) for b in pipe]

    inline = run(runner="inline")
    assert len(inline) == 3
    assert run(runner="threads", max_workers=2) == inline
    assert run(runner="process", max_workers=2) == inline
    other_seed = Pipeline(sources.from_sequence(samples), seed=6, chunk_size=4) \
        .map(RandomResizedCrop(24)).batch(4).options(RuntimeOptions(runner="inline"))
    assert [b["image"].tobytes() for b in other_seed] != [img for _, img in inline]


@pytest.mark.parametrize("kwargs,field", [
    ({"size": 0}, "size"), ({"size": (3, 4, 5)}, "size"), ({"size": True}, "size"),
    ({"scale": (0.5, 0.1)}, "scale"), ({"scale": (0, 1)}, "scale"),
    ({"ratio": (1.0,)}, "ratio"), ({"flip": 1.5}, "flip"),
    ({"interpolation": "cubic"}, "interpolation"), ({"layout": "NHWC"}, "layout"),
    ({"key": ""}, "key"), ({"fast_idct": 1}, "fast_idct")])
def test_bad_arguments_are_config_errors_naming_the_field(kwargs, field):
    with pytest.raises(ZephonConfigError) as err:
        RandomResizedCrop(**kwargs)
    assert err.value.field == f"RandomResizedCrop.{field}"


def test_center_crop_arguments():
    assert CenterCrop(224, resize=(256, 300)).resize == (256, 300)
    assert CenterCrop(224, resize=None).resize is None
    with pytest.raises(ZephonConfigError) as err:
        CenterCrop(224, resize=-1)
    assert err.value.field == "CenterCrop.resize"


def test_zephon_vision_imports_without_pillow_and_names_the_extra_when_used():
    code = (
        "import sys\n"
        "sys.modules['PIL'] = None\nsys.modules['simplejpeg'] = None\n"
        "import zephon.vision as v\n"
        "op = v.RandomResizedCrop(32)\n"
        "for blob in (b'\\x89PNG\\r\\n\\x1a\\n' + bytes(40), %r):\n"
        "    try:\n"
        "        v.decode_image(blob)\n"
        "    except ImportError as exc:\n"
        "        print('IMPORT', exc)\n" % jpeg_bytes(picture((16, 16))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("IMPORT")]
    assert len(lines) == 2 and all('.[vision]' in ln for ln in lines)
    assert all("Pillow" in ln for ln in lines)  # every decode needs it (resampling, limits)


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (640, 481)])
def test_grayscale_jpegs_decode_for_every_crop(size):
    """A gray JPEG's region at the decoded image's last rows (x0 > 0) once failed in
    Pillow's in-place mapping of an L buffer: every box is drawn here."""
    data = jpeg_bytes(picture(size).convert("L"))
    op, center = RandomResizedCrop(64), CenterCrop(64, resize=64)
    for i in range(300):
        out = op({"image": data}, OpContext(("g", i, 0), 0))["image"]
        assert out.shape == (64, 64, 3)
    assert center({"image": data})["image"].shape == (64, 64, 3)


def test_a_decompression_bomb_is_refused_as_pillow_refuses_it(monkeypatch):
    data = jpeg_bytes(picture((64, 48)))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 48 // 2 - 1)
    with pytest.raises(SourceError, match="decompression bomb"):
        decode_image(data, path="big.jpg")
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(data)).load()  # (the reference refuses it too)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert decode_image(data).shape == (48, 64, 3)


@pytest.mark.parametrize("factors, most", [((0x41, 0x11, 0x11), 2), ((0x14, 0x11, 0x11), 2),
                                           ((0x22, 0x11, 0x11), 8), ((0x11, 0x11, 0x11), 8)])
def test_chroma_sampled_four_to_one_is_never_scaled_past_half(factors, most):
    """4:1:1 (or 1x4) chroma loses too much at 1/4 and 1/8 DCT scale (under 30 dB)."""
    data = bytearray(jpeg_bytes(picture((64, 48))))
    at = dec.jpeg_layout(bytes(data)).height_at + 6  # the first component's factors
    for c, f in enumerate(factors):
        data[at + 3 * c] = f
    assert dec.jpeg_layout(bytes(data)).max_scale == most


def test_center_crop_reads_a_one_element_resize_as_the_shorter_side():
    assert CenterCrop(64, resize=[72]).resize == CenterCrop(64, resize=72).resize == 72
