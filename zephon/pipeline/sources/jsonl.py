"""jsonl: one JSON object per line, over local or remote files, plain or compressed.

The files (paths, globs or fsspec URLs; each glob sorted; a local path must be a
regular file) are read once when the source is built to index the non-blank
lines: sample ``i`` is the ``i``-th such line over all files, its identity the
file and line. Lines end at ``\\n`` (a ``\\r`` before it is JSON whitespace); a
line of only whitespace is blank.

Index: built by streaming each file in blocks of ``_BLOCK`` bytes through a
vectorised newline scan; only the index itself (28 bytes per line: start, end,
file, line number) grows with the file, never a copy of it.

Parse errors: a line that is not valid JSON (also not UTF-8, or nested deeper
than Python's recursion limit), or holds something other than an object, raises
a :class:`SourceError` when it is read, naming the file, the line and the byte
offset where the line starts (in the decompressed stream for a compressed file).

``.jsonl.gz`` and ``.jsonl.zst`` files are indexed on their decompressed bytes,
streamed; a file that decompresses to more than ``max_decompressed_bytes``
(default :data:`DEFAULT_MAX_DECOMPRESSED`, 1 GiB) is a SourceError naming it when
the source is built, so a small compressed file cannot expand without bound. A
compressed file cannot be read at an offset, so a reading process decompresses a
file once on first use and keeps it in memory; it keeps at most
``max_decompressed_bytes`` of decompressed files in all (least recently used
first out; split big corpora into shards).
"""

from __future__ import annotations

import gzip
import json
import os
import threading
from collections import OrderedDict
from typing import Any, Iterator, Sequence

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.io.config import DEFAULT_IO, IoConfig
from zephon.io.index import learn, load_detail
from zephon.io.remote import expand, is_remote
from zephon.pipeline.sources.base import FileSource, SourceError
from zephon.pipeline.sources.files import require_regular_files

__all__ = ["DEFAULT_MAX_DECOMPRESSED", "JsonlSource"]

DEFAULT_MAX_DECOMPRESSED = 1 << 30
_BLOCK = 2 << 20
# bytes.strip()'s whitespace: a line of only these is blank
_TEXT = np.ones(256, dtype=bool)
_TEXT[list(b" \t\n\r\x0b\x0c")] = False


def _codec(path: str) -> str | None:
    if path.endswith(".gz"):
        return "gzip"
    if path.endswith((".zst", ".zstd")):
        return "zstd"
    return None


def _decompressing(fh, codec: str):
    if codec == "gzip":
        return gzip.GzipFile(fileobj=fh, mode="rb")
    import zstandard

    return zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True)


def _blocks(fh, codec: str | None, path: str, limit: int) -> Iterator[bytes]:
    """The (decompressed) bytes of ``fh`` in blocks; a compressed stream longer than
    ``limit`` bytes, or corrupt, is a SourceError naming ``path``."""
    stream = _decompressing(fh, codec) if codec else fh
    total = 0
    while True:
        try:
            block = stream.read(_BLOCK)
        except Exception as exc:  # noqa: BLE001 - gzip/zstd/io raise many classes
            what = f"cannot decompress ({codec})" if codec else "cannot read"
            raise SourceError(f"jsonl: {path}: {what} after {total} bytes: "
                              f"{type(exc).__name__}: {exc}") from None
        if not block:
            return
        total += len(block)
        if codec and total > limit:
            raise SourceError(f"jsonl: {path} decompresses to more than "
                              f"max_decompressed_bytes={limit} bytes; pass a larger "
                              f"max_decompressed_bytes= or split the file")
        yield block


