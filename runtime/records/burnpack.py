"""The burnpack (`.bpk`) format, byte-compatible with Rust Burn's `burn-pack`: its dtypes, tensor entries,
limits, 256-byte alignment, the 10-byte header and the checks every entry must pass, for reader and writer alike.

Pure values and bytes: the CBOR metadata lives in `burnpack_metadata`, files in `burnpack_io`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

import ml_dtypes
import numpy as np

from kiln.ir.errors import RecordError
from kiln.ir.param_id import ParamId

from .cbor import Decoder, Encoder

__all__ = [
    "BurnDType",
    "IntScalar",
    "PackTensor",
    "TensorEntry",
    "UIntScalar",
    "itemsize",
    "numpy_dtype",
]

MAGIC = 0x4255524E
FORMAT_VERSION = 1
HEADER_SIZE = 10
_HEADER = "<IHI"  # magic u32, version u16, metadata size u32
TENSOR_ALIGNMENT = 256
MAX_METADATA_SIZE = 100 * 2**20
MAX_TENSOR_COUNT = 100_000
MAX_TENSOR_SIZE = 10 * 2**30
MAX_FILE_SIZE = 100 * 2**30
MAX_RANK = 64  # numpy's own limit on dimensions, so every readable entry can become an array
MIN_QFLOAT_BITS = 2  # the densest QFloat packing, bounding a quantized tensor's element count

ELEMENT_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "Flex32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
}
BOOL_STORES: dict[str, np.dtype] = {
    "Native": np.dtype(np.bool_),
    "U8": np.dtype(np.bool_),
    "U32": np.dtype("<u4"),
}


class IntScalar(int):
    """A `Scalar::Int` (i64) value; a distinct int type so it re-encodes with its own tag."""


class UIntScalar(int):
    """A `Scalar::UInt` (u64) value; a distinct int type so it re-encodes with its own tag."""


ScalarValue: TypeAlias = int | float | bool


@dataclass(frozen=True)
class BurnDType:
    """A Burn `DType`: an element name, `Bool` with its storage, or `QFloat` with a verbatim CBOR scheme."""

    kind: str
    store: str | None = None
    scheme: bytes | None = None

    def __post_init__(self) -> None:
        """Reject combinations Burn cannot express, so every instance encodes and decodes."""
        if not isinstance(self.kind, str):
            raise RecordError(f"not a Burn dtype: {self!r}")
        if self.kind in ELEMENT_DTYPES and self.store is None and self.scheme is None:
            return
        if self.kind == "Bool" and self.store in tuple(BOOL_STORES) and self.scheme is None:
            return
        if self.kind == "QFloat" and self.store is None and isinstance(self.scheme, bytes):
            Decoder(self.scheme, "QFloat scheme").single_item()
            return
        raise RecordError(f"not a Burn dtype: {self!r}")

    @classmethod
    def parse(cls, value: DTypeLike) -> BurnDType:
        """Accept "F32", {"Bool": "U8"}, {"QFloat": scheme} or a BurnDType, the spellings Burn's CBOR uses."""
        if isinstance(value, BurnDType):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, Mapping) and len(value) == 1:
            ((variant, inner),) = value.items()
            if variant == "Bool" and isinstance(inner, str):
                return cls("Bool", store=inner)
            if variant == "QFloat":
                return cls.qfloat(inner)
        raise RecordError(f"not a Burn dtype: {value!r}")

    @classmethod
    def qfloat(cls, scheme: object) -> BurnDType:
        """A QFloat dtype whose scheme is a plain Python value (dicts keep key order), encoded as CBOR."""
        encoder = Encoder("QFloat scheme")
        encoder.value(scheme, 0)
        return cls("QFloat", scheme=bytes(encoder.out))

    @property
    def scheme_value(self) -> object:
        """The QFloat scheme decoded into Python values, for inspection; None for other dtypes."""
        return None if self.scheme is None else Decoder(self.scheme, "QFloat scheme").single_item(keep=True)

    def __str__(self) -> str:
        """Burn's name for the dtype, e.g. `F32`, `Bool(U8)`, `QFloat`."""
        return f"Bool({self.store})" if self.kind == "Bool" else self.kind


DTypeLike: TypeAlias = BurnDType | str | Mapping[str, object]


def numpy_dtype(dtype: DTypeLike) -> np.dtype:
    """The numpy dtype that views a tensor's bytes in place; QFloat has none, its bytes are packed."""
    dt = BurnDType.parse(dtype)
    if dt.kind == "QFloat":
        raise RecordError("QFloat tensors have no numpy dtype; read their bytes instead")
    return BOOL_STORES[dt.store] if dt.kind == "Bool" else ELEMENT_DTYPES[dt.kind]


