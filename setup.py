"""Build of the compiled kernels.

Every ``kernels/<name>.pyx`` becomes the extension module
``zephon._kernels.<name>``, compiled with NumPy's headers. Metadata lives in
pyproject.toml; this file only declares the extensions.

``ZEPHON_BUILD_DEBUG=1`` keeps bounds and wraparound checks in the kernels
(for debugging a kernel against its reference).
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
