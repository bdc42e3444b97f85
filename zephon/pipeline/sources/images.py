"""image_folder: an ImageFolder tree (``root/<class>/<image>``) as a random-access source.

Owned here: listing the tree once, when the source is built, into a compact index, and
reading one image's encoded bytes per sample. Decoding is an op of its own (a ``map``
after the source); this module never looks inside an image.

The tree, as torchvision's ``ImageFolder`` reads it:

- *classes* are the sorted names of the directories directly under ``root`` (a
  symbolic link to a directory counts, as ``os.scandir``'s ``is_dir()`` says); the
  label of a class is its index in that list (``class_to_idx``);
- a class's *images* are the files found recursively under its directory whose name
  ends, in any case, with one of ``extensions`` (default :data:`IMG_EXTENSIONS`), in
  torchvision's order: directories by their path (``sorted(os.walk(...))``), files by
  name within each; samples run class by class, so sample ``i`` of a tree is
  ``ImageFolder(root).samples[i]`` of the same tree;
- files directly under ``root`` belong to no class and are ignored.

Symbolic links are followed, as torchvision follows them (a tree of links into shared
storage is a common layout), with two refusals torchvision does not make, each a
:class:`SourceError` naming the path when the source is built: a link that points
nowhere (torchvision lists it and fails when it reads it), and a directory link that
leads back to a directory above it (a cycle: ``os.walk`` would follow it until path
lengths run out). An image name that is not a regular file (a fifo, a device) is refused
too: reading it could block forever.

Index: one pass of ``os.scandir`` per directory, one ``stat`` per image (its size and
mtime) and one per directory (its inode, for the cycle check); whether an entry is a
directory comes from the directory listing itself. The stats are most of the cost: at
100,000 files 1.3 to 1.9 times a bare ``scandir`` + ``stat`` loop, 3.5 times
torchvision's listing, which stats nothing (and so has nothing to fingerprint or check
reads against). The relative paths are
held as one string with an offset array, sizes and mtimes as int64 arrays, classes as
``C + 1`` index bounds: about the paths' characters plus 24 bytes per image, pickled
into each worker as a handful of buffers rather than one object per file.

Identity and fingerprint: sample ``i`` is ``(name, i)``; the same tree gives every file
the same index. :meth:`ImageFolderSource.describe` (the pipeline fingerprint's source
part) holds a SHA-256 of the class names, the relative paths, the sizes and, by default,
the mtimes (remote trees: the versions the store reports), so a checkpoint refuses to
resume over another tree: a file added, removed, renamed, resized or rewritten.
``fingerprint_mtimes=False`` leaves the mtimes out, for copies of one tree whose mtimes
differ (one copy per node, made without keeping times); sizes and names still count.
The root's own location is not part of it (a tree moved to another directory resumes).

Reads: sample ``i`` is ``{"image": bytes, "label": int, "path": str}``. A local image
is opened (transient OS errors retried as :func:`~zephon.io.open_with_retry` does),
checked with one ``fstat`` against the size and mtime listed (a file that vanished,
was replaced by something that is not a regular file, or changed since the listing is
a SourceError naming it) and read with one positional read. A remote image (an fsspec
root: ``s3://bucket/train``) is read whole through the io layer (:class:`~zephon.io.FileReader`:
the local cache when ``cache_enabled``, else one ranged request pinned to the version
listed), so remote roots follow the same ``StoreOptions`` as the other file sources.
Nothing stays open between reads: a tree of millions of files needs no descriptor per
file, and the source pickles without handles.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import stat
import time
from typing import Any

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.io.config import DEFAULT_IO, IoConfig, call_with_retry, is_transient
from zephon.io.reader import FileReader, pread_exact
from zephon.io.remote import FileRef, expand, filesystem, is_remote, strip_file_url
from zephon.pipeline.sources.base import IoConfigured, SourceError
from zephon.pipeline.sources.files import changed, describe_kind

__all__ = ["IMG_EXTENSIONS", "ImageFolderSource"]

#: torchvision's ``IMG_EXTENSIONS``: what an ImageFolder tree holds unless told otherwise
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_WHAT = "image_folder"
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def check_extensions(extensions: Any) -> tuple[str, ...]:
    """``extensions=`` as lower-case suffixes (None: :data:`IMG_EXTENSIONS`)."""
    if extensions is None:
        return IMG_EXTENSIONS
    items = [extensions] if isinstance(extensions, str) else extensions
    try:
        items = list(items)
    except TypeError:
        items = None
    if not items or not all(isinstance(e, str) and len(e) > 1 and e.startswith(".")
                            for e in items):
        raise ZephonConfigError(
            f"{_WHAT}: extensions must be a non-empty list of suffixes starting with a dot "
            f"(such as ['.jpg', '.png']), or None for {IMG_EXTENSIONS}; got {extensions!r}",
            field=f"{_WHAT}.extensions")
    return tuple(dict.fromkeys(e.lower() for e in items))


# -- listing a local tree ---------------------------------------------------------------------
# An image found: (directory relative to its class, file name, size, mtime_ns)
_Found = tuple[str, str, int, int]


def _dir_key(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _local_classes(root: str) -> list[str]:
    try:
        st = os.stat(root)
    except OSError as exc:
        raise SourceError(f"{_WHAT}: cannot read the root {root!r}: "
                          f"{exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SourceError(f"{_WHAT}: the root {root!r} is {describe_kind(st.st_mode)}; an "
                          f"ImageFolder root is a directory of class directories "
                          f"(root/<class>/<image>)")
    with _scandir(root) as entries:
        return sorted(e.name for e in entries if _is_dir(e))


def _scandir(path: str):
    try:
        return os.scandir(path)
    except OSError as exc:
        raise SourceError(f"{_WHAT}: cannot list {path}: {exc.strerror or exc}") from None


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows a symbolic link; a broken one is no directory
    except OSError:
        return False


def _refuse_image(entry: os.DirEntry, st: os.stat_result | None, exc: OSError | None):
    """The SourceError of an image entry whose stat failed (``exc``) or that is not a
    regular file (``st``)."""
    if st is None:
        why = ("a symbolic link to nothing" if entry.is_symlink()
               else f"unreadable ({exc.strerror if exc is not None else ''})")
        return SourceError(f"{_WHAT}: {entry.path} is {why}; remove it or fix it, or leave "
                           f"its extension out of extensions=")
    return SourceError(f"{_WHAT}: {entry.path} is {describe_kind(st.st_mode)}, not an "
                       f"image file; remove it or rename it")


def _walk(top: str, rel: str, ancestors: frozenset, exts: tuple[str, ...],
          out: list[_Found]) -> None:
    """Append the images under ``top`` (``rel`` below its class directory) to ``out``;
    ``ancestors``: the (device, inode) of every directory from the class down to ``top``."""
    subdirs = []
    regular = stat.S_ISREG
    with _scandir(top) as entries:
        for entry in entries:  # the hot loop of a listing: one stat per image, no more
            if _is_dir(entry):
                subdirs.append(entry)
                continue
            name = entry.name
            if not name.lower().endswith(exts):
                continue
            try:
                st = entry.stat()  # through a link
            except OSError as exc:
                raise _refuse_image(entry, None, exc) from None
            if not regular(st.st_mode):
                raise _refuse_image(entry, st, None)
            out.append((rel, name, st.st_size, st.st_mtime_ns))
    for entry in subdirs:
        try:
            key = _dir_key(entry.stat())
        except OSError as exc:
            raise SourceError(f"{_WHAT}: cannot read {entry.path}: "
                              f"{exc.strerror or exc}") from None
        if key in ancestors:
            raise SourceError(f"{_WHAT}: {entry.path} is a link back to a directory above "
                              f"it (a cycle); remove the link")
        _walk(entry.path, f"{rel}/{entry.name}" if rel else entry.name, ancestors | {key},
              exts, out)


def _list_local(root: str, exts: tuple[str, ...]) -> tuple[list[str], list[list[_Found]]]:
    classes = _local_classes(root)
    top = _dir_key(os.stat(root))
    found = []
    for name in classes:
        path = os.path.join(root, name)
        images: list[_Found] = []
        _walk(path, "", frozenset({top, _dir_key(os.stat(path))}), exts, images)
        found.append(images)
    return classes, found


# -- listing a remote tree ----------------------------------------------------------------------
def _bare(url: str) -> str:
    """A URL without its protocol and leading slashes (how listings are compared)."""
    return url.split("://", 1)[-1].strip("/")


def _remote_classes(fs, root: str, cfg: IoConfig) -> list[str]:
    """The sorted names of the directories directly under a remote root (one ``ls``)."""
    try:
        top = call_with_retry(lambda: fs.ls(root, detail=True), cfg, root)
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - named for the user
        raise SourceError(f"{_WHAT}: cannot list {root}: {type(exc).__name__}: {exc}") from None
    return sorted({str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in top
                   if e.get("type") == "directory"})


def _list_remote(root: str, exts: tuple[str, ...], cfg: IoConfig, storage_options):
    """Classes and images of a remote tree: one ``ls`` of the root for the classes, one
    recursive listing for the files (with their sizes and versions)."""
    names = _remote_classes(filesystem(root, storage_options), root, cfg)
    index = {name: k for k, name in enumerate(names)}
    found: list[list] = [[] for _ in names]
    refs = expand(f"{root}/**", _WHAT, cfg, storage_options) if names else []
    prefix = _bare(root) + "/"
    for ref in refs:
        rel = _bare(ref.url)
        if not rel.startswith(prefix):
            continue
        rel = rel[len(prefix):]
        cls, _, inner = rel.partition("/")
        if cls not in index or not inner or not ref.basename.lower().endswith(exts):
            continue
        directory, _, base = inner.rpartition("/")
        found[index[cls]].append((directory, base, ref.size, (ref.version, ref.version_id)))
    return names, found


def _flatten(classes: list[str], found: list[list]) -> tuple[list[str], list, list, list[int]]:
    """The images of every class in torchvision's order: their paths relative to the root,
    sizes, stamps (mtime or remote version) and the ``C + 1`` class bounds."""
    rels: list[str] = []
    sizes: list[int] = []
    stamps: list = []
    bounds = [0]
    for cls, images in zip(classes, found, strict=True):
        images.sort()  # by directory path, then by name (unique in a directory)
        dirs, bases, size, stamp = zip(*images, strict=True) if images else ((),) * 4
        rels += [f"{cls}/{d}/{b}" if d else f"{cls}/{b}"
                 for d, b in zip(dirs, bases, strict=True)]
        sizes += size
        stamps += stamp
        bounds.append(len(rels))
    return rels, sizes, stamps, bounds


class ImageFolderSource(IoConfigured):
    """See :func:`zephon.sources.image_folder` and the module docstring."""

    def __init__(self, root: Any, extensions: Any, name: str, io: IoConfig = DEFAULT_IO,
                 storage_options: dict | None = None, allow_empty: bool = False,
                 fingerprint_mtimes: bool = True) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise ZephonConfigError(f"{_WHAT}: root must be a path (str or os.PathLike), got "
                                    f"{type(root).__name__}", field=f"{_WHAT}.root")
        for flag, value in (("allow_empty", allow_empty),
                            ("fingerprint_mtimes", fingerprint_mtimes)):
            if not isinstance(value, bool):
                raise ZephonConfigError(f"{_WHAT}: {flag} must be True or False, got "
                                        f"{value!r}", field=f"{_WHAT}.{flag}")
        self.extensions = check_extensions(extensions)
        root = os.fspath(root)
        self.remote = is_remote(root)
        self.root = root.rstrip("/") if self.remote else \
            os.path.expanduser(strip_file_url(root))
        self.name, self.io, self.storage_options = name, io, storage_options
        self.fingerprint_mtimes = fingerprint_mtimes
        if self.remote:
            classes, found = _list_remote(self.root, self.extensions, io, storage_options)
        else:
            classes, found = _list_local(self.root, self.extensions)
        self._index(classes, found, allow_empty)

    def _index(self, classes: list[str], found: list[list], allow_empty: bool) -> None:
        if not classes:
            raise SourceError(f"{_WHAT}: no class directory under {self.root}; an ImageFolder "
                              f"tree is root/<class>/<image>")
        empty = [c for c, images in zip(classes, found, strict=True) if not images]
        if empty and not allow_empty:
            raise self._empty_classes(empty)
        self.classes = list(classes)
        self.class_to_idx = {c: k for k, c in enumerate(self.classes)}
        rels, sizes, stamps, bounds = _flatten(self.classes, found)
        self._paths = "".join(rels)
        self._ends = np.cumsum([len(r) for r in rels], dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.bounds = bounds
        if self.remote:
            self.versions: list | None = stamps
            self.mtimes = np.zeros(len(rels), dtype=np.int64)
        else:
            self.versions = None
            self.mtimes = np.asarray(stamps, dtype=np.int64)
        self.digest = self._fingerprint()

    def _empty_classes(self, empty: list[str]) -> SourceError:
        many = len(empty) > 1
        more = f" and {len(empty) - 5} more" if len(empty) > 5 else ""
        return SourceError(
            f"{_WHAT}: no image ({', '.join(self.extensions)}) under the class "
            f"director{'ies' if many else 'y'} "
            f"{', '.join(repr(self._join(c)) for c in empty[:5])}{more}; remove "
            f"{'them' if many else 'it'} (a hidden directory counts as a class), give "
            f"extensions=, or allow_empty=True to keep empty classes")

    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update("\0".join(self.classes).encode("utf-8", "surrogatepass"))
        h.update(np.asarray(self.bounds, dtype=np.int64).tobytes())
        h.update(self._paths.encode("utf-8", "surrogatepass"))
        h.update(self._ends.tobytes())
        h.update(self.sizes.tobytes())
        if self.versions is not None:
            h.update(repr(self.versions).encode("utf-8", "surrogatepass"))
        elif self.fingerprint_mtimes:
            h.update(self.mtimes.tobytes())
        return h.hexdigest()

    # -- what a user asks of it ------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def targets(self) -> np.ndarray:
        """The label of every sample (int64), as torchvision's ``targets``."""
        return np.repeat(np.arange(len(self.classes), dtype=np.int64), np.diff(self.bounds))

    def relative_path(self, i: int) -> str:
        """Sample ``i``'s path below the root (``<class>/.../<file>``)."""
        start = int(self._ends[i - 1]) if i else 0
        return self._paths[start:int(self._ends[i])]

    def label(self, i: int) -> int:
        """Sample ``i``'s class index."""
        return bisect.bisect_right(self.bounds, i) - 1

    def _join(self, rel: str) -> str:
        return f"{self.root}/{rel}" if self.remote else os.path.join(self.root, rel)

    def get(self, i: int) -> Any:
        if not 0 <= i < len(self.sizes):
            raise IndexError(f"{_WHAT}: sample {i} out of range [0, {len(self.sizes)})")
        path = self._join(self.relative_path(i))
        data = self._read_remote(i, path) if self.remote else self._read_local(i, path)
        return {"image": data, "label": self.label(i), "path": path}

    # -- reading -------------------------------------------------------------------------------
    def _where(self, i: int, path: str) -> str:
        return f"{_WHAT}: {path} (sample {i}, class {self.classes[self.label(i)]!r})"

    def _open(self, i: int, path: str) -> int:
        attempts, delay, longest = self.io.open_retry
        for attempt in range(1, attempts + 1):
            try:
                return os.open(path, _OPEN_FLAGS)
            except OSError as exc:
                if attempt == attempts or not is_transient(exc):
                    gone = isinstance(exc, FileNotFoundError)
                    what = ("vanished since the source was built" if gone
                            else f"cannot be opened: {exc.strerror or exc}")
                    raise SourceError(f"{self._where(i, path)} {what}; build the source again "
                                      f"to list the tree as it is now") from None
                time.sleep(delay)
                delay = min(longest, delay * 2)
        raise AssertionError("unreachable")

    def _read_local(self, i: int, path: str) -> bytes:
        fd = self._open(i, path)
        try:
            data, what = self._checked_read(i, fd)
        except OSError as exc:
            data, what = b"", f"it cannot be read: {exc.strerror or exc}"
        finally:
            os.close(fd)
        if what is not None:
            raise SourceError(f"{self._where(i, path)} changed since the source was built: "
                              f"{what}; build the source again to list the tree as it is now")
        return data

    def _checked_read(self, i: int, fd: int) -> tuple[bytes, str | None]:
        """The bytes of open image ``i`` and None, or ``b""`` and what differs from the
        listing (its kind, size or mtime, or a short read)."""
        size, mtime = int(self.sizes[i]), int(self.mtimes[i])
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return b"", f"it is now {describe_kind(st.st_mode)}"
        if st.st_size != size or st.st_mtime_ns != mtime:
            return b"", changed((0, 0, size, mtime), (0, 0, st.st_size, st.st_mtime_ns))
        data = pread_exact(fd, size, 0)
        if len(data) != size:
            return b"", f"it holds {len(data)} bytes, {size} when listed"
        return data, None

    def _read_remote(self, i: int, path: str) -> bytes:
        assert self.versions is not None
        version, version_id = self.versions[i]
        reader = FileReader(FileRef(path, int(self.sizes[i]), version, version_id), self.io,
                            self.storage_options)
        try:
            return reader.pread(0, int(self.sizes[i]), f"sample {i}")
        finally:
            reader.close()

    # -- the Source contract -------------------------------------------------------------------
    def describe(self) -> str:
        # a local root's path (its name included) is left out: a copy of the tree anywhere
        # else (a per-node copy) is the same data; a remote root is named
        where = f"root={self.root}, " if self.remote else ""
        return (f"ImageFolderSource({self.name}, {where}classes={len(self.classes)}, "
                f"n={len(self)}, extensions={list(self.extensions)}, "
                f"tree={self.digest[:32]})")
