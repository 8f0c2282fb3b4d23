"""Constant int8 weights of QDQ models (issue 12: "QuantizeLinear/DequantizeLinear (QDQ-quantized models, per-tensor
and per-axis) ... mapped onto kiln's quantize/dequantize ops"): a `DequantizeLinear` of an int8 initializer with a
zero point of 0 imports as a kiln quantized parameter (q8f codes, Burn's symmetric QFloat: `x = scale * q`), so the
module, its record and the TVM build keep i8 codes; other zero points keep the float decoding.

The oracle is onnxruntime with graph optimizations off (its optimizer rewrites DequantizeLinear -> MatMul into a
dynamically quantized matmul, which rounds x) and numpy's `x @ (q * scale)`.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.ir import DType
from kiln.runtime.tvm.lower import lower

RNG = np.random.default_rng(0)
W = RNG.integers(-128, 128, (8, 4)).astype(np.int8)
X = RNG.standard_normal((3, 8)).astype(np.float32)


def qdq_model(w: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None, op: str = "MatMul",
              **dq) -> bytes:
    """x -> op(x, DequantizeLinear(w, scale[, zero_point]))."""
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(scale, "w_scale")]
    if zero_point is not None:
        inits.append(numpy_helper.from_array(zero_point, "w_zero"))
    nodes = [helper.make_node("DequantizeLinear", [i.name for i in inits], ["wf"], **dq),
             helper.make_node(op, ["x", "wf"], ["y"], **({"transB": 1} if op == "Gemm" else {}))]
    n = w.shape[0] if op == "Gemm" else w.shape[1]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])], inits)
    opset = 21 if "block_size" in dq else 13
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10).SerializeToString()


def onnxruntime(data: bytes) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


# scheme: (ONNX scale, DequantizeLinear attributes, kiln block, the scale of each element of W)
SCALES = {"per-tensor": (np.float32(0.02), {}, ()),
          "per-axis": ((RNG.random(4) * 0.02 + 0.01).astype(np.float32), {"axis": 1}, (8, 1)),
          "per-block": ((RNG.random((2, 4)) * 0.02 + 0.01).astype(np.float32), {"axis": 0, "block_size": 4},
                        (4, 1))}
EACH = {"per-tensor": lambda s: np.full(W.shape, s), "per-axis": lambda s: np.broadcast_to(s, W.shape),
        "per-block": lambda s: np.repeat(s, 4, axis=0)}


@pytest.mark.parametrize("scheme", SCALES)
def test_an_int8_weight_imports_quantized_and_matches_onnxruntime(scheme: str):
    scale, dq, block = SCALES[scheme]
    data = qdq_model(W, np.asarray(scale), **dq)
    imported = kiln.import_onnx(onnx.load_from_string(data))
    graph = imported.graph
    assert graph.params["w.codes"].type.dtype is DType.i8
    np.testing.assert_array_equal(graph.params["w.codes"].data, W)
    r = graph.reparams["w"]
    assert (r.kind, r.attrs["value"], tuple(r.attrs["block"])) == ("dequantize", "q8f", block)
    want = onnxruntime(data)
    np.testing.assert_allclose(want, X @ (W.astype(np.float32) * EACH[scheme](scale)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(imported(X).numpy(), want, rtol=1e-6, atol=1e-6)
    record = imported.into_record()
    assert dict((k, v.dtype) for k, v in record.items())["w"] is DType.i8  # the record writes the codes


def test_the_tvm_build_keeps_the_codes_int8():
    scale, dq, _ = SCALES["per-axis"]
    data = qdq_model(W, scale, op="MatMul", **dq)
    imported = kiln.import_onnx(onnx.load_from_string(data)).valid()
    arg = imported.graph.functions["forward"].args[0].type
    relax_text = lower(kiln.trace(imported, arg)).module.script()
    # the fused kernel of runtime/tvm/quant_matmul.py reads the i8 codes (the plain dequantize beside it is dead:
    # the pipeline's dead-code elimination drops it)
    assert 'B: T.Buffer((T.int64(8), T.int64(4)), "int8")' in relax_text.split("def dequantize_matmul")[1]
    np.testing.assert_allclose(np.asarray(kiln.compile(imported, arg)(X)), onnxruntime(data), rtol=1e-5, atol=1e-5)


def test_gemm_reads_the_quantized_weight_transposed():
    w = np.ascontiguousarray(W.T)  # [4, 8]: Gemm's transB weight, quantized per output row (axis 0)
    scale = (RNG.random(4) * 0.02 + 0.01).astype(np.float32)
    data = qdq_model(w, scale, op="Gemm", axis=0)
    imported = kiln.import_onnx(onnx.load_from_string(data))
    assert imported.graph.reparams["w"].attrs["block"] == (1, 8)
    np.testing.assert_allclose(imported(X).numpy(), onnxruntime(data), rtol=1e-6, atol=1e-6)


def test_a_nonzero_zero_point_keeps_the_float_decoding():
    """kiln's schemes are symmetric (Burn's QFloat has no zero point), so `(q - 3) * scale` stays a float weight."""
    data = qdq_model(W, np.float32(0.02), np.int8(3))
    imported = kiln.import_onnx(onnx.load_from_string(data))
    assert not imported.graph.reparams
    np.testing.assert_allclose(imported(X).numpy(), onnxruntime(data), rtol=1e-6, atol=1e-6)
