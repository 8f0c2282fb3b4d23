"""Burnpack (`.bpk`) files, byte-compatible with Rust Burn's `burn-pack`: lazy mmap reading, atomic writing.

CBOR is hand-written here, not taken from cbor2: only that gives Burn's exact bytes (serde field order
with shortest-width floats), duplicate-key, depth and size checks before allocating, and verbatim QFloat
scheme bytes.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import mmap
import operator
import os
import secrets
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple, NoReturn, TypeAlias

import ml_dtypes
import numpy as np

from kiln.ir.errors import RecordError

__all__ = [
    "BurnDType",
    "BurnpackFile",
    "CborTag",
    "IntScalar",
    "PackTensor",
    "TensorEntry",
    "UIntScalar",
    "itemsize",
    "numpy_dtype",
    "pack_header",
    "to_bytes",
    "write_burnpack",
]

MAGIC = 0x4255524E
FORMAT_VERSION = 1
HEADER_SIZE = 10
TENSOR_ALIGNMENT = 256
MAX_CBOR_DEPTH = 128
MAX_METADATA_SIZE = 100 * 2**20
MAX_TENSOR_COUNT = 100_000
MAX_TENSOR_SIZE = 10 * 2**30
MAX_FILE_SIZE = 100 * 2**30
MAX_RANK = 64  # numpy's own limit on dimensions, so every readable entry can become an array
MIN_QFLOAT_BITS = 2  # the densest QFloat packing, bounding a quantized tensor's element count

_ELEMENT_DTYPES: dict[str, np.dtype] = {
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
_BOOL_STORES: dict[str, np.dtype] = {
    "Native": np.dtype(np.bool_),
    "U8": np.dtype(np.bool_),
    "U32": np.dtype("<u4"),
}


class CborTag(NamedTuple):
    """A tagged CBOR item inside an opaque value such as a QFloat scheme."""

    tag: int
    value: object


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
        if self.kind in _ELEMENT_DTYPES and self.store is None and self.scheme is None:
            return
        if self.kind == "Bool" and self.store in tuple(_BOOL_STORES) and self.scheme is None:
            return
        if self.kind == "QFloat" and self.store is None and isinstance(self.scheme, bytes):
            _Decoder(self.scheme, "QFloat scheme").single_item()
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
        encoder = _Encoder("QFloat scheme")
        encoder.value(scheme, 0)
        return cls("QFloat", scheme=bytes(encoder.out))

    @property
    def scheme_value(self) -> object:
        """The QFloat scheme decoded into Python values, for inspection; None for other dtypes."""
        return None if self.scheme is None else _Decoder(self.scheme, "QFloat scheme").single_item(keep=True)

    def __str__(self) -> str:
        """Burn's name for the dtype, e.g. `F32`, `Bool(U8)`, `QFloat`."""
        return f"Bool({self.store})" if self.kind == "Bool" else self.kind


DTypeLike: TypeAlias = BurnDType | str | Mapping[str, object]


def numpy_dtype(dtype: DTypeLike) -> np.dtype:
    """The numpy dtype that views a tensor's bytes in place; QFloat has none, its bytes are packed."""
    dt = BurnDType.parse(dtype)
    if dt.kind == "QFloat":
        raise RecordError("QFloat tensors have no numpy dtype; read their bytes instead")
    return _BOOL_STORES[dt.store] if dt.kind == "Bool" else _ELEMENT_DTYPES[dt.kind]


def itemsize(dtype: DTypeLike) -> int:
    """Bytes per element on disk, as Burn's writer checks them; QFloat has no fixed size."""
    return numpy_dtype(dtype).itemsize


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's metadata: `data_offsets` is [start, end) relative to the data section."""

    name: str
    dtype: BurnDType
    shape: tuple[int, ...]
    param_id: int | None
    data_offsets: tuple[int, int]

    def __post_init__(self) -> None:
        """Normalise dtype spellings and sequences so hand-built entries equal parsed ones."""
        object.__setattr__(self, "dtype", BurnDType.parse(self.dtype))
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


