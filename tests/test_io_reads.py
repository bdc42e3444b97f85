"""Local reads of the io layer: reads of any size, and which open errors are retried.

Real files only: a sparse file larger than one ``pread`` can return, a directory and a
path through a regular file (deterministic errors: one attempt), and a process that
runs out of file descriptors until its first failed attempt is logged (a transient
error: retried, then served).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from zephon import sources
from zephon.io import DEFAULT_IO, FileReader, FileRef, SourceError, open_with_retry

PATIENT = (5, 0.01, 0.02)  # five attempts: a retried error would log four warnings


def _retries(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("zephon.io") and "failed" in r.getMessage()]


@pytest.mark.slow
@pytest.mark.ci
def test_a_read_of_more_than_2_gib_is_served_whole(tmp_path):
    path = tmp_path / "sparse.bin"
    size = (2 << 30) + (100 << 20)  # 2.1 GiB, above Linux's 2,147,479,552 bytes per pread
    with open(path, "wb") as fh:
        os.truncate(fh.fileno(), size)
        fh.seek(0x7FFFF000 - 1)
        fh.write(b"A")  # the last byte one pread(2) returns...
        fh.write(b"B")  # ...and the first it leaves over
        fh.seek(size - 1)
        fh.write(b"Z")
    reader = FileReader(FileRef(str(path), size), DEFAULT_IO)
    try:
        data = reader.pread(0, size, "all of it")
        assert len(data) == size
        assert data[0x7FFFF000 - 1:0x7FFFF000 + 1] == b"AB" and data[-1:] == b"Z"
        del data
        with pytest.raises(SourceError, match=r"sparse\.bin, past the end: truncated: expected "
                                              rf"{size + 1} bytes"):
            reader.pread(0, size + 1, "past the end")
    finally:
        reader.close()


def test_deterministic_open_errors_are_raised_after_one_attempt(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="zephon.io")
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"\0" * 64)
    for path, error in ((tmp_path, IsADirectoryError), (plain / "inside", NotADirectoryError),
                        (tmp_path / "missing.bin", FileNotFoundError)):
        with pytest.raises(error):
            open_with_retry(str(path), "rb", PATIENT)
    assert _retries(caplog) == []
    directory = tmp_path / "tokens"
    directory.mkdir()
    with pytest.raises(Exception, match=r"tokens is a directory; a file is needed"):
        sources.token_windows(str(directory), 4, "uint8")  # refused when it is built
    assert _retries(caplog) == []


_EMFILE = textwrap.dedent("""
    import logging, os, resource, sys
    from zephon.io import open_with_retry
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    spare = []
    try:
        while True:  # every descriptor taken: the next open fails with EMFILE
            spare.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass

    class Release(logging.Handler):  # the first failed attempt frees the descriptors
        def emit(self, record):
            while spare:
                os.close(spare.pop())

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("zephon.io").addHandler(Release(logging.WARNING))
    with open_with_retry(sys.argv[1], "rb", (5, 0.0, 0.0)) as fh:
        print(fh.read().decode())
""")


def test_a_transient_open_error_is_retried(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("served")
    out = subprocess.run([sys.executable, "-c", _EMFILE, str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "served"
    assert "Too many open files" in out.stderr  # the warning of the failed attempt
