"""The burnpack header section: the CBOR `Metadata` struct (tensor descriptors, user metadata, scalars) encoded
exactly as Burn's serde writes it and parsed as its derived Deserialize reads it, with Burn's count and depth
limits; bytes in, bytes out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import numpy as np

from kiln.ir.errors import RecordError

from .burnpack import (
    BOOL_STORES,
    ELEMENT_DTYPES,
    HEADER_SIZE,
    MAX_METADATA_SIZE,
    MAX_RANK,
    MAX_TENSOR_COUNT,
    BurnDType,
    IntScalar,
    Layout,
    ScalarValue,
    TensorEntry,
    UIntScalar,
    align,
    check_entries,
    fixed_header,
    read_header,
)
from .cbor import Decoder, Encoder, utf8

__all__ = ["Contents", "pack_header", "parse_pack"]


class Contents(NamedTuple):
    """Everything the metadata declares."""

    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    scalars: dict[str, ScalarValue]


def _parse_metadata(data: bytes, source: str) -> Contents:
    """Decode the CBOR metadata like serde's derived Deserialize, plus Burn's count and depth limits."""
    dec = Decoder(data, source, "metadata")
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
    return Contents(fields["tensors"], fields.get("metadata", {}), fields.get("scalars", {}))


def _read_entry(dec: Decoder, name: str) -> TensorEntry:
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


def _read_offsets(dec: Decoder, what: str) -> tuple[int, int]:
    """Decode data_offsets, a two-element [start, end) array."""
    offsets = dec.uint_array(f"{what} data_offsets", 2)
    if len(offsets) != 2:
        dec.fail(f"{what} data_offsets does not have two members")
    return offsets[0], offsets[1]


def _read_dtype(dec: Decoder, what: str) -> BurnDType:
    """Decode a DType: a text name, {"Bool": store}, or {"QFloat": scheme} kept as its exact bytes."""
    if dec.peek() >> 5 == 3:
        kind = dec.text(f"{what} dtype")
        if kind == "Bool":
            dec.fail(f"{what} has Burn 0.20's plain 'Bool' dtype, which Burn 0.21+ no longer reads")
        if kind not in ELEMENT_DTYPES:
            dec.fail(f"{what} has unknown dtype {kind!r}")
        return BurnDType(kind)
    variant = dec.variant(f"{what} dtype")
    with dec.nested():
        if variant == "Bool":
            store = dec.text(f"{what} Bool storage")
            if store not in BOOL_STORES:
                dec.fail(f"{what} has unknown Bool storage {store!r}")
            return BurnDType("Bool", store=store)
        if variant == "QFloat":
            start = dec.pos
            dec.item(False)
            return BurnDType("QFloat", scheme=bytes(dec.data[start : dec.pos]))
    dec.fail(f"{what} has unknown dtype variant {variant!r}")


def _read_scalar(dec: Decoder, key: str) -> ScalarValue:
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


def _encode_scalar(encoder: Encoder, key: str, value: object) -> None:
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


def _encode_int_scalar(encoder: Encoder, key: str, value: int, kind: type) -> None:
    """Write the Int or UInt variant, checking the value fits it."""
    unsigned = kind is UIntScalar or (kind is not IntScalar and value >= 2**63)
    low, high = (0, 2**64) if unsigned else (-(2**63), 2**63)
    if not low <= value < high:
        encoder.fail(f"scalar {key!r} = {value} does not fit {'u64' if unsigned else 'i64'}")
    encoder.text("UInt" if unsigned else "Int")
    encoder.integer(value)


def _encode_entry(encoder: Encoder, entry: TensorEntry) -> None:
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
    encoder: Encoder, items: Mapping[str, object], write: Callable[[str, object], None]
) -> None:
    """Write a map sorted by UTF-8 key bytes, as a Rust BTreeMap<String, _> serializes."""
    keyed = sorted(((utf8(key, encoder.source), key, value) for key, value in items.items()), key=_first)
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
    encoder = Encoder(source)
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
    check_entries(entries, source)
    encoded = _encode_metadata(entries, metadata or {}, scalars or {}, source)
    if len(encoded) > MAX_METADATA_SIZE:
        raise RecordError(f"{source}: metadata of {len(encoded)} bytes exceeds {MAX_METADATA_SIZE}")
    header = fixed_header(len(encoded)) + encoded
    return header + bytes(align(len(header)) - len(header))


def parse_pack(view: memoryview, source: str) -> tuple[Layout, Contents]:
    """Parse and check header and metadata; tensor bytes are not touched."""
    layout = read_header(view, source)
    contents = _parse_metadata(bytes(view[HEADER_SIZE : HEADER_SIZE + layout.metadata_size]), source)
    check_entries(contents.entries.values(), source)
    needed = layout.data_start + max((e.data_offsets[1] for e in contents.entries.values()), default=0)
    if len(view) < needed:
        raise RecordError(f"{source}: file is {len(view)} bytes but its tensor data needs {needed}")
    return layout, contents