# ---------------------------------------------------------------------------------------------------------
# CBOR


class _Encoder:
    """CBOR as ciborium writes it: definite lengths, minimal heads, shortest round-tripping floats."""

    def __init__(self, source: str):
        self.out = bytearray()
        self.source = source

    def fail(self, reason: str) -> NoReturn:
        """Raise a RecordError naming the destination."""
        raise RecordError(f"{self.source}: {reason}")

    def head(self, major: int, argument: int) -> None:
        """Write a major type with its argument in the fewest bytes."""
        if not 0 <= argument < 2**64:
            self.fail(f"integer {argument} does not fit CBOR's 64-bit argument")
        if argument < 24:
            self.out.append(major << 5 | argument)
            return
        width = 1 if argument < 2**8 else 2 if argument < 2**16 else 4 if argument < 2**32 else 8
        self.out.append(major << 5 | (24 + width.bit_length() - 1))
        self.out += argument.to_bytes(width, "big")

    def integer(self, value: int) -> None:
        """Write a signed integer as major type 0 or 1."""
        if value >= 0:
            self.head(0, value)
        else:
            self.head(1, -1 - value)

    def floating(self, value: float) -> None:
        """Write a float at the narrowest IEEE width whose bits round-trip, as ciborium does."""
        bits = struct.pack(">d", value)
        for initial, fmt in ((0xF9, ">e"), (0xFA, ">f")):
            try:
                narrow = struct.pack(fmt, value)
            except OverflowError:
                continue
            if struct.pack(">d", struct.unpack(fmt, narrow)[0]) == bits:
                self.out.append(initial)
                self.out += narrow
                return
        self.out.append(0xFB)
        self.out += bits

    def text(self, value: str) -> None:
        """Write a text string; strings that are not valid Unicode are refused."""
        self.raw_text(_utf8(value, self.source))

    def raw_text(self, encoded: bytes) -> None:
        """Write a text string already encoded as UTF-8."""
        self.head(3, len(encoded))
        self.out += encoded

    def value(self, value: object, depth: int) -> None:
        """Write a generic Python value (for opaque schemes); dicts keep their insertion order."""
        if depth > MAX_CBOR_DEPTH:
            self.fail(f"value nests deeper than {MAX_CBOR_DEPTH}")
        if value is None or isinstance(value, bool):
            self.out.append({None: 0xF6, False: 0xF4, True: 0xF5}[value])
        elif isinstance(value, int):
            self.integer(value)
        elif isinstance(value, float):
            self.floating(value)
        elif isinstance(value, str):
            self.text(value)
        elif isinstance(value, bytes | bytearray):
            self.head(2, len(value))
            self.out += value
        elif isinstance(value, CborTag):
            self.head(6, value.tag)
            self.value(value.value, depth + 1)
        elif isinstance(value, list | tuple):
            self.sequence(value, depth)
        elif isinstance(value, Mapping):
            self.mapping(value, depth)
        else:
            self.fail(f"cannot encode {type(value).__name__} as CBOR")

    def sequence(self, items: list | tuple, depth: int) -> None:
        """Write an array of generic values."""
        self.head(4, len(items))
        for item in items:
            self.value(item, depth + 1)

    def mapping(self, items: Mapping, depth: int) -> None:
        """Write a map of generic values in insertion order."""
        self.head(5, len(items))
        for key, item in items.items():
            self.value(key, depth + 1)
            self.value(item, depth + 1)


