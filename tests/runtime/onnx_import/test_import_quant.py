"""ONNX import of affine integer quantization (convert_quant): one-node models made with onnx.helper against
onnx.reference.ReferenceEvaluator, and a QDQ model made by onnxruntime's own quantizer against onnxruntime.

ONNX (QuantizeLinear): "y = saturate(round(x / y_scale) + y_zero_point) ... rounding to nearest ties to even";
(DequantizeLinear): "y = (x - x_zero_point) * x_scale"; per tensor, per axis and (opset 21) per block.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from test_convert_elem_reduce_index import Case, Const, model

import kiln
from kiln.ir import interpret
from kiln.runtime.onnx.importer.driver import UnsupportedModel, import_graph

RNG = np.random.default_rng(21)


def f32(*shape: int, lo: float = -4.0, hi: float = 4.0) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def ints(dtype: type, *shape: int) -> np.ndarray:
    info = np.iinfo(dtype)
    return RNG.integers(info.min, int(info.max) + 1, shape).astype(dtype)


# ties of x / 0.5 at every half, and values far outside the u8 / i8 ranges (saturation; the reference wraps a
# quotient beyond i32, so the i16 and f16 cases leave the last one out)
HALVES = np.array([-1.25, -0.75, -0.25, 0.25, 0.75, 1.25, 300.0, -300.0, 1e9], np.float32)
S = Const(np.float32(0.5))
X3 = f32(2, 3, 5)

CASES = [
    # QuantizeLinear: per tensor (opset 10), per axis (13), saturate (19), blocks and output_dtype (21)
    Case("q-u8-default-zp", "QuantizeLinear", 10, [HALVES, S]),
    Case("q-u8-zp", "QuantizeLinear", 10, [HALVES, S, Const(np.uint8(3))]),
    Case("q-i8-zp", "QuantizeLinear", 13, [HALVES, S, Const(np.int8(-5))]),
    Case("q-i16", "QuantizeLinear", 21, [HALVES[:-1] * 100, S, Const(np.int16(7))]),
    Case("q-axis-1", "QuantizeLinear", 13, [X3, Const(np.float32([0.1, 0.02, 0.3])),
                                            Const(np.int8([0, -3, 9]))]),
    Case("q-axis-last", "QuantizeLinear", 13, [X3, Const(np.float32([0.1, 0.2, 0.03, 0.4, 0.05])),
                                               Const(np.uint8([128, 0, 7, 255, 10]))], {"axis": -1}),
    Case("q-runtime-scale", "QuantizeLinear", 13, [X3, np.array(0.03, np.float32), np.array(4, np.int8)]),
    Case("q-19-saturate-ignored", "QuantizeLinear", 19, [HALVES, S, Const(np.int8(0))], {"saturate": 0}),
    Case("q-21-blocked", "QuantizeLinear", 21, [X3, Const(np.float32([[[0.1, 0.2, 0.3]], [[0.4, 0.5, 0.6]]])
                                                          .repeat(3, 1)),
                                                Const(np.int8(RNG.integers(-9, 9, (2, 3, 3))))],
         {"axis": 2, "block_size": 2}),  # 5 along axis 2 in blocks of 2: the last block holds one element
    Case("q-21-output-dtype", "QuantizeLinear", 21, [HALVES, S], {"output_dtype": TensorProto.INT8}),
    Case("q-f16", "QuantizeLinear", 19, [HALVES[:-1].astype(np.float16), Const(np.float16(0.5)),
                                         Const(np.int8(1))]),
    # DequantizeLinear
    Case("dq-u8", "DequantizeLinear", 10, [ints(np.uint8, 3, 4), Const(np.float32(0.05)), Const(np.uint8(128))]),
    Case("dq-i8-no-zp", "DequantizeLinear", 13, [ints(np.int8, 3, 4), Const(np.float32(0.05))]),
    Case("dq-i32-bias", "DequantizeLinear", 13, [np.array([-70000, 3, 90000], np.int32), Const(np.float32(1e-3))]),
    Case("dq-i16", "DequantizeLinear", 21, [ints(np.int16, 3, 4), Const(np.float32(0.5)), Const(np.int16(-9))]),
    Case("dq-axis-0", "DequantizeLinear", 13, [ints(np.int8, 3, 4), Const(np.float32([0.1, 0.2, 0.3])),
                                               Const(np.int8([1, -2, 0]))], {"axis": 0}),
    Case("dq-21-blocked", "DequantizeLinear", 21, [ints(np.uint8, 4, 6), Const(f32(4, 2, lo=0.01, hi=0.1)),
                                                   Const(ints(np.uint8, 4, 2))], {"axis": 1, "block_size": 3}),
    Case("dq-f16-scale", "DequantizeLinear", 19, [ints(np.int8, 3, 4), Const(np.float16(0.0123))]),
    Case("dq-runtime", "DequantizeLinear", 13, [ints(np.uint8, 3, 4), np.array(0.2, np.float32),
                                                np.array(9, np.uint8)]),
    # DynamicQuantizeLinear: "y_scale = (maximum(0, max(x)) - minimum(0, min(x))) / (qmax - qmin)"
    Case("dyn", "DynamicQuantizeLinear", 11, [f32(3, 4)], outputs=3),
    Case("dyn-positive", "DynamicQuantizeLinear", 11, [f32(3, 4, lo=1, hi=5)], outputs=3),
    Case("dyn-negative", "DynamicQuantizeLinear", 11, [f32(3, 4, lo=-5, hi=-1)], outputs=3),
    Case("dyn-zeros", "DynamicQuantizeLinear", 11, [np.zeros((2, 2), np.float32)], outputs=3),
    # integer products
    Case("matmul-integer", "MatMulInteger", 10, [ints(np.uint8, 3, 4), ints(np.uint8, 4, 5),
                                                 Const(np.uint8(12)), Const(np.uint8(200))]),
    Case("matmul-integer-batched", "MatMulInteger", 10, [ints(np.uint8, 2, 3, 4), ints(np.int8, 4, 5)]),
    Case("qlinear-matmul-u8", "QLinearMatMul", 10,
         [ints(np.uint8, 2, 3, 4), Const(np.float32(0.02)), Const(np.uint8(113)), ints(np.uint8, 4, 5),
          Const(np.float32(0.01)), Const(np.uint8(114)), Const(np.float32(0.05)), Const(np.uint8(118))]),
    Case("qlinear-matmul-i8", "QLinearMatMul", 21,
         [ints(np.int8, 3, 4), Const(np.float32(0.02)), Const(np.int8(-3)), ints(np.int8, 4, 5),
          Const(np.float32(0.01)), Const(np.int8(2)), Const(np.float32(0.03)), Const(np.int8(-1))]),
    Case("conv-integer", "ConvInteger", 10, [ints(np.uint8, 1, 2, 5, 5), ints(np.uint8, 3, 2, 3, 3),
                                             Const(np.uint8(100))], {"pads": [1, 1, 1, 1]}),
    Case("qlinear-conv-per-channel", "QLinearConv", 10,
         [ints(np.uint8, 2, 4, 6, 6), Const(np.float32(0.02)), Const(np.uint8(120)), Const(ints(np.int8, 6, 2, 3, 3)),
          Const(np.float32([0.01, 0.02, 0.005, 0.03, 0.01, 0.002])), Const(np.zeros(6, np.int8)),
          Const(np.float32(0.2)), Const(np.uint8(128)), Const(RNG.integers(-900, 900, 6).astype(np.int32))],
         {"group": 2, "strides": [2, 1], "pads": [0, 1, 1, 0]}),
    Case("qlinear-conv-i8", "QLinearConv", 10,
         [ints(np.int8, 1, 3, 5, 5), Const(np.float32(0.05)), Const(np.int8(4)), ints(np.int8, 2, 3, 3, 3),
          Const(np.float32(0.01)), Const(np.int8(-1)), Const(np.float32(0.5)), Const(np.int8(-7))],
         {"auto_pad": "SAME_UPPER"}),
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)
def test_import_matches_the_onnx_reference(c: Case) -> None:
    """Exact codes: every integer output equals the reference's, every float one to rounding."""
    onnx_model, feeds = model(c)
    named = {f"in{i}": x for i, x in enumerate(c.inputs) if isinstance(x, np.ndarray)}
    if c.op == "DequantizeLinear" and c.opset < 19:  # the reference evaluator implements opsets 19 and later
        import onnxruntime

        onnx_model.ir_version = 8  # onnxruntime's, which also wants the output typed (these scales are f32)
        onnx_model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT
        want = onnxruntime.InferenceSession(onnx_model.SerializeToString(),
                                            providers=["CPUExecutionProvider"]).run(None, named)
    else:
        want = ReferenceEvaluator(onnx_model).run(None, named)
    got = interpret(import_graph(onnx_model), feeds)
    assert_same(got, want)


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        w = np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        if np.issubdtype(w.dtype, np.integer):
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=0)


