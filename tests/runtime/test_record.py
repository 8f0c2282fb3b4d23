"""Tests for ModuleRecord (kiln.runtime.records), the load-record pass over parameter nodes, and `kiln inspect`."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kiln.ir import DType, Graph, Init, ParamId, ParamNode, RecordError, ReparamNode, TensorType
from kiln.passes.load_record import LoadRecord
from kiln.runtime.records.burnpack import BurnDType, PackTensor
from kiln.runtime.records.burnpack_io import BurnpackFile, to_bytes, write_burnpack
from kiln.runtime.records.record import DTypePolicy, ModuleRecord, RecordEntry, burn_dtype, kiln_dtype

FIXTURE = Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures" / "burn" / "mnist-model.bpk"
needs_fixture = pytest.mark.skipif(not FIXTURE.exists(), reason=f"Burn's MNIST burnpack is not at {FIXTURE}")

ARRAYS = {
    "f64": np.linspace(-1, 1, 6).reshape(2, 3),
    "f32": np.arange(6, dtype=np.float32).reshape(3, 2),
    "f16": np.array([0.5, -2.0, 65504.0], np.float16),
    "bf16": np.array([1.5, -3.0, 1e30], ml_dtypes.bfloat16),
    "i64": np.array([-(2**62), 2**62], np.int64),
    "i32": np.array([[-7], [9]], np.int32),
    "i16": np.array([-300, 300], np.int16),
    "i8": np.array([-128, 127], np.int8),
    "u8": np.array([0, 255], np.uint8),
    "u16": np.array([0, 65535], np.uint16),  # burn-notes 1.3: "U64, U32, U16, U8" are Burn dtypes
    "u32": np.array([0, 2**32 - 1], np.uint32),
    "u64": np.array([0, 2**64 - 1], np.uint64),
    "bool": np.array([[True, False], [False, True]]),
}


def record_of(arrays: dict[str, np.ndarray]) -> ModuleRecord:
    """A record holding each array under its name, with ids 1, 2, ..."""
    return ModuleRecord({name: RecordEntry(i + 1, DType.from_numpy(a.dtype), a.shape, a)
                         for i, (name, a) in enumerate(arrays.items())})


def mmap_backed(array: np.ndarray) -> bool:
    """Whether the array views a memory-mapped file rather than memory of its own."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)


# dtypes ---------------------------------------------------------------------------------------------------------
def test_dtypes_map_to_burn_names_and_back():
    assert burn_dtype(DType.f32) == BurnDType("F32")
    assert burn_dtype(DType.bf16) == BurnDType("BF16")
    assert burn_dtype(DType.bool) == BurnDType.parse({"Bool": "Native"})
    for dtype in (DType(name) for name in ARRAYS):
        assert kiln_dtype(burn_dtype(dtype)) is dtype
    assert kiln_dtype(BurnDType("Flex32")) is DType.f32
    assert kiln_dtype(BurnDType.parse({"Bool": "U32"})) is DType.bool


def test_dtypes_without_a_counterpart_are_record_errors():
    for dtype in (DType.f8e4m3fn, DType.f8e4m3fnuz, DType.f8e5m2, DType.f8e5m2fnuz):  # Burn's DType has no float8
        with pytest.raises(RecordError, match=f"kiln dtype {dtype.value} has no Burn dtype"):
            burn_dtype(dtype)
    codes = ModuleRecord({"codes": RecordEntry(1, DType.nf4, (2,), np.zeros(2, DType.nf4.numpy))})
    with pytest.raises(RecordError, match="tensor 'codes': kiln dtype nf4 has no Burn dtype"):
        codes.to_bytes()


def test_burn_unsigned_tensors_read_as_kiln_unsigned_dtypes():
    """burn-notes 1.3: U64/U32/U16 tensors are 8/4/2 bytes an element; kiln reads them as u64/u32/u16."""
    pack = to_bytes([PackTensor("wide", "U32", (1,), 5, np.array([2**32 - 1], np.uint32))])
    wide = ModuleRecord.from_bytes(pack)["wide"]
    assert wide.dtype is DType.u32
    np.testing.assert_array_equal(wide.array(), np.array([2**32 - 1], np.uint32))


# round trips --------------------------------------------------------------------------------------------------
def test_bytes_round_trip_keeps_order_values_ids_and_dtypes():
    back = ModuleRecord.from_bytes(record_of(ARRAYS).to_bytes())
    assert list(back) == list(ARRAYS)
    for i, (name, array) in enumerate(ARRAYS.items()):
        entry = back[name]
        assert (entry.param_id, entry.dtype, entry.shape) == (i + 1, DType(name), array.shape)
        assert entry.array().dtype == array.dtype
        np.testing.assert_array_equal(entry.array(), array)


