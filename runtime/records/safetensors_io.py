"""safetensors files: `SafetensorsFile` parses the header and maps the tensor bytes lazily (read-only, zero copy);
`write_safetensors` produces deferred tensors one at a time into a file written atomically."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from kiln.ir import DType, RecordError
from kiln.runtime.atomic import atomic_file

from .mapping import map_file, release
from .safetensors import encode_header, parse_header, view

__all__ = ["SafetensorsFile", "write_safetensors"]


class SafetensorsFile:
    """A parsed safetensors file whose tensor bytes stay in the file (memory-mapped) until asked for."""

    def __init__(self, data: memoryview, source: str, mapping: mmap.mmap | None = None):
        self.path = source
        self._data: memoryview | None = data
        self._mapping = mapping
        self.entries, self.metadata, self._start = parse_header(data, source)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> SafetensorsFile:
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
    def from_bytes(cls, data: bytes | bytearray | memoryview, source: str = "<bytes>") -> SafetensorsFile:
        """Parse in-memory bytes; arrays view them directly and are read-only."""
        return cls(memoryview(data).cast("B").toreadonly(), source)

    def array(self, name: str) -> np.ndarray:
        """One tensor as a read-only ndarray viewing the file's bytes."""
        if self._data is None:
            raise RecordError(f"{self.path}: file is closed")
        if name not in self.entries:
            raise RecordError(f"{self.path}: no tensor named {name!r}")
        return view(self._data, self._start, self.entries[name])

    def close(self) -> None:
        """Release the mapping; arrays still alive keep their pages until they are dropped."""
        if self._data is not None:
            release(self._data, self._mapping)
        self._data = self._mapping = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


Tensor = tuple[str, DType, tuple[int, ...], "np.ndarray | Callable[[], np.ndarray]"]


def write_safetensors(path: str | os.PathLike[str], tensors: Iterable[Tensor],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write tensors (name, dtype, shape, array or provider) back to back, atomically; a provider runs when the
    writer reaches it and its result is not kept, so peak memory is one tensor."""
    source = os.fspath(path)
    tensors = list(tensors)
    header = encode_header(((name, dtype, tuple(shape)) for name, dtype, shape, _ in tensors), metadata)
    try:
        with atomic_file(path) as out:
            out.write(header)
            for name, dtype, shape, data in tensors:
                array = np.asarray(data() if callable(data) else data, dtype=dtype.numpy, order="C")
                if array.shape != tuple(shape):
                    raise RecordError(f"{source}: tensor {name!r} has shape {list(array.shape)}, "
                                      f"{list(shape)} was declared")
                out.write(memoryview(array.reshape(-1).view(np.uint8)))
    except OSError as error:
        raise RecordError(f"{source}: cannot write: {error.strerror or error}") from error

