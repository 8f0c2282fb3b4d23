"""The safetensors format, bytes in and bytes out: an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the tensor bytes (Hugging Face's default checkpoint format).

kiln reads and writes it itself rather than through the `safetensors` package: the format is three fields, and a
reader of our own views the memory-mapped file with numpy (zero copy, lazy per tensor, as burnpack is), checks every
offset against the file before anything is read, and reports a bad file as a RecordError naming the file and tensor;
the package would be a dependency of the core for no more than that (it stays a benchmark and test peer).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np

from kiln.ir import DType, RecordError

__all__ = ["MAX_HEADER", "StEntry", "encode_header", "parse_header", "safetensors_dtype", "view"]

MAX_HEADER = 100 << 20  # the header-size bound the reference implementation enforces
METADATA_KEY = "__metadata__"

_TO_ST: dict[DType, str] = {
    DType.f64: "F64", DType.f32: "F32", DType.f16: "F16", DType.bf16: "BF16", DType.i64: "I64",
    DType.i32: "I32", DType.i16: "I16", DType.i8: "I8", DType.u8: "U8", DType.bool: "BOOL",
    DType.u64: "U64", DType.u32: "U32", DType.u16: "U16", DType.f8e4m3fn: "F8_E4M3", DType.f8e5m2: "F8_E5M2",
}
_FROM_ST: dict[str, DType] = {name: dtype for dtype, name in _TO_ST.items()}


class StEntry(NamedTuple):
    """One tensor of a header: name, kiln dtype, shape and byte range relative to the data section."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    offsets: tuple[int, int]


def safetensors_dtype(dtype: DType) -> str:
    """The safetensors dtype name of a kiln dtype (packed sub-byte codes have none)."""
    try:
        return _TO_ST[dtype]
    except KeyError:
        raise RecordError(f"kiln dtype {dtype.value} has no safetensors dtype") from None


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object hook refusing a key given twice (which one a reader takes would be arbitrary)."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise RecordError(f"header names {key!r} twice")
        out[key] = value
    return out


def _dims(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(d) is int and d >= 0 for d in value):
        raise RecordError(f"{what}: shape {value!r} is not a list of non-negative integers")
    return tuple(value)


def _entry(name: str, fields: object, what: str) -> StEntry:
    """One header entry, checked: its fields, dtype, shape, and a byte range the shape fills exactly."""
    if not isinstance(fields, dict) or set(fields) != {"dtype", "shape", "data_offsets"}:
        raise RecordError(f"{what}: needs exactly dtype, shape and data_offsets, got {fields!r}"[:300])
    dtype = _FROM_ST.get(fields["dtype"]) if isinstance(fields["dtype"], str) else None
    if dtype is None:
        raise RecordError(f"{what}: dtype {fields['dtype']!r} has no kiln dtype")
    shape = _dims(fields["shape"], what)
    offsets = fields["data_offsets"]
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise RecordError(f"{what}: data_offsets {offsets!r} is not a [begin, end] pair with begin <= end")
    expected = math.prod(shape) * dtype.numpy.itemsize
    if offsets[1] - offsets[0] != expected:
        raise RecordError(f"{what}: data_offsets {offsets} hold {offsets[1] - offsets[0]:,} bytes, but "
                          f"{fields['dtype']} {list(shape)} needs {expected:,}")
    return StEntry(name, dtype, shape, (offsets[0], offsets[1]))


def parse_header(data: memoryview, source: str) -> tuple[dict[str, StEntry], dict[str, str], int]:
    """The tensors (in data order), the metadata and the data section's start of a safetensors file's bytes;
    every range must lie inside the file and no two may overlap."""
    if len(data) < 8:
        raise RecordError(f"{source}: {len(data)} bytes, too short for a safetensors header length")
    (size,) = struct.unpack_from("<Q", data, 0)
    if size > MAX_HEADER or 8 + size > len(data):
        raise RecordError(f"{source}: header length {size:,} is past the file's {len(data):,} bytes or the "
                          f"{MAX_HEADER:,}-byte bound")
    try:
        header = json.loads(bytes(data[8 : 8 + size]).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except RecordError as error:
        raise RecordError(f"{source}: {error}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise RecordError(f"{source}: header is not JSON ({error})"[:300]) from None
    if not isinstance(header, dict):
        raise RecordError(f"{source}: header is {type(header).__name__}, not a JSON object")
    metadata = header.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise RecordError(f"{source}: {METADATA_KEY} is not an object of strings")
    entries = sorted((_entry(name, fields, f"{source}: tensor {name!r}") for name, fields in header.items()),
                     key=lambda e: e.offsets)
    start, end = 8 + size, 0
    for entry in entries:
        if entry.offsets[0] < end:
            raise RecordError(f"{source}: tensor {entry.name!r}: data_offsets {list(entry.offsets)} overlap "
                              f"another tensor's bytes")
        end = max(end, entry.offsets[1])
    if start + end > len(data):
        raise RecordError(f"{source}: tensors need {end:,} data bytes, the file has {len(data) - start:,}")
    return {e.name: e for e in entries}, metadata, start


def encode_header(tensors: Iterable[tuple[str, DType, tuple[int, ...]]],
                  metadata: Mapping[str, str] | None = None) -> bytes:
    """The length-prefixed header for tensors laid out back to back in the given order, padded with spaces to
    8 bytes as the reference writer does."""
    header: dict[str, object] = {METADATA_KEY: dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtype.numpy.itemsize
        header[name] = {"dtype": safetensors_dtype(dtype), "shape": list(shape), "data_offsets": [offset,
                                                                                                  offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def view(data: memoryview, start: int, entry: StEntry) -> np.ndarray:
    """One tensor as a read-only ndarray viewing `data` (the whole file), without copying."""
    array = np.frombuffer(data[start + entry.offsets[0] : start + entry.offsets[1]], dtype=entry.dtype.numpy)
    array = array.reshape(entry.shape)
    array.flags.writeable = False
    return array
