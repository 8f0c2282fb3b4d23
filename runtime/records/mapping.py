"""Read-only memory maps of record files: the one way a reader maps a file, shared by every format's `_io` module."""

from __future__ import annotations

import contextlib
import mmap
import os

from kiln.ir.errors import RecordError

__all__ = ["map_file", "release"]


def map_file(source: str) -> mmap.mmap | None:
    """Map a file read-only (None when empty, which mmap refuses); OS errors become RecordErrors."""
    try:
        with open(source, "rb") as file:
            if os.fstat(file.fileno()).st_size == 0:
                return None
            return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as error:
        raise RecordError(f"{source}: cannot open: {error.strerror or error}") from error


def release(view: memoryview, mapping: mmap.mmap | None) -> None:
    """Drop our view and close the mapping unless arrays still export it (then GC closes it later)."""
    view.release()
    if mapping is not None:
        with contextlib.suppress(BufferError):
            mapping.close()
