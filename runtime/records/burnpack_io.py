"""Burnpack files: `BurnpackFile` reads header and metadata and maps the tensor bytes lazily (read-only, zero
copy); `write_burnpack` lays tensors out, produces deferred ones one at a time and writes the file atomically;
`to_bytes` gives the same bytes in memory.
"""

from __future__ import annotations

import io
import math
import operator
import os
from collections.abc import Callable, Iterable, Mapping
from typing import BinaryIO, NamedTuple

import numpy as np

from kiln.ir.errors import RecordError
from kiln.runtime.atomic import atomic_file

from .burnpack import (
    MAX_TENSOR_SIZE,
    BurnDType,
    PackTensor,
    ScalarValue,
    TensorEntry,
    align,
    check_entry,
    itemsize,
    numpy_dtype,
)
from .burnpack_metadata import pack_header, parse_pack
from .cbor import utf8
from .mapping import MappedFile

__all__ = ["BurnpackFile", "to_bytes", "write_burnpack"]


class BurnpackFile(MappedFile):
    """A parsed burnpack whose tensor bytes stay in the file (memory-mapped) until asked for."""

    def _parse(self, data: memoryview) -> None:
        layout, contents = parse_pack(data, self.path)
        self.version = layout.version
        self.data_start = layout.data_start
        self.entries: dict[str, TensorEntry] = dict(sorted(contents.entries.items(), key=_name_key))
        self.metadata: dict[str, str] = contents.metadata
        self.scalars: dict[str, ScalarValue] = contents.scalars

    def tensor_bytes(self, name: str) -> memoryview:
        """A zero-copy, read-only view of one tensor's bytes."""
        entry = self._entry(name)
        start, end = entry.data_offsets
        return self.data()[self.data_start + start : self.data_start + end]

    def array(self, name: str) -> np.ndarray:
        """One tensor as a read-only ndarray viewing the file's bytes (QFloat has none: use tensor_bytes)."""
        entry = self._entry(name)
        try:
            dtype = numpy_dtype(entry.dtype)
        except RecordError as error:
            raise RecordError(f"{self.path}: tensor {name!r}: {error}") from None
        array = np.frombuffer(self.tensor_bytes(name), dtype=dtype).reshape(entry.shape)
        array.flags.writeable = False
        return array

    def _entry(self, name: str) -> TensorEntry:
        """The entry called `name`, or a RecordError."""
        entry = self.entries.get(name)
        if entry is None:
            raise RecordError(f"{self.path}: no tensor named {name!r}")
        return entry


def _name_key(item: tuple[str, object]) -> bytes:
    """Sort key matching Rust's String order: byte-wise UTF-8."""
    return item[0].encode("utf-8")


class _Planned(NamedTuple):
    """A tensor placed in the layout, with its bytes or the provider that will produce them."""

    entry: TensorEntry
    data: memoryview | Callable[[], object]


def _as_pack_tensor(item: object, source: str) -> PackTensor:
    """Accept a 5- or 6-tuple or any object with the PackTensor attributes."""
    if isinstance(item, tuple):
        if len(item) not in (5, 6):
            raise RecordError(f"{source}: a tensor tuple needs 5 or 6 fields, got {len(item)}")
        return PackTensor(*item)
    try:
        fields = [getattr(item, name) for name in PackTensor._fields[:5]]
    except AttributeError as error:
        raise RecordError(f"{source}: {type(item).__name__} is not a tensor: {error}") from None
    return PackTensor(*fields, getattr(item, "nbytes", None))


def _as_buffer(data: object, what: str) -> memoryview:
    """Flat little-endian bytes of an ndarray or bytes-like object, without copying when already so."""
    if isinstance(data, np.ndarray):
        array = np.ascontiguousarray(data)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        return memoryview(array.reshape(-1).view(np.uint8))
    try:
        view = memoryview(data)
    except TypeError:
        raise RecordError(f"{what}: data is {type(data).__name__}, not bytes, ndarray or callable") from None
    return (view if view.c_contiguous else memoryview(view.tobytes())).cast("B")


def _index(value: object, what: str, limit: int) -> int:
    """A non-negative integer below `limit` (shape dims, param ids, offsets)."""
    try:
        number = operator.index(value)
    except TypeError:
        raise RecordError(f"{what} is {value!r}, not an integer") from None
    if isinstance(value, bool) or not 0 <= number < limit:
        raise RecordError(f"{what} is {value!r}, outside [0, {limit})")
    return number


def _shape(value: object, what: str) -> tuple[int, ...]:
    """A shape as a tuple of u64 dimensions."""
    try:
        dims = tuple(value)
    except TypeError:
        raise RecordError(f"{what} shape {value!r} is not a sequence") from None
    return tuple(_index(dim, f"{what} dimension", 2**64) for dim in dims)


