"""Build of the compiled kernels.

Every ``kernels/<name>.pyx`` becomes the extension module
``zephon._kernels.<name>``, compiled with NumPy's headers. Metadata lives in
pyproject.toml; this file only declares the extensions.

``ZEPHON_BUILD_DEBUG=1`` keeps bounds and wraparound checks in the kernels
(for debugging a kernel against its reference).

One extension is optional: ``zephon._kernels.jpeg_region`` (``kernels/jpeg/``), the
region decoder of :mod:`zephon.vision`, links the system's libjpeg (libjpeg-turbo >= 2.1.3,
for a partial-decode API without its known bugs: an older library fails the compile, and
the build goes on without the kernel). It is built when ``jpeglib.h`` is found (in
``ZEPHON_JPEG_INCLUDE`` or the usual include directories) and skipped, with the build
going on, when it is not or when it fails to compile or link; the vision ops then use
simplejpeg and Pillow alone. ``ZEPHON_JPEG=0`` never builds it; ``ZEPHON_JPEG=1`` makes a
failure to build it an error.
"""

import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
debug = os.environ.get("ZEPHON_BUILD_DEBUG") == "1"

extensions = [
    Extension(
        f"zephon._kernels.{os.path.splitext(os.path.basename(path))[0]}",
        [os.path.relpath(path, HERE)],
        include_dirs=[numpy.get_include(), "kernels"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                       # PyDataMem_SetHandler (heap.pyx) is NumPy 1.22 API
                       ("NPY_TARGET_VERSION", "NPY_1_22_API_VERSION")],
        extra_compile_args=["-O3"] if os.name != "nt" else [],
    )
    for path in sorted(glob.glob(os.path.join(HERE, "kernels", "*.pyx")))
]


def _jpeg_include() -> str | None:
    """The directory holding libjpeg's ``jpeglib.h``, or None."""
    import sysconfig

    candidates = [os.environ.get("ZEPHON_JPEG_INCLUDE", ""), "/usr/include",
                  "/usr/local/include", "/opt/homebrew/include", "/opt/local/include",
                  sysconfig.get_paths().get("include", "")]
    for path in candidates:
        if path and os.path.exists(os.path.join(path, "jpeglib.h")):
            return path
    return None


jpeg_mode = os.environ.get("ZEPHON_JPEG", "auto")
jpeg_include = _jpeg_include() if jpeg_mode != "0" else None
if jpeg_mode == "1" and jpeg_include is None:
    raise SystemExit("ZEPHON_JPEG=1: jpeglib.h not found (set ZEPHON_JPEG_INCLUDE)")
if jpeg_include is not None:
    extensions.append(Extension(
        "zephon._kernels.jpeg_region",
        ["kernels/jpeg/jpeg_region.pyx", "kernels/jpeg/zj_region.c"],
        include_dirs=["kernels/jpeg", jpeg_include],
        libraries=["jpeg"],
        extra_compile_args=["-O3"] if os.name != "nt" else [],
        optional=jpeg_mode != "1",
    ))

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": debug,
            "wraparound": debug,
            "initializedcheck": debug,
            "cdivision": True,
            "embedsignature": True,
        },
    ),
)
