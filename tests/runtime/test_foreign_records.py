"""safetensors and `torch.save` files as ModuleRecords (issue 16): read lazily from files written by an independent
writer (the format spelled out here with struct and json, real torch, the `safetensors` package where installed),
written atomically, renamed by Burn's KeyRemapper rules and filtered by prefix; hostile and damaged files give
RecordErrors only, and a hostile pickle's payload never runs."""

from __future__ import annotations

import io
import json
import pickle
import struct
import zipfile

import ml_dtypes
import numpy as np
import pytest
import torch

from kiln.ir import DType, RecordError
from kiln.runtime.records.record import ModuleRecord


def _spec_safetensors(tensors: dict[str, np.ndarray], metadata: dict | None = None) -> bytes:
    """A safetensors file as its spec describes it: u64 LE header length, JSON header, tensor bytes."""
    names = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(np.bool_): "BOOL", np.dtype(np.float16): "F16"}
    header, data = ({"__metadata__": metadata} if metadata else {}), b""
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": names[array.dtype], "shape": list(array.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


TENSORS = {"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "steps": np.array(7, np.int64),
           "half": np.array([1.5, -2], ml_dtypes.bfloat16), "mask": np.array([True, False]),
           "empty": np.zeros((0, 4), np.float16)}


def test_a_safetensors_file_reads_lazily_with_its_dtypes_and_shapes(tmp_path):
    # The safetensors format: "8 bytes: N, an unsigned little-endian 64-bit integer ... N bytes: a JSON UTF-8
    # string representing the header ... Rest of the file: byte-buffer".
    path = tmp_path / "m.safetensors"
    path.write_bytes(_spec_safetensors(TENSORS, {"format": "pt"}))
    record = ModuleRecord.from_safetensors(path)
    assert list(record) == list(TENSORS)
    for name, array in TENSORS.items():
        entry = record[name]
        assert entry.shape == array.shape and entry.dtype.numpy == array.dtype
        assert callable(entry.data)  # lazy: nothing read until used
        np.testing.assert_array_equal(entry.array(), array)
        assert not entry.array().flags.writeable


def test_to_safetensors_writes_what_the_spec_and_the_package_read(tmp_path):
    path = tmp_path / "out.safetensors"
    (tmp_path / "in.safetensors").write_bytes(_spec_safetensors(TENSORS))
    ModuleRecord.from_safetensors(tmp_path / "in.safetensors").to_safetensors(path)
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    assert (8 + size) % 8 == 0  # the reference writer pads the header to 8 bytes
    for name, array in TENSORS.items():
        begin, end = header[name]["data_offsets"]
        assert header[name]["shape"] == list(array.shape)
        assert raw[8 + size + begin : 8 + size + end] == np.ascontiguousarray(array).tobytes()
    safetensors = pytest.importorskip("safetensors.numpy")
    loaded = safetensors.load_file(str(path))
    for name in ("fc.weight", "steps", "mask"):
        np.testing.assert_array_equal(loaded[name], TENSORS[name])


def test_to_safetensors_is_atomic(tmp_path):
    # Issue 16: "`.to_safetensors(path)` writes one, atomically".
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"old")

    def fail():
        raise RecordError("provider failed")

    record = ModuleRecord.from_safetensors(_write(tmp_path / "a.safetensors", TENSORS))
    broken = ModuleRecord({**record, "late": type(record["steps"])(record["steps"].param_id, DType.f32, (2,), fail)})
    with pytest.raises(RecordError, match="provider failed"):
        broken.to_safetensors(path)
    assert path.read_bytes() == b"old"  # the old file stays, and no temporary is left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "m.safetensors"]


