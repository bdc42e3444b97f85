"""Compiled kernels: ``kernels/<name>.pyx`` builds into ``zephon._kernels.<name>``.

Import them through :mod:`zephon.kernels`, which falls back to the pure
Python/NumPy references (with one warning) when a module is missing, and uses
the references everywhere when ``ZEPHON_PURE_PYTHON=1``.
"""