class _Decoder:
    """A bounded CBOR reader: depth, lengths and UTF-8 are checked before anything is built from them."""

    def __init__(self, data: bytes, source: str):
        self.data = data
        self.source = source
        self.pos = 0
        self.depth = 0

    def fail(self, reason: str) -> NoReturn:
        """Raise a RecordError naming the file, the reason and where in the metadata it was found."""
        raise RecordError(f"{self.source}: bad metadata at byte {self.pos}: {reason}")

    def take(self, count: int) -> bytes:
        """Consume `count` bytes, refusing to run past the end."""
        if count > len(self.data) - self.pos:
            self.fail("metadata ends inside an item")
        chunk = self.data[self.pos : self.pos + count]
        self.pos += count
        return chunk

    def peek(self) -> int:
        """The next initial byte, not consumed."""
        if self.pos >= len(self.data):
            self.fail("metadata ends inside an item")
        return self.data[self.pos]

    def head(self) -> tuple[int, int, int | None]:
        """Consume an item head: major type, additional info, argument (None for indefinite length)."""
        initial = self.take(1)[0]
        major, info = initial >> 5, initial & 0x1F
        if info < 24:
            return major, info, info
        if info < 28:
            return major, info, int.from_bytes(self.take(1 << (info - 24)), "big")
        if info == 31 and major in (2, 3, 4, 5, 7):
            return major, info, None
        self.fail(f"malformed item head 0x{initial:02x}")

    @contextlib.contextmanager
    def nested(self) -> Iterator[None]:
        """Count one level of container nesting, refusing more than Burn's limit."""
        self.depth += 1
        if self.depth > MAX_CBOR_DEPTH:
            self.fail(f"CBOR nests deeper than {MAX_CBOR_DEPTH}")
        yield
        self.depth -= 1

    def members(self, count: int | None, min_size: int) -> Iterator[int]:
        """Yield once per member of a definite or indefinite container, consuming the closing break."""
        if count is not None:
            if count * min_size > len(self.data) - self.pos:
                self.fail(f"container claims {count} members, more than the metadata holds")
            yield from range(count)
            return
        index = 0
        while self.peek() != 0xFF:
            yield index
            index += 1
        self.pos += 1

    def container(self, major: int, what: str) -> int | None:
        """Consume the head of an array (4) or map (5) and return its length (None if indefinite)."""
        found, _, count = self.head()
        if found != major:
            self.fail(f"{what} is not {'a map' if major == 5 else 'an array'}")
        return count

    def string(self, major: int, count: int | None) -> bytes:
        """The payload of a byte or text string whose head was consumed, joining indefinite chunks."""
        if count is not None:
            return self.take(count)
        chunks = []
        for _ in self.members(None, 1):
            chunk_major, _, size = self.head()
            if chunk_major != major or size is None:
                self.fail("malformed chunk in an indefinite-length string")
            chunks.append(self.take(size))
        return b"".join(chunks)

    def decode_text(self, raw: bytes, what: str) -> str:
        """Text payload as str; invalid UTF-8 is refused, as Rust's String is."""
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not valid UTF-8")

    def text(self, what: str) -> str:
        """Consume a text string."""
        major, _, count = self.head()
        if major != 3:
            self.fail(f"{what} is not a text string")
        return self.decode_text(self.string(3, count), what)

    def uint(self, what: str) -> int:
        """Consume an unsigned integer (u64)."""
        major, _, value = self.head()
        if major != 0:
            self.fail(f"{what} is not an unsigned integer")
        return value

    def int64(self, what: str) -> int:
        """Consume a signed integer that fits i64."""
        major, _, value = self.head()
        if major not in (0, 1) or value >= 2**63:
            self.fail(f"{what} is not a 64-bit signed integer")
        return value if major == 0 else -1 - value

    def floating(self, what: str) -> float:
        """Consume a float of any IEEE width (f16, f32, f64)."""
        major, info, bits = self.head()
        if major != 7 or info not in (25, 26, 27):
            self.fail(f"{what} is not a float")
        return _float_from_bits(info, bits)

    def boolean(self, what: str) -> bool:
        """Consume `true` or `false`."""
        major, info, _ = self.head()
        if major != 7 or info not in (20, 21):
            self.fail(f"{what} is not a bool")
        return info == 21

    def optional_uint(self, what: str) -> int | None:
        """Consume an Option<u64>: null or an unsigned integer."""
        if self.peek() == 0xF6:
            self.pos += 1
            return None
        return self.uint(what)

    def uint_array(self, what: str, limit: int) -> list[int]:
        """Consume an array of unsigned integers holding at most `limit` members."""
        count = self.container(4, what)
        values: list[int] = []
        with self.nested():
            for index in self.members(count, 1):
                if index >= limit:
                    self.fail(f"{what} has more than {limit} members")
                values.append(self.uint(what))
        return values

    def variant(self, what: str) -> str:
        """Consume the head and name of a one-entry map `{variant: value}`, serde's externally tagged enum."""
        major, _, count = self.head()
        if major != 5 or count != 1:
            self.fail(f"{what} is not a one-entry map")
        return self.text(f"{what} variant")

    def struct(self, what: str, readers: Mapping[str, Callable[[], object]]) -> dict[str, object]:
        """Consume a serde struct: known fields via their readers, unknown ones skipped, no duplicates."""
        count = self.container(5, what)
        fields: dict[str, object] = {}
        with self.nested():
            for _ in self.members(count, 2):
                if self.peek() >> 5 != 3:
                    self.item(False)
                    self.item(False)
                    continue
                key = self.text(f"field name in {what}")
                if key in fields:
                    self.fail(f"{what} has duplicate field {key!r}")
                reader = readers.get(key)
                if reader is None:
                    self.item(False)
                else:
                    fields[key] = reader()
        return fields

    def text_map(
        self, what: str, read_value: Callable[[str], object], limit: int | None = None
    ) -> dict[str, object]:
        """Consume a BTreeMap<String, _>: text keys, no duplicates, at most `limit` entries if given."""
        count = self.container(5, what)
        if limit is not None and count is not None and count > limit:
            self.fail(f"{what} has {count} entries, more than {limit}")
        result: dict[str, object] = {}
        with self.nested():
            for index in self.members(count, 2):
                if limit is not None and index >= limit:
                    self.fail(f"{what} has more than {limit} entries")
                key = self.text(f"key in {what}")
                if key in result:
                    self.fail(f"{what} has duplicate key {key!r}")
                result[key] = read_value(key)
        return result

    def item(self, keep: bool) -> object:
        """Consume any well-formed item; build its Python value only when `keep`, else just validate it."""
        major, info, argument = self.head()
        if major == 0:
            return argument
        if major == 1:
            return -1 - argument
        if major in (2, 3):
            raw = self.string(major, argument)
            return raw if major == 2 else self.decode_text(raw, "text string")
        if major == 7:
            return self.simple(info, argument)
        with self.nested():
            if major == 4:
                return self.array_items(argument, keep)
            if major == 5:
                return self.map_items(argument, keep)
            return CborTag(argument, self.item(keep))

    def array_items(self, count: int | None, keep: bool) -> list | None:
        """Members of an array whose head was consumed."""
        values = []
        for _ in self.members(count, 1):
            value = self.item(keep)
            if keep:
                values.append(value)
        return values if keep else None

    def map_items(self, count: int | None, keep: bool) -> dict | None:
        """Entries of a map whose head was consumed; duplicate or unhashable keys refused when kept."""
        result: dict = {}
        for _ in self.members(count, 2):
            key, value = self.item(keep), self.item(keep)
            if not keep:
                continue
            try:
                duplicate = key in result
            except TypeError:
                self.fail("map key contains an array or map")
            if duplicate:
                self.fail(f"map has duplicate key {key!r}")
            result[key] = value
        return result if keep else None

    def simple(self, info: int, argument: int | None) -> object:
        """A major-type-7 item: false, true, null or a float; other simple values and stray breaks refused."""
        if info in (20, 21, 22):
            return {20: False, 21: True, 22: None}[info]
        if info in (25, 26, 27):
            return _float_from_bits(info, argument)
        self.fail("unsupported CBOR simple value" if info != 31 else "unexpected break")

    def single_item(self, keep: bool = False) -> object:
        """Consume exactly one item spanning all the data."""
        value = self.item(keep)
        self.finish()
        return value

    def finish(self) -> None:
        """Refuse bytes left over after the top-level item."""
        if self.pos != len(self.data):
            self.fail(f"{len(self.data) - self.pos} trailing byte(s) after the metadata")


