"""Atomic, durable file replacement: the one way kiln writes a file that a reader or a crash may catch half-done.

A writer fills a hidden temporary sibling of the destination; on success the temporary file is fsynced, renamed
over the destination and the folder fsynced, so the destination is always the old file or the whole new one. On
any exception (KeyboardInterrupt too) the temporary file is removed and the destination left as it was. Imports
neither TVM nor onnx, so records and builds share it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_file", "atomic_path", "install"]


@contextlib.contextmanager
def atomic_path(destination: str | os.PathLike[str], suffix: str = "") -> Iterator[Path]:
    """A fresh, empty temporary sibling of `destination` for writers that take a path (TVM's `export_library`);
    `suffix` ends its name, for writers that choose a format by extension. Replaces `destination` on success."""
    destination = Path(destination)
    temporary = destination.with_name(f".{destination.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp{suffix}")
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