def _plan_one(tensor: PackTensor, offset: int, source: str) -> _Planned:
    """Validate one tensor and place it at the first aligned offset from `offset`."""
    name = tensor.name
    what = f"{source}: tensor {name!r}"
    utf8(name, source)
    try:
        dtype = BurnDType.parse(tensor.dtype)
    except RecordError as error:
        raise RecordError(f"{what}: {error}") from None
    shape = _shape(tensor.shape, what)
    param_id = None if tensor.param_id is None else _index(tensor.param_id, f"{what} param_id", 2**64)
    data = tensor.data if callable(tensor.data) else _as_buffer(tensor.data, what)
    nbytes = _declared_nbytes(dtype, shape, data, tensor.nbytes, what)
    start = align(offset)
    entry = TensorEntry(name, dtype, shape, param_id, (start, start + nbytes))
    check_entry(entry, source)
    return _Planned(entry, data)


def _declared_nbytes(
    dtype: BurnDType, shape: tuple[int, ...], data: object, nbytes: int | None, what: str
) -> int:
    """The byte length to reserve, known before any deferred provider runs."""
    if dtype.kind != "QFloat":
        expected = math.prod(shape) * itemsize(dtype)
        if nbytes is not None and nbytes != expected:
            raise RecordError(f"{what}: nbytes {nbytes} but {dtype} {list(shape)} needs {expected}")
        if isinstance(data, memoryview) and len(data) != expected:
            raise RecordError(f"{what}: {len(data)} bytes but {dtype} {list(shape)} needs {expected}")
        return expected
    if isinstance(data, memoryview):
        if nbytes is not None and nbytes != len(data):
            raise RecordError(f"{what}: nbytes {nbytes} but the data has {len(data)}")
        return len(data)
    if nbytes is None:
        raise RecordError(f"{what}: a deferred QFloat tensor needs nbytes")
    return _index(nbytes, f"{what} nbytes", MAX_TENSOR_SIZE + 1)


def _plan(tensors: Iterable[object], source: str) -> list[_Planned]:
    """Lay tensors out in the given order at 256-byte alignment, refusing duplicate names."""
    planned: list[_Planned] = []
    names: set[str] = set()
    offset = 0
    for item in tensors:
        tensor = _as_pack_tensor(item, source)
        if tensor.name in names:
            raise RecordError(f"{source}: duplicate tensor name {tensor.name!r}")
        names.add(tensor.name)
        planned.append(_plan_one(tensor, offset, source))
        offset = planned[-1].entry.data_offsets[1]
    return planned


def _write_tensor(out: BinaryIO, planned: _Planned, source: str) -> None:
    """Write one tensor's bytes, calling a deferred provider now and keeping nothing after."""
    entry = planned.entry
    what = f"{source}: tensor {entry.name!r}"
    data = planned.data() if callable(planned.data) else planned.data
    buffer = _as_buffer(data, what)
    start, end = entry.data_offsets
    if len(buffer) != end - start:
        raise RecordError(f"{what}: provider returned {len(buffer)} bytes, {end - start} were declared")
    out.write(buffer)


def _write_pack(out: BinaryIO, header: bytes, planned: list[_Planned], source: str) -> None:
    """Stream header then tensors in layout order with zero padding between them."""
    out.write(header)
    position = 0
    for item in planned:
        start, end = item.entry.data_offsets
        out.write(bytes(start - position))
        _write_tensor(out, item, source)
        position = end


def _prepare(
    tensors: Iterable[object],
    metadata: Mapping[str, str] | None,
    scalars: Mapping[str, object] | None,
    source: str,
) -> tuple[bytes, list[_Planned]]:
    """Plan the layout and encode the header before any tensor bytes are produced."""
    planned = _plan(tensors, source)
    return pack_header((item.entry for item in planned), metadata, scalars, source=source), planned


def to_bytes(
    tensors: Iterable[object],
    metadata: Mapping[str, str] | None = None,
    scalars: Mapping[str, ScalarValue] | None = None,
) -> bytes:
    """An in-memory burnpack, byte-identical to what write_burnpack puts on disk."""
    header, planned = _prepare(tensors, metadata, scalars, "<bytes>")
    out = io.BytesIO()
    _write_pack(out, header, planned, "<bytes>")
    return out.getvalue()


def write_burnpack(
    path: str | os.PathLike[str],
    tensors: Iterable[object],
    metadata: Mapping[str, str] | None = None,
    scalars: Mapping[str, ScalarValue] | None = None,
) -> None:
    """Write a burnpack atomically: a crash or error at any point leaves the old file as it was."""
    source = os.fspath(path)
    header, planned = _prepare(tensors, metadata, scalars, source)
    try:
        with atomic_file(path) as out:
            _write_pack(out, header, planned, source)
    except OSError as error:
        raise RecordError(f"{source}: cannot write: {error.strerror or error}") from error
