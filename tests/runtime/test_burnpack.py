"""Tests for kiln.runtime.records.burnpack: Burn's own file, round trips, lazy reads, atomic writes, hostile input."""

from __future__ import annotations

import math
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.ir.errors import RecordError
from kiln.runtime.records.burnpack import (
    BurnDType,
    BurnpackFile,
    CborTag,
    IntScalar,
    PackTensor,
    TensorEntry,
    UIntScalar,
    itemsize,
    numpy_dtype,
    pack_header,
    to_bytes,
    write_burnpack,
)

FIXTURE = Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures" / "burn" / "mnist-model.bpk"

FIXTURE_NAMES = {
    *(f"conv{i}.conv.{p}" for i in (1, 2) for p in ("weight", "bias")),
    *(f"conv{i}.norm.{p}" for i in (1, 2) for p in ("gamma", "beta", "running_mean", "running_var")),
    *(f"fc{i}.{p}" for i in (1, 2, 3) for p in ("weight", "bias")),
}

# Burn HEAD's default QuantScheme, as serde would spell it.
DEFAULT_SCHEME = {
    "value": "Q8F",
    "store": {"PackedU32": 0},
    "mode": "Symmetric",
    "tensor": None,
    "block": None,
}


def text(value: str) -> bytes:
    """A short CBOR text string, for hand-made metadata."""
    raw = value.encode()
    assert len(raw) < 24
    return bytes([0x60 + len(raw)]) + raw


def metadata_of(pack: bytes) -> bytes:
    """The CBOR metadata of a pack."""
    (size,) = struct.unpack_from("<I", pack, 6)
    return pack[10 : 10 + size]