def _float_from_bits(info: int, bits: int) -> float:
    """Decode an f16 (info 25), f32 (26) or f64 (27) argument."""
    fmt, width = {25: (">e", 2), 26: (">f", 4), 27: (">d", 8)}[info]
    return struct.unpack(fmt, bits.to_bytes(width, "big"))[0]


def _utf8(text: str, source: str) -> bytes:
    """Encode a name as UTF-8, refusing non-str values and lone surrogates with a RecordError."""
    if not isinstance(text, str):
        raise RecordError(f"{source}: expected a string, got {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise RecordError(f"{source}: {text!r} is not valid Unicode") from None


# ---------------------------------------------------------------------------------------------------------
# Metadata: decoding


class _Contents(NamedTuple):
    """Everything the metadata declares."""

    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    scalars: dict[str, ScalarValue]


def _parse_metadata(data: bytes, source: str) -> _Contents:
    """Decode the CBOR metadata like serde's derived Deserialize, plus Burn's count and depth limits."""
    dec = _Decoder(data, source)
    entry, scalar = functools.partial(_read_entry, dec), functools.partial(_read_scalar, dec)
    fields = dec.struct(
        "metadata",
        {
            "tensors": lambda: dec.text_map("'tensors'", entry, MAX_TENSOR_COUNT),
            "metadata": lambda: dec.text_map("'metadata'", lambda key: dec.text(f"metadata {key!r}")),
            "scalars": lambda: dec.text_map("'scalars'", scalar),
        },
    )
    dec.finish()
    if "tensors" not in fields:
        raise RecordError(f"{source}: metadata has no 'tensors' map")
    return _Contents(fields["tensors"], fields.get("metadata", {}), fields.get("scalars", {}))


def _read_entry(dec: _Decoder, name: str) -> TensorEntry:
    """Decode one TensorDescriptor map into an entry."""
    what = f"tensor {name!r}"
    fields = dec.struct(
        what,
        {
            "dtype": lambda: _read_dtype(dec, what),
            "shape": lambda: tuple(dec.uint_array(f"{what} shape", MAX_RANK)),
            "data_offsets": lambda: _read_offsets(dec, what),
            "param_id": lambda: dec.optional_uint(f"{what} param_id"),
        },
    )
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in fields]
    if missing:
        dec.fail(f"{what} has no {', '.join(missing)}")
    return TensorEntry(name, fields["dtype"], fields["shape"], fields.get("param_id"), fields["data_offsets"])


