"""token_windows: fixed-length windows over a flat token file (nanoGPT style).

The file is a raw array of ``uint16`` or ``uint32`` tokens (``.bin``), or a
``.npy`` array (its header gives the dtype, which must then agree with ``dtype``
if one is given): a file named ``*.npy`` in any case, or one that starts with the
``.npy`` magic bytes ``\x93NUMPY`` whatever its name (a renamed ``.npy`` is never
read as raw tokens, header included). Sample ``i`` is
``{"tokens": tokens[i*seq_len:(i+1)*seq_len]}``; the tail shorter than ``seq_len``
is not a sample, and a file of fewer than ``seq_len`` tokens (not one window) is a
ZephonConfigError naming its token count. ``seq_len`` and ``vocab_size`` are ints
(Python or NumPy).

Checked when the source is built (a SourceError naming the path): the path is
one existing regular file (not a directory), its data is a whole number of
tokens (a ``.bin`` whose size is not a multiple of the dtype's size is the wrong
dtype or a damaged file), a ``.npy`` header parses and its shape matches the
bytes that follow it. With ``vocab_size=``, a sample of the file (a few stretches
spread over it, :data:`VOCAB_PROBE_STRETCHES` of :data:`VOCAB_PROBE_BYTES`) read
as ``dtype`` must lie in ``[0, vocab_size)``: a ``uint16`` file read as ``uint32``
is a ZephonConfigError naming the dtype under which it does (a ``uint32`` file
read as ``uint16`` passes it: its halves are valid ids). A misspelled ``dtype`` is
a ZephonConfigError too.

Reads: each reading process opens the file once and reads each window with one
``os.preadv`` into a fresh NumPy array (no memory mapping: a file that shrinks
under a mapping kills the process with SIGBUS; here a shrink is a short read).
Every read also checks the open file's size and mtime (``fstat``) against those
seen when the source was built, and opening checks the device and inode too: a
file truncated, grown, rewritten or replaced after building is a SourceError
naming the file and what changed, on every runner. (A process that already has
the file open keeps reading the file it indexed when another one is renamed over
its path.) A remote file with the cache enabled is read the same way from its
cached copy (checked against the copy's identity when first opened); with the
cache disabled it is read window by window with exact ranged requests.

A fused ``read -> batch`` reads a batch's windows together
(:meth:`TokenWindows.get_batch`: one ``fstat`` per batch, one ``os.preadv`` per run
of consecutive windows, straight into the batch's rows), and on the process runner
many such batches travel in one message (:func:`~zephon.pipeline.program.batches_per_message`):
the windows are a few KiB each, so moving them one by one cost more than reading
them. The batches are exactly those of reading window by window; any check that
fails in the batched read sends the batch back to the window-by-window read, so
each error is the same either way.
"""

from __future__ import annotations

import ast
import os
from typing import Any

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.io.config import DEFAULT_IO, IoConfig
from zephon.io.remote import expand, is_remote, read_range
from zephon.pipeline.sources.base import FileSource, SourceError
from zephon.pipeline.sources.files import changed, identity, require_regular_files

__all__ = ["TokenWindows"]

_DTYPES = ("uint16", "uint32", "int32", "int64", "uint8")
#: the first bytes of a ``.npy`` file: a file that starts with them is read as one
_NPY_MAGIC = b"\x93NUMPY"
#: the vocabulary check (``vocab_size=``) reads this many stretches of the file ...
VOCAB_PROBE_STRETCHES = 4
#: ... of this many bytes each, spread evenly over it (at offsets aligned for every dtype)
VOCAB_PROBE_BYTES = 64 << 10


def _token_dtype(dtype: Any) -> np.dtype | None:
    """``dtype=`` as a NumPy token dtype (None stays None: a ``.npy`` file's own)."""
    if dtype is None:
        return None
    try:
        found = np.dtype(dtype)
    except (TypeError, ValueError):
        found = None
    if found is None or str(found) not in _DTYPES:
        raise ZephonConfigError(f"token_windows: dtype must be one of {_DTYPES} (or None for "
                                f"a .npy file's own), got {dtype!r}")
    return found


def _fitting(data: int, but: np.dtype) -> str:
    """The other token dtypes a file of ``data`` bytes is a whole number of, for a message."""
    fits = [f"dtype={d!r}" for d in _DTYPES if d != str(but) and not data % np.dtype(d).itemsize]
    return f" (its size fits {' or '.join(fits)})" if fits else ""


