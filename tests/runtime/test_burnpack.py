"""Tests for kiln.runtime.records.burnpack and burnpack_metadata, the format: dtypes, scalars, metadata bytes
exactly as Burn writes them, layout, and hostile input refused with a RecordError naming its source."""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from burnpack_samples import (
    BASE,
    DEFAULT_SCHEME,
    EMPTY,
    RICH,
    SCALAR_S,
    edit_metadata,
    metadata_of,
    read_everything,
    rewrite,
    text,
    with_metadata,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.ir.errors import RecordError
from kiln.runtime.records.burnpack import BurnDType, IntScalar, UIntScalar, itemsize, numpy_dtype
from kiln.runtime.records.burnpack_io import BurnpackFile, to_bytes
from kiln.runtime.records.cbor import CborTag

# ---------------------------------------------------------------------------------------------------------
# dtypes

DTYPE_TABLE = [
    ("F64", np.dtype("<f8"), 8),
    ("F32", np.dtype("<f4"), 4),
    ("Flex32", np.dtype("<f4"), 4),
    ("F16", np.dtype("<f2"), 2),
    ("BF16", np.dtype(ml_dtypes.bfloat16), 2),
    ("I64", np.dtype("<i8"), 8),
    ("I32", np.dtype("<i4"), 4),
    ("I16", np.dtype("<i2"), 2),
    ("I8", np.dtype("i1"), 1),
    ("U64", np.dtype("<u8"), 8),
    ("U32", np.dtype("<u4"), 4),
    ("U16", np.dtype("<u2"), 2),
    ("U8", np.dtype("u1"), 1),
    ({"Bool": "Native"}, np.dtype(np.bool_), 1),
    ({"Bool": "U8"}, np.dtype(np.bool_), 1),
    ({"Bool": "U32"}, np.dtype("<u4"), 4),
]


@pytest.mark.parametrize(("dtype", "expected", "size"), DTYPE_TABLE, ids=lambda v: str(v))
def test_numpy_dtype_and_itemsize(dtype: object, expected: np.dtype, size: int) -> None:
    assert numpy_dtype(dtype) == expected
    assert itemsize(dtype) == size


def test_qfloat_has_no_numpy_dtype() -> None:
    with pytest.raises(RecordError, match="QFloat"):
        numpy_dtype(BurnDType.qfloat(DEFAULT_SCHEME))
    with pytest.raises(RecordError):
        itemsize({"QFloat": DEFAULT_SCHEME})


@pytest.mark.parametrize("bad", ["F128", "Bool", {"Bool": "U16"}, {"X": 1}, {"Bool": 1}, 42, BurnDType])
def test_unknown_dtypes_rejected(bad: object) -> None:
    with pytest.raises(RecordError):
        BurnDType.parse(bad)


def test_qfloat_scheme_round_trips_as_opaque_cbor() -> None:
    dtype = BurnDType.qfloat(DEFAULT_SCHEME)
    payload = bytes(range(13))  # QFloat lengths are not numel * size
    pack = BurnpackFile.from_bytes(to_bytes([("q", {"QFloat": DEFAULT_SCHEME}, [7, 3], 9, payload)]))
    entry = pack.entries["q"]
    assert entry.dtype == dtype and entry.dtype.scheme_value == DEFAULT_SCHEME
    assert bytes(pack.tensor_bytes("q")) == payload
    with pytest.raises(RecordError, match="'q'"):
        pack.array("q")


def test_qfloat_scheme_bytes_kept_exactly_even_when_not_canonical() -> None:
    # {"value": 1.0 as f64, "v": [_ 1, 2] (indefinite), "t": tag 7(0x18 0x05: non-minimal 5)}
    scheme = (
        b"\xa3" + text("value") + b"\xfb" + struct.pack(">d", 1.0)
        + text("v") + b"\x9f\x01\x02\xff" + text("t") + b"\xc7\x18\x05"
    )  # fmt: skip
    first = to_bytes([("q", BurnDType("QFloat", scheme=scheme), [2], None, b"\x01\x02\x03")])
    assert scheme in metadata_of(first)
    pack = BurnpackFile.from_bytes(first)
    assert pack.entries["q"].dtype.scheme == scheme
    assert pack.entries["q"].dtype.scheme_value == {"value": 1.0, "v": [1, 2], "t": CborTag(7, 5)}
    assert rewrite(pack) == first


# ---------------------------------------------------------------------------------------------------------
# Metadata and layout


@pytest.mark.parametrize(
    ("value", "kind", "encoded"),
    [
        (IntScalar(-7), IntScalar, b"\xa1" + text("Int") + b"\x26"),
        (-(2**63), IntScalar, b"\xa1" + text("Int") + b"\x3b" + (2**63 - 1).to_bytes(8, "big")),
        (IntScalar(42), IntScalar, b"\xa1" + text("Int") + b"\x18\x2a"),
        (UIntScalar(42), UIntScalar, b"\xa1" + text("UInt") + b"\x18\x2a"),
        (2**63, UIntScalar, b"\xa1" + text("UInt") + b"\x1b" + (2**63).to_bytes(8, "big")),
        (True, bool, b"\xa1" + text("Bool") + b"\xf5"),
        (np.bool_(False), bool, b"\xa1" + text("Bool") + b"\xf4"),
        (1.5, float, b"\xa1" + text("Float") + b"\xf9\x3e\x00"),
        (-0.0, float, b"\xa1" + text("Float") + b"\xf9\x80\x00"),
        (math.inf, float, b"\xa1" + text("Float") + b"\xf9\x7c\x00"),
        (math.nan, float, b"\xa1" + text("Float") + b"\xf9\x7e\x00"),
        (65504.0, float, b"\xa1" + text("Float") + b"\xf9\x7b\xff"),
        (65520.0, float, b"\xa1" + text("Float") + b"\xfa" + struct.pack(">f", 65520.0)),
        (float(np.float32(0.1)), float, b"\xa1" + text("Float") + b"\xfa" + struct.pack(">f", 0.1)),
        (np.float64(0.1), float, b"\xa1" + text("Float") + b"\xfb" + struct.pack(">d", 0.1)),
        (1e300, float, b"\xa1" + text("Float") + b"\xfb" + struct.pack(">d", 1e300)),
    ],
    ids=repr,
)
def test_scalar_round_trip_keeps_tag_and_width(value: object, kind: type, encoded: bytes) -> None:
    first = to_bytes([], scalars={"s": value})
    assert metadata_of(first) == SCALAR_S + encoded
    pack = BurnpackFile.from_bytes(first)
    read = pack.scalars["s"]
    assert type(read) is kind
    assert read == value or (math.isnan(read) and math.isnan(value))
    assert math.copysign(1, read) == math.copysign(1, value)
    assert rewrite(pack) == first


@pytest.mark.parametrize(
    "width", [b"\xf9\x3e\x00", b"\xfa" + struct.pack(">f", 1.5), b"\xfb" + struct.pack(">d", 1.5)]
)
def test_scalar_float_accepted_at_any_width(width: bytes) -> None:
    pack = edit_metadata(to_bytes([], scalars={"s": 1.5}), b"\xf9\x3e\x00", width)
    assert BurnpackFile.from_bytes(pack).scalars == {"s": 1.5}


@pytest.mark.parametrize(
    "bad", [{"s": 2**64}, {"s": IntScalar(2**63)}, {"s": UIntScalar(-1)}, {"s": "x"}, {1: 2}, {"s": None}]
)
def test_bad_scalars_rejected(bad: dict) -> None:
    with pytest.raises(RecordError):
        to_bytes([], scalars=bad)


def test_user_metadata_round_trips_sorted_by_utf8() -> None:
    metadata = {"producer": "kiln", "é": "ü", "Z": "", "format": "burnpack"}
    first = to_bytes([], metadata=metadata)
    pack = BurnpackFile.from_bytes(first)
    assert pack.metadata == metadata
    encoded = metadata_of(first)
    positions = [encoded.index(text(key)) for key in ("Z", "format", "producer", "é")]
    assert positions == sorted(positions)
    assert rewrite(pack) == first


def test_empty_pack_is_exactly_256_bytes() -> None:
    assert EMPTY == b"NRUB\x01\x00\x0a\x00\x00\x00\xa1" + text("tensors") + b"\xa0" + bytes(236)
    pack = BurnpackFile.from_bytes(EMPTY)
    assert (pack.entries, pack.metadata, pack.scalars, pack.data_start) == ({}, {}, {}, 256)


def test_layout_follows_given_order_with_aligned_zero_padding() -> None:
    pack_bytes = to_bytes(
        [("zeta", "U8", [3], None, b"\x07\x08\x09"), ("alpha", "I16", [2], 1, np.array([1, -1], np.int16))]
    )
    pack = BurnpackFile.from_bytes(pack_bytes)
    assert list(pack.entries) == ["alpha", "zeta"]
    assert pack.entries["zeta"].data_offsets == (0, 3)
    assert pack.entries["alpha"].data_offsets == (256, 260)
    data = pack_bytes[pack.data_start :]
    assert data == b"\x07\x08\x09" + bytes(253) + b"\x01\x00\xff\xff"
    descriptor = metadata_of(pack_bytes).split(text("zeta"))[1]
    assert descriptor.startswith(b"\xa3" + text("dtype") + text("U8") + text("shape") + b"\x81\x03")
    assert b"param_id" not in descriptor


def test_writer_rejects_bad_metadata() -> None:
    with pytest.raises(RecordError):
        to_bytes([], metadata={"k": 1})


# ---------------------------------------------------------------------------------------------------------
# Hostile input

TOP = b"\xa2" + text("tensors") + b"\xa0" + text("x")  # {"tensors": {}, "x": <what follows>}
METADATA_K = b"\xa2" + text("tensors") + b"\xa0" + text("metadata") + b"\xa1" + text("k")
A_SHAPE = b"\x61a\xa4" + text("dtype") + text("F32") + text("shape")  # tensor "a" up to its shape
B_DTYPE = b"\x61b\xa4" + text("dtype")  # tensor "b" up to its dtype
BIG = b"\x1b" + (2**62).to_bytes(8, "big")
BOOL = text("Bool")
B_OFFSETS = b"\x82\x19\x01\x00\x19\x02\x00"  # tensor "b": [256, 512)


def header_patch(offset: int, value: bytes) -> bytes:
    """BASE with header bytes replaced."""
    return BASE[:offset] + value + BASE[offset + len(value) :]


HOSTILE = {
    **{f"truncated-at-{n}": BASE[:n] for n in (0, 3, 9, 10, 40, 255, 256, 300, len(BASE) - 1)},
    "empty-truncated-at-255": EMPTY[:255],
    "rich-truncated-in-metadata": RICH[:200],
    "wrong-magic": header_patch(0, b"NRUC"),
    "version-2": header_patch(4, b"\x02\x00"),
    "metadata-size-beyond-file": header_patch(6, struct.pack("<I", len(BASE))),
    "metadata-size-above-limit": header_patch(6, struct.pack("<I", 2**31)),
    "absurd-shape": edit_metadata(BASE, A_SHAPE + b"\x81\x18\x40", A_SHAPE + b"\x82" + BIG + BIG),
    "rank-65": edit_metadata(BASE, A_SHAPE + b"\x81\x18\x40", A_SHAPE + b"\x98\x41" + b"\x01" * 65),
    "offsets-beyond-file": edit_metadata(BASE, B_OFFSETS, b"\x82\x19\x10\x00\x19\x11\x00"),
    "overlapping-ranges": edit_metadata(BASE, B_OFFSETS, b"\x82\x00\x19\x01\x00"),
    "start-not-aligned": edit_metadata(BASE, B_OFFSETS, b"\x82\x18\x80\x19\x01\x80"),
    "end-before-start": edit_metadata(BASE, B_OFFSETS, b"\x82\x19\x02\x00\x19\x01\x00"),
    "length-not-numel-times-size": edit_metadata(BASE, B_OFFSETS, b"\x82\x19\x01\x00\x19\x01\x04"),
    "offsets-three-members": edit_metadata(BASE, B_OFFSETS, b"\x83\x19\x01\x00\x19\x02\x00\x00"),
    "duplicate-names": edit_metadata(BASE, b"\x61b\xa4", b"\x61a\xa4"),
    "non-utf8-name": edit_metadata(BASE, b"\x61b\xa4", b"\x61\xff\xa4"),
    "non-text-name": edit_metadata(BASE, b"\x61b\xa4", b"\x02\xa4"),
    "unknown-dtype": edit_metadata(BASE, B_DTYPE + text("F32"), B_DTYPE + text("F99")),
    "legacy-bool-dtype": edit_metadata(BASE, B_DTYPE + text("F32"), B_DTYPE + text("Bool")),
    "bool-store-unknown": edit_metadata(BASE, B_DTYPE + text("F32"), B_DTYPE + b"\xa1" + BOOL + text("U16")),
    "dtype-two-entry-map": edit_metadata(BASE, B_DTYPE + text("F32"), B_DTYPE + b"\xa2\x00\x00\x01\x01"),
    "negative-param-id": edit_metadata(BASE, text("param_id") + b"\x02", text("param_id") + b"\x21"),
    "missing-data-offsets": edit_metadata(
        BASE, text("data_offsets") + B_OFFSETS, text("data_offset") + B_OFFSETS
    ),
    "duplicate-field": edit_metadata(BASE, text("param_id") + b"\x02", text("dtype") + b"\x02"),
    "metadata-not-a-map": with_metadata(BASE, b"\x80"),
    "metadata-is-text": with_metadata(BASE, text("tensors")),
    "tensors-key-missing": with_metadata(BASE, b"\xa0"),
    "tensors-not-a-map": with_metadata(BASE, b"\xa1" + text("tensors") + b"\x80"),
    "duplicate-tensors-key": with_metadata(EMPTY, b"\xa2" + (text("tensors") + b"\xa0") * 2),
    "trailing-bytes": with_metadata(EMPTY, metadata_of(EMPTY) + b"\x00"),
    "empty-metadata": with_metadata(EMPTY, b""),
    "deep-arrays-at-top": with_metadata(EMPTY, b"\x81" * 10_000 + b"\x00"),
    "deep-arrays-under-unknown-key": with_metadata(EMPTY, TOP + b"\x81" * 10_000 + b"\x00"),
    "deep-maps-under-unknown-key": with_metadata(EMPTY, TOP + (b"\xa1" + text("k")) * 10_000 + b"\x00"),
    "deep-tags": with_metadata(EMPTY, TOP + b"\xc1" * 10_000 + b"\x00"),
    "deep-indefinite-arrays": with_metadata(EMPTY, TOP + b"\x9f" * 10_000 + b"\xff" * 10_000),
    "deep-qfloat-scheme": with_metadata(
        EMPTY,
        b"\xa1" + text("tensors") + b"\xa1" + text("q") + b"\xa2" + text("dtype") + b"\xa1" + text("QFloat")
        + b"\x81" * 10_000 + b"\x00",
    ),
    "array-claims-2^64-members": with_metadata(EMPTY, TOP + b"\x9b" + b"\xff" * 8),
    "text-claims-2^64-bytes": with_metadata(EMPTY, TOP + b"\x7b" + b"\xff" * 8),
    "too-many-tensors": with_metadata(EMPTY, b"\xa1" + text("tensors") + b"\xba\x00\x01\x86\xa1"),  # 100,001
    "reserved-head": with_metadata(EMPTY, TOP + b"\x1c"),
    "stray-break": with_metadata(EMPTY, TOP + b"\xff"),
    "undefined-value": with_metadata(EMPTY, TOP + b"\xf7"),
    "unknown-scalar-variant": with_metadata(EMPTY, SCALAR_S + b"\xa1" + text("Nope") + b"\x00"),
    "int-scalar-above-i64": with_metadata(EMPTY, SCALAR_S + b"\xa1" + text("Int") + b"\x1b\x80" + bytes(7)),
    "uint-scalar-negative": with_metadata(EMPTY, SCALAR_S + b"\xa1" + text("UInt") + b"\x20"),
    "float-scalar-is-int": with_metadata(EMPTY, SCALAR_S + b"\xa1" + text("Float") + b"\x01"),
    "bool-scalar-is-null": with_metadata(EMPTY, SCALAR_S + b"\xa1" + text("Bool") + b"\xf6"),
    "scalar-two-entry-map": with_metadata(EMPTY, SCALAR_S + b"\xa2" + text("Int") + b"\x01" + BOOL + b"\xf5"),
    "metadata-value-not-utf8": with_metadata(EMPTY, METADATA_K + b"\x61\xc3"),
    "metadata-value-not-text": with_metadata(EMPTY, METADATA_K + b"\x01"),
}  # fmt: skip


@pytest.mark.parametrize("data", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_input_is_record_error_naming_file(data: bytes, tmp_path: Path) -> None:
    path = tmp_path / "hostile.bpk"
    path.write_bytes(data)
    with pytest.raises(RecordError) as info:
        BurnpackFile.open(path)
    assert str(path) in str(info.value)
    with pytest.raises(RecordError, match="<hostile>"):
        BurnpackFile.from_bytes(data, source="<hostile>")


def test_unknown_keys_are_ignored_like_serde() -> None:
    extra = text("extra") + b"\x82\xa0\xf6"
    pack = edit_metadata(BASE, b"\x61b\xa4", b"\x61b\xa5" + extra)
    pack = with_metadata(pack, b"\xa2" + metadata_of(pack)[1:] + text("future") + b"\x9f\x01\xff")
    parsed = BurnpackFile.from_bytes(pack)
    assert set(parsed.entries) == {"a", "b"} and rewrite(parsed) == BASE


@pytest.mark.parametrize(("arrays", "accepted"), [(127, True), (128, False)])
def test_nesting_limit_is_128(arrays: int, accepted: bool) -> None:
    data = with_metadata(EMPTY, TOP + b"\x81" * arrays + b"\x00")  # the top map is one level
    if accepted:
        assert BurnpackFile.from_bytes(data).entries == {}
    else:
        with pytest.raises(RecordError, match="deeper than 128"):
            BurnpackFile.from_bytes(data)


def test_version_zero_is_refused() -> None:
    """issue 15: "Burnpack version 0 is refused" (Burn's reader lets it through, but no writer ever made one, so
    a 0 is a damaged header)."""
    with pytest.raises(RecordError, match=r"unsupported burnpack version 0 \(kiln reads 1 to 1\)"):
        BurnpackFile.from_bytes(header_patch(4, b"\x00\x00"))


# ---------------------------------------------------------------------------------------------------------
# Fuzzing


def check_mutant(data: bytes) -> None:
    """Reading either succeeds (and then re-encodes to an equal pack) or raises RecordError."""
    try:
        pack = read_everything(data)
    except RecordError:
        return
    again = BurnpackFile.from_bytes(rewrite(BurnpackFile.from_bytes(data)))
    assert [(e.name, e.dtype, e.shape, e.param_id) for e in again.entries.values()] == [
        (e.name, e.dtype, e.shape, e.param_id) for e in pack.entries.values()
    ]


BASES = [BASE, RICH, EMPTY]


@settings(max_examples=int(os.environ.get("KILN_FUZZ_ITERATIONS", 600)), deadline=None, database=None)
@given(
    base=st.sampled_from(BASES),
    edits=st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), min_size=1, max_size=4),
    in_metadata=st.booleans(),
    cut=st.none() | st.integers(0, 2**16),
)
def test_fuzz_byte_mutations(base: bytes, edits: list, in_metadata: bool, cut: int | None) -> None:
    data = bytearray(base)
    span = 10 + len(metadata_of(base)) if in_metadata else len(base)
    for position, value in edits:
        data[position % span] = value
    check_mutant(bytes(data[: None if cut is None else cut % (len(data) + 1)]))


@settings(max_examples=int(os.environ.get("KILN_FUZZ_ITERATIONS", 400)), deadline=None, database=None)
@given(
    base=st.sampled_from(BASES),
    start=st.integers(0, 2**16),
    length=st.integers(0, 8),
    insert=st.binary(max_size=8),
)
def test_fuzz_metadata_splices(base: bytes, start: int, length: int, insert: bytes) -> None:
    metadata = metadata_of(base)
    start %= len(metadata) + 1
    check_mutant(with_metadata(base, metadata[:start] + insert + metadata[start + length :]))