def itemsize(dtype: DTypeLike) -> int:
    """Bytes per element on disk, as Burn's writer checks them; QFloat has no fixed size."""
    return numpy_dtype(dtype).itemsize


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's metadata: `data_offsets` is [start, end) relative to the data section."""

    name: str
    dtype: BurnDType
    shape: tuple[int, ...]
    param_id: ParamId | None
    data_offsets: tuple[int, int]

    def __post_init__(self) -> None:
        """Normalise dtype spellings, ids and sequences so hand-built entries equal parsed ones."""
        object.__setattr__(self, "dtype", BurnDType.parse(self.dtype))
        object.__setattr__(self, "param_id", None if self.param_id is None else ParamId(self.param_id))
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "data_offsets", tuple(self.data_offsets))

    @property
    def numel(self) -> int:
        """Number of elements the shape declares."""
        return math.prod(self.shape)


class PackTensor(NamedTuple):
    """A tensor to write; data is bytes-like, an ndarray or a zero-argument callable producing one."""

    name: str
    dtype: DTypeLike
    shape: Iterable[int]
    param_id: int | None
    data: object
    nbytes: int | None = None  # needed only by a deferred QFloat tensor, whose shape cannot give its length


def align(offset: int) -> int:
    """Round up to the tensor alignment."""
    return -(-offset // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT


def check_entry(entry: TensorEntry, source: str) -> None:
    """Refuse an entry whose rank, size, alignment or byte length is impossible, before any allocation."""
    what = f"{source}: tensor {entry.name!r}"
    start, end = entry.data_offsets
    if len(entry.shape) > MAX_RANK:
        raise RecordError(f"{what} has rank {len(entry.shape)}, above {MAX_RANK}")
    quantized = entry.dtype.kind == "QFloat"
    declared = entry.numel if quantized else entry.numel * itemsize(entry.dtype)
    limit = MAX_TENSOR_SIZE * 8 // MIN_QFLOAT_BITS if quantized else MAX_TENSOR_SIZE
    if declared > limit:
        raise RecordError(f"{what} shape {list(entry.shape)} is absurdly large")
    if end < start:
        raise RecordError(f"{what} data_offsets end {end} is before start {start}")
    if end - start > MAX_TENSOR_SIZE:
        raise RecordError(f"{what} has {end - start} bytes, above the {MAX_TENSOR_SIZE}-byte limit")
    if start % TENSOR_ALIGNMENT:
        raise RecordError(f"{what} starts at offset {start}, not a multiple of {TENSOR_ALIGNMENT}")
    if not quantized and end - start != declared:
        needs = f"{entry.dtype} {list(entry.shape)} needs {declared}"
        raise RecordError(f"{what} has {end - start} bytes; {needs}")


def _check_ranges(entries: Iterable[TensorEntry], source: str) -> None:
    """Refuse tensors whose byte ranges overlap."""
    previous: TensorEntry | None = None
    for entry in sorted(entries, key=lambda e: e.data_offsets):
        if previous is not None and entry.data_offsets[0] < previous.data_offsets[1]:
            raise RecordError(f"{source}: tensors {previous.name!r} and {entry.name!r} overlap")
        previous = entry


def check_entries(entries: Iterable[TensorEntry], source: str) -> None:
    """Apply every per-entry and cross-entry check, including Burn's tensor count limit."""
    entries = list(entries)
    if len(entries) > MAX_TENSOR_COUNT:
        raise RecordError(f"{source}: {len(entries)} tensors, above the {MAX_TENSOR_COUNT} limit")
    for entry in entries:
        check_entry(entry, source)
    _check_ranges(entries, source)


class Layout(NamedTuple):
    """What the header says."""

    version: int
    metadata_size: int
    data_start: int


def fixed_header(metadata_size: int) -> bytes:
    """The 10 bytes that open every pack: magic, format version, metadata size (little-endian)."""
    return struct.pack(_HEADER, MAGIC, FORMAT_VERSION, metadata_size)


def read_header(view: memoryview, source: str) -> Layout:
    """Check the 10-byte header against the file's length and Burn's limits."""
    if len(view) < HEADER_SIZE:
        raise RecordError(f"{source}: truncated header ({len(view)} of {HEADER_SIZE} bytes)")
    if len(view) > MAX_FILE_SIZE:
        raise RecordError(f"{source}: file of {len(view)} bytes exceeds the {MAX_FILE_SIZE}-byte limit")
    magic, version, metadata_size = struct.unpack_from(_HEADER, view, 0)
    if magic != MAGIC:
        raise RecordError(f"{source}: not a burnpack file (magic 0x{magic:08x})")
    if not 1 <= version <= FORMAT_VERSION:  # Burn reads a 0 too, but no writer ever made one: a damaged header
        raise RecordError(f"{source}: unsupported burnpack version {version} (kiln reads 1 to {FORMAT_VERSION})")
    if metadata_size > MAX_METADATA_SIZE:
        raise RecordError(f"{source}: metadata_size {metadata_size} exceeds {MAX_METADATA_SIZE}")
    if HEADER_SIZE + metadata_size > len(view):
        raise RecordError(f"{source}: metadata_size {metadata_size} runs past the end of the file")
    return Layout(version, metadata_size, align(HEADER_SIZE + metadata_size))
