"""u16/u32/u64 and the float8 dtypes through ONNX (import against onnx's reference evaluator, export against
onnxruntime), safetensors records and the TVM build (unsigned ints built, float8 refused naming the op)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from kiln.ir import Builder, DType, KilnError, interpret
from kiln.runtime.onnx.export import to_onnx
from kiln.runtime.onnx.importer.driver import import_graph
from kiln.runtime.records.record import ModuleRecord, RecordEntry
from kiln.runtime.tvm.compile import compile_graph

FLOAT8 = {DType.f8e4m3fn: TensorProto.FLOAT8E4M3FN, DType.f8e4m3fnuz: TensorProto.FLOAT8E4M3FNUZ,
          DType.f8e5m2: TensorProto.FLOAT8E5M2, DType.f8e5m2fnuz: TensorProto.FLOAT8E5M2FNUZ}
X = np.array([0.3, -0.3, 6.5e4, -6.5e4, np.inf, -np.inf, np.nan, 449.0, 465.0, -0.0], np.float32)


def _same(got: np.ndarray, want: np.ndarray) -> None:
    """Equal dtype and values, NaN where the other has NaN, zeros with their sign."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    g, w = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    keep = ~np.isnan(w)
    np.testing.assert_array_equal(g[keep], w[keep])
    np.testing.assert_array_equal(np.signbit(g[keep]), np.signbit(w[keep]))


def _model(nodes: list, outputs: list, opset: int = 21) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [len(X)])],
                              outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_cast_and_quantize_to_float8_match_onnxs_reference_with_and_without_saturate() -> None:
    """ONNX Cast: "saturate ... all values out of range are mapped to the greatest/lowest finite value"; with
    saturate=0, "[x] > FLT_MAX" is NaN (Inf for E5M2). QuantizeLinear to float8 casts x / scale the same way."""
    nodes, outputs = [], []
    for dtype, code in FLOAT8.items():
        for sat in (0, 1):
            name = f"{dtype.value}_{sat}"
            nodes.append(helper.make_node("Cast", ["x"], [f"c_{name}"], to=code, saturate=sat))
            nodes.append(helper.make_node("Cast", [f"c_{name}"], [f"back_{name}"], to=TensorProto.FLOAT))
            outputs += [helper.make_tensor_value_info(f"c_{name}", code, [len(X)]),
                        helper.make_tensor_value_info(f"back_{name}", TensorProto.FLOAT, [len(X)])]
        nodes.append(helper.make_node("Constant", [], [f"zp_{dtype.value}"],
                                      value=helper.make_tensor("zp", code, [], [0.0])))
        nodes.append(helper.make_node("QuantizeLinear", ["x", "scale", f"zp_{dtype.value}"], [f"q_{dtype.value}"],
                                      saturate=0))
        outputs.append(helper.make_tensor_value_info(f"q_{dtype.value}", code, [len(X)]))
    nodes.insert(0, helper.make_node("Constant", [], ["scale"], value=helper.make_tensor("s", TensorProto.FLOAT,
                                                                                          [], [2.0])))
    model = _model(nodes, outputs)
    want = ReferenceEvaluator(model).run(None, {"x": X})
    got = interpret(import_graph(model), [X])
    assert len(got) == len(want)
    for g, w in zip(got, want):
        _same(g, w)
    assert float(got[0][2]) != float(got[0][2]) and float(got[2][2]) == 448.0  # no-saturate NaN, saturate 448


