"""Read-only memory maps of record files: the one way a reader maps a file, shared by every format's `_io` module."""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Self

from kiln.ir.errors import RecordError

__all__ = ["MappedFile", "map_file", "release"]


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


class MappedFile:
    """A record file's bytes, mapped read-only: how every format's reader opens a file or reads bytes in memory,
    closes, and refuses use once closed. A subclass parses its format's header in `_parse`."""

    def __init__(self, data: memoryview, source: str, mapping: mmap.mmap | None = None):
        """Parse `data` (the whole file); `mapping`, if any, is closed with this object."""
        self.path = source
        self._bytes: memoryview | None = data
        self._mapping = mapping
        self._parse(data)

    def _parse(self, data: memoryview) -> None:
        raise NotImplementedError

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Self:
        """Parse a file's header and map the rest read-only, without reading tensor data."""
        source = os.fspath(path)
        mapping = map_file(source)
        data = memoryview(mapping) if mapping is not None else memoryview(b"")
        try:
            return cls(data, source, mapping)
        except BaseException:
            release(data, mapping)
            raise

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, source: str = "<bytes>") -> Self:
        """Parse in-memory bytes; arrays view them directly and are read-only."""
        return cls(memoryview(data).cast("B").toreadonly(), source)

    def data(self) -> memoryview:
        """The whole file's bytes, or a RecordError once closed."""
        if self._bytes is None:
            raise RecordError(f"{self.path}: file is closed")
        return self._bytes

    def close(self) -> None:
        """Release the mapping; arrays still alive keep their pages until they are dropped."""
        if self._bytes is not None:
            release(self._bytes, self._mapping)
        self._bytes = self._mapping = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
