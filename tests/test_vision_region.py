"""The region kernel of zephon.vision (``zephon._kernels.jpeg_region``): libjpeg's
partial decode of a JPEG's box, against the whole-row decode it replaces.

Both paths decode with the same libjpeg settings, so the pixels of every box must be
the same bits: for baseline, progressive, restart markers, 4:2:0, 4:2:2, 4:4:4 and
grayscale files, at every DCT scale, with each inverse DCT and upsampling setting, for
boxes anywhere (edges included). A file the kernel declines (libjpeg fails or warns of
corrupt data) goes to the whole-row path, which gives the verdict it always gave.
"""

from __future__ import annotations

import io
import os
import random
import sysconfig

import numpy as np
import pytest

Image = pytest.importorskip("PIL.Image", reason="the vision extra: Pillow")
pytest.importorskip("simplejpeg", reason="the vision extra: simplejpeg")

from _images import make_image  # noqa: E402

from zephon.vision import decode as dec  # noqa: E402


def _headers_here() -> bool:
    """Whether this machine has, where setup.py looks, the headers of a libjpeg-turbo the
    kernel compiles against (2.1.3 or later: ``zj_region.c`` refuses older ones)."""
    import glob
    import re

    dirs = [os.environ.get("ZEPHON_JPEG_INCLUDE", ""), "/usr/include", "/usr/local/include",
            "/opt/homebrew/include", "/opt/local/include",
            sysconfig.get_paths().get("include", "")]
    for d in dirs:
        if not d or not os.path.exists(os.path.join(d, "jpeglib.h")):
            continue
        for conf in [os.path.join(d, "jconfig.h"), *glob.glob(os.path.join(d, "*", "jconfig.h"))]:
            if os.path.exists(conf):
                found = re.search(r"LIBJPEG_TURBO_VERSION_NUMBER\s+(\d+)", open(conf).read())
                return bool(found) and int(found.group(1)) >= 2001003
        return False
    return False


def test_the_kernel_is_built_wherever_libjpeg_s_headers_are():
    if not _headers_here() or os.environ.get("ZEPHON_JPEG") == "0":
        pytest.skip("no libjpeg-turbo >= 2.1.3 headers here: zephon builds without the "
                    "region kernel")
    assert dec.region_kernel() is not None, \
        "jpeglib.h is here but zephon._kernels.jpeg_region was not built (setup.py)"


kernel = pytest.mark.skipif(dec.region_kernel() is None,
                            reason="zephon was built without libjpeg's headers")

KINDS = {"baseline": {}, "progressive": {"progressive": True},
         "restarts": {"restart_marker_blocks": 3}, "444": {"subsampling": 0},
         "422": {"subsampling": 1}, "gray": {}}


def _jpeg(kind: str, size=(333, 251), seed=0) -> bytes:
    img = make_image(size, np.random.default_rng(seed), "L" if kind == "gray" else "RGB")
    out = io.BytesIO()
    img.save(out, "JPEG", quality=90, **KINDS[kind])
    return out.getvalue()


def _whole_rows(monkeypatch, p, box, size, **kw):
    with monkeypatch.context() as m:
        m.setitem(dec._REGION, "kernel", None)
        return np.asarray(dec.decode_box(p, box, size, **kw))


@kernel
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_box_is_the_whole_row_decode_s_pixels_bit_for_bit(kind, monkeypatch):
    data = _jpeg(kind)
    p = dec.probe(data)
    rnd = random.Random(kind)
    calls = []
    real = dec.region_kernel()

    def counting(*args):
        calls.append(args[1])
        return real(*args)

    monkeypatch.setitem(dec._REGION, "kernel", counting)
    for i in range(40):
        w, h = p.width, p.height
        if i < 4:  # the corners and the whole image
            box = [(0, 0, 40, 30), (w - 40, h - 30, w, h), (0, h - 17, 23, h), (0, 0, w, h)][i]
        else:
            bw, bh = rnd.uniform(3, w), rnd.uniform(3, h)
            left, top = rnd.uniform(0, w - bw), rnd.uniform(0, h - bh)
            box = (left, top, left + bw, top + bh)
        out = rnd.choice([(16, 16), (40, 30), (64, 64), (24, 80)])
        kw = dict(resample=rnd.choice(["bilinear", "bicubic", "nearest"]),
                  clamp=rnd.random() < 0.7, fast_idct=rnd.random() < 0.5,
                  fast_upsample=rnd.random() < 0.3)
        got = np.asarray(dec.decode_box(p, box, out, **kw))
        assert np.array_equal(got, _whole_rows(monkeypatch, p, box, out, **kw)), (i, box, kw)
    assert len(calls) >= 40 and {1, 2, 4, 8} & set(calls) >= {1, 2, 4}  # DCT scales too


@kernel
def test_the_kernel_s_raw_rows_are_a_full_decode_s_inside_the_edge_columns():
    import simplejpeg

    data = _jpeg("baseline", (500, 375), seed=4)
    full = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False)
    out = np.empty(1 << 22, np.uint8)
    decode = dec.region_kernel()
    for x, y, w, h in [(17, 9, 100, 60), (0, 0, 500, 375), (250, 300, 250, 75), (33, 1, 1, 1)]:
        status, x0, width, comps, warnings, _ = decode(data, 1, x, y, w, h, False, False,
                                                       False, out)
        assert status == 0 and warnings == 0 and comps == 3 and x0 <= x and x0 % 16 == 0
        rows = out[:h * width * 3].reshape(h, width, 3)
        inner = slice(max(x, 2) - x0 if x > 0 else 0, x + w - x0 - (2 if x + w < 500 else 0))
        assert np.array_equal(rows[:, inner], full[y:y + h, x0:x0 + width][:, inner])