def _in_vocab(stretches: list[bytes], dtype: np.dtype, vocab_size: int) -> tuple[int, int] | None:
    """The first token of ``stretches`` read as ``dtype`` outside ``[0, vocab_size)``, as
    ``(token, place in the sample)``, or None."""
    seen = 0
    for raw in stretches:
        tokens = np.frombuffer(raw[:len(raw) - len(raw) % dtype.itemsize], dtype=dtype)
        bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
        if bad.size:
            return int(tokens[bad[0]]), seen + int(bad[0])
        seen += tokens.size
    return None


def _npy_header(head: bytes, path: str) -> tuple[np.dtype, int, int]:
    """(dtype, data offset, number of elements) of a .npy file from its first bytes."""
    if head[:6] != _NPY_MAGIC:
        raise SourceError(f"token_windows: {path} is not a .npy file (bad magic)")
    major = head[6] if len(head) > 6 else 0
    if major == 1:
        hlen, start = int.from_bytes(head[8:10], "little"), 10
    else:
        hlen, start = int.from_bytes(head[8:12], "little"), 12
    try:
        header = ast.literal_eval(head[start:start + hlen].decode("latin1"))
        shape, dtype = header["shape"], np.dtype(header["descr"])
        fortran = header.get("fortran_order")
    except (ValueError, SyntaxError, TypeError, KeyError, AttributeError,
            MemoryError, RecursionError) as exc:
        raise SourceError(f"token_windows: {path}: unreadable .npy header (bytes 0-"
                          f"{start + hlen}): {type(exc).__name__}: {exc}") from None
    if fortran or not isinstance(shape, tuple) or len(shape) != 1:
        raise SourceError(f"token_windows: {path} must hold a 1-D C-order array, got "
                          f"{header}")
    return dtype, start + hlen, int(shape[0])