def test_matmul_integer_zero_points_per_row_and_per_column() -> None:
    """MatMulInteger: "a_zero_point ... 1-D tensor of size M (per-row quantization)", "b_zero_point ... 1-D
    tensor of size N (per-column quantization)" (numpy as oracle: the reference evaluator broadcasts a [M] zero
    point along K)."""
    a, b, a_zp, b_zp = ints(np.int8, 3, 4), ints(np.int8, 4, 5), np.int8([1, -2, 3]), ints(np.int8, 5)
    onnx_model, feeds = model(Case("mmi", "MatMulInteger", 10, [a, b, Const(a_zp), Const(b_zp)]))
    want = (a.astype(np.int32) - a_zp[:, None]) @ (b.astype(np.int32) - b_zp)
    assert_same(interpret(import_graph(onnx_model), feeds), [want])


def test_every_converter_of_the_module_has_a_case() -> None:
    from kiln.runtime.onnx.importer.registry import converters

    mine = {c.op_type for c in converters() if c.fn.__module__.endswith(".convert_quant")}
    assert mine - {c.op for c in CASES} == set()


@pytest.mark.parametrize(("op", "opset", "inputs", "attrs", "match"), [
    ("QuantizeLinear", 21, [HALVES, S], {"output_dtype": TensorProto.INT32}, r"i32 codes: kiln quantizes to i8, u8"),
    ("DequantizeLinear", 13, [ints(np.int8, 3, 4), Const(np.float32([[0.1, 0.2], [0.3, 0.4]]))], {},
     r"per-axis scale or zero point of shape \[2, 2\] is not 1-D"),
])
def test_unsupported_forms_name_the_node_and_the_reason(op: str, opset: int, inputs: list, attrs: dict,
                                                        match: str) -> None:
    onnx_model, _ = model(Case("bad_node", op, opset, inputs, attrs))
    with pytest.raises(UnsupportedModel, match=r"bad_node \(" + op + r", opset \d+\): .*" + match):
        import_graph(onnx_model)


