"""The suite's own guards (tests/conftest.py) look at what zephon made, nothing else."""

from __future__ import annotations

import os

import pytest
from conftest import SHM_DIR, zephon_shm_entries

from zephon.transport.arena import segment_name


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="names are listable on Linux only")
def test_the_shm_guard_counts_zephon_segments_only():
    import _posixshmem

    ours = segment_name(os.getpid(), os.getpid(), "c0de", 0)
    theirs = f"another-program-{os.getpid()}"
    for name in (ours, theirs):
        os.close(_posixshmem.shm_open("/" + name, os.O_CREAT | os.O_RDWR, 0o600))
    try:
        seen = zephon_shm_entries()
        assert ours in seen and theirs not in seen
    finally:
        for name in (ours, theirs):
            _posixshmem.shm_unlink("/" + name)
