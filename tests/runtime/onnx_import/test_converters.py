"""Converters of the shape and basic families against onnx's reference evaluator, in the forms ONNX's own node
tests leave out: attribute forms of old opsets, flatten-at-axis softmax, broadcasting, dynamic dims.

Issue 12: "Op coverage, each with its attributes and broadcasting rules ... Softmax, LogSoftmax (old and new axis
semantics) ... Split (sizes as input), Slice (steps, negative) ... Squeeze/Unsqueeze (axes as input)".
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from onnx_cases import assert_matches_reference, model

from kiln.runtime.onnx.importer.driver import import_graph

F32, I64 = np.float32, np.int64
rng = np.random.default_rng(0)
X234 = rng.standard_normal((2, 3, 4)).astype(F32)


def node(op: str, inputs: list[str], outputs: list[str] | None = None, **attrs) -> helper.NodeProto:
    return helper.make_node(op, inputs, outputs or ["y"], **attrs)


# (id, nodes, inputs {name: array}, dims override {name: dims} for dynamic ones, opset, initializers)
# onnx's reference evaluator normalizes opset-11 Softmax over the one axis, against the opset-11 spec ("coerced
# into [a_0 * ... * a_{k-1}, a_k * ... * a_{n-1}]"): those cases take onnxruntime as the oracle.
ORT = {"softmax-opset11-flattens-at-axis-1", "logsoftmax-opset11-axis-0", "softmax-opset11-dynamic-batch"}
CASES = [
    ("softmax-opset11-flattens-at-axis-1", [node("Softmax", ["x"], axis=1)], {"x": X234}, {}, 11, {}),
    ("logsoftmax-opset11-axis-0", [node("LogSoftmax", ["x"], axis=0)], {"x": X234}, {}, 11, {}),
    ("softmax-opset11-dynamic-batch", [node("Softmax", ["x"], axis=1)], {"x": X234}, {"x": ["n", 3, 4]}, 11, {}),
    ("softmax-opset13-axis-1", [node("Softmax", ["x"], axis=1)], {"x": X234}, {}, 13, {}),
    ("split-opset11-attribute", [node("Split", ["x"], ["a", "b"], axis=2, split=[1, 3])], {"x": X234}, {}, 11, {}),
    ("split-opset18-num-outputs-uneven", [node("Split", ["x"], ["a", "b"], axis=1, num_outputs=2)], {"x": X234},
     {}, 18, {}),
    ("slice-opset9-attributes", [node("Slice", ["x"], starts=[0, -1], ends=[1, -5], axes=[0, 2])], {"x": X234},
     {}, 9, {}),
    ("slice-negative-steps", [node("Slice", ["x", "s", "e", "a", "st"])], {"x": X234}, {}, 13,
     {"s": np.array([-1, 2], I64), "e": np.array([-2**63, 0], I64), "a": np.array([2, 1], I64),
      "st": np.array([-2, -1], I64)}),
    ("squeeze-opset11-attribute", [node("Squeeze", ["x"], axes=[0])], {"x": X234[:1]}, {}, 11, {}),
    ("unsqueeze-opset11-attribute-dynamic", [node("Unsqueeze", ["x"], axes=[1, -1])], {"x": X234},
     {"x": ["n", 3, 4]}, 11, {}),
    ("flatten-negative-axis-dynamic", [node("Flatten", ["x"], axis=-2)], {"x": X234}, {"x": ["n", 3, 4]}, 13, {}),
    ("reshape-zero-copies-dynamic-batch", [node("Reshape", ["x", "shape"])], {"x": X234}, {"x": ["n", 3, 4]}, 14,
     {"shape": np.array([0, 12], I64)}),
    ("reshape-allowzero", [node("Reshape", ["x", "shape"], allowzero=1)], {"x": np.zeros((0, 3), F32)}, {}, 14,
     {"shape": np.array([3, 0], I64)}),
    ("expand-bidirectional", [node("Expand", ["x", "shape"])], {"x": X234[:, :1]}, {}, 13,
     {"shape": np.array([3, 1, 1, 4], I64)}),
    ("gemm-trans-alpha-beta-row-bias", [node("Gemm", ["a", "b", "c"], transA=1, transB=1, alpha=0.5, beta=2.0)],
     {"a": X234[0].T.copy(), "b": rng.standard_normal((5, 4)).astype(F32)}, {}, 13,
     {"c": rng.standard_normal((1, 5)).astype(F32)}),
    ("gemm-opset7-scalar-bias", [node("Gemm", ["a", "b", "c"])], {"a": X234[0], "b": X234[1].T.copy()}, {}, 7,
     {"c": np.array(3.0, F32)}),
    ("div-integers-truncate", [node("Div", ["a", "b"])], {"a": np.array([7, -7, 7, -7], I64),
                                                          "b": np.array([2, 2, -2, -2], I64)}, {}, 13, {}),
    ("pow-integer-base-float-exponent", [node("Pow", ["a", "b"])], {"a": np.array([2, 3, 4], I64),
                                                                    "b": np.array([2.0], F32)}, {}, 15, {}),
    ("variadic-mean-max-broadcast", [node("Mean", ["a", "b", "c"], ["m"]), node("Max", ["m", "b"], ["y"])],
     {"a": X234, "b": X234[0, 0], "c": X234[:1]}, {}, 13, {}),
    ("less-or-equal-broadcast", [node("LessOrEqual", ["a", "b"])], {"a": X234, "b": X234[0, :, :1]}, {}, 16, {}),
    ("where-broadcast", [node("Where", ["c", "a", "b"])],
     {"c": X234[0] > 0, "a": X234[0], "b": np.array([1.0], F32)}, {}, 16, {}),
    ("shape-start-end", [node("Shape", ["x"], start=-2, end=10)], {"x": X234}, {}, 15, {}),
    ("size", [node("Size", ["x"])], {"x": X234}, {}, 13, {}),
    ("castlike", [node("CastLike", ["x", "like"])], {"x": X234, "like": np.array([1], I64)}, {}, 15, {}),
    ("gelu-tanh-opset20", [node("Gelu", ["x"], approximate="tanh")], {"x": X234}, {}, 20, {}),
    ("leaky-relu", [node("LeakyRelu", ["x"], alpha=0.2)], {"x": X234}, {}, 13, {}),
    ("gather-negative-indices", [node("Gather", ["x", "i"], axis=1)], {"x": X234}, {}, 13,
     {"i": np.array([[-1, 0]], I64)}),
    ("gather-elements", [node("GatherElements", ["x", "i"], axis=2)], {"x": X234}, {}, 13,
     {"i": rng.integers(0, 4, (2, 3, 2)).astype(I64)}),
    ("dropout-inference-mask", [node("Dropout", ["x"], ["y", "mask"], ratio=0.3)], {"x": X234}, {}, 10, {}),
    ("reciprocal-sum", [node("Reciprocal", ["x"], ["r"]), node("Sum", ["r", "x"], ["y"])], {"x": X234 + 3}, {},
     13, {}),
]


@pytest.mark.parametrize("case, nodes, feeds, dims, opset, initializers", CASES, ids=[c[0] for c in CASES])
def test_converter_matches_onnx_reference(case, nodes, feeds, dims, opset, initializers):
    outputs = [o for n in nodes[-1:] for o in n.output]
    inputs = {n: (a.dtype, dims.get(n, list(a.shape))) for n, a in feeds.items()}
    onnx_model = model(nodes, inputs, outputs, opset=opset, initializers=initializers)
    assert_matches_reference(import_graph(onnx_model), onnx_model, feeds,
                             oracle="onnxruntime" if case in ORT else "reference")