def _write(path, tensors):
    path.write_bytes(_spec_safetensors(tensors))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw[:5], "too short"),
    (lambda raw: struct.pack("<Q", 2**40) + raw[8:], "header length"),
    (lambda raw: raw[:-4], "data bytes"),
    (lambda raw: raw.replace(b'"F32"', b'"F99"'), "dtype 'F99'"),
    (lambda raw: raw.replace(b'"shape": [2, 3]', b'"shape": [3, 3]'), "fc.weight"),
    (lambda raw: raw.replace(b'"data_offsets": [0, 24]', b'"data_offsets": [8, 32]'), "overlap"),
    (lambda raw: raw.replace(b"{", b"[", 1), "not JSON"),
])
def test_a_damaged_safetensors_file_is_a_record_error_naming_it(tmp_path, edit, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(edit(_spec_safetensors(TENSORS)))
    with pytest.raises(RecordError, match=message) as caught:
        ModuleRecord.from_safetensors(path)
    assert str(path) in str(caught.value)


def test_a_torch_save_state_dict_reads_without_running_torch_code(tmp_path):
    # Issue 16: "the zip-based torch.save format, read with a restricted unpickler"; a non-contiguous tensor keeps
    # torch's strides, and every dtype torch stores reads as the same values.
    state = {"w": torch.randn(3, 4), "t": torch.arange(12.0).reshape(3, 4).t(), "steps": torch.tensor(5),
             "half": torch.randn(3).to(torch.bfloat16), "i": torch.arange(4, dtype=torch.int32),
             "b": torch.tensor([True, False]), "view": torch.arange(10.0)[2:7],
             "p": torch.nn.Parameter(torch.randn(2))}  # pickled through _rebuild_parameter
    torch.save(state, tmp_path / "m.pt")
    record = ModuleRecord.from_pytorch(tmp_path / "m.pt")
    assert list(record) == list(state)
    for name, tensor in state.items():
        expected = tensor.detach().float().numpy() if tensor.dtype == torch.bfloat16 else tensor.detach().numpy()
        assert record[name].shape == tuple(tensor.shape) and callable(record[name].data)
        np.testing.assert_array_equal(np.asarray(record[name].array(), expected.dtype), expected)


def _torch_zip(pickle_bytes: bytes, extra: dict[str, bytes] | None = None) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("archive/data.pkl", pickle_bytes)
        archive.writestr("archive/byteorder", b"little")
        for name, data in (extra or {}).items():
            archive.writestr(f"archive/{name}", data)
    return out.getvalue()


def _hostile(tmp_path):
    """Pickles whose payload would create `marker` (protocol-0 text, as an attacker writes them)."""
    marker = tmp_path / "ran"
    return marker, {
        "os.system": f"cos\nsystem\n(S'touch {marker}'\ntR.".encode(),
        "builtins.eval": f"cbuiltins\neval\n(S'open({str(marker)!r}, \"w\")'\ntR.".encode(),
        "posix.system in a state dict": (b"\x80\x02ccollections\nOrderedDict\n)R(X\x01\x00\x00\x00wcposix\nsystem\n"
                                         b"(S'touch " + str(marker).encode() + b"'\ntRu."),
    }


@pytest.mark.parametrize("which", ["os.system", "builtins.eval", "posix.system in a state dict"])
def test_a_hostile_pickle_is_refused_naming_the_global_and_never_runs(tmp_path, which):
    # Issue 16: "a hostile .pt whose pickle names os.system (or any other global) is refused without running it".
    marker, payloads = _hostile(tmp_path)
    path = tmp_path / "evil.pt"
    path.write_bytes(_torch_zip(payloads[which]))
    with pytest.raises(RecordError, match=r"global (os|posix|builtins)\.(system|eval)"):
        ModuleRecord.from_pytorch(path)
    assert not marker.exists()


def test_the_hostile_payload_is_live(tmp_path):
    # The control: the same eval payload does create the file under a plain unpickler, so the refusal is what
    # kept it from running.
    marker, payloads = _hostile(tmp_path)
    pickle.loads(payloads["builtins.eval"]).close()
    assert marker.exists()


def test_a_reduce_of_a_storage_class_is_refused(tmp_path):
    # A REDUCE of an admitted name that is not a tensor rebuild: calling torch.FloatStorage builds nothing.
    path = tmp_path / "evil.pt"
    path.write_bytes(_torch_zip(b"\x80\x02ctorch\nFloatStorage\n)R."))
    with pytest.raises(RecordError, match="calls torch.FloatStorage"):
        ModuleRecord.from_pytorch(path)


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw[: len(raw) // 2], "not a torch.save zip"),
    (lambda raw: b"", "not a torch.save zip"),
])
def test_a_damaged_torch_file_is_a_record_error(tmp_path, edit, message):
    torch.save({"w": torch.randn(4, 4)}, tmp_path / "m.pt")
    path = tmp_path / "bad.pt"
    path.write_bytes(edit((tmp_path / "m.pt").read_bytes()))
    with pytest.raises(RecordError, match=message):
        ModuleRecord.from_pytorch(path)