def _read_offsets(dec: _Decoder, what: str) -> tuple[int, int]:
    """Decode data_offsets, a two-element [start, end) array."""
    offsets = dec.uint_array(f"{what} data_offsets", 2)
    if len(offsets) != 2:
        dec.fail(f"{what} data_offsets does not have two members")
    return offsets[0], offsets[1]


def _read_dtype(dec: _Decoder, what: str) -> BurnDType:
    """Decode a DType: a text name, {"Bool": store}, or {"QFloat": scheme} kept as its exact bytes."""
    if dec.peek() >> 5 == 3:
        kind = dec.text(f"{what} dtype")
        if kind == "Bool":
            dec.fail(f"{what} has Burn 0.20's plain 'Bool' dtype, which Burn 0.21+ no longer reads")
        if kind not in _ELEMENT_DTYPES:
            dec.fail(f"{what} has unknown dtype {kind!r}")
        return BurnDType(kind)
    variant = dec.variant(f"{what} dtype")
    with dec.nested():
        if variant == "Bool":
            store = dec.text(f"{what} Bool storage")
            if store not in _BOOL_STORES:
                dec.fail(f"{what} has unknown Bool storage {store!r}")
            return BurnDType("Bool", store=store)
        if variant == "QFloat":
            start = dec.pos
            dec.item(False)
            return BurnDType("QFloat", scheme=bytes(dec.data[start : dec.pos]))
    dec.fail(f"{what} has unknown dtype variant {variant!r}")


