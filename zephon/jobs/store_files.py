"""The trust rules of the checkpoint store's directory and files, in one place.

Owns: opening a store directory (:func:`open_dir`), vetting a file of the store
reached through a directory descriptor (:func:`open_vetted`, :func:`check_file`) and
reading one whole (:func:`read_vetted`). Invariants, whoever calls them:

- a directory is opened with ``O_NOFOLLOW | O_DIRECTORY`` and accepted only when it
  is a real directory owned by the current user and not writable by group or
  others; an own directory merely readable by others is tightened to 0700 through
  its descriptor, never through a path;
- a file is opened relative to its directory's descriptor with
  ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO never blocks, a symlink is never followed)
  and accepted only as a regular file owned by the current user (and, where asked,
  not writable by group or others);
- a refusal is a :class:`~zephon.errors.CheckpointError` naming the path and what is
  wrong; nothing refused is read, truncated or chmodded.
"""

from __future__ import annotations

import errno
import os
import stat

from zephon.errors import CheckpointError

__all__ = ["check_file", "open_dir", "open_vetted", "owner_text", "read_vetted"]

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
READ_FLAGS = os.O_RDONLY | O_NOFOLLOW | os.O_NONBLOCK | O_CLOEXEC


def owner_text(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _check_dir(fd: int, path: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"checkpoint directory {path} is not a directory")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise CheckpointError(
            f"checkpoint directory {path} is owned by {owner_text(st.st_uid)}, not by "
            f"this run's {owner_text(uid)}; refusing to use it (its entries could be "
            "forged): use a directory of your own")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise CheckpointError(
            f"checkpoint directory {path} is writable by group or others (mode "
            f"{mode:04o}); refusing to use it (its entries could be forged): use a "
            "directory of your own with mode 0700, or chmod 0700 this one")
    if mode & 0o077:
        os.fchmod(fd, 0o700)  # through the descriptor: never a symlink's target


def open_dir(path: str, *, dir_fd: int | None = None, create: bool) -> int:
    """Open (creating it 0700 if asked) a store directory that must be a real directory
    owned by us and not writable by group or others; its descriptor."""
    name = path if dir_fd is None else os.path.basename(path)
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        except FileExistsError:
            pass
        except OSError as exc:
            raise CheckpointError(f"cannot create checkpoint directory {path}: {exc}") from exc
    try:
        fd = os.open(name, os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        try:
            link = stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
        except OSError:
            link = False
        if link or exc.errno == errno.ELOOP:
            raise CheckpointError(
                f"checkpoint directory {path} is a symbolic link; refusing to follow it (give "
                "the real path of a directory you own)") from None
        raise CheckpointError(f"cannot open checkpoint directory {path}: {exc}") from exc
    try:
        _check_dir(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_file(fd: int, path: str, *, private: bool = False) -> os.stat_result:
    """``fstat`` of an open file of the store, refused unless it is a regular file of ours
    (and, with ``private``, not writable by group or others)."""
    st = os.fstat(fd)
    uid = os.geteuid()
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path} is not a regular file; refused")
    if st.st_uid != uid:
        raise CheckpointError(f"{path} is owned by {owner_text(st.st_uid)}, not by "
                              f"this run's {owner_text(uid)}; refused")
    mode = stat.S_IMODE(st.st_mode)
    if private and mode & 0o022:
        raise CheckpointError(f"{path} is writable by group or others (mode {mode:04o}); "
                              "refused (its entries could be forged)")
    return st


def open_vetted(dir_fd: int, name: str, path: str, what: str, *,
                private: bool = False) -> int | None:
    """A read-only descriptor of the store file ``name`` (vetted by :func:`check_file`),
    or None when it does not exist."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"{what} {path} is a symbolic link; refused "
                                  "(not followed)") from None
        raise CheckpointError(f"{what} {path} cannot be opened: {exc}") from exc
    try:
        check_file(fd, f"{what} {path}", private=private)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_vetted(dir_fd: int, name: str, path: str, what: str) -> bytes | None:
    """The bytes of the store file ``name``, or None when it does not exist; a file that
    is not a regular file of ours raises CheckpointError (never followed, never blocks)."""
    fd = open_vetted(dir_fd, name, path, what)
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        chunks, got = [], 0
        while True:
            chunk = os.read(fd, max(1 << 16, size - got + 1))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