def test_blocks_along_a_dynamic_axis_are_refused() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "n"])
    node = helper.make_node("QuantizeLinear", ["x", "s"], ["y"], name="q", axis=1, block_size=2)
    graph = helper.make_graph([node], "g", [x], [helper.make_empty_tensor_value_info("y")],
                              [numpy_helper.from_array(np.full((2, 1), 0.1, np.float32), "s")])
    with pytest.raises(UnsupportedModel, match=r"q \(QuantizeLinear, opset 21\): blocked quantization along the "
                                               r"dynamic axis 1"):
        import_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))


def _qdq_mlp(tmp_path) -> onnx.ModelProto:
    """A float MLP exported from torch, QDQ-quantized by onnxruntime's static quantizer (per-channel int8 weights,
    u8 activations)."""
    import torch
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    float_path, q_path = tmp_path / "float.onnx", tmp_path / "qdq.onnx"
    torch.onnx.export(net, (torch.zeros(1, 8),), str(float_path), input_names=["x"], output_names=["y"],
                      dynamo=False)
    batches = iter([{"x": f32(1, 8, lo=-2, hi=2)} for _ in range(16)])

    class Reader(CalibrationDataReader):
        def get_next(self):
            return next(batches, None)

    quantize_static(str(float_path), str(q_path), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return onnx.load(q_path)


def test_a_qdq_model_from_onnxruntimes_quantizer_matches_onnxruntime(tmp_path) -> None:
    """Issue 12: "QuantizeLinear/DequantizeLinear (QDQ-quantized models, per-tensor and per-axis)". onnxruntime
    fuses the QDQ pairs into integer kernels, so kiln's f32 composition may land one activation step away."""
    import onnxruntime

    qdq = _qdq_mlp(tmp_path)
    ops = {n.op_type for n in qdq.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    module = kiln.import_onnx(qdq)
    # the weights' DequantizeLinear reads only initializers: it folds into float parameters
    assert len(list(module.named_parameters())) >= 2
    x = f32(1, 8, lo=-2, hi=2)
    session = onnxruntime.InferenceSession(qdq.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"x": x})
    (reference,) = ReferenceEvaluator(qdq).run(None, {"x": x})
    got = module(x).numpy()
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)
    step = max(float(numpy_helper.to_array(t).max()) for t in qdq.graph.initializer if "scale" in t.name)
    np.testing.assert_allclose(got, want, atol=2 * step)
