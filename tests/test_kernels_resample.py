"""The resampling kernel of zephon.vision: ``zephon._kernels.resample`` against its
reference ``zephon.kernels.resample_ref``, and the reference against Pillow.

The compiled kernel must give the reference's bits for every filter, channel count,
fractional box, strided input, mirrored output and size (upscaling, downscaling, one
pass skipped). The reference is Pillow's convolution resize: equal to Pillow 12 (run
here where Pillow 12 is installed). Pillow 13 may run the vertical pass first for some
sizes, so its intermediate image is rounded and clipped to 8 bits at another point:
within one for the filters without negative lobes (box, bilinear, hamming), further
off where bicubic's or lanczos's overshoot was clipped; few pixels differ at all.
"""

from __future__ import annotations

import numpy as np
import pytest

from zephon.kernels import resample_ref

Image = pytest.importorskip("PIL.Image", reason="the reference is checked against Pillow")

FILTERS = ["box", "bilinear", "hamming", "bicubic", "lanczos"]


def _case(rng, i):
    h, w = (int(v) for v in rng.integers(1, 160, 2))
    c = 3 if i % 2 else 1
    base = rng.integers(0, 256, (h + 4, w + 6, c), dtype=np.uint8)
    src = base[1:1 + h, 2:2 + w]  # rows with a stride wider than the row: a view
    left, top = rng.uniform(0, w / 2), rng.uniform(0, h / 2)
    box = (left, top, rng.uniform(left + 0.5, w), rng.uniform(top + 0.5, h))
    if i % 7 == 0:
        box = (0, 0, w, h)
    size = (int(rng.integers(1, 240)), int(rng.integers(1, 240)))
    if i % 11 == 0:
        size = (w, size[1])  # the horizontal pass may be skipped
    return src, box, size, FILTERS[i % 5], i % 3 == 0


def test_the_compiled_kernel_is_the_reference_bit_for_bit():
    compiled = pytest.importorskip("zephon._kernels.resample",
                                   reason="zephon's kernels are not built")
    rng = np.random.default_rng(0)
    for i in range(300):
        src, box, size, name, flip = _case(rng, i)
        got = compiled.resample(src, box, size, name, flip)
        want = resample_ref.resample(src, box, size, name, flip)
        assert got.flags.c_contiguous and got.flags.writeable and got.dtype == np.uint8
        assert np.array_equal(got, want), (i, src.shape, box, size, name, flip)
        bounds, kk = compiled.coefficients(src.shape[1], box[0], box[2], size[0], name)
        ref_bounds, ref_kk = resample_ref.coefficients(src.shape[1], box[0], box[2],
                                                       size[0], name)
        assert np.array_equal(bounds, ref_bounds) and np.array_equal(kk, ref_kk)


def test_the_reference_is_pillow_s_resize():
    import PIL

    major = int(PIL.__version__.split(".")[0])
    rng = np.random.default_rng(1)
    differ = pixels = 0
    for i in range(200):
        src, box, size, name, _ = _case(rng, i)
        img = Image.fromarray(np.ascontiguousarray(src[..., 0] if src.shape[2] == 1 else src))
        want = np.asarray(img.resize(size, getattr(Image.Resampling, name.upper()), box=box))
        got = resample_ref.resample(src, box, size, name).reshape(want.shape)
        diff = np.abs(got.astype(np.int16) - want)
        if major < 13:
            assert not diff.any(), (i, PIL.__version__, src.shape, box, size, name)
        elif name in ("box", "bilinear", "hamming"):  # no negative lobes: no clipping
            assert diff.max() <= 1, (i, src.shape, box, size, name)
        differ += int(np.count_nonzero(diff))
        pixels += diff.size
    assert differ <= pixels // 20  # one off in places, not a different filter


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="uint8"):
        resample_ref.resample(np.zeros((4, 4, 2), np.uint8), (0, 0, 4, 4), (2, 2), "box")
    with pytest.raises(ValueError, match="unknown filter"):
        resample_ref.filter_weight("cubic", 0.5)


def test_a_box_that_is_the_output_still_gives_a_new_array():
    """No pass runs when the box is the output size at the origin: the result must still
    be a new array (the input may be a decoder's buffer its next decode overwrites)."""
    kernels = [resample_ref.resample]
    try:
        from zephon._kernels.resample import resample as compiled
    except ImportError:
        pass
    else:
        kernels.append(compiled)
    for width in (5, 1):  # one column: its mirror is still contiguous, still the input
        src = np.arange(4 * width * 3, dtype=np.uint8).reshape(4, width, 3)
        for kernel in kernels:
            for flip in (False, True):
                out = kernel(src, (0, 0, width, 4), (width, 4), "bilinear", flip)
                assert not np.shares_memory(out, src)
                assert np.array_equal(out, src[:, ::-1] if flip else src)
                assert out.flags.c_contiguous and out.flags.writeable


def test_wide_outputs_stay_compiled_and_exact():
    """Rows wider than the old stack accumulator (4096 values) are resized by the
    compiled kernel too, with the reference's bits."""
    compiled = pytest.importorskip("zephon._kernels.resample",
                                   reason="zephon's kernels are not built")
    src = np.random.default_rng(5).integers(0, 256, (7, 900, 3), dtype=np.uint8)
    for size in ((1366, 3), (2100, 5)):
        got = compiled.resample(src, (0.5, 0.25, 899.5, 6.5), size, "bilinear")
        assert np.array_equal(got, resample_ref.resample(src, (0.5, 0.25, 899.5, 6.5),
                                                         size, "bilinear"))