def test_file_round_trip_is_lazy_and_memory_mapped(tmp_path):
    path = tmp_path / "model.bpk"
    record_of(ARRAYS).save(path)
    back = ModuleRecord.load(path)
    assert all(callable(entry.data) for entry in back.values())  # nothing read at load: only the metadata
    assert len(back) == len(ARRAYS)
    assert mmap_backed(back["f32"].array()) and not back["f32"].array().flags.writeable
    np.testing.assert_array_equal(back["bf16"].array(), ARRAYS["bf16"])


@needs_fixture
def test_burns_file_reads_with_its_ids_and_writes_back_byte_identical():
    data = FIXTURE.read_bytes()
    record = ModuleRecord.load(FIXTURE)
    with BurnpackFile.open(FIXTURE) as pack:
        assert {name: e.param_id for name, e in pack.entries.items()} == {n: e.param_id for n, e in record.items()}
        assert all(type(e.param_id) is ParamId for e in [*pack.entries.values(), *record.values()])
        assert list(record)[:2] == ["conv1.conv.weight", "conv1.conv.bias"]  # the file's (visit) order
    assert record["fc1.weight"].shape == (1600, 128) and record["fc1.weight"].dtype is DType.f32
    assert record.to_bytes() == data


def test_entries_without_param_id_get_fresh_random_ids():
    pack = to_bytes([PackTensor(name, "F32", (1,), None, np.zeros(1, np.float32)) for name in "abc"])
    ids = [entry.param_id for entry in ModuleRecord.from_bytes(pack).values()]
    assert len(set(ids)) == 3 and all(0 <= i < 2**64 for i in ids)
    assert all(type(i) is ParamId for i in ids)
    assert [e.param_id for e in ModuleRecord.from_bytes(pack).values()] != ids


def test_bool_stored_as_u32_reads_as_bool():
    pack = to_bytes([PackTensor("mask", {"Bool": "U32"}, (3,), 1, np.array([0, 1, 7], np.uint32))])
    entry = ModuleRecord.from_bytes(pack)["mask"]
    assert entry.dtype is DType.bool
    np.testing.assert_array_equal(entry.array(), [False, True, True])


def test_extension_is_added_on_save_and_found_on_load(tmp_path):
    record_of({"w": ARRAYS["f32"]}).save(tmp_path / "model")
    assert (tmp_path / "model.bpk").exists() and not (tmp_path / "model").exists()
    assert list(ModuleRecord.load(tmp_path / "model")) == ["w"]


def test_missing_file_is_a_record_error(tmp_path):
    with pytest.raises(RecordError, match="cannot open"):
        ModuleRecord.load(tmp_path / "absent.bpk")


# providers and atomic saves -----------------------------------------------------------------------------------
def test_providers_run_only_while_writing_and_nothing_is_kept(tmp_path):
    calls = []

    def provider():
        calls.append(1)
        return np.ones(4, np.float32)

    record = ModuleRecord({"lazy": RecordEntry(3, DType.f32, (4,), provider)})
    assert calls == []
    record.save(tmp_path / "a.bpk")
    record.save(tmp_path / "b.bpk")
    assert len(calls) == 2 and record["lazy"].data is provider
    np.testing.assert_array_equal(ModuleRecord.load(tmp_path / "a.bpk")["lazy"].array(), np.ones(4))


def test_a_failing_provider_leaves_the_old_file_intact(tmp_path):
    path = tmp_path / "model.bpk"
    record_of({"w": ARRAYS["f32"]}).save(path)
    before = path.read_bytes()

    def broken():
        raise MemoryError("out of memory mid-save")

    record = ModuleRecord({"w": RecordEntry(1, DType.f32, (3, 2), ARRAYS["f32"]),
                           "v": RecordEntry(2, DType.f32, (3,), broken)})
    with pytest.raises(MemoryError):
        record.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bpk"]  # no temporary left behind


# settings -----------------------------------------------------------------------------------------------------
def test_builders_return_new_records_sharing_entries():
    record = record_of({"w": ARRAYS["f32"]})
    tolerant = record.allow_partial(True).allow_unused(True).validate(False)
    cast = tolerant.with_dtype_policy(DTypePolicy.CAST_TO_MODULE)
    assert (record.settings.allow_partial, record.settings.allow_unused, record.settings.validate) == (
        False, False, True)
    assert (cast.settings.allow_partial, cast.settings.allow_unused, cast.settings.validate) == (True, True, False)
    assert cast.settings.dtype_policy is DTypePolicy.CAST_TO_MODULE
    assert record.settings.dtype_policy is DTypePolicy.FROM_RECORD
    assert cast["w"] is record["w"] and len(cast) == 1