def with_metadata(pack: bytes, metadata: bytes) -> bytes:
    """The same pack with its metadata replaced: header size fixed, data section kept after new padding."""
    old_start = -(-(10 + len(metadata_of(pack))) // 256) * 256
    head = pack[:6] + struct.pack("<I", len(metadata)) + metadata
    return head + bytes(-len(head) % 256) + pack[old_start:]


def edit_metadata(pack: bytes, old: bytes, new: bytes) -> bytes:
    """Replace the one occurrence of `old` in the metadata."""
    metadata = metadata_of(pack)
    assert metadata.count(old) == 1, old
    return with_metadata(pack, metadata.replace(old, new))


def read_everything(data: bytes) -> BurnpackFile:
    """Parse a pack and touch every tensor the way a loader would."""
    with BurnpackFile.from_bytes(data) as pack:
        for name, entry in pack.entries.items():
            start, end = entry.data_offsets
            assert len(pack.tensor_bytes(name)) == end - start
            if entry.dtype.kind == "QFloat":
                entry.dtype.scheme_value  # noqa: B018 - decoding is the check
            else:
                assert pack.array(name).shape == entry.shape
    return pack


def rewrite(pack: BurnpackFile) -> bytes:
    """Re-encode a parsed pack with its tensors in file order."""
    ordered = sorted(pack.entries.values(), key=lambda e: e.data_offsets)
    tensors = [(e.name, e.dtype, e.shape, e.param_id, pack.tensor_bytes(e.name)) for e in ordered]
    return to_bytes(tensors, pack.metadata, pack.scalars)


BASE = to_bytes(
    [
        ("a", "F32", [64], 1, np.arange(64, dtype=np.float32)),
        ("b", "F32", [64], 2, np.ones(64, dtype=np.float32)),
    ]
)
RICH = to_bytes(
    [
        ("w", "BF16", [2, 3], 11, np.arange(6).astype(ml_dtypes.bfloat16)),
        ("mask", {"Bool": "Native"}, [3], None, np.array([True, False, True])),
        ("q", BurnDType.qfloat(DEFAULT_SCHEME), [4], 12, bytes(8)),
        ("empty", "I64", [0, 5], None, b""),
        ("u", {"Bool": "U32"}, [1], 13, np.array([1], dtype="<u4")),
    ],
    metadata={"producer": "kiln", "format": "burnpack"},
    scalars={"i": IntScalar(-3), "u": UIntScalar(3), "f": 0.1, "h": 1.5, "b": True},
)
EMPTY = to_bytes([])
SCALAR_S = b"\xa2" + text("tensors") + b"\xa0" + text("scalars") + b"\xa1" + text("s")  # scalar "s" next


# ---------------------------------------------------------------------------------------------------------
# The file Rust Burn wrote


@pytest.fixture
def fixture_path() -> Path:
    if not FIXTURE.is_file():
        pytest.skip("Burn fixture mnist-model.bpk not found in shared/fixtures/burn next to the repository")
    return FIXTURE


def test_fixture_entries(fixture_path: Path) -> None:
    with BurnpackFile.open(fixture_path) as pack:
        assert set(pack.entries) == FIXTURE_NAMES
        assert list(pack.entries) == sorted(FIXTURE_NAMES)
        assert (pack.version, pack.data_start, pack.metadata, pack.scalars) == (1, 1536, {}, {})
        assert pack.entries["fc1.weight"].shape == (1600, 128)
        assert pack.entries["conv2.conv.weight"].shape == (64, 64, 3, 3)
        assert pack.entries["fc3.bias"].shape == (10,)
        for entry in pack.entries.values():
            assert entry.dtype == BurnDType("F32")
            assert isinstance(entry.param_id, int) and 0 <= entry.param_id < 2**64
        assert len({e.param_id for e in pack.entries.values()}) == 18


def test_fixture_arrays_are_zero_copy_views(fixture_path: Path) -> None:
    with BurnpackFile.open(fixture_path) as pack:
        weight = pack.array("fc1.weight")
        assert weight.dtype == np.float32 and weight.shape == (1600, 128)
        assert not weight.flags.writeable and not weight.flags.owndata
        assert np.isfinite(weight).all()
        assert (pack.array("conv1.norm.running_var") > 0).all()
        start, end = pack.entries["fc1.weight"].data_offsets
        raw = fixture_path.read_bytes()[1536 + start : 1536 + end]
        assert weight.tobytes() == raw


def test_fixture_reencodes_byte_identical(fixture_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "copy.bpk"
    with BurnpackFile.open(fixture_path) as pack:
        ordered = sorted(pack.entries.values(), key=lambda e: e.data_offsets)
        tensors = [(e.name, e.dtype, e.shape, e.param_id, pack.tensor_bytes(e.name)) for e in ordered]
        write_burnpack(out, tensors)
        assert rewrite(pack) == fixture_path.read_bytes()
    assert out.read_bytes() == fixture_path.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["copy.bpk"]


# ---------------------------------------------------------------------------------------------------------
# dtypes and round trips

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


SAMPLES = {
    "F64": np.array([[1.5, -2.0], [np.inf, 0.1]]),
    "F32": np.array([1.0, -0.5, 3e38], dtype=np.float32),
    "Flex32": np.array([0.25, 7.0], dtype=np.float32),
    "F16": np.array([1.0, 65504.0, -0.0], dtype=np.float16),
    "BF16": np.array([[1.0, -2.5], [3.0e38, 0.0]], dtype=ml_dtypes.bfloat16),
    "I64": np.array([-(2**63), 2**63 - 1], dtype=np.int64),
    "I32": np.array([[-(2**31)], [2**31 - 1]], dtype=np.int32),
    "I16": np.array([-7, 300], dtype=np.int16),
    "I8": np.array([-128, 127], dtype=np.int8),
    "U64": np.array([2**64 - 1, 0], dtype=np.uint64),
    "U32": np.array([2**32 - 1], dtype=np.uint32),
    "U16": np.array([65535, 1], dtype=np.uint16),
    "U8": np.arange(10, dtype=np.uint8).reshape(2, 5),
    "Bool(Native)": np.array([True, False, True]),
    "Bool(U8)": np.array([[False], [True]]),
    "Bool(U32)": np.array([1, 0, 1], dtype=np.uint32),
}


def burn_dtype(label: str) -> object:
    """The dtype spelling for a SAMPLES label."""
    return {"Bool": label[5:-1]} if label.startswith("Bool(") else label


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
@pytest.mark.parametrize("label", list(SAMPLES))
def test_round_trip_every_dtype(label: str, deferred: bool, tmp_path: Path) -> None:
    sample = SAMPLES[label]
    data = (lambda: sample) if deferred else sample
    path = tmp_path / "t.bpk"
    write_burnpack(path, [("x.y", burn_dtype(label), sample.shape, 5, data)])
    with BurnpackFile.open(path) as pack:
        entry = pack.entries["x.y"]
        dtype = BurnDType.parse(burn_dtype(label))
        assert entry == TensorEntry("x.y", dtype, sample.shape, 5, entry.data_offsets)
        array = pack.array("x.y")
        assert array.dtype == numpy_dtype(burn_dtype(label)) and array.shape == sample.shape
        assert array.tobytes() == sample.tobytes()
        assert not array.flags.writeable
        assert bytes(pack.tensor_bytes("x.y")) == sample.tobytes()
        assert rewrite(pack) == path.read_bytes()


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


def test_deferred_qfloat_needs_nbytes() -> None:
    qfloat = BurnDType.qfloat(DEFAULT_SCHEME)
    with pytest.raises(RecordError, match="nbytes"):
        to_bytes([("q", qfloat, [4], None, lambda: bytes(8))])
    pack = BurnpackFile.from_bytes(to_bytes([PackTensor("q", qfloat, [4], None, lambda: bytes(8), 8)]))
    assert pack.entries["q"].data_offsets == (0, 8)


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


def test_writer_accepts_tuples_named_tuples_and_objects() -> None:
    class Param:
        name, dtype, shape, param_id, data = "p", "U8", (2,), 2**64 - 1, b"\x01\x02"

    tensors = [("t", "U8", (1,), None, b"\x00"), PackTensor("n", "U8", [1], 3, bytearray(b"\x05")), Param()]
    pack = BurnpackFile.from_bytes(to_bytes(tensors))
    assert {name: e.param_id for name, e in pack.entries.items()} == {"n": 3, "p": 2**64 - 1, "t": None}


def test_writer_normalises_array_layout() -> None:
    base = np.arange(6, dtype=">i4").reshape(2, 3)
    pack = BurnpackFile.from_bytes(to_bytes([("t", "I32", [3, 2], None, base.T)]))
    assert np.array_equal(pack.array("t"), base.T)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ([("a", "U8", [1], None, b"\x00"), ("a", "U8", [1], None, b"\x00")], "duplicate"),
        ([("a", "F32", [2], None, bytes(7))], "needs 8"),
        ([("a", "F32", [2], None, np.zeros(2))], "needs 8"),
        ([("a", "F99", [1], None, b"\x00")], "dtype"),
        ([("a", "U8", [-1], None, b"")], "dimension"),
        ([("a", "U8", 3, None, b"")], "shape"),
        ([("a", "U8", [1], -1, b"\x00")], "param_id"),
        ([("a", "U8", [1], None, 3.0)], "data is float"),
        ([("a", "U8", [1], None)], "5 or 6"),
        ([("\ud800", "U8", [1], None, b"\x00")], "Unicode"),
        ([("a", "U8", [2**62, 2**62], None, lambda: b"")], "absurd"),
        ([("a", "U8", [1] * 65, None, b"\x00")], "rank"),
    ],
)
def test_writer_rejects_bad_tensors(tensors: list, match: str) -> None:
    with pytest.raises(RecordError, match=match):
        to_bytes(tensors)


