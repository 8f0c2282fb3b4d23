"""Atomic, durable file replacement: the one way kiln writes a file that a reader or a crash may catch half-done.

A writer fills a hidden temporary sibling of the destination; on success the temporary file is fsynced, renamed
over the destination and the folder fsynced, so the destination is always the old file or the whole new one. On
any exception (KeyboardInterrupt too) the temporary file is removed and the destination left as it was. A process
killed mid-write cannot clean up, so each write first removes the temporaries beside its destination whose writer
(the pid in the name) is gone: a path never collects more than the temporaries of live writers. Imports neither
TVM nor onnx, so records and builds share it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_file", "atomic_folder", "atomic_path", "install", "staging_folder", "temporary_sibling"]


@contextlib.contextmanager
def atomic_path(destination: str | os.PathLike[str], suffix: str = "") -> Iterator[Path]:
    """A fresh, empty temporary sibling of `destination` for writers that take a path (TVM's `export_library`);
    `suffix` ends its name, for writers that choose a format by extension. Replaces `destination` on success."""
    destination = Path(destination)
    _check_destination(destination)
    remove_orphans(destination)
    temporary = temporary_sibling(destination, suffix)
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666))
    try:
        yield temporary
        install(temporary, destination)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


@contextlib.contextmanager
def atomic_file(destination: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary file object writing a temporary sibling of `destination`, which replaces it on success."""
    with atomic_path(destination) as temporary, open(temporary, "wb") as out:
        yield out


@contextlib.contextmanager
def atomic_folder(destination: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh, empty temporary sibling folder of `destination`, renamed to it on success (a checkpoint of several
    files appears whole or not at all); write its files with `atomic_file` so each is on disk before the rename.
    `destination` must not exist yet."""
    destination = Path(destination)
    if destination.exists():
        raise FileExistsError(errno.EEXIST, "already exists", str(destination))
    _check_destination(destination)
    remove_orphans(destination)
    temporary = temporary_sibling(destination)
    temporary.mkdir()
    try:
        yield temporary
        os.rename(temporary, destination)
        _fsync_directory(destination.parent)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def temporary_sibling(destination: Path, suffix: str = "") -> Path:
    """The hidden name of one writer's temporary beside `destination`, carrying the writer's pid so that
    `remove_orphans` can tell a dead writer's leftovers from a live one's."""
    return destination.with_name(f".{destination.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp{suffix}")


@contextlib.contextmanager
def staging_folder(destination: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh temporary sibling folder of `destination` (which may exist) for a writer that replaces several
    files of `destination` one by one with `install`, in an order readers tolerate; always removed afterwards.
    Dead writers' staging folders are removed first."""
    destination = Path(destination)
    remove_orphans(destination)
    temporary = temporary_sibling(destination)
    temporary.mkdir()
    try:
        yield temporary
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _check_destination(destination: Path) -> None:
    """Refuse a destination in a missing folder or that is a folder, naming the user's path (not the hidden
    temporary's, which the failing call would name)."""
    if not destination.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such folder", str(destination.parent))
    if destination.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(destination))


def remove_orphans(destination: Path) -> list[Path]:
    """Delete the temporaries (files or `atomic_folder` folders) of `destination` left by writers that no longer
    run (killed mid-write); returns them. A live writer's, or one kiln cannot tell about, is kept."""
    pattern = re.compile(rf"\.{re.escape(destination.name)}\.(\d+)-[0-9a-f]{{8}}\.tmp.*", re.DOTALL)
    try:
        siblings = list(destination.parent.iterdir())
    except OSError:
        return []  # a missing folder: the write itself reports it
    removed = []
    for path in siblings:
        match = pattern.fullmatch(path.name)
        if match and not _running(int(match[1])):
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
                removed.append(path)
    return removed


def _running(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts: it may be writing)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


def install(temporary: Path, destination: Path) -> None:
    """Flush a finished file in `destination`'s folder to disk, rename it over `destination`, make the rename
    durable: the step every atomic write ends with (a staged folder of files takes it once per file)."""
    _fsync(os.open(temporary, os.O_RDWR | getattr(os, "O_BINARY", 0)))
    os.replace(temporary, destination)
    _fsync_directory(destination.parent)


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable; platforms that cannot open a directory skip it."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    _fsync(descriptor)


def _fsync(descriptor: int) -> None:
    """Flush what the descriptor's file or folder holds to disk, then close the descriptor."""
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