def _read_scalar(dec: _Decoder, key: str) -> ScalarValue:
    """Decode an externally tagged Scalar, keeping Int and UInt apart by type."""
    what = f"scalar {key!r}"
    variant = dec.variant(what)
    with dec.nested():
        if variant == "Int":
            return IntScalar(dec.int64(what))
        if variant == "UInt":
            return UIntScalar(dec.uint(what))
        if variant == "Float":
            return dec.floating(what)
        if variant == "Bool":
            return dec.boolean(what)
    dec.fail(f"{what} has unknown variant {variant!r}")


# ---------------------------------------------------------------------------------------------------------
# Metadata: checks shared by reader and writer


def _align(offset: int) -> int:
    """Round up to the tensor alignment."""
    return -(-offset // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT


def _check_entry(entry: TensorEntry, source: str) -> None:
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


def _check_entries(entries: Iterable[TensorEntry], source: str) -> None:
    """Apply every per-entry and cross-entry check, including Burn's tensor count limit."""
    entries = list(entries)
    if len(entries) > MAX_TENSOR_COUNT:
        raise RecordError(f"{source}: {len(entries)} tensors, above the {MAX_TENSOR_COUNT} limit")
    for entry in entries:
        _check_entry(entry, source)
    _check_ranges(entries, source)


# ---------------------------------------------------------------------------------------------------------
# Reading


class _Layout(NamedTuple):
    """What the header says."""

    version: int
    metadata_size: int
    data_start: int


def _read_header(view: memoryview, source: str) -> _Layout:
    """Check the 10-byte header against the file's length and Burn's limits."""
    if len(view) < HEADER_SIZE:
        raise RecordError(f"{source}: truncated header ({len(view)} of {HEADER_SIZE} bytes)")
    if len(view) > MAX_FILE_SIZE:
        raise RecordError(f"{source}: file of {len(view)} bytes exceeds the {MAX_FILE_SIZE}-byte limit")
    magic, version, metadata_size = struct.unpack_from("<IHI", view, 0)
    if magic != MAGIC:
        raise RecordError(f"{source}: not a burnpack file (magic 0x{magic:08x})")
    if version > FORMAT_VERSION:
        raise RecordError(f"{source}: unsupported burnpack version {version}")
    if metadata_size > MAX_METADATA_SIZE:
        raise RecordError(f"{source}: metadata_size {metadata_size} exceeds {MAX_METADATA_SIZE}")
    if HEADER_SIZE + metadata_size > len(view):
        raise RecordError(f"{source}: metadata_size {metadata_size} runs past the end of the file")
    return _Layout(version, metadata_size, _align(HEADER_SIZE + metadata_size))


def _parse(view: memoryview, source: str) -> tuple[_Layout, _Contents]:
    """Parse and check header and metadata; tensor bytes are not touched."""
    layout = _read_header(view, source)
    contents = _parse_metadata(bytes(view[HEADER_SIZE : HEADER_SIZE + layout.metadata_size]), source)
    _check_entries(contents.entries.values(), source)
    needed = layout.data_start + max((e.data_offsets[1] for e in contents.entries.values()), default=0)
    if len(view) < needed:
        raise RecordError(f"{source}: file is {len(view)} bytes but its tensor data needs {needed}")
    return layout, contents


class BurnpackFile:
    """A parsed burnpack whose tensor bytes stay in the file (memory-mapped) until asked for."""

    def __init__(self, view: memoryview, source: str, mapping: mmap.mmap | None = None):
        """Parse `view` (the whole pack); `mapping`, if any, is closed with this object."""
        self.path = source
        self._view: memoryview | None = view
        self._mapping = mapping
        layout, contents = _parse(view, source)
        self.version = layout.version
        self.data_start = layout.data_start
        self.entries: dict[str, TensorEntry] = dict(sorted(contents.entries.items(), key=_name_key))
        self.metadata: dict[str, str] = contents.metadata
        self.scalars: dict[str, ScalarValue] = contents.scalars

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> BurnpackFile:
        """Read header and metadata of a file and map the rest read-only, without reading tensor data."""
        source = os.fspath(path)
        mapping = _map_file(source)
        view = memoryview(mapping) if mapping is not None else memoryview(b"")
        try:
            return cls(view, source, mapping)
        except BaseException:
            _release(view, mapping)
            raise

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, source: str = "<bytes>") -> BurnpackFile:
        """Parse an in-memory pack; arrays view `data` directly and are read-only."""
        return cls(memoryview(data).cast("B").toreadonly(), source)

    def tensor_bytes(self, name: str) -> memoryview:
        """A zero-copy, read-only view of one tensor's bytes."""
        entry = self._entry(name)
        start, end = entry.data_offsets
        return self._data()[self.data_start + start : self.data_start + end]

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

    def close(self) -> None:
        """Release the mapping; arrays still alive keep their pages until they are dropped."""
        if self._view is not None:
            _release(self._view, self._mapping)
        self._view = self._mapping = None

    def __enter__(self) -> BurnpackFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _entry(self, name: str) -> TensorEntry:
        """The entry called `name`, or a RecordError."""
        entry = self.entries.get(name)
        if entry is None:
            raise RecordError(f"{self.path}: no tensor named {name!r}")
        return entry

    def _data(self) -> memoryview:
        """The whole pack's bytes, or a RecordError once closed."""
        if self._view is None:
            raise RecordError(f"{self.path}: file is closed")
        return self._view


