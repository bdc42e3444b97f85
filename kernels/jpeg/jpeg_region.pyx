# cython: language_level=3
"""One rectangle of a JPEG decoded at a DCT scale, decoding only what it needs
(libjpeg's ``jpeg_crop_scanline`` and ``jpeg_skip_scanlines``; see ``zj_region.c``;
libjpeg-turbo 2.1.3 or later).

Built only where libjpeg's headers are found at build time (``setup.py``);
:mod:`zephon.vision.decode` uses it when it imports and falls back to simplejpeg and
Pillow otherwise.
"""

cdef extern from "zj_region.h":
    ctypedef struct zj_result:
        int x
        int width
        int components
        int warnings
        char message[200]
    int zj_decode_region(const unsigned char *data, size_t size, int scale, int x, int y,
                         int w, int h, int gray, int fast_idct, int fast_upsample, int cut,
                         unsigned char *out, size_t out_size, zj_result *result) nogil


def decode_region(const unsigned char[::1] data, int scale, int x, int y, int w, int h,
                  bint gray, bint fast_idct, bint fast_upsample, unsigned char[::1] out,
                  bint cut=False):
    """Decode rows ``y:y+h`` and at least columns ``x:x+w`` of the JPEG ``data`` at
    1/``scale`` into ``out``, row after row.

    ``cut``: the frame height in ``data`` was cut by the caller (libjpeg's warning about
    the data past it is then expected, not counted).

    Returns ``(status, x0, width, components, warnings, message)``: ``status`` 0 done,
    1 libjpeg failed (``message``), 2 ``out`` too small, 3 declined (sampling factors
    above 2); the rows written start at
    column ``x0`` (``<= x``, an iMCU edge) and are ``width`` pixels of ``components``
    bytes each. The GIL is released while libjpeg runs."""
    cdef zj_result result
    cdef int status
    cdef size_t n = data.shape[0], m = out.shape[0]
    if n == 0 or m == 0:
        return 1, 0, 0, 0, 0, "empty input or output"
    with nogil:
        status = zj_decode_region(&data[0], n, scale, x, y, w, h, gray, fast_idct,
                                  fast_upsample, cut, &out[0], m, &result)
    return (status, result.x, result.width, result.components, result.warnings,
            result.message.decode("latin-1"))