def test_a_legacy_torch_file_is_refused_with_the_way_out(tmp_path):
    torch.save({"w": torch.randn(2)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(RecordError, match="legacy .* re-save it with torch.save's default zip format"):
        ModuleRecord.from_pytorch(tmp_path / "old.pt")


def test_a_quantized_record_is_refused_by_to_safetensors(tmp_path):
    import kiln
    from kiln import nn

    record = nn.Linear(8, 4, bias=False).quantize_weights(kiln.Quantizer()).into_record()
    with pytest.raises(RecordError, match="quantized; safetensors has no quantized dtype"):
        record.to_safetensors(tmp_path / "q.safetensors")
    assert not (tmp_path / "q.safetensors").exists()


def test_a_tensor_reaching_past_its_storage_is_refused(tmp_path):
    torch.save({"w": torch.randn(4)}, tmp_path / "m.pt")
    with zipfile.ZipFile(tmp_path / "m.pt") as archive:
        members = {i.filename: archive.read(i) for i in archive.infolist()}
    pkl = next(k for k in members if k.endswith("data.pkl"))
    members[pkl] = members[pkl].replace(b"K\x04\x85", b"K\x09\x85")  # size (4,) -> (9,)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    (tmp_path / "bad.pt").write_bytes(out.getvalue())
    with pytest.raises(RecordError, match="reaches element 8 of storage '0', which has 4"):
        ModuleRecord.from_pytorch(tmp_path / "bad.pt")


def test_remap_follows_burns_key_remapper(tmp_path):
    # Burn's KeyRemapper: "Pattern-based remapping rules (regex pattern, replacement string)", applied in order,
    # replacements with capture groups like $1.
    record = ModuleRecord.from_safetensors(_write(tmp_path / "m.safetensors", TENSORS))
    renamed = record.remap([(r"^fc\.(.*)", "head.$1"), (r"\.weight$", ".w"), ("^(?P<all>steps)$", "${all}_n")])
    assert list(renamed) == ["head.w", "steps_n", "half", "mask", "empty"]
    assert renamed["head.w"] is record["fc.weight"]
    with pytest.raises(RecordError, match="sends both 'fc.weight' and 'steps' to 'x'"):
        record.remap([("fc.weight|steps", "x")])
    with pytest.raises(RecordError, match="not a regex"):
        record.remap([("(", "x")])


def test_filter_prefix_selects_whole_segments(tmp_path):
    record = ModuleRecord.from_safetensors(_write(tmp_path / "m.safetensors",
                                                 {"enc.a": TENSORS["steps"], "enc2.b": TENSORS["steps"],
                                                  "enc": TENSORS["steps"], "dec.c": TENSORS["steps"]}))
    assert list(record.filter_prefix("enc")) == ["enc.a", "enc"]
    assert list(record.filter_prefix("enc", "dec", exclude=True)) == ["enc2.b"]
