"""safetensors files: `SafetensorsFile` parses the header and maps the tensor bytes lazily (read-only, zero copy);
`write_safetensors` produces deferred tensors one at a time into a file written atomically."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from kiln.ir import DType, RecordError
from kiln.runtime.atomic import atomic_file

from .mapping import MappedFile
from .safetensors import encode_header, parse_header, view

__all__ = ["SafetensorsFile", "write_safetensors"]


class SafetensorsFile(MappedFile):
    """A parsed safetensors file whose tensor bytes stay in the file (memory-mapped) until asked for."""

    def _parse(self, data: memoryview) -> None:
        self.entries, self.metadata, self._start = parse_header(data, self.path)

    def array(self, name: str) -> np.ndarray:
        """One tensor as a read-only ndarray viewing the file's bytes."""
        data = self.data()
        if name not in self.entries:
            raise RecordError(f"{self.path}: no tensor named {name!r}")
        return view(data, self._start, self.entries[name])


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