def _name_key(item: tuple[str, object]) -> bytes:
    """Sort key matching Rust's String order: byte-wise UTF-8."""
    return item[0].encode("utf-8")


def _map_file(source: str) -> mmap.mmap | None:
    """Map a file read-only (None when empty, which mmap refuses); OS errors become RecordErrors."""
    try:
        with open(source, "rb") as file:
            if os.fstat(file.fileno()).st_size == 0:
                return None
            return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as error:
        raise RecordError(f"{source}: cannot open: {error.strerror or error}") from error


def _release(view: memoryview, mapping: mmap.mmap | None) -> None:
    """Drop our view and close the mapping unless arrays still export it (then GC closes it later)."""
    view.release()
    if mapping is not None:
        with contextlib.suppress(BufferError):
            mapping.close()


# ---------------------------------------------------------------------------------------------------------
# Writing


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
    _utf8(name, source)
    try:
        dtype = BurnDType.parse(tensor.dtype)
    except RecordError as error:
        raise RecordError(f"{what}: {error}") from None
    shape = _shape(tensor.shape, what)
    param_id = None if tensor.param_id is None else _index(tensor.param_id, f"{what} param_id", 2**64)
    data = tensor.data if callable(tensor.data) else _as_buffer(tensor.data, what)
    nbytes = _declared_nbytes(dtype, shape, data, tensor.nbytes, what)
    start = _align(offset)
    entry = TensorEntry(name, dtype, shape, param_id, (start, start + nbytes))
    _check_entry(entry, source)
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


def _encode_scalar(encoder: _Encoder, key: str, value: object) -> None:
    """Write one Scalar as {"Int"|"UInt"|"Float"|"Bool": value}; plain ints pick Int, or UInt past i64."""
    encoder.head(5, 1)
    if isinstance(value, bool | np.bool_):
        encoder.text("Bool")
        encoder.out.append(0xF5 if value else 0xF4)
    elif isinstance(value, float | np.floating):
        encoder.text("Float")
        encoder.floating(float(value))
    elif isinstance(value, int | np.integer):
        _encode_int_scalar(encoder, key, int(value), type(value))
    else:
        encoder.fail(f"scalar {key!r} is {type(value).__name__}, not int, float or bool")


def _encode_int_scalar(encoder: _Encoder, key: str, value: int, kind: type) -> None:
    """Write the Int or UInt variant, checking the value fits it."""
    unsigned = kind is UIntScalar or (kind is not IntScalar and value >= 2**63)
    low, high = (0, 2**64) if unsigned else (-(2**63), 2**63)
    if not low <= value < high:
        encoder.fail(f"scalar {key!r} = {value} does not fit {'u64' if unsigned else 'i64'}")
    encoder.text("UInt" if unsigned else "Int")
    encoder.integer(value)