@kernel
def test_a_box_the_kernel_declines_goes_to_the_whole_row_path(monkeypatch):
    decode = dec.region_kernel()
    data = _jpeg("baseline", seed=5)
    out = np.empty(1 << 20, np.uint8)
    # libjpeg fails: no image in the bytes
    status, *_, message = decode(b"\xff\xd8\xff\xd9", 1, 0, 0, 4, 4, False, False, False, out)
    assert status == 1 and message
    # the output buffer is too small: status 2, nothing written past it
    small = np.zeros(64, np.uint8)
    assert decode(data, 1, 0, 0, 100, 100, False, False, False, small)[0] == 2
    # a region outside the image is refused, not read out of bounds
    assert decode(data, 1, 300, 0, 100, 10, False, False, False, out)[0] == 1
    # corrupt entropy data inside the box: the kernel warns, so the whole-row path
    # decides (and gives what it gives without the kernel)
    bad = bytearray(data)
    start = dec.jpeg_layout(data).height_at + 200
    bad[start:start + 64] = bytes(64)
    assert decode(bytes(bad), 1, 0, 0, 333, 251, False, False, False, out)[4] > 0
    p = dec.probe(bytes(bad))
    box = (0.0, 0.0, float(p.width), float(p.height))
    got = np.asarray(dec.decode_box(p, box, (64, 48)))
    assert np.array_equal(got, _whole_rows(monkeypatch, p, box, (64, 48)))


def test_outputs_never_share_the_decoders_buffers():
    """Every output is the op's own array: a crop that is exactly the output size (no
    resampling pass at all) must not hand back a view of the per-thread decode buffer
    the next image overwrites."""
    from zephon.pipeline.ops.base import OpContext
    from zephon.vision import CenterCrop, RandomResizedCrop

    datas = [_jpeg(kind, (256, 192), seed=i) for i, kind in enumerate(
        ["baseline", "progressive", "444", "gray", "baseline", "422"])]
    # 1x1 images cropped to 1x1 and mirrored: no resampling pass at all, and a mirrored
    # single column is still contiguous (the case an earlier fix missed)
    tiny = [_jpeg("baseline", (1, 1), seed=20 + i) for i in range(6)]
    cases = [(CenterCrop(192), datas), (CenterCrop((192, 256)), datas),
             (RandomResizedCrop(64), datas), (RandomResizedCrop(1, flip=1.0), tiny)]
    for op, images in cases:
        outs = [op({"image": d}, OpContext(("s", i, 0), 0))["image"]
                for i, d in enumerate(images)]
        for i, d in enumerate(images):
            alone = op({"image": d}, OpContext(("s", i, 0), 0))["image"]
            assert np.array_equal(outs[i], alone), (op, i)
            assert outs[i].flags.writeable and outs[i].flags.c_contiguous
        assert len({o.tobytes() for o in outs}) > 1 or len(images) == 1, op  # not one buffer


@kernel
@pytest.mark.parametrize("kind", ["baseline", "progressive", "restarts"])
def test_a_cut_frame_height_is_decoded_by_the_kernel_without_warnings(kind):
    """The row limit cuts the frame height in a copy of the bytes; every scan then has
    data past that height, which libjpeg warns about. That warning is expected there, so
    the kernel takes the box (progressive files used to be declined every time and
    decoded twice)."""
    data = _jpeg(kind, (320, 240), seed=9)
    p = dec.probe(data)
    cut, height = dec._limited(p, 64)
    assert height < p.height
    out = np.empty(1 << 20, np.uint8)
    status, _, _, _, warnings, message = dec.region_kernel()(
        bytes(cut), 1, 10, 5, 100, 50, False, False, False, out, True)
    assert status == 0 and warnings == 0, message
    # without the flag the same bytes warn (a genuine extraneous-data warning counts)
    if kind == "progressive":
        assert dec.region_kernel()(bytes(cut), 1, 10, 5, 100, 50, False, False, False,
                                   out, False)[4] > 0


def _cjpeg(tmp_path, sample: str) -> bytes:
    import shutil
    import subprocess

    if shutil.which("cjpeg") is None:
        pytest.skip("cjpeg (libjpeg-turbo's tools) is not installed")
    ppm = tmp_path / "in.ppm"
    Image.fromarray(np.asarray(make_image((96, 80), np.random.default_rng(2)))).save(ppm)
    out = tmp_path / "out.jpg"
    subprocess.run(["cjpeg", "-sample", sample, "-outfile", str(out), str(ppm)], check=True)
    return out.read_bytes()


@pytest.mark.parametrize("sample", ["1x4", "4x1", "4x2"])
def test_unusual_sampling_is_decoded_as_the_full_decode_decodes_it(tmp_path, sample):
    """4:4:1 once raised a bare KeyError from simplejpeg's header reader; 4:1:1 and 4x2
    are declined by the region kernel (libjpeg-turbo before 3.0 misplaces their cropped
    columns when scaled) and go to the whole-row path."""
    from zephon.pipeline.ops.base import OpContext
    from zephon.vision import CenterCrop

    data = _cjpeg(tmp_path, sample)
    got = CenterCrop((80, 96), resize=None)({"image": data}, OpContext(("s", 0, 0), 0))["image"]
    full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    mse = float(np.mean((got.astype(np.float64) - full) ** 2))
    assert got.shape == full.shape and (mse == 0 or 10 * np.log10(255 ** 2 / mse) >= 40)
    if dec.region_kernel() is not None and sample != "1x4":
        out = np.empty(1 << 20, np.uint8)
        status = dec.region_kernel()(data, 2, 0, 0, 40, 30, False, False, False, out)[0]
        assert status == 3