def test_writer_rejects_bad_metadata() -> None:
    with pytest.raises(RecordError):
        to_bytes([], metadata={"k": 1})


# ---------------------------------------------------------------------------------------------------------
# Lazy reading


def test_open_reads_only_header_and_metadata(tmp_path: Path) -> None:
    size = 4 * 2**30
    header = pack_header([TensorEntry("huge", "F32", [size // 4], 7, (0, size))])
    path = tmp_path / "sparse.bpk"
    with open(path, "wb") as file:
        file.write(header)
        file.truncate(len(header) + size)
    if path.stat().st_blocks * 512 > 2**20:
        pytest.skip("this filesystem does not keep the file sparse")
    started = time.perf_counter()
    with BurnpackFile.open(path) as pack:
        assert pack.entries["huge"].shape == (2**30,)
        elapsed = time.perf_counter() - started
        array = pack.array("huge")
        assert array.shape == (2**30,) and array[-1] == 0
    assert elapsed < 1.0


def test_arrays_outlive_close_and_views_refuse_after_it(tmp_path: Path) -> None:
    path = tmp_path / "t.bpk"
    path.write_bytes(BASE)
    pack = BurnpackFile.open(path)
    array = pack.array("a")
    pack.close()
    assert array[63] == 63
    with pytest.raises(RecordError, match="closed"):
        pack.tensor_bytes("a")
    with pytest.raises(RecordError, match="no tensor"):
        BurnpackFile.from_bytes(BASE).array("missing")


# ---------------------------------------------------------------------------------------------------------
# Atomic, deferred writing


@pytest.fixture
def old_file(tmp_path: Path) -> tuple[Path, bytes]:
    path = tmp_path / "model.bpk"
    write_burnpack(path, [("old", "U8", [4], None, b"\x01\x02\x03\x04")])
    return path, path.read_bytes()


def test_deferred_provider_runs_once_during_write_and_is_not_kept(tmp_path: Path) -> None:
    calls: list[weakref.ref] = []

    def provide() -> np.ndarray:
        array = np.full(1000, 3.0, dtype=np.float32)
        calls.append(weakref.ref(array))
        return array

    tensors = [("lazy", "F32", [1000], None, provide)]
    write_burnpack(tmp_path / "t.bpk", tensors)
    assert len(calls) == 1 and calls[0]() is None
    assert BurnpackFile.open(tmp_path / "t.bpk").array("lazy")[999] == 3.0


def test_provider_wrong_length_leaves_old_file(old_file: tuple[Path, bytes]) -> None:
    path, before = old_file
    with pytest.raises(RecordError, match="provider returned 3 bytes") as info:
        write_burnpack(path, [("a", "U8", [300], None, bytes(300)), ("b", "U8", [4], None, lambda: b"abc")])
    assert str(path) in str(info.value)
    assert path.read_bytes() == before
    assert list(path.parent.iterdir()) == [path]


def test_provider_exception_leaves_old_file(old_file: tuple[Path, bytes]) -> None:
    path, before = old_file

    def fail() -> bytes:
        raise ValueError("provider failed")

    with pytest.raises(ValueError, match="provider failed"):
        write_burnpack(path, [("a", "U8", [300], None, bytes(300)), ("b", "U8", [4], None, fail)])
    assert path.read_bytes() == before
    assert list(path.parent.iterdir()) == [path]
    with pytest.raises(ValueError):
        write_burnpack(path.with_name("new.bpk"), [("b", "U8", [4], None, fail)])
    assert list(path.parent.iterdir()) == [path]


def test_write_into_missing_directory_is_record_error(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "t.bpk"
    with pytest.raises(RecordError, match="cannot write") as info:
        write_burnpack(target, [])
    assert str(target) in str(info.value)


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from kiln.runtime.records.burnpack import write_burnpack

    def stall():
        print("stalling", flush=True)
        time.sleep(60)
        return bytes(1024)

    write_burnpack(sys.argv[1], [("a", "U8", [300], None, bytes(300)), ("b", "F32", [256], None, stall)])
    """
)


def test_killed_writer_leaves_old_file(old_file: tuple[Path, bytes]) -> None:
    path, before = old_file
    command = [sys.executable, "-c", KILLED_WRITER, str(path)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, cwd=path.parent)
    try:
        assert child.stdout.readline() == b"stalling\n"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    assert path.read_bytes() == before
    leftovers = [p.name for p in path.parent.iterdir() if p != path]
    assert leftovers, "the writer should have been killed mid-write"
    for name in leftovers:
        assert name.startswith(".model.bpk.") and name.endswith(".tmp")
    with BurnpackFile.open(path) as pack:
        assert list(pack.entries) == ["old"]


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


def test_version_zero_is_accepted_like_burn() -> None:
    assert BurnpackFile.from_bytes(header_patch(4, b"\x00\x00")).version == 0


def test_missing_file_is_record_error(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match="cannot open"):
        BurnpackFile.open(tmp_path / "nope.bpk")


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


@settings(max_examples=2500, deadline=None, database=None)
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


@settings(max_examples=1500, deadline=None, database=None)
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
