"""The small data files the documentation's examples read (``python -m zephon example-data DIR``).

What it owns: one writer per example file or directory, and the table of them
(:data:`EXAMPLES`). :func:`write_examples` writes every example into a directory:

- ``corpus/part-000.parquet``, ``corpus/part-001.parquet``: 2 x 100 rows of ``text``
  (str) and ``score`` (float32), row groups of 25 rows (``parquet`` extra: pyarrow);
- ``shards/train-000.tar``, ``shards/train-001.tar``: WebDataset shards, 2 x 50
  samples, each a ``.txt`` caption and a ``.json`` ``{"label": k}``;
- ``train.bin``: 64 x 1024 raw uint16 token ids below 50257 (the layout of a
  nanoGPT ``train.bin``);
- ``notes.jsonl.zst``: 200 zstd-compressed JSON lines ``{"text", "stars"}``;
- ``hf_saved/``: a ``datasets.Dataset`` of 64 rows (``text``, ``label``) written by
  ``save_to_disk`` (``hf`` extra: datasets).

Invariants:
- Deterministic: the contents depend on nothing but this module (fixed seeds, tar
  members with fixed metadata), so two runs write the same bytes (given the same
  versions of pyarrow and datasets).
- Small: under a megabyte in all.
- A format whose library is missing is skipped, not an error: its entry comes back
  with ``written=False`` and the install line of its extra, and the other files are
  still written.
- Nothing of the user's is lost or touched. Every file is written first into a fresh
  staging directory inside the target, then moved into place; before anything moves,
  each destination is checked: an existing file with other contents is refused unless
  ``force=True`` (the CLI's ``--force``), one with exactly the bytes it would get is
  left as it is, and a symbolic link anywhere on the way (at a file's path or at one of
  the directories holding it) is refused even with ``force``: nothing is ever written
  through a link, so nothing outside the target directory is written. A refusal moves
  nothing (the staging directory is removed). Only the listed paths are written;
  other files in the directory, also inside ``corpus/`` or ``shards/``, stay.

Nothing here prints: the CLI (:mod:`zephon.__main__`) reports the returned entries.
"""

from __future__ import annotations

import errno
import filecmp
import importlib
import io
import json
import os
import shutil
import stat
import tarfile
import tempfile
from dataclasses import dataclass
from typing import Callable

import numpy as np

TOKENS_VOCAB = 50257  # GPT-2's vocabulary: fits uint16, as in nanoGPT's train.bin
TOKENS_SEQ_LEN = 1024
TOKENS_WINDOWS = 64


@dataclass(frozen=True)
class ExampleFile:
    """One example file or directory, as :func:`write_examples` reports it.

    Attributes:
        path: relative to the target directory (a directory ends with ``/``).
        what: a one-line description of the contents.
        written: False when the library of its format is missing.
        install: the install line of the missing extra (empty when written).
        unchanged: True when every file of it was already there with the same bytes
            (nothing was written).
    """

    path: str
    what: str
    written: bool
    install: str = ""
    unchanged: bool = False


def _parquet_corpus(root: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = ["data", "loader", "token", "shard", "epoch", "batch", "lane", "seed"]
    rng = np.random.default_rng(1)
    os.makedirs(os.path.join(root, "corpus"), exist_ok=True)
    for f in range(2):
        texts = [" ".join(rng.choice(words, size=int(rng.integers(2, 12))))
                 for _ in range(100)]
        scores = rng.random(100).astype(np.float32)
        pq.write_table(pa.table({"text": texts, "score": scores}),
                       os.path.join(root, "corpus", f"part-{f:03d}.parquet"),
                       row_group_size=25)


def _tar_shards(root: str) -> None:
    os.makedirs(os.path.join(root, "shards"), exist_ok=True)
    for s in range(2):
        with tarfile.open(os.path.join(root, "shards", f"train-{s:03d}.tar"), "w",
                          format=tarfile.USTAR_FORMAT) as tar:
            for k in range(50):
                key = f"{s * 50 + k:06d}"
                members = (("txt", f"caption {s}-{k}".encode()),
                           ("json", json.dumps({"label": k % 10}).encode()))
                for ext, data in members:
                    info = tarfile.TarInfo(f"{key}.{ext}")  # mtime 0, uid 0, mode 0644
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def _token_file(root: str) -> None:
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, TOKENS_VOCAB, size=TOKENS_WINDOWS * TOKENS_SEQ_LEN,
                          dtype=np.uint16)
    tokens.tofile(os.path.join(root, "train.bin"))