# the load-record pass -----------------------------------------------------------------------------------------
def node(name: str, shape: tuple[int, ...], dtype: DType = DType.f32, **state) -> ParamNode:
    """A lazy parameter node on an autodiff device that requires gradients."""
    return ParamNode(name, TensorType(shape, dtype), 100 + len(name), Init("zeros"), grad=dtype.is_float,
                     configured_grad=dtype.is_float, device="cpu", autodiff=True, **state)


def state(*nodes: ParamNode, reparams: tuple[ReparamNode, ...] = ()) -> Graph:
    return Graph("M", {n.name: n for n in nodes}, {}, {r.name: r for r in reparams})


def test_a_hit_takes_data_and_id_and_keeps_the_nodes_state():
    data = np.ones((2, 3), np.float32)
    record = ModuleRecord({"w": RecordEntry(7, DType.f32, (2, 3), data)})
    out = LoadRecord(record).apply(state(node("w", (2, 3), checkpointing="balanced")))
    w = out.params["w"]
    assert w.data is data and w.id == 7 and w.init is None
    assert (w.grad, w.configured_grad, w.device, w.autodiff, w.checkpointing) == (True, True, "cpu", True, "balanced")


def test_all_problems_are_reported_together_in_burns_order():
    record = ModuleRecord({"zeta": RecordEntry(1, DType.f32, (1,), np.zeros(1, np.float32)),
                           "w": RecordEntry(2, DType.f32, (3, 2), np.zeros((3, 2), np.float32)),
                           "alpha": RecordEntry(3, DType.f32, (1,), np.zeros(1, np.float32))})
    graph = state(node("w", (2, 3)), node("b", (3,)), node("c", (1,)))
    with pytest.raises(RecordError) as caught:
        LoadRecord(record).apply(graph)
    message = str(caught.value)
    assert message == ("Apply errors: ['w: shape mismatch, expected [2, 3] but record has [3, 2]']; "
                       "Missing tensors: ['b', 'c']; Unused tensors: ['alpha', 'zeta']")


@pytest.mark.parametrize(("settings", "reported"), [
    ({"validate": False}, ["Missing tensors", "Unused tensors"]),
    ({"allow_partial": True}, ["Apply errors", "Unused tensors"]),
    ({"allow_unused": True}, ["Apply errors", "Missing tensors"]),
    ({"validate": False, "allow_partial": True, "allow_unused": True}, []),
])
def test_each_setting_tolerates_its_own_problem(settings, reported):
    record = ModuleRecord({"w": RecordEntry(2, DType.f32, (9,), np.zeros(9, np.float32)),
                           "extra": RecordEntry(3, DType.f32, (1,), np.zeros(1, np.float32))})
    for key, value in settings.items():
        record = getattr(record, key)(value)
    graph = state(node("w", (2, 3)), node("b", (3,)))
    if not reported:
        out = LoadRecord(record).apply(graph)
        assert all(out.params[n] is graph.params[n] for n in ("w", "b"))  # mismatched and missing left alone
        return
    with pytest.raises(RecordError) as caught:
        LoadRecord(record).apply(graph)
    assert [part.split(":")[0] for part in str(caught.value).split("; ")] == reported


def test_dtype_policy_keeps_the_records_dtype_or_casts_to_the_modules():
    half = np.array([1.5, 2.5], ml_dtypes.bfloat16)
    record = ModuleRecord({"w": RecordEntry(2, DType.bf16, (2,), half)})
    kept = LoadRecord(record).apply(state(node("w", (2,)))).params["w"]
    assert kept.type.dtype is DType.bf16 and kept.data is half
    cast = LoadRecord(record.with_dtype_policy(DTypePolicy.CAST_TO_MODULE)).apply(state(node("w", (2,))))
    assert cast.params["w"].type.dtype is DType.f32 and cast.params["w"].data.dtype == np.float32
    np.testing.assert_array_equal(cast.params["w"].data, [1.5, 2.5])


def test_a_record_of_another_kind_is_an_apply_error_unless_cast():
    record = ModuleRecord({"steps": RecordEntry(2, DType.f32, (1,), np.ones(1, np.float32))})
    graph = state(node("steps", (1,), DType.i64))
    with pytest.raises(RecordError, match="steps: dtype mismatch, expected i64 but record has f32"):
        LoadRecord(record).apply(graph)
    cast = LoadRecord(record.with_dtype_policy(DTypePolicy.CAST_TO_MODULE)).apply(graph).params["steps"]
    assert cast.type.dtype is DType.i64 and cast.data.tolist() == [1]