def _encode_entry(encoder: _Encoder, entry: TensorEntry) -> None:
    """Write a TensorDescriptor with Burn's field order; param_id only when present."""
    encoder.head(5, 3 if entry.param_id is None else 4)
    encoder.text("dtype")
    dtype = entry.dtype
    if dtype.kind == "Bool":
        encoder.head(5, 1)
        encoder.text("Bool")
        encoder.text(dtype.store)
    elif dtype.kind == "QFloat":
        encoder.head(5, 1)
        encoder.text("QFloat")
        encoder.out += dtype.scheme
    else:
        encoder.text(dtype.kind)
    encoder.text("shape")
    encoder.head(4, len(entry.shape))
    for dim in entry.shape:
        encoder.head(0, dim)
    encoder.text("data_offsets")
    encoder.head(4, 2)
    encoder.head(0, entry.data_offsets[0])
    encoder.head(0, entry.data_offsets[1])
    if entry.param_id is not None:
        encoder.text("param_id")
        encoder.head(0, entry.param_id)


def _encode_sorted(
    encoder: _Encoder, items: Mapping[str, object], write: Callable[[str, object], None]
) -> None:
    """Write a map sorted by UTF-8 key bytes, as a Rust BTreeMap<String, _> serializes."""
    keyed = sorted(((_utf8(key, encoder.source), key, value) for key, value in items.items()), key=_first)
    encoder.head(5, len(keyed))
    for encoded, key, value in keyed:
        encoder.raw_text(encoded)
        write(key, value)


def _first(item: tuple) -> object:
    """Sort key: the first element only, so values never get compared."""
    return item[0]


def _encode_metadata(
    entries: Iterable[TensorEntry], metadata: Mapping[str, str], scalars: Mapping[str, object], source: str
) -> bytes:
    """The Metadata struct: tensors always, metadata and scalars only when non-empty."""
    encoder = _Encoder(source)
    encoder.head(5, 1 + bool(metadata) + bool(scalars))
    encoder.text("tensors")
    _encode_sorted(encoder, {e.name: e for e in entries}, lambda _, entry: _encode_entry(encoder, entry))
    if metadata:
        encoder.text("metadata")
        _encode_sorted(encoder, metadata, lambda _, value: encoder.text(value))
    if scalars:
        encoder.text("scalars")
        _encode_sorted(encoder, scalars, lambda key, value: _encode_scalar(encoder, key, value))
    return bytes(encoder.out)


def pack_header(
    entries: Iterable[TensorEntry],
    metadata: Mapping[str, str] | None = None,
    scalars: Mapping[str, ScalarValue] | None = None,
    *,
    source: str = "<burnpack>",
) -> bytes:
    """Header, CBOR metadata and zero padding up to the data section, for entries already laid out."""
    entries = list(entries)
    if len({entry.name for entry in entries}) != len(entries):
        raise RecordError(f"{source}: duplicate tensor names")
    _check_entries(entries, source)
    encoded = _encode_metadata(entries, metadata or {}, scalars or {}, source)
    if len(encoded) > MAX_METADATA_SIZE:
        raise RecordError(f"{source}: metadata of {len(encoded)} bytes exceeds {MAX_METADATA_SIZE}")
    header = struct.pack("<IHI", MAGIC, FORMAT_VERSION, len(encoded)) + encoded
    return header + bytes(_align(len(header)) - len(header))


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
    destination = Path(path)
    source = os.fspath(path)
    header, planned = _prepare(tensors, metadata, scalars, source)
    try:
        _write_atomically(destination, lambda out: _write_pack(out, header, planned, source))
    except OSError as error:
        raise RecordError(f"{source}: cannot write: {error.strerror or error}") from error


def _write_atomically(destination: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write a hidden `.tmp` sibling, fsync it, rename it over the destination and fsync the directory."""
    temporary = destination.with_name(f".{destination.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    descriptor = os.open(temporary, flags, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, destination)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(destination.parent)


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable; platforms that cannot open directories skip it."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