def _jsonl_zst(root: str) -> None:
    import zstandard

    lines = "".join(json.dumps({"text": f"note {i}", "stars": i % 5}) + "\n"
                    for i in range(200))
    data = zstandard.ZstdCompressor(level=3).compress(lines.encode())
    with open(os.path.join(root, "notes.jsonl.zst"), "wb") as fh:
        fh.write(data)


def _hf_saved(root: str) -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"text": [f"text {i}" for i in range(64)],
                                     "label": [i % 2 for i in range(64)]})
    quiet = not datasets.utils.are_progress_bars_disabled()
    if quiet:  # its progress bar would be the only output on stderr
        datasets.disable_progress_bars()
    try:
        ds.save_to_disk(os.path.join(root, "hf_saved"))
    finally:
        if quiet:
            datasets.enable_progress_bars()


def _image_folder(root: str) -> None:
    from PIL import Image, ImageDraw

    classes = ("circle", "square", "stripes")
    rng = np.random.default_rng(3)
    for label, name in enumerate(classes):
        os.makedirs(os.path.join(root, "images", name), exist_ok=True)
        for k in range(8):
            w, h = int(rng.integers(120, 200)), int(rng.integers(90, 150))
            ramp = np.linspace(0, 1, w)[None, :, None] * rng.integers(40, 200, 3)
            pixels = (ramp + rng.normal(0, 8, (h, w, 3))).clip(0, 255).astype(np.uint8)
            img = Image.fromarray(pixels, "RGB")
            draw, box = ImageDraw.Draw(img), (w // 4, h // 4, 3 * w // 4, 3 * h // 4)
            fill = tuple(int(c) for c in rng.integers(0, 255, 3))
            if label == 0:
                draw.ellipse(box, fill=fill)
            elif label == 1:
                draw.rectangle(box, fill=fill)
            else:
                for x in range(0, w, 12):
                    draw.line((x, 0, x, h), fill=fill, width=4)
            img.save(os.path.join(root, "images", name, f"{k:03d}.jpg"), quality=90)


@dataclass(frozen=True)
class _Example:
    path: str
    what: str
    write: Callable[[str], None]
    module: str = ""  # the third-party module the format needs ("" = none beyond core)
    extra: str = ""


# The documentation's examples read exactly these paths (tests/test_docs.py checks that each
# block reading one runs after `python -m zephon example-data .`).
EXAMPLES = (
    _Example("corpus/", "2 Parquet files, 200 rows of text and score", _parquet_corpus,
             "pyarrow", "parquet"),
    _Example("shards/", "2 WebDataset tar shards, 100 samples of txt and json", _tar_shards),
    _Example("train.bin", f"{TOKENS_WINDOWS * TOKENS_SEQ_LEN} uint16 token ids",
             _token_file),
    _Example("notes.jsonl.zst", "200 zstd-compressed JSON lines of text and stars",
             _jsonl_zst),
    _Example("hf_saved/", "a datasets.Dataset of 64 rows saved with save_to_disk",
             _hf_saved, "datasets", "hf"),
    _Example("images/", "an ImageFolder of 3 classes, 24 JPEGs", _image_folder, "PIL",
             "vision"),
)


def install_line(extra: str) -> str:
    """The command installing ``extra`` from a zephon checkout (zephon is not on the index)."""
    return f'python -m pip install -e ".[{extra}]"'


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _staged_files(staging: str, entry: str) -> list[str]:
    """The files (relative to ``staging``) that the writer of ``entry`` made there."""
    top = os.path.join(staging, entry.rstrip("/"))
    if os.path.isfile(top):
        return [entry]
    return sorted(os.path.relpath(os.path.join(d, f), staging)
                  for d, _, files in os.walk(top) for f in files)


def _link_refused(path: str) -> OSError:
    return OSError(errno.ELOOP, f"{path} is a symbolic link: zephon example-data never "
                   "writes through a link (remove it, or pick another directory)")


def _destination_state(root: str, rel: str, staged: str) -> str:
    """``"new"``, ``"same"`` (identical bytes) or ``"differs"`` for ``root/rel``; raises
    when a component of the way is a symbolic link or not of the kind needed."""
    parts = rel.split("/")
    path = root
    for k, part in enumerate(parts):
        path = os.path.join(path, part)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return "new"
        if stat.S_ISLNK(mode):
            raise _link_refused(path)
        last = k == len(parts) - 1
        if not (stat.S_ISREG(mode) if last else stat.S_ISDIR(mode)):
            kind = "a file" if last else "a directory"
            raise FileExistsError(errno.EEXIST, f"{path} exists and is not {kind}: "
                                  "example-data cannot write there")
    return "same" if filecmp.cmp(staged, path, shallow=False) else "differs"


def _open_dir_nofollow(root_fd: int, parts: list[str]) -> int:
    """A descriptor of ``root/parts...``, each directory made if missing and opened with
    O_NOFOLLOW, so that a link planted after the check is still never followed."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            try:
                os.mkdir(part, 0o777, dir_fd=fd)
            except FileExistsError:
                pass
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _move_into_place(staging: str, root: str, files: list[str]) -> None:
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for rel in files:
            *dirs, name = rel.split("/")
            fd = _open_dir_nofollow(root_fd, dirs)
            try:  # os.replace swaps a directory entry: it never writes through a link
                os.replace(os.path.join(staging, rel), name, dst_dir_fd=fd)
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)


def write_examples(directory: str, *, force: bool = False) -> list[ExampleFile]:
    """Write every example file into ``directory`` (created if missing).

    Args:
        directory: where to write; the documentation's examples run in it.
        force: replace existing files of the listed names whose contents differ
            (without it they are refused). A symbolic link is refused either way.

    Returns:
        One :class:`ExampleFile` per entry of :data:`EXAMPLES`, in that order: written
        (or found already there, ``unchanged``), or skipped with the install line of its
        extra when its library is missing.

    Raises:
        FileExistsError: files of the listed names exist with other contents and
            ``force`` is False (the message lists them); nothing was written.
        OSError: a symbolic link on the way to a file (``errno.ELOOP``), or the
            directory cannot be created or written; nothing of the user's was changed.
    """
    os.makedirs(directory, exist_ok=True)
    root = os.path.realpath(directory)  # the directory the user named, links resolved
    staging = tempfile.mkdtemp(prefix=".zephon-example-data-", dir=root)
    try:
        out, moves, taken = [], [], []
        for ex in EXAMPLES:
            if ex.module and not _importable(ex.module):
                out.append(ExampleFile(ex.path, ex.what, False, install_line(ex.extra)))
                continue
            ex.write(staging)
            files = _staged_files(staging, ex.path)
            states = {rel: _destination_state(root, rel, os.path.join(staging, rel))
                      for rel in files}
            taken += [os.path.join(directory, rel) for rel, st in states.items()
                      if st == "differs"]
            moves += [rel for rel, st in states.items() if st != "same"]
            unchanged = all(st == "same" for st in states.values())
            out.append(ExampleFile(ex.path, ex.what, True, unchanged=unchanged))
        if taken and not force:
            raise FileExistsError(
                errno.EEXIST, f"{len(taken)} file(s) exist with other contents: "
                f"{', '.join(taken)}; nothing was written (pass --force, or "
                "force=True, to replace them, or use an empty directory)")
        _move_into_place(staging, root, moves)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