def test_a_derived_parameters_base_is_recorded_at_its_path():
    base, a, b = node("w.base", (2, 3)), node("w.lora.a", (2, 1)), node("w.lora.b", (1, 3))
    lora = ReparamNode("w", TensorType((2, 3), DType.f32), "lora", ("w.base", "w.lora.a", "w.lora.b"),
                       {"scale": 1.0})
    arrays = {"w": np.ones((2, 3), np.float32), "w.lora.a": np.ones((2, 1), np.float32),
              "w.lora.b": np.ones((1, 3), np.float32)}
    out = LoadRecord(record_of(arrays)).apply(state(base, a, b, reparams=(lora,)))
    assert out.params["w.base"].data is arrays["w"] and out.params["w.base"].id == 1
    assert out.params["w.lora.b"].data is arrays["w.lora.b"] and out.reparams == {"w": lora}


def test_only_matched_entries_are_read():
    def unread():
        raise AssertionError("an unused entry was read")

    record = ModuleRecord({"w": RecordEntry(2, DType.f32, (1,), np.ones(1, np.float32)),
                           "other": RecordEntry(3, DType.f32, (1,), unread)}).allow_unused(True)
    assert LoadRecord(record).apply(state(node("w", (1,)))).params["w"].id == 2


# kiln inspect ---------------------------------------------------------------------------------------------------
def run_inspect(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "kiln", "inspect", *args], capture_output=True, timeout=60,
                          input=stdin)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def test_inspect_lists_tensors_and_totals(tmp_path):
    """Ids show in Burn's display form: "123456 -> `83h0200000000`" (burn-notes 1.6, ParamId `Display`)."""
    path = tmp_path / "model.bpk"
    write_burnpack(path, [PackTensor("fc.weight", "F32", (2, 3), 123456, np.zeros((2, 3), np.float32)),
                          PackTensor("mask", {"Bool": "Native"}, (4,), None, np.zeros(4, bool))],
                   metadata={"producer": "test"})
    text = run_inspect(str(path))
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split() == ["NAME", "DTYPE", "SHAPE", "PARAM_ID", "BYTES"]
    assert lines[1].split() == ["fc.weight", "F32", "[2,", "3]", "83h0200000000", "24"]
    assert lines[2].split() == ["mask", "Bool(Native)", "[4]", "-", "4"]
    assert "metadata producer = test" in lines
    assert lines[-1] == f"2 tensors, 10 elements, 28 bytes of tensor data, {path.stat().st_size:,} bytes on disk"
    report = json.loads(run_inspect(str(path), "--json").stdout)
    assert report["tensors"][0] == {"name": "fc.weight", "dtype": "F32", "shape": [2, 3],
                                    "param_id": "83h0200000000", "bytes": 24}
    assert report["totals"] == {"tensors": 2, "elements": 10, "bytes": 28, "file_bytes": path.stat().st_size}
    assert report["metadata"] == {"producer": "test"}


@needs_fixture
def test_inspect_reads_burns_file():
    report = json.loads(run_inspect(str(FIXTURE), "--json").stdout)
    assert report["totals"]["tensors"] == 18 and report["totals"]["bytes"] == 1_043_240
    assert {t["name"]: t["shape"] for t in report["tensors"]}["fc1.weight"] == [1600, 128]


def test_inspect_reads_standard_input(tmp_path):
    """`kiln inspect -` reads the pack from standard input, as the README says `-` does for every command."""
    path = tmp_path / "model.bpk"
    write_burnpack(path, [PackTensor("fc.weight", "F32", (2, 3), 123456, np.zeros((2, 3), np.float32))])
    from_file, from_stdin = run_inspect(str(path), "--json"), run_inspect("-", "--json", stdin=path.read_bytes())
    assert from_stdin.returncode == 0, from_stdin.stderr
    assert json.loads(from_stdin.stdout) == {**json.loads(from_file.stdout), "file": "-"}
    bad = run_inspect("-", stdin=b"garbage")
    assert bad.returncode == 1 and "<stdin>: truncated header" in bad.stderr


def test_inspect_exit_codes(tmp_path):
    missing = run_inspect(str(tmp_path / "absent.bpk"))
    assert missing.returncode == 3 and "No such file" in missing.stderr
    (tmp_path / "bad.bpk").write_bytes(b"not a burnpack")
    bad = run_inspect(str(tmp_path / "bad.bpk"))
    assert bad.returncode == 1 and "not a burnpack file" in bad.stderr