class _LineIndex:
    """Start, end and line number of the non-blank lines of one stream, fed block by
    block; a line may span blocks (only whether it holds text so far is carried)."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.pos = 0              # stream offset of the next block
        self.open_start = 0       # where the unfinished line began
        self.open_text = False    # whether it holds a non-whitespace byte
        self.lines = 0            # lines finished so far

    def feed(self, block: bytes) -> None:
        arr = np.frombuffer(block, dtype=np.uint8)
        nl = np.flatnonzero(arr == 10)
        if not len(nl):
            self.open_text = self.open_text or bool(block.strip())
            self.pos += len(arr)
            return
        starts = np.empty(len(nl), dtype=np.int64)
        starts[0], starts[1:] = 0, nl[:-1] + 1
        ends = nl + 1
        # a line whose first byte is text holds text; the others (rare) are looked at whole
        keep = _TEXT[arr[starts]]
        for j in np.flatnonzero(~keep).tolist():
            keep[j] = bool(block[starts[j]:ends[j]].strip())
        keep[0] = self.open_text or bool(block[:int(ends[0])].strip())
        starts += self.pos
        starts[0] = self.open_start
        numbers = np.arange(self.lines + 1, self.lines + 1 + len(nl), dtype=np.int64)
        self.parts.append((starts[keep], (ends + self.pos)[keep], numbers[keep]))
        self.lines += len(nl)
        self.open_start = self.pos + int(nl[-1]) + 1
        self.open_text = bool(block[int(nl[-1]) + 1:].strip())
        self.pos += len(arr)

    def finish(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.open_text:  # a last line without a newline
            one = np.ones(1, dtype=np.int64)
            self.parts.append((one * self.open_start, one * self.pos, one * (self.lines + 1)))
        if not self.parts:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        return tuple(np.concatenate(col) for col in zip(*self.parts, strict=True))  # type: ignore[return-value]


class JsonlSource(FileSource):
    _per_process = ("_plain", "_plain_lock", "_tables", "_proven")

    def __init__(self, paths: str | Sequence[str], name: str, io: IoConfig = DEFAULT_IO,
                 storage_options: dict | None = None,
                 max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED,
                 index: Any = None) -> None:
        if (isinstance(max_decompressed_bytes, bool)
                or not isinstance(max_decompressed_bytes, (int, np.integer))
                or max_decompressed_bytes < 1):
            raise ZephonConfigError(f"jsonl: max_decompressed_bytes must be an int >= 1, got "
                                    f"{max_decompressed_bytes!r}")
        self.name, self.io, self.storage_options = name, io, storage_options
        self.max_decompressed_bytes = int(max_decompressed_bytes)
        self._set_files(expand(paths, "jsonl", io, storage_options,
                               suffixes=(".jsonl", ".jsonl.gz", ".jsonl.zst")))
        require_regular_files(self.refs, "jsonl")
        self._fresh()
        learnt = learn(self, "jsonl", 1, self._learn_file, index=index, detail=True)
        #: per file ``[facts, detail]``: the detail (its line table) inline, or the digest of
        #: its blob in the shared index (``index_store``), read when the file is first read
        self.file_entries = list(learnt)
        self.index_store = learnt.store
        self.index_counts = (learnt.read, learnt.scanned)
        self.plain_size = [int(facts["bytes"]) for facts, _ in self.file_entries]
        counts = [int(facts["lines"]) for facts, _ in self.file_entries]
        self.file_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def _learn_file(self, k: int) -> tuple[dict, bytes]:
        """File ``k``'s facts (lines, decompressed bytes) and line table (int64 starts,
        ends and line numbers, as bytes)."""
        index = _LineIndex()
        with self._stream(k, "building the line index") as blocks:
            for block in blocks:
                index.feed(block)
        starts, ends, numbers = index.finish()
        self._readers.pop(k, None)  # the builder keeps no open file
        table = np.stack([starts, ends, numbers]).astype(np.int64)
        self._tables[k] = table  # scanned here: used as it is
        self._proven.add(k)
        return {"lines": len(starts), "bytes": index.pos}, table.tobytes()

    def lines(self, k: int) -> np.ndarray:
        """File ``k``'s line table: rows of starts, ends and line numbers (``(3, n)``)."""
        table = self._tables.get(k)
        if table is None:
            facts, detail = self.file_entries[k]
            raw = load_detail(self.index_store, [facts, detail], self.files[k])
            n = int(facts["lines"])
            if not isinstance(raw, bytes) or len(raw) != 24 * n:
                raise SourceError(f"jsonl: {self.files[k]}: the index's line table does not "
                                  f"hold the {n} lines its entry names; rebuild the index")
            table = np.frombuffer(raw, dtype=np.int64).reshape(3, n)
            self._check_table(k, table)
            with self._plain_lock:
                self._tables.setdefault(k, table)
        return table

    def _check_table(self, k: int, table: np.ndarray) -> None:
        """A line table read from the shared index cuts the file into lines in order: each
        line inside the file and after the one before (none listed twice, none out of
        order), numbered rising; a plain file's size is the one indexed. (A compressed
        file's table is compared with the file itself once it is decompressed.)"""
        starts, ends, numbers = table
        n, size = len(starts), self.plain_size[k]
        plain = not _codec(self.files[k])
        if (plain and size != self.refs[k].size) or (n and (
                starts[0] < 0 or ends[-1] > size or (ends <= starts).any()
                or (starts[1:] < ends[:-1]).any() or (numbers[1:] <= numbers[:-1]).any()
                or numbers[0] < 1)):
            raise SourceError(f"jsonl: {self.files[k]}: the line table "
                              f"{self.index_store.top if self.index_store else 'the index'} "
                              f"holds does not cut the file's {size} bytes into lines in "
                              f"order: the index is forged or stale; rebuild it with "
                              f"`python -m zephon index --rebuild`")

    @property
    def line_no(self) -> np.ndarray:
        """Every sample's line number in its file (1-based), over all files."""
        return np.concatenate([self.lines(k)[2] for k in range(len(self.files))]) \
            if self.files else np.zeros(0, dtype=np.int64)

    def _fresh(self) -> None:
        super()._fresh()
        self._plain: OrderedDict[int, bytearray] = OrderedDict()
        self._plain_lock = threading.Lock()
        self._tables: dict[int, np.ndarray] = {}
        self._proven: set[int] = set()  # files whose line table this process scanned

    class _Stream:
        def __init__(self, fh, blocks) -> None:
            self.fh, self.blocks = fh, blocks

        def __enter__(self):
            return self.blocks

        def __exit__(self, *exc) -> None:
            self.fh.close()

    def _stream(self, k: int, context: str) -> "_Stream":
        """The (decompressed) blocks of file ``k``, in a context that closes it."""
        try:
            fh = self.reader(k).file_object(context)
        except OSError as exc:
            raise SourceError(f"jsonl: cannot read {self.files[k]}: {exc}") from None
        path = self.files[k]
        return self._Stream(fh, _blocks(fh, _codec(path), path, self.max_decompressed_bytes))

    def _decompressed(self, k: int, context: str) -> bytearray:
        """All decompressed bytes of file ``k``, as indexed."""
        out = bytearray(self.plain_size[k])
        at = 0
        with self._stream(k, context) as blocks:
            for block in blocks:
                if at + len(block) > len(out):
                    at += len(block)
                    break
                out[at:at + len(block)] = block
                at += len(block)
        if at != len(out):
            raise SourceError(f"jsonl: {self.files[k]}, {context}: the file changed after the "
                              f"source was built: it decompresses to "
                              f"{'more than ' if at > len(out) else ''}{at} bytes, "
                              f"{len(out)} when indexed")
        return out

    def __len__(self) -> int:
        return int(self.file_starts[-1])

    def shard_bounds(self) -> np.ndarray:
        """The files: each one's lines are consecutive indices (a compressed file is one
        stream, read once in order)."""
        return self.file_starts

    def _held(self, k: int, context: str) -> bytearray:
        """File ``k`` decompressed, from this process's bounded set."""
        with self._plain_lock:
            data = self._plain.get(k)
            if data is not None:
                self._plain.move_to_end(k)
                return data
            data = self._decompressed(k, context)
            if k not in self._proven:  # a table from the index: the file's own lines?
                index = _LineIndex()
                for at in range(0, len(data), _BLOCK):
                    index.feed(bytes(data[at:at + _BLOCK]))
                if not np.array_equal(np.stack(index.finish()), self.lines(k)):
                    raise SourceError(f"jsonl: {self.files[k]}: its lines are not the ones "
                                      f"the line table of {self.index_store.top if self.index_store else 'the index'} "
                                      f"lists: the index is forged or stale; rebuild it with "
                                      f"`python -m zephon index --rebuild`")
                self._proven.add(k)
            held = sum(len(v) for v in self._plain.values())
            while self._plain and held + len(data) > self.max_decompressed_bytes:
                held -= len(self._plain.popitem(last=False)[1])
            self._plain[k] = data
            return data

    def _line(self, k: int, start: int, end: int, number: int) -> bytes | bytearray:
        context = f"line {number}"
        if _codec(self.files[k]):
            return self._held(k, context)[start:end]
        before = 1 if start else 0
        line = self.reader(k).pread(start - before, end - start + before, context)
        # a line lies between line ends (or the file's ends): an index entry that does not
        # cut the file at line ends (forged or stale) fails here
        if (before and line[:1] != b"\n") or (line[-1:] != b"\n" and end != self.plain_size[k]):
            raise SourceError(f"jsonl: {self.files[k]}: {context} is not a whole line at "
                              f"bytes [{start}, {end}) of the file: the index is forged or "
                              f"stale; rebuild it with `python -m zephon index`")
        return line[before:]

    def get(self, i: int) -> Any:
        if not 0 <= i < len(self):
            raise IndexError(f"jsonl: sample {i} out of range [0, {len(self)})")
        k = int(np.searchsorted(self.file_starts, i, side="right")) - 1
        path = self.files[k]
        starts, ends, numbers = self.lines(k)
        j = i - int(self.file_starts[k])
        start, end, number = int(starts[j]), int(ends[j]), int(numbers[j])
        line = self._line(k, start, end, number)
        where = f"jsonl: {path}, line {number}"
        at = f"the line starts at byte {start}"
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise SourceError(f"{where}: invalid JSON ({exc}); {at}") from None
        except RecursionError:
            raise SourceError(f"{where}: nested too deeply to parse (beyond Python's "
                              f"recursion limit); {at}") from None
        if not isinstance(value, dict):
            raise SourceError(f"{where}: expected an object, got {type(value).__name__}; "
                              f"{at}")
        return value

    def describe(self) -> str:
        names = [f if is_remote(f) else os.path.basename(f) for f in self.files]
        return f"JsonlSource({self.name}, files={names}, n={len(self)})"
