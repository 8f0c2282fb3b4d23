"""Hostile ONNX files (issue 15): every defect of an initializer is a one-line RecordError naming the file, the
initializer and the field, found when the file opens; nothing escapes as onnx's or numpy's exception."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.cli import main as cli_main
from kiln.ir import ParamId, RecordError
from kiln.runtime.onnx.tensors import PARAM_ID_KEY, read_record


def model_with(*tensors: TensorProto) -> onnx.ModelProto:
    graph = helper.make_graph([], "g", [], [], initializer=list(tensors))
    return helper.make_model(graph)


def weights(name: str = "w", values: np.ndarray | None = None) -> TensorProto:
    return numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3) if values is None else values, name)


def external(folder: Path, name: str = "w", **fields: str) -> TensorProto:
    """An initializer of 2x3 f32 whose data is in `data.bin` beside the model (fields override the defaults)."""
    (folder / "data.bin").write_bytes(np.arange(6, dtype=np.float32).tobytes())
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[2, 3], data_location=TensorProto.EXTERNAL)
    for key, value in {"location": "data.bin", "offset": "0", "length": "24", **fields}.items():
        tensor.external_data.add(key=key, value=value)
    return tensor


def tagged(tensor: TensorProto, param_id: str) -> TensorProto:
    tensor.metadata_props.add(key=PARAM_ID_KEY, value=param_id)
    return tensor


def short_raw(folder: Path) -> onnx.ModelProto:
    tensor = weights()
    tensor.raw_data = tensor.raw_data[:-4]
    return model_with(tensor)


CASES: list[tuple[str, Callable[[Path], onnx.ModelProto | bytes], str]] = [
    ("empty file", lambda d: b"", "empty file, not an ONNX model"),
    ("not protobuf", lambda d: b"\xff\xff\xff\xff garbage", "not an ONNX model"),
    ("no graph", lambda d: onnx.ModelProto(ir_version=8).SerializeToString(), "it has no graph"),
    ("short raw_data", short_raw, "initializer 'w': raw_data has 20 bytes, but dims [2, 3] of f32 need 24"),
    ("missing external file", lambda d: model_with(external(d, location="gone.bin")),
     "initializer 'w': external_data location 'gone.bin': no such file beside the model"),
    ("outside the folder", lambda d: model_with(external(d, location="../data.bin")),
     "initializer 'w': external_data location '../data.bin' is not a file inside the model's folder"),
    ("absolute location", lambda d: model_with(external(d, location=str(d / "data.bin"))),
     "is not a file inside the model's folder"),
    ("offset past the end", lambda d: model_with(external(d, offset="8")),
     "initializer 'w': external_data offset 8 + length 24 is past the end of 'data.bin' (24 bytes)"),
    ("huge length", lambda d: model_with(external(d, length=str(2**62))),
     "initializer 'w': external_data length 4,611,686,018,427,387,904 does not match dims [2, 3]"),
    ("non-integer offset", lambda d: model_with(external(d, offset="1.5")),
     "initializer 'w': external_data offset '1.5' is not a non-negative integer"),
    ("malformed param id", lambda d: model_with(tagged(weights(), "-3")),
     f"initializer 'w': {PARAM_ID_KEY} '-3' is not a u64 in decimal"),
    ("duplicate names", lambda d: model_with(weights("w"), weights("w")), "initializer 'w' appears twice"),
    ("empty name", lambda d: model_with(weights("")), "initializer 0 has an empty name"),
    ("duplicate ParamIds", lambda d: model_with(tagged(weights("a"), "7"), tagged(weights("b"), "7")),
     f"initializer 'b': has ParamId {ParamId(7)}, as initializer 'a' has"),
]


def write(folder: Path, make: Callable[[Path], onnx.ModelProto | bytes]) -> Path:
    content = make(folder)
    path = folder / "model.onnx"
    path.write_bytes(content if isinstance(content, bytes) else content.SerializeToString())
    return path


@pytest.mark.parametrize("make, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_defective_file_is_a_record_error_naming_file_initializer_and_field(
        tmp_path: Path, make: Callable[[Path], onnx.ModelProto | bytes], message: str) -> None:
    path = write(tmp_path, make)
    with pytest.raises(RecordError) as caught:
        read_record(path)
    assert str(caught.value).startswith(f"{path}: ") and message in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("make, message", [c[1:] for c in CASES[:6]], ids=[c[0] for c in CASES[:6]])
def test_import_onnx_exits_1_with_one_line_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Callable[[Path], onnx.ModelProto | bytes],
        message: str) -> None:
    path = write(tmp_path, make)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli_main(["import-onnx", str(path), "-o", str(tmp_path / "out.bpk")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_sound_external_and_inline_data_read_back(tmp_path: Path) -> None:
    """The checks refuse only what is wrong: a model with both kinds of data reads as numpy wrote it."""
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    record = read_record(write(tmp_path, lambda d: model_with(external(d, "ext"), tagged(weights("in"), "9"))))
    np.testing.assert_array_equal(record["ext"].array(), values)
    np.testing.assert_array_equal(record["in"].array(), values)
    assert int(record["in"].param_id) == 9


def test_a_graph_output_no_node_computes_is_a_refusal_naming_it(tmp_path: Path) -> None:
    """Found by the `onnx_import` fuzz target (a node's output renamed to ""): the output was a KeyError traceback
    from the importer; issue 15: "only kiln's errors escape"."""
    import kiln
    from kiln.ir import KilnError

    graph = helper.make_graph([helper.make_node("Relu", ["x"], [""])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    with pytest.raises(KilnError, match="'y' is computed by no node"):
        kiln.import_onnx(path)
