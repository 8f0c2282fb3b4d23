"""int4/uint4/int2/uint2, float4e2m1 and float8e8m0 through ONNX import (against onnx's reference evaluator and
numpy_helper's float8e8m0 rule), the TVM build (casts to codes wrap as numpy does) and records (Burn lacks them)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from kiln.ir import Builder, DType, KilnError, RecordError, interpret
from kiln.runtime.onnx.export import to_onnx
from kiln.runtime.onnx.importer.driver import UnsupportedModel, import_graph
from kiln.runtime.records.record import ModuleRecord, RecordEntry, burn_dtype
from kiln.runtime.tvm.compile import compile_graph

CODES = {DType.i4: TensorProto.INT4, DType.u4: TensorProto.UINT4, DType.i2: TensorProto.INT2,
         DType.u2: TensorProto.UINT2, DType.f4e2m1fn: TensorProto.FLOAT4E2M1}


def _model(nodes: list, inputs: list, outputs: list, opset: int) -> object:
    graph = helper.make_graph(nodes, "m", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _powers_and_neighbours() -> np.ndarray:
    """Every f32 power of two (subnormals included), 1.5 times it, its two neighbours, specials and node-test
    values."""
    p = np.ldexp(np.float32(1), np.arange(-149, 128)).astype(np.float32)
    with np.errstate(over="ignore"):
        near = [p * np.float32(1.5), np.nextafter(p, np.float32(np.inf)), np.nextafter(p, np.float32(0)), -3 * p]
    return np.concatenate([p, *near, np.float32([0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, 0.124, 1.1])])


@pytest.mark.parametrize("round_mode", ["up", "down", "nearest"])
def test_cast_to_float8e8m0_matches_onnxs_rule_bit_for_bit(round_mode: str) -> None:
    """ONNX Cast (opset 24) to FLOAT8E8M0 with `round_mode` and `saturate`: numpy_helper.to_float8e8m0, which the
    reference evaluator runs."""
    x = _powers_and_neighbours()
    for saturate in (0, 1):
        node = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT8E8M0, saturate=saturate,
                                round_mode=round_mode)
        model = _model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [len(x)])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT8E8M0, [len(x)])], 25)
        (got,) = interpret(import_graph(model), [x])
        want = numpy_helper.to_float8e8m0(x, bool(saturate), round_mode)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", list(CODES), ids=lambda d: d.value)
def test_quantize_and_dequantize_per_axis_with_zero_points_match_onnxs_reference(dtype: DType) -> None:
    """QuantizeLinear: "y = saturate(round(x / y_scale) + y_zero_point)" into the code's range (float4: x / scale
    plus the zero point, cast); DequantizeLinear: "(x - x_zero_point) * x_scale"."""
    code = CODES[dtype]
    x = np.linspace(-60, 60, 24, dtype=np.float32).reshape(2, 3, 4)
    x[0, 0, 0] = -0.0
    zp = [0.0, 0.0, -0.0] if dtype is DType.f4e2m1fn else [0, 1, dtype.int_range[0]]
    nodes = [helper.make_node("Constant", [], ["s"], value=helper.make_tensor("s", TensorProto.FLOAT, [3],
                                                                           [0.5, 2.0, 7.0])),
             helper.make_node("Constant", [], ["z"], value=helper.make_tensor("z", code, [3], zp)),
             helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=1),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=1)]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                   [helper.make_tensor_value_info("q", code, list(x.shape)),
                    helper.make_tensor_value_info("y", TensorProto.FLOAT, list(x.shape))], 21)
    want = ReferenceEvaluator(model).run(None, {"x": x})
    got = interpret(import_graph(model), [x])
    assert got[0].dtype == want[0].dtype == dtype.numpy
    np.testing.assert_array_equal(got[0].astype(np.float32), want[0].astype(np.float32))
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(np.signbit(got[0].astype(np.float32)), np.signbit(want[0].astype(np.float32)))
    if dtype.is_int_code:  # the range is reached at both ends
        assert {int(got[0].min()), int(got[0].max())} == set(dtype.int_range)


def test_a_nonzero_float4_zero_point_is_refused_naming_it() -> None:
    """ONNX's reference adds a float4 zero point in QuantizeLinear and ignores it in DequantizeLinear, so kiln
    requires it zero, as ONNX requires of float8 ones."""
    nodes = [helper.make_node("Constant", [], ["s"], value=helper.make_tensor("s", TensorProto.FLOAT, [], [1.0])),
             helper.make_node("Constant", [], ["z"], value=helper.make_tensor("z", TensorProto.FLOAT4E2M1, [],
                                                                              [0.5])),
             helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                   [helper.make_tensor_value_info("q", TensorProto.FLOAT4E2M1, [2])], 23)
    with pytest.raises(UnsupportedModel, match=r"q \(QuantizeLinear, opset 23\): a f4e2m1fn zero point of 0.5: "
                                               r"kiln's, as ONNX's float8 ones, must be zero"):
        import_graph(model)


def test_tvm_casts_to_codes_wrap_as_numpy_does() -> None:
    """The uint4 casts node_expected_failures_tvm.txt listed: astype to the code's storage byte took -9.0 to
    garbage (uint8 conversion of a negative float); the cast now wraps into the code's range first, by
    `DType.to_code`'s rule also where int32 cannot hold the value (an f64 2**40 + 3 is 3 mod 16, not int32's
    out-of-range garbage), and NaN/inf give 0."""
    x = np.concatenate([np.arange(-9, 16), [-0.5, 15.9, -8.7, 300.0, -300.0, np.nan, np.inf, -np.inf]])
    wide = np.float64([2.0**40 + 3, -(2.0**40) - 5, 2.0**52 + 6, np.nan, -np.inf])
    codes = (DType.u4, DType.i4, DType.u2, DType.i2)
    b = Builder("M")
    v, h = b.input("x", ((len(x),), "f32")), b.input("h", ((len(x),), "f16"))
    w = b.input("w", ((len(wide),), "f64"))
    outs = [b.cast(v, dtype=d) for d in codes] + [b.cast(h, dtype=d) for d in codes]
    outs += [b.cast(w, dtype=d) for d in codes]
    b.ret(*outs, *(b.cast(o, dtype=DType.f32) for o in outs[:4]), b.cast(outs[0], dtype=DType.i2))
    graph = b.build()
    inputs = [x.astype(np.float32), x.astype(np.float16), wide]
    got = compile_graph(graph, cache=False)(*inputs)
    want = interpret(graph, inputs)  # kiln's rule, checked in tests/ir/test_sub_byte_dtypes.py
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g.astype(np.float32), w.astype(np.float32)), (g, w)


def test_tvm_refuses_float4_naming_the_op() -> None:
    b = Builder("F")
    b.ret(b.cast(b.input("x", ((3,), "f32")), dtype=DType.f4e2m1fn))
    with pytest.raises(KilnError, match="cast: result 0 has dtype f4e2m1fn, which kiln does not lower to TVM"):
        compile_graph(b.build(), cache=False)


def test_export_refuses_kilns_float8e8m0_cast_and_writes_the_code_casts() -> None:
    """ONNX's Cast to FLOAT8E8M0 rounds up by default, kiln's cast (ml_dtypes') does not: refused, not mis-stated;
    a cast to INT4 is ONNX's (numpy's astype), as onnx's reference evaluator runs it."""
    b = Builder("M")
    b.ret(b.cast(b.input("x", ((3,), "f32")), dtype=DType.f8e8m0fnu))
    with pytest.raises(KilnError, match="cast to f8e8m0fnu: kiln's rounding"):
        to_onnx(b.build())
    b = Builder("M")
    b.ret(b.cast(b.cast(b.input("x", ((4,), "f32")), dtype=DType.i4), dtype=DType.f32))
    x = np.float32([-9.0, 7.5, 8.0, -3.2])
    (got,) = ReferenceEvaluator(to_onnx(b.build())).run(None, {"x": x})
    np.testing.assert_array_equal(got, x.astype(ml_dtypes.int4).astype(np.float32))


def test_records_refuse_the_dtypes_burn_lacks() -> None:
    """burn-notes: Burn's DType has no 2-bit integer, float4 or float8 dtype."""
    for dtype in (DType.i2, DType.u2, DType.f4e2m1fn, DType.f8e8m0fnu):
        with pytest.raises(RecordError, match=f"kiln dtype {dtype.value} has no Burn dtype"):
            burn_dtype(dtype)
    codes = ModuleRecord({"c": RecordEntry(1, DType.i2, (2,), np.zeros(2, ml_dtypes.int2))})
    with pytest.raises(RecordError, match="tensor 'c': kiln dtype i2 has no Burn dtype"):
        codes.to_bytes()