def test_uint16_quantize_and_dequantize_match_onnxs_reference() -> None:
    """QuantizeLinear (opset 21) "y = saturate(round(x / y_scale) + y_zero_point)" with uint16 codes."""
    nodes = [helper.make_node("Constant", [], ["scale"], value=helper.make_tensor("s", TensorProto.FLOAT, [], [0.01])),
             helper.make_node("Constant", [], ["zp"], value=helper.make_tensor("z", TensorProto.UINT16, [], [30000])),
             helper.make_node("QuantizeLinear", ["x", "scale", "zp"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("q", TensorProto.UINT16, [len(X)]),
                           helper.make_tensor_value_info("y", TensorProto.FLOAT, [len(X)])])
    x = np.nan_to_num(X, nan=0.0, posinf=1e3, neginf=-1e3)
    want = ReferenceEvaluator(model).run(None, {"x": x})
    got = interpret(import_graph(model), [x])
    np.testing.assert_array_equal(got[0], want[0])
    assert got[0].dtype == np.uint16 and got[0].max() == 65535 and got[0].min() == 0
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


def test_export_runs_in_onnxruntime_and_imports_back() -> None:
    """Exported u32/u64 arithmetic, u64 comparison and kiln's non-saturating float8 cast agree with onnxruntime."""
    b = Builder("M")
    x, y = b.input("x", ((3,), "u32")), b.input("y", ((3,), "u32"))
    p, q = b.input("p", ((3,), "u64")), b.input("q", ((3,), "u64"))
    # no +-6.5e4: onnxruntime 1.31 casts a finite value past f8e5m2's range to NaN, not the spec's (and kiln's) inf
    f32 = X[np.abs(np.nan_to_num(X)) != 6.5e4]
    f = b.input("f", ((len(f32),), "f32"))
    # onnxruntime returns no float8 arrays, so each float8 goes back to f32 inside the graph
    b.ret(b.add(x, y), b.less(p, q), b.sub(p, q), *(b.cast(b.cast(f, dtype=d), dtype=DType.f32)
                                                     for d in (DType.f8e4m3fn, DType.f8e5m2)))
    graph = b.build()
    model = to_onnx(graph)
    onnx.checker.check_model(model, full_check=True)
    feeds = [np.array([1, 2**32 - 1, 7], np.uint32), np.array([2**32 - 1, 1, 7], np.uint32),
             np.array([2**63, 2**64 - 1, 9], np.uint64), np.array([2**63 - 1, 2**64 - 2, 3], np.uint64), f32]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ran = session.run(None, {i.name: v for i, v in zip(model.graph.input, feeds)})
    want = [np.array([0, 0, 14], np.uint32), np.array([False, False, False]), np.array([1, 1, 6], np.uint64),
            *(f32.astype(t).astype(np.float32) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2))]
    for r, g, w in zip(ran, interpret(graph, feeds), want):
        _same(np.asarray(r), w)
        _same(g, w)
    back = import_graph(model).functions["forward"]
    assert [a.type.dtype for a in back.args] == [DType.u32, DType.u32, DType.u64, DType.u64, DType.f32]


def test_safetensors_round_trip_of_unsigned_and_float8_tensors(tmp_path: Path) -> None:
    arrays = {"a": np.array([0, 65535], np.uint16), "b": np.array([0, 2**32 - 1], np.uint32),
              "c": np.array([0, 2**64 - 1], np.uint64), "d": np.array([448, -0.5], ml_dtypes.float8_e4m3fn),
              "e": np.array([57344, -0.5], ml_dtypes.float8_e5m2)}
    record = ModuleRecord({k: RecordEntry(i + 1, DType.from_numpy(v.dtype), v.shape, v)
                           for i, (k, v) in enumerate(arrays.items())})
    record.to_safetensors(tmp_path / "w.safetensors")
    back = ModuleRecord.from_safetensors(tmp_path / "w.safetensors")
    for k, v in arrays.items():
        assert back[k].dtype is DType.from_numpy(v.dtype)
        assert np.asarray(back[k].array()).tobytes() == v.tobytes()


def test_tvm_builds_unsigned_ops_and_refuses_float8_naming_the_op() -> None:
    b = Builder("M")
    x, y = b.input("x", ((3,), "u32")), b.input("y", ((3,), "u32"))
    p, q = b.input("p", ((3,), "u64")), b.input("q", ((3,), "u64"))
    b.ret(b.add(x, y), b.less(p, q), b.maximum(p, q))
    feeds = [np.array([1, 2**32 - 1, 7], np.uint32), np.array([2**32 - 1, 1, 7], np.uint32),
             np.array([2**63, 2**64 - 1, 9], np.uint64), np.array([2**63 - 1, 2**64 - 2, 30], np.uint64)]
    add, less, most = compile_graph(b.build(), cache=False)(*feeds)
    np.testing.assert_array_equal(add, np.array([0, 0, 14], np.uint32))
    np.testing.assert_array_equal(less, [False, False, True])
    np.testing.assert_array_equal(most, np.array([2**63, 2**64 - 1, 30], np.uint64))
    assert add.dtype == np.uint32 and most.dtype == np.uint64
    b = Builder("F")
    b.ret(b.cast(b.input("x", ((3,), "f32")), dtype=DType.f8e4m3fn))
    with pytest.raises(KilnError, match="cast: result 0 has dtype f8e4m3fn, which kiln does not lower to TVM"):
        compile_graph(b.build(), cache=False)
