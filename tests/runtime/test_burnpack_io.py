"""Tests for kiln.runtime.records.burnpack_io: Burn's own file, round trips through files, the writer's input,
lazy reads, atomic and deferred writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from burnpack_samples import BASE, DEFAULT_SCHEME, FIXTURE, rewrite

from kiln.ir.errors import RecordError
from kiln.runtime.records.burnpack import BurnDType, PackTensor, TensorEntry, numpy_dtype
from kiln.runtime.records.burnpack_io import BurnpackFile, to_bytes, write_burnpack
from kiln.runtime.records.burnpack_metadata import pack_header

FIXTURE_NAMES = {
    *(f"conv{i}.conv.{p}" for i in (1, 2) for p in ("weight", "bias")),
    *(f"conv{i}.norm.{p}" for i in (1, 2) for p in ("gamma", "beta", "running_mean", "running_var")),
    *(f"fc{i}.{p}" for i in (1, 2, 3) for p in ("weight", "bias")),
}


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
# Round trips and the writer's input

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


def test_deferred_qfloat_needs_nbytes() -> None:
    qfloat = BurnDType.qfloat(DEFAULT_SCHEME)
    with pytest.raises(RecordError, match="nbytes"):
        to_bytes([("q", qfloat, [4], None, lambda: bytes(8))])
    pack = BurnpackFile.from_bytes(to_bytes([PackTensor("q", qfloat, [4], None, lambda: bytes(8), 8)]))
    assert pack.entries["q"].data_offsets == (0, 8)


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


def test_missing_file_is_record_error(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match="cannot open"):
        BurnpackFile.open(tmp_path / "nope.bpk")


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
    from kiln.runtime.records.burnpack_io import write_burnpack

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


def test_a_write_that_cannot_be_made_durable_leaves_old_file(old_file: tuple[Path, bytes],
                                                            request: pytest.FixtureRequest) -> None:
    path, before = old_file
    request.getfixturevalue("failing_fsync")
    with pytest.raises(RecordError, match="cannot write: Input/output error") as info:
        write_burnpack(path, [("new", "U8", [1], None, b"\x00")])
    assert str(path) in str(info.value)
    assert path.read_bytes() == before
    assert list(path.parent.iterdir()) == [path]


def test_an_interrupted_provider_leaves_old_file(old_file: tuple[Path, bytes]) -> None:
    path, before = old_file

    def interrupt() -> bytes:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_burnpack(path, [("a", "U8", [300], None, bytes(300)), ("b", "U8", [4], None, interrupt)])
    assert path.read_bytes() == before
    assert list(path.parent.iterdir()) == [path]