class TokenWindows(FileSource):
    _per_process = ("_fh", "_fd")

    def __init__(self, path: str, seq_len: int, dtype: str | None, name: str,
                 io: IoConfig = DEFAULT_IO, storage_options: dict | None = None,
                 vocab_size: int | None = None) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or \
                seq_len < 1:
            raise ZephonConfigError(f"token_windows: seq_len must be an int >= 1, got {seq_len!r}")
        seq_len = int(seq_len)
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(
                vocab_size, (int, np.integer)) or vocab_size < 1):
            raise ZephonConfigError(f"token_windows: vocab_size must be an int >= 1 (or None: "
                                    f"not checked), got {vocab_size!r}")
        given = _token_dtype(dtype)
        path = os.fspath(path)
        self.path, self.seq_len, self.name = path, seq_len, name
        self.io, self.storage_options = io, storage_options
        refs = expand(path, "token_windows", io, storage_options)
        if len(refs) != 1:
            raise SourceError(f"token_windows: {path!r} must name one file, matches {len(refs)}")
        require_regular_files(refs, "token_windows")
        self._set_files(refs)
        self._fresh()
        # the identity the reads are checked against (local files; None: see _open)
        self.stat = None if refs[0].remote else identity(os.stat(refs[0].url))
        size = refs[0].size if self.stat is None else self.stat[2]
        self.offset = 0
        if path.lower().endswith(".npy") or self._starts_npy(size):
            self.dtype = self._npy(path, size, given)
        else:
            self.dtype = given if given is not None else np.dtype("uint16")
        data = size - self.offset
        if data % self.dtype.itemsize:
            raise SourceError(f"token_windows: {path}: {data} bytes of tokens is not a multiple "
                              f"of {self.dtype.itemsize} ({self.dtype}): a wrong dtype="
                              f"{_fitting(data, self.dtype)} or a damaged file")
        self.n_tokens = data // self.dtype.itemsize
        if self.n_tokens < seq_len:
            raise ZephonConfigError(f"token_windows: {path} holds {self.n_tokens} tokens, fewer "
                                    f"than seq_len={seq_len}: not one window; give a shorter "
                                    f"seq_len, or a longer file", field="token_windows.seq_len")
        self.nbytes = self.seq_len * self.dtype.itemsize
        if vocab_size is not None:
            self._check_vocab(int(vocab_size), data)

    def _starts_npy(self, size: int) -> bool:
        """Whether the file starts with the ``.npy`` magic bytes: read on their own (one
        ranged request for a remote file, never the whole file into the cache)."""
        if size < len(_NPY_MAGIC):
            return False
        ref = self.refs[0]
        if ref.remote:
            head = read_range(ref, 0, len(_NPY_MAGIC), self.io, self.storage_options, "header")
        else:
            try:
                with open(ref.url, "rb") as fh:
                    head = fh.read(len(_NPY_MAGIC))
            except OSError as exc:
                raise SourceError(f"token_windows: cannot open {self.path}: {exc}") from None
        return head == _NPY_MAGIC

    def _npy(self, path: str, size: int, given: np.dtype | None) -> np.dtype:
        """The dtype of a ``.npy`` file (by its name, any case, or its magic bytes), its
        header checked against the file; sets ``self.offset`` past the header."""
        head = self.reader(0).pread(0, min(size, 4096), "header")
        found, self.offset, count = _npy_header(head, path)
        if given is not None and given != found:
            raise SourceError(f"token_windows: {path} holds {found}, dtype={str(given)!r} "
                              f"given")
        if str(found) not in _DTYPES:
            raise SourceError(f"token_windows: {path} holds {found}; token files hold "
                              f"one of {_DTYPES}")
        if count * found.itemsize != size - self.offset:
            raise SourceError(f"token_windows: {path}: the .npy header says {count} "
                              f"tokens of {found}, the file holds {size - self.offset} "
                              f"bytes of data")
        return found

    def _check_vocab(self, vocab_size: int, data: int) -> None:
        """Refuse a file whose tokens, read as ``self.dtype``, fall outside the vocabulary:
        checked on :data:`VOCAB_PROBE_STRETCHES` stretches of :data:`VOCAB_PROBE_BYTES`
        spread over the file (a sample, not every token), naming the dtypes under which
        the same bytes are all in the vocabulary."""
        span = min(data, VOCAB_PROBE_BYTES)
        starts = sorted({(data - span) * j // max(1, VOCAB_PROBE_STRETCHES - 1) // 8 * 8
                         for j in range(VOCAB_PROBE_STRETCHES)})
        stretches = [self.reader(0).pread(self.offset + at, min(span, data - at),
                                          "vocabulary check") for at in starts]
        bad = _in_vocab(stretches, self.dtype, vocab_size)
        if bad is None:
            return
        likely = [d for d in _DTYPES if d != str(self.dtype)  # uint8 fits any vocabulary:
                  and np.iinfo(d).max >= vocab_size            # it tells nothing
                  and not data % np.dtype(d).itemsize
                  and _in_vocab(stretches, np.dtype(d), vocab_size) is None]
        fix = (f"the file was likely written as {' or '.join(f'dtype={d!r}' for d in likely)}"
               if likely else "a wrong dtype= or vocab_size=, or a damaged file")
        raise ZephonConfigError(
            f"token_windows: {self.path} holds token {bad[0]} read as {self.dtype}, outside "
            f"vocab_size={vocab_size} (checked on {len(starts)} stretch(es) of up to {span} bytes "
            f"spread over the file): {fix}", field="token_windows.dtype")

    def _fresh(self) -> None:
        super()._fresh()
        self._fh: Any = None
        self._fd = -1

    def __len__(self) -> int:
        return self.n_tokens // self.seq_len

    def _open(self, i: int) -> int:
        """This process's descriptor of the (local or cached) file, checked against the
        identity seen when the source was built."""
        with self._lock:
            if self._fh is None:
                path = self.reader(0).local_file(f"window {i}")
                try:
                    fh = open(path, "rb", buffering=0)
                except OSError as exc:
                    raise SourceError(f"token_windows: cannot open {self.path}: {exc}") from None
                now = identity(os.fstat(fh.fileno()))
                if self.stat is None:  # a cached remote file: its copy as first opened
                    self.stat = now
                self._fh = fh
                self._fd = fh.fileno()
                self._check(now, i)
        return self._fd

    def _check(self, now: tuple, i: int) -> None:
        assert self.stat is not None
        what = changed(self.stat, now)
        if what is not None:
            raise SourceError(f"token_windows: {self.path}, window {i}: the file changed "
                              f"after the source was built: {what}")

    def get(self, i: int) -> Any:
        return self._read(i, self._checked_fd(i))

    def _checked_fd(self, i: int) -> int:
        """This process's descriptor of the file after one ``fstat`` check that it is as
        built (-1 for a streamed remote file: each window is then a ranged request)."""
        if not 0 <= i < self.n_tokens // self.seq_len:
            raise IndexError(f"token_windows: window {i} out of range [0, {len(self)})")
        fd = self._fd
        if fd < 0:
            if self.reader(0).streamed:
                return -1
            fd = self._open(i)
        st = os.fstat(fd)
        if st.st_size != self.stat[2] or st.st_mtime_ns != self.stat[3]:  # type: ignore[index]
            self._check(identity(st), i)
        return fd

    def _read(self, i: int, fd: int) -> dict:
        """Window ``i`` through ``fd`` (checked by :meth:`_checked_fd`)."""
        if not 0 <= i < self.n_tokens // self.seq_len:
            raise IndexError(f"token_windows: window {i} out of range [0, {len(self)})")
        at = self.offset + i * self.nbytes
        if fd < 0:
            data = self.reader(0).pread(at, self.nbytes, f"window {i}")
            return {"tokens": np.frombuffer(data, dtype=self.dtype).copy()}
        out = np.empty(self.seq_len, dtype=self.dtype)
        got = os.preadv(fd, [out.data], at)
        if got != self.nbytes:
            raise SourceError(f"token_windows: {self.path}, window {i}: truncated: expected "
                              f"{self.nbytes} bytes at offset {at}, read {got}")
        return {"tokens": out}

    def view(self, indices, epoch: int) -> "_WindowsView":
        """The windows of one read unit: the file is checked (one ``fstat``: its size and
        mtime as built) once for the unit, not once per window, then each window is one
        ``os.preadv``."""
        return _WindowsView(self, indices)

    def get_batch(self, indices) -> dict | None:
        """Windows ``indices`` collated (see :meth:`Source.get_batch`): one ``(n, seq_len)``
        array, each run of consecutive windows read with one ``os.preadv`` straight into its
        rows, after one ``fstat`` check of the whole batch.

        None (the windows are then read one by one, each with its own check and error)
        when the file is streamed (ranged requests per window), an index is out of range,
        the file changed since the source was built, or a read comes back short."""
        idx = np.asarray(indices, dtype=np.int64)
        n = idx.size
        if n == 0 or int(idx.min()) < 0 or int(idx.max()) >= len(self):
            return None
        fd = self._fd
        if fd < 0:
            if self.reader(0).streamed:
                return None
            try:
                fd = self._open(int(idx[0]))
            except SourceError:
                return None
        st = os.fstat(fd)
        if st.st_size != self.stat[2] or st.st_mtime_ns != self.stat[3]:  # type: ignore[index]
            return None
        out = np.empty((n, self.seq_len), dtype=self.dtype)
        rows = out.data.cast("B")
        size = self.nbytes
        cuts = (np.flatnonzero(np.diff(idx) != 1) + 1).tolist()
        for a, b in zip([0, *cuts], [*cuts, n], strict=True):
            want = (b - a) * size
            if os.preadv(fd, [rows[a * size:b * size]], self.offset + int(idx[a]) * size) \
                    != want:
                return None
        return {"tokens": out}

    def known_tokens_per_sample(self) -> float | None:
        """Every window holds ``seq_len`` tokens."""
        return float(self.seq_len)

    def sample_nbytes(self) -> float | None:
        """Bytes of one window: ``seq_len`` tokens of the file's dtype."""
        return float(self.nbytes)

    def stamps(self, now: bool = False) -> list[tuple[str, int, str]] | None:
        """The token file as it was when the source was built (its size and mtime; a
        remote one: its version), or with ``now`` as it is now; see
        :meth:`Source.stamps`."""
        if now or self.refs[0].remote or self.stat is None:
            return super().stamps(now)
        return [(os.path.basename(self.path), self.stat[2], f"mtime:{self.stat[3]}")]

    def describe(self) -> str:
        where = self.path if is_remote(self.path) else os.path.basename(self.path)
        return (f"TokenWindows({self.name}, {where}, "
                f"tokens={self.n_tokens}, seq_len={self.seq_len}, {self.dtype.str})")


class _WindowsView:
    """:meth:`TokenWindows.view`: the unit's windows, the file checked at the first read."""

    __slots__ = ("fd", "indices", "source")

    def __init__(self, source: TokenWindows, indices) -> None:
        self.source, self.fd = source, -2  # -2: not checked yet (-1: a streamed file)
        self.indices = indices.tolist() if isinstance(indices, np.ndarray) else list(indices)

    def identity(self, n: int) -> tuple[str, int]:
        return self.source.identity(self.indices[n])

    def get(self, n: int) -> Any:
        i = self.indices[n]
        if self.fd == -2:
            self.fd = self.source._checked_fd(i)
        return self.source._read(i, self.fd)
